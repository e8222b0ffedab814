"""The import graph of aperf/, package by package: each package on a floor, drivers above
one reader, sources below it, ctypes only in _native; no cycle between any two modules,
nothing upward, at the top and inside every package that has floors of its own."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "aperf"

# The floors of aperf/, bottom up. A unit (a top-level module or package) may import its
# own floor and the ones below. The entry points (``python -m aperf``, ``python -m
# aperf.fleet``) sit on the top floor, wherever their file is: fleet's __main__ takes the
# tools' NATS options, and the tools use aperf.fleet.
FLOORS = {
    "_errors": 0, "_privileges": 0, "_log": 0, "_naming": 0, "_events": 0, "_options": 0,
    "_boottime": 0,
    "_native": 1,  # the only ctypes: libbpf, ebpfapi.dll, libc
    "_waiting": 2,  # how drivers wait; knows no ring (the seam takes its HandleKind)
    "_decoding": 3, "_arrow": 3,  # Arrow from the decoders' layouts (_arrow on _decoding)
    "_bpf": 4,  # BPF objects and BTF (BTF compiles decoders)
    "_rings": 5,  # the seam and the sources
    "_recording": 5,  # recordings; their replay is a source (on the seam)
    "_reading": 6,  # the one reading policy
    "_drivers": 7,
    "__init__": 8, "abc": 8, "decoders": 8, "testing": 8,  # the public API
    "fleet": 9,  # public too, built on the API above
    "pytest_plugin": 9,  # aperf.testing's fixtures for pytest (entry point pytest11)
    "_tools": 10,  # commands
    "__main__": 11, "fleet.__main__": 11,
}
ENTRY_POINTS = {"__main__", "fleet.__main__"}

# Floors inside packages (their modules and subpackages), bottom up, by the same rule.
INSIDE = {
    "_native": {"prototypes": 0, "libc": 0, "speedups": 0, "_speedups": 0, "libbpf": 1,
                "ebpfapi": 1},
    "_native.libc": {"functions": 0, "shared_ring": 0, "timerfd": 1},
    # libbpf cut by noun, as libbpf-rs cuts it; __init__ re-exports them all.
    "_native.libbpf": {"binding": 0, "log": 1, "object": 1, "query": 1, "program": 1,
                       "map": 2, "pin": 2, "btf": 2, "perf_buffer": 2, "__init__": 3},
    "_native.ebpfapi": {"binding": 0, "api": 1},
    # The protocols are vocabulary the seam uses; the loops' bindings sit above them, and
    # __init__ (which chooses one) on top.
    "_waiting": {"base": 0, "epoll": 0, "win32": 0, "asyncio": 1, "trio_win32": 1,
                 "trio": 2, "__init__": 3},
    "_decoding": {"layout": 0, "decode": 1, "encode": 2},
    "_arrow": {"schema": 0, "columns": 1, "builder": 2},
    "_recording": {"layouts": 0, "files": 1, "writer": 2, "replay": 2, "record": 3},
    "_bpf": {"map_types": 0, "btf": 0, "header": 0, "object": 1},
    # The seam (the protocols and the segment types every format hands the reader) sits
    # under the formats and sources that implement it; Windows' ring buffer reads with
    # the ring buffer format.
    "_rings": {"seam": 0, "map_lock": 0, "map_spec": 1, "multi": 1, "perf": 2, "ringbuf": 2,
               "windows": 3},
    "_rings.perf": {"format": 0, "runs": 0, "backward": 0, "hotplug": 0, "source": 1,
                    "fake": 2, "lease_ring": 2},
    "_rings.ringbuf": {"format": 0, "mapping": 1, "source": 2, "user_format": 1, "array": 2},
    "_rings.windows": {"base": 0, "perf": 1, "ringbuf": 2},
    # The reader's rooms below it: the ring set, the drain clock, the loss ledger, the
    # builder and callbacks; statistics, gathered wakeups and ordering on those.
    "_reading": {"clock": 0, "losses": 0, "callbacks": 0, "build": 0, "rings": 0, "looks": 0,
                 "order": 1, "stats": 1, "gather": 1, "columnar": 2, "multi": 2,
                 "ordering": 2, "lease": 1, "reader": 3, "snapshot": 4},
    "_drivers": {"items": 0, "setup": 0, "lifetime": 0, "signals": 0, "lease": 1,
                 "user_ringbuf": 1, "stream": 2, "sync": 3},
    # The fleet's sans-I/O rooms (the wire format, the window, the holes, the intake) sit
    # under their drivers (the sink, the reader); its __main__ is an entry point, on top.
    "fleet": {"_args": 0, "_clock": 0, "_errors": 0, "_events": 0, "testing": 0,
              "_wire": 1, "_signing": 1, "_connect": 1, "_gaps": 2, "_window": 2,
              "_intake": 3, "_sink": 4, "_reader": 4, "__init__": 5, "__main__": 6},
    "_tools": {"nats_options": 0, "doctor": 0, "trace": 1, "record": 2},
    # The tracer's loop (session) serves both the command (cli) and its shards.
    "_tools.trace": {"preflight": 0, "render": 0, "output": 0, "session": 1, "shards": 2,
                     "cli": 3},
}

# Who may import each binding of _native: __init__ re-exports (libbpf_version); the
# doctor creates a tiny map of each type to probe the kernel. eBPF
# for Windows' binding serves its sources and waits only. libc's pieces each serve one
# user: the asyncio binding's timer, the perf source's RCU grace period, and the second
# mapping of perf rings, the leased ring.
NATIVE_USERS = {
    "_native.libbpf": {"_bpf.object", "_bpf.btf", "_rings.map_spec", "_rings.perf.source",
                       "__init__", "_tools.doctor"},
    "_native.ebpfapi": {"_waiting.win32", "_waiting.trio_win32", "_rings.windows.base",
                        "_rings.windows.perf", "_rings.windows.ringbuf"},
    "_native.libc.timerfd": {"_waiting.asyncio"},
    "_native.libc.functions": {"_rings.perf.source"},
    "_native.libc.shared_ring": {"_rings.perf.lease_ring"},
    # The compiled fast path (_speedups.c, no library of anyone else's) stands in for pure
    # functions of the formats, the ring memory, the builder, the reader's tick, the
    # stream's iterator, and says which path runs (__init__, aperf-trace -v).
    "_native.speedups": {"_rings.perf.format", "_rings.ringbuf.format",
                         "_native.libbpf.perf_buffer", "_reading.build", "_reading.looks",
                         "_reading.reader", "_drivers.items", "__init__", "_tools.trace.cli"},
}
# aperf.fleet is built on the public API (aperf, aperf.decoders: its events, errors and
# decoders). Of the private floors it uses these only, each for a reason; an entry no
# fleet module uses any more is to go.
PUBLIC = {"__init__", "abc", "decoders", "testing"}
FLEET_PRIVATE = {
    "_log": "aperf's one logger (library code never configures logging)",
    "_naming": "public names shown as the package's (aperf.fleet.FleetError)",
    "_boottime": "the wall clock against the boot-time clock, measured as recordings do",
    "_reading.build": "EventBuilder: a fleet reader builds its samples as a stream does",
    "_drivers.items": "the streams' iterator class: a cancelled anext() ends no iterator",
}

# The map-backed source families are siblings: none imports another's source (they share
# map_spec and the seam; Windows' ring buffer reads with the ring buffer *format*).
MAP_SOURCES = ("_rings.perf.source", "_rings.ringbuf.source", "_rings.ringbuf.array",
               "_rings.windows")


def module_of(path: Path) -> str:
    """aperf/_rings/perf/source.py -> "_rings.perf.source"; a package's __init__.py ->
    the package ("_waiting"); aperf/__init__.py -> "__init__"."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def _is_package(module: str) -> bool:
    return module == "__init__" or (PACKAGE / module.replace(".", "/")).is_dir()


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
    """module -> the aperf modules it imports at run time (lazy imports included)."""
    modules = {module_of(p): p for p in PACKAGE.rglob("*.py")}
    # Compiled modules (aperf/_native/_speedups.c) are imported as modules too.
    compiled = {module_of(p.with_suffix(".py")) for p in PACKAGE.rglob("*.c")}

    def named(dotted: str) -> str:
        return dotted if dotted else "__init__"

    def target(base: str, name: str) -> str:
        # ``from base import name``: the submodule base.name if there is one, else base.
        full = f"{base}.{name}" if base else name
        return full if full in modules or full in compiled else named(base)

    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        deps = graph.setdefault(module, set())
        here = [] if module == "__init__" else module.split(".")
        package = here if _is_package(module) else here[:-1]
        for node in _runtime_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base_parts = package[: len(package) - (node.level - 1)]
                    base = ".".join(base_parts + ([node.module] if node.module else []))
                elif node.module == "aperf" or (node.module or "").startswith("aperf."):
                    base = (node.module or "")[len("aperf."):]
                else:
                    continue
                deps.update(target(base, alias.name) for alias in node.names)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == "aperf":
                        deps.add("__init__")
                    elif alias.name.startswith("aperf."):
                        deps.add(named(alias.name[len("aperf."):]))
        deps.discard(module)
    return graph


