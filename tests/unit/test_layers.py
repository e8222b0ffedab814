"""The import graph of aperf/: drivers above one reader, sources below it, the
ctypes binding only under sources, objects and BTF; no cycle, nothing upward."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "aperf"

# Each module's floor. A module may import its own floor and the ones below.
FLOORS = {
    "_errors": 0, "_log": 0, "_prototypes": 0, "_privileges": 0, "_map_types": 0,
    "_naming": 0,
    "_events": 1, "_options": 1, "_libbpf": 1, "_map_lock": 1, "_hotplug": 1, "_waiting.base": 1,
    # The seam (_source: the protocols and the segment types every format hands the
    # reader) sits on the formats' floor, under the sources that implement it.
    "_source": 2,
    "_object": 2, "_btf": 2, "_perf_format": 2, "_ringbuf_format": 2, "_decode": 2,
    "_layout": 2, "_callbacks": 2, "_encode": 2, "_user_ringbuf_format": 2, "_backward": 2,
    "_map_spec": 3, "_perf_source": 3, "_ringbuf_source": 3, "_fake": 3,
    "_ebpfwin": 3, "_columnar": 3, "_clock": 3, "_losses": 3, "_build": 3, "_order": 3,
    "_multi": 3,
    "_reader": 4, "_overwrite": 4,
    "_setup": 5, "_lifetime": 5, "_waiting": 5, "_waiting.asyncio": 5, "_waiting.trio": 5,
    "_waiting.epoll": 5, "_user_ringbuf": 5, "_lease": 5,
    "_stream": 6, "_sync": 6, "_signals": 6,
    "__init__": 7, "abc": 7, "decoders": 7, "testing": 7, "_natsargs": 7,
    "_trace": 8, "__main__": 8, "fleet": 8,  # tools built on the public API
}
# Subpackages whose modules sit on floors of their own (the waiting protocols are
# vocabulary the seam uses; the loops' bindings sit with the drivers).
SPLIT = {"_waiting"}
# __init__ re-exports; testing's Producer runs a program through the binding; a lease
# maps perf rings a second time through it (_libbpf/_shared_ring.py). _ebpfwin
# has its own binding and shares only _prototypes (MapInfo) with libbpf's. The asyncio
# binding takes libc's timerfd from there (ctypes lives only there), not libbpf.
BINDING_USERS = {
    "_object", "_btf", "_map_spec", "_perf_source", "testing", "__init__", "_lease",
    "_waiting.asyncio",
}
# The map-backed sources are siblings: none imports another (they share _map_spec and
# the seam). The fake is a perf ring and takes the perf source's wakeup settings.
MAP_SOURCES = {"_perf_source", "_ringbuf_source", "_ebpfwin"}


def unit_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    if len(rel.parts) == 1:
        return rel.stem
    if rel.parts[0] in SPLIT and rel.stem != "__init__":
        return f"{rel.parts[0]}.{rel.stem}"
    return rel.parts[0]


def _unit_named(dotted: str) -> str:
    """The unit of the aperf module ``dotted`` (relative to the package)."""
    parts = dotted.split(".")
    if parts[0] in SPLIT and len(parts) > 1:
        return f"{parts[0]}.{parts[1]}"
    return parts[0]


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node but those under ``if TYPE_CHECKING:`` (annotations import no module)."""
    out: list[ast.AST] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            todo.extend(node.orelse)
            continue
        out.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return out


def imports() -> dict[str, set[str]]:
    """unit -> the aperf units it imports (subpackages count as one unit)."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        unit = unit_of(path)
        deps = graph.setdefault(unit, set())
        rel = path.relative_to(PACKAGE)
        inside_subpackage = len(rel.parts) > 1
        for node in _runtime_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                if node.level == 1 and inside_subpackage:
                    if rel.parts[0] not in SPLIT:
                        continue  # within the subpackage
                    names = [node.module] if node.module else [a.name for a in node.names]
                    deps.update(_unit_named(f"{rel.parts[0]}.{name}") for name in names)
                elif node.module:
                    deps.add(_unit_named(node.module))
                else:
                    deps.update(alias.name for alias in node.names)
            elif isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [
                    node.module or ""
                ]
                for name in names:
                    if name.startswith("aperf."):
                        deps.add(_unit_named(name.split(".", 1)[1]))
                    elif name == "aperf":
                        deps.add("__init__")
        deps.discard(unit)
    return graph


def test_every_module_has_a_floor() -> None:
    assert set(imports()) <= set(FLOORS), "place new modules in FLOORS"


def test_nothing_imports_upward() -> None:
    upward = [
        f"{unit} (floor {FLOORS[unit]}) imports {dep} (floor {FLOORS[dep]})"
        for unit, deps in imports().items()
        for dep in deps
        if FLOORS[dep] > FLOORS[unit]
    ]
    assert not upward


def test_no_cycle() -> None:
    graph = imports()
    state: dict[str, int] = {}

    def visit(unit: str, path: list[str]) -> None:
        state[unit] = 1
        for dep in graph.get(unit, ()):
            assert state.get(dep) != 1, f"import cycle: {' -> '.join([*path, unit, dep])}"
            if dep not in state:
                visit(dep, [*path, unit])
        state[unit] = 2

    for unit in graph:
        if unit not in state:
            visit(unit, [])


def test_the_binding_is_reached_only_by_sources_objects_and_btf() -> None:
    users = {unit for unit, deps in imports().items() if "_libbpf" in deps}
    assert users <= BINDING_USERS


def test_map_backed_sources_do_not_import_one_another() -> None:
    graph = imports()
    chained = [f"{unit} imports {dep}" for unit in sorted(MAP_SOURCES)
               for dep in sorted(graph[unit] & MAP_SOURCES)]
    assert not chained


def test_the_btf_room_knows_no_bpf_object() -> None:
    source = (PACKAGE / "_btf.py").read_text()
    assert "_object" not in imports()["_btf"] and "TYPE_CHECKING" not in source


def test_the_reader_reaches_no_binding() -> None:
    graph = imports()
    seen: set[str] = set()
    todo = ["_reader"]
    while todo:
        unit = todo.pop()
        if unit not in seen:
            seen.add(unit)
            todo.extend(graph.get(unit, ()))
    assert not seen & {
        "_libbpf", "_object", "_btf", "_perf_source", "_ebpfwin", "_stream", "_sync"
    }


def test_importing_aperf_loads_no_library() -> None:
    import subprocess
    import sys

    code = (
        "import sys, ctypes; loaded = []\n"
        "orig = ctypes.CDLL.__init__\n"
        "def spy(self, name, *a, **k): loaded.append(name); orig(self, name, *a, **k)\n"
        "ctypes.CDLL.__init__ = spy\n"
        "import aperf, aperf.testing, aperf.decoders\n"
        "print(loaded)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_architecture_page_draws_these_floors() -> None:
    # docs/architecture.md's picture: a line "  N name ..." starts floor N, and every
    # module named (``x.py`` or ``x/``) until the next one sits on that floor here.
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    picture = page.split("```", 2)[1]
    drawn: dict[str, int] = {}
    floor = -1
    for line in picture.splitlines():
        if line[:4].strip().isdigit():
            floor = int(line[:4])
        for name in re.findall(r"(?<![\w./])(\w+(?:/\w+)?)(?:\.py\b|/)", line):
            drawn.setdefault(name.replace("/", "."), floor)  # _waiting/base.py: _waiting.base
    assert drawn == FLOORS
