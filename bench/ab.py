"""A/B: the same scenarios on two trees, in alternating rounds, with a verdict that
noise cannot fake.

    .venv/bin/python bench/ab.py --before /path/to/old-tree --rounds 7 \\
        --only 'flat32/aperf.aiter.raw@asyncio' --only 'flat32/libbpf.watermark' ...

Each tree is a checkout with its own ``.venv`` and built ``bpf/*.bpf.o`` (``bash
scripts/setup.sh`` in it). A round runs ``bench/run.py --quick --no-bcc --no-doc`` once
in each tree, the order of the two alternating from round to round (before, after;
after, before; ...), so that a drift of the machine's load falls on both. For each
scenario it prints the median CPU per sample of each tree, the spread (lowest and highest
round) and a verdict: *faster* or *slower* only when the two trees' rounds do not overlap
at all, else *no verdict*. Figures and verdicts are written as a Markdown table too
(``--markdown FILE``), for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
KEY = "cpu_us_per_sample"


def one_round(tree: Path, only: list[str], out: Path) -> dict[str, float]:
    """One ``bench/run.py --quick`` in ``tree``: CPU per sample by scenario."""
    cmd = [str(tree / ".venv" / "bin" / "python"), str(tree / "bench" / "run.py"), "--quick",
           "--no-bcc", "--no-doc", "--results", str(out)]
    for pattern in only:
        cmd += ["--only", pattern]
    out.unlink(missing_ok=True)
    subprocess.run(cmd, cwd=tree, check=True, stdout=subprocess.DEVNULL)
    figures = {}
    for entry in json.loads(out.read_text())["results"]:
        if entry.get(KEY) is not None:
            figures[entry["name"]] = float(entry[KEY])
    return figures


def verdict(before: list[float], after: list[float]) -> str:
    if max(after) < min(before):
        return "faster"
    if min(after) > max(before):
        return "slower"
    return "no verdict (rounds overlap)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, type=Path, help="the older tree")
    parser.add_argument("--after", type=Path, default=HERE, help="the newer tree (this one)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--only", action="append", required=True, metavar="PATTERN")
    parser.add_argument("--markdown", type=Path, help="write the table here too")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    for name, tree in trees.items():
        if not (tree / ".venv" / "bin" / "python").exists():
            parser.error(f"--{name} {tree}: no .venv (run bash scripts/setup.sh there)")
    rounds: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for n in range(args.rounds):
            order = ("before", "after") if n % 2 == 0 else ("after", "before")
            for name in order:
                figures = one_round(trees[name], args.only, Path(tmp) / f"{name}.json")
                for scenario, value in figures.items():
                    rounds[name].setdefault(scenario, []).append(value)
            print(f"round {n + 1} of {args.rounds} done", file=sys.stderr, flush=True)
    lines = ["| scenario | before: median (min-max) | after: median (min-max) | after / before "
             "| verdict |", "| --- | --- | --- | --- | --- |"]
    for scenario in sorted(set(rounds["before"]) & set(rounds["after"])):
        b, a = rounds["before"][scenario], rounds["after"][scenario]
        mb, ma = statistics.median(b), statistics.median(a)
        lines.append(f"| `{scenario}` | {mb:.3f} ({min(b):.3f}-{max(b):.3f}) | {ma:.3f} "
                     f"({min(a):.3f}-{max(a):.3f}) | {ma / mb:.2f} | {verdict(b, a)} |")
    table = "\n".join(lines)
    print(table)
    print(json.dumps(rounds), file=sys.stderr)
    if args.markdown:
        args.markdown.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