def top_unit(module: str) -> str:
    return module if module in ENTRY_POINTS else module.split(".")[0]


def child_of(package: str, module: str) -> str:
    """The module or subpackage of ``package`` that holds ``module``."""
    return "__init__" if module == package else module[len(package) + 1:].split(".")[0]


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def floors_of(importer: str, imported: str) -> tuple[str, int, int] | None:
    """Where an import is judged: (the package whose floors decide, the importer's floor,
    the imported's floor), or None where no floors are declared (fleet inside)."""
    a, b = top_unit(importer), top_unit(imported)
    if a != b:
        return "aperf", FLOORS[a], FLOORS[b]
    package = a
    while package in INSIDE:
        ca, cb = child_of(package, importer), child_of(package, imported)
        if ca != cb:
            floors = INSIDE[package]
            return package, floors[ca], floors[cb]
        package = f"{package}.{ca}"
    return None


def test_every_module_has_a_floor() -> None:
    graph = imports()
    assert {top_unit(m) for m in graph} <= set(FLOORS), "place new modules in FLOORS"
    missing = []
    for module, deps in graph.items():
        for package, floors in INSIDE.items():
            if _inside(module, package):
                child = child_of(package, module)
                # A package's __init__ that only says its job needs no floor.
                if child not in floors and (child != "__init__" or deps):
                    missing.append(f"{module} (in {package})")
    assert not missing, "place these in INSIDE"


