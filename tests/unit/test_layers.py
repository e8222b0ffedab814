"""The import graph of aperf/: drivers above one reader, sources below it, the
ctypes binding only under sources, objects and BTF; no cycle, nothing upward."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "aperf"

# Each module's floor. A module may import its own floor and the ones below.
FLOORS = {
    "_errors": 0, "_log": 0, "_prototypes": 0,
    "_events": 1, "_options": 1, "_libbpf": 1, "_lifetime": 1,
    "_object": 2, "_btf": 2, "_perf_format": 2, "_ringbuf_format": 2, "_decode": 2,
    "_layout": 2,
    "_source": 3, "_map_spec": 3, "_perf_source": 3, "_ringbuf_source": 3, "_fake": 3,
    "_ebpfwin": 3, "_columnar": 3,
    "_reader": 4,
    "_setup": 5, "_loops": 5, "_trio": 5,
    "_stream": 6, "_sync": 6,
    "__init__": 7, "decoders": 7, "testing": 7, "_natsargs": 7,
    "_trace": 8, "__main__": 8, "fleet": 8,  # tools built on the public API
}
# __init__ re-exports; _ebpfwin (eBPF for Windows' own binding and source) reads its
# map facts with _libbpf's MapInfo.
BINDING_USERS = {
    "_object", "_btf", "_map_spec", "_perf_source", "_ebpfwin", "testing", "__init__",
}


def unit_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


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
        inside_subpackage = len(path.relative_to(PACKAGE).parts) > 1
        for node in _runtime_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                if node.level == 1 and inside_subpackage:
                    continue  # within the subpackage
                if node.module:
                    deps.add(node.module.split(".")[0])
                else:
                    deps.update(alias.name for alias in node.names)
            elif isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [
                    node.module or ""
                ]
                for name in names:
                    if name.startswith("aperf."):
                        deps.add(name.split(".")[1])
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
