"""What ran, and how it ended: a report on a recording of the exec/exit tracer.

Record for a while (the tracer prints as usual; Ctrl-C stops it), then ask::

    $ sudo aperf-trace --record /var/tmp/execs
    $ python -m examples.exec_report /var/tmp/execs --top 3
    recorded on vm (Linux 6.18.44), 2026-12-05 23:50:01 to 23:52:13 UTC
    COMMAND            EXECS
    sh                   212
    git                  104
    python3               31
    MINUTE (UTC)      EXITS  CODE 0  FAILED  CODES
    23:50               188     171      17  1: 15, 2: 2
    ...
    SLOWEST                PID      SECONDS
    make                 40211       84.113
    ...
    LOST EVENTS: none

DuckDB runs the queries straight on the Parquet files (``samples-*.parquet``, one row
per event; ``losses-*.parquet``, one row per lost notice), with no copy into Python.
The kernel stamps each event with ``bpf_ktime_get_boot_ns()``: the boot-time offset
the recording keeps (``aperf.Recording(DIR).boot_offset_ns``) turns those stamps into
dates. A minute in which events were lost says so, so that a gap in the counts is
never mistaken for a quiet minute. docs/recording.md walks through this file.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import duckdb

import aperf


def open_recording(path: Path) -> tuple[aperf.Recording, duckdb.DuckDBPyConnection]:
    """The recording, and a DuckDB connection with its two tables as views: ``samples``
    (with ``event_time``, each event's time as a date) and ``losses``."""
    recording = aperf.Recording(path)
    offset = recording.boot_offset_ns or 0
    db = duckdb.connect()
    db.execute("SET TimeZone = 'UTC'")
    files = ", ".join(f"'{s.samples}'" for s in recording.segments)
    db.execute(f"""CREATE VIEW samples AS SELECT *,
        CAST(make_timestamp(CAST((timestamp_ns + {int(offset)}) // 1000 AS BIGINT))
             AS TIMESTAMPTZ) AS event_time
        FROM read_parquet([{files}])""")
    losses = [f"'{s.losses}'" for s in recording.segments if s.losses]
    db.execute(f"CREATE VIEW losses AS SELECT * FROM read_parquet([{', '.join(losses)}])")
    return recording, db


def report(path: Path, top: int = 10, out: object = sys.stdout) -> None:
    recording, db = open_recording(path)
    meta = recording.metadata

    def say(text: str = "") -> None:
        print(text, file=out)  # type: ignore[arg-type]

    first, last = db.sql("SELECT min(event_time), max(event_time) FROM samples").fetchall()[0]
    kernel = meta.get("aperf.kernel", "").split(" ")[0]
    span = "no events" if first is None else (
        f"{first:%Y-%m-%d %H:%M:%S} to {last:%H:%M:%S} UTC")
    say(f"recorded on {meta.get('aperf.host')} (Linux {kernel}), {span}")

    say(f"{'COMMAND':<16} {'EXECS':>7}")
    for comm, execs in db.sql(f"""SELECT comm, count(*) AS execs FROM samples
            WHERE NOT exit_event GROUP BY comm ORDER BY execs DESC, comm LIMIT {int(top)}"""
                              ).fetchall():
        say(f"{comm:<16} {execs:>7}")

    say(f"{'MINUTE (UTC)':<16} {'EXITS':>7} {'CODE 0':>7} {'FAILED':>7}  CODES")
    lost_by_minute = dict(db.sql("""SELECT date_trunc('minute', _time) AS minute, sum(count)
            FROM losses GROUP BY minute""").fetchall())
    for minute, exits, ok, codes in db.sql("""
            SELECT date_trunc('minute', event_time) AS minute, count(*) AS exits,
                   count(*) FILTER (WHERE exit_code = 0) AS ok,
                   list(exit_code) FILTER (WHERE exit_code <> 0) AS codes
            FROM samples WHERE exit_event GROUP BY minute ORDER BY minute""").fetchall():
        counts: dict[int, int] = {}
        for code in codes or []:
            counts[code] = counts.get(code, 0) + 1
        text = ", ".join(f"{code}: {n}" for code, n in sorted(counts.items()))
        lost = lost_by_minute.pop(minute, 0)
        if lost:
            text += f"  ({lost} events lost in this minute)"
        say(f"{minute:%H:%M}{'':<11} {exits:>7} {ok:>7} {exits - ok:>7}  {text}")

    say(f"{'SLOWEST':<16} {'PID':>7} {'SECONDS':>12}")
    for comm, pid, seconds in db.sql(f"""SELECT comm, pid, duration_ns / 1e9 FROM samples
            WHERE exit_event AND duration_ns > 0 ORDER BY duration_ns DESC, pid
            LIMIT {int(top)}""").fetchall():
        say(f"{comm:<16} {pid:>7} {seconds:>12.3f}")

    lost = db.sql("""SELECT strftime(date_trunc('minute', _time), '%H:%M'), _cpu, sum(count)
            FROM losses GROUP BY ALL ORDER BY ALL""").fetchall()
    if not lost:
        say("LOST EVENTS: none")
    for minute, cpu, count in lost:
        say(f"LOST EVENTS: {count} on CPU {cpu} at {minute}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m examples.exec_report",
        description="Report on a recording of the exec/exit tracer (aperf-trace --record DIR).")
    parser.add_argument("recording", type=Path, metavar="DIR")
    parser.add_argument("--top", type=int, default=10, metavar="N",
                        help="how many commands and slow processes to list (default 10)")
    args = parser.parse_args(argv)
    try:
        report(args.recording, args.top)
    except (aperf.RecordingError, aperf.RecordingFormatError) as exc:
        print(f"exec_report: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