def test_nothing_imports_upward() -> None:
    upward = []
    for module, deps in imports().items():
        for dep in deps:
            judged = floors_of(module, dep)
            if judged and judged[2] > judged[1]:
                package, mine, theirs = judged
                upward.append(f"{module} (floor {mine} of {package}) imports {dep} "
                              f"(floor {theirs})")
    assert not upward


def test_no_cycle() -> None:
    graph = imports()
    state: dict[str, int] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in sorted(graph.get(module, ())):
            assert state.get(dep) != 1, f"import cycle: {' -> '.join([*path, module, dep])}"
            if dep not in state:
                visit(dep, [*path, module])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])


def test_each_binding_is_reached_only_by_its_users() -> None:
    # Every part of _native that a module outside it imports has its users listed.
    strays = [
        f"{module} imports {dep}"
        for module, deps in imports().items() if not _inside(module, "_native")
        for dep in deps if _inside(dep, "_native")
        if module not in next((users for binding, users in NATIVE_USERS.items()
                               if _inside(dep, binding)), set())
    ]
    assert not strays


# What calls into C: loading a library, declaring a function, reading or writing memory
# at an address. ctypes' types (``_decoding`` compiles ``ctypes.Structure`` layouts) are
# no call into C and may be used anywhere.
C_CALLS = {"CDLL", "WinDLL", "cdll", "windll", "pythonapi", "CFUNCTYPE", "WINFUNCTYPE",
           "PYFUNCTYPE", "string_at", "wstring_at", "memmove", "memset", "addressof", "cast",
           "byref", "pointer", "get_errno", "set_errno"}
C_MEMBERS = {"argtypes", "restype", "errcheck", "from_address"}  # of a C function, a C type


def test_only_native_calls_into_c() -> None:
    calls = []
    for path in PACKAGE.rglob("*.py"):
        module = module_of(path)
        if _inside(module, "_native"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and (
                node.attr in C_MEMBERS
                or (node.attr in C_CALLS and getattr(node.value, "id", "") == "ctypes")
            ):
                calls.append(f"{module}:{node.lineno} .{node.attr}")
            elif isinstance(node, ast.ImportFrom) and node.module == "ctypes":
                calls += [f"{module}:{node.lineno} {alias.name}" for alias in node.names
                          if alias.name in C_CALLS]
    assert not calls


def test_map_backed_sources_do_not_import_one_another() -> None:
    def family(module: str) -> str | None:
        return next((f for f in MAP_SOURCES if _inside(module, f)), None)

    chained = [f"{module} imports {dep}" for module, deps in sorted(imports().items())
               for dep in sorted(deps)
               if family(module) and family(dep) and family(module) != family(dep)]
    assert not chained


def test_the_fleet_uses_the_public_api_and_the_private_rooms_it_names() -> None:
    # (fleet/__main__.py is an entry point: the commands' NATS options are its own.)
    used = {dep for module, deps in imports().items() if top_unit(module) == "fleet"
            for dep in deps if top_unit(dep) != "fleet" and dep not in PUBLIC}
    assert used == set(FLEET_PRIVATE)


def test_the_btf_room_knows_no_bpf_object() -> None:
    source = (PACKAGE / "_bpf" / "btf.py").read_text()
    assert "_bpf.object" not in imports()["_bpf.btf"] and "TYPE_CHECKING" not in source


def test_the_reading_floor_knows_no_particular_source() -> None:
    # The reader and its rooms talk to sources through the seam only: what a source can
    # do is a protocol there (isinstance), never a class of one of them.
    known = sorted(f"{module} imports {dep}" for module, deps in imports().items()
                   if _inside(module, "_reading") for dep in deps
                   if _inside(dep, "_rings") and dep != "_rings.seam")
    assert known == []


def test_the_reader_reaches_no_binding() -> None:
    graph = imports()
    seen: set[str] = set()
    todo = ["_reading.reader"]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(graph.get(module, ()))
    forbidden = ("_native", "_bpf.object", "_bpf.btf", "_rings.perf.source", "_rings.windows",
                 "_drivers")
    # The compiled fast path is no binding: it stands in for the reader's own functions.
    allowed = {"_native.speedups", "_native._speedups"}
    assert not [m for m in seen - allowed if any(_inside(m, f) for f in forbidden)]


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


NAME = re.compile(r"\w+(?:\.py|/)")


def drawn_tree() -> tuple[dict[str, int], list[str]]:
    """docs/architecture.md's picture, read as a folder tree: each line names files
    (``x.py``) and folders (``x/``) side by side, then says what they are; a folder's
    contents are the lines under it indented deeper. A number in the first four columns
    starts a floor of aperf/. Returns each path drawn (``_rings/perf/source.py``) with its
    floor, in the order drawn."""
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    picture = page.split("```", 2)[1]
    drawn: dict[str, int] = {}
    order: list[str] = []
    stack: list[tuple[int, str]] = []  # (indent, folder path) of the open folders
    floor = -1
    for line in picture.splitlines()[1:]:
        if line[:4].strip().isdigit():
            floor = int(line[:4])
        rest = line[4:]
        words = rest.split()
        if not words or not NAME.fullmatch(words[0]) or words[0] == "aperf/":
            continue
        indent = len(rest) - len(rest.lstrip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        parent = stack[-1][1] if stack else ""
        names = []
        for word in words:
            if not NAME.fullmatch(word):
                break
            names.append(word)
            drawn[parent + word] = floor
            order.append(parent + word)
        if names[-1].endswith("/"):
            stack.append((indent, parent + names[-1]))
    return drawn, order


def test_the_architecture_page_draws_this_tree() -> None:
    # Every module is drawn where it is (a package's __init__.py when it holds more than
    # its docstring), and nothing else; each top-level unit on its floor; inside a
    # package with floors, the higher floors drawn first (the picture reads top-down).
    drawn, order = drawn_tree()
    files = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        body = ast.parse(path.read_text()).body
        only_docstring = len(body) <= 1 and all(isinstance(n, ast.Expr) for n in body)
        if rel.name == "__init__.py" and len(rel.parts) > 1 and only_docstring:
            continue
        files[rel.as_posix()] = path
    folders = {p.relative_to(PACKAGE).as_posix() + "/" for p in PACKAGE.rglob("*")
               if p.is_dir() and any(p.glob("*.py"))}
    assert set(drawn) == set(files) | folders
    tops = {name.removesuffix(".py").removesuffix("/"): floor for name, floor in drawn.items()
            if "/" not in name.rstrip("/")}
    assert tops == {unit: floor for unit, floor in FLOORS.items() if "." not in unit}
    for package, floors in INSIDE.items():
        folder = package.replace(".", "/") + "/"
        children = [name[len(folder):].rstrip("/").removesuffix(".py") for name in order
                    if name.startswith(folder) and name != folder
                    and "/" not in name[len(folder):].rstrip("/")]
        drawn_floors = [floors[child] for child in children]
        assert drawn_floors == sorted(drawn_floors, reverse=True), f"{folder}: {children}"
