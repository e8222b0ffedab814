"""``aperf-trace --shards N``: one process loads the tracer, N processes read it.

For hosts where one Python core cannot drain every CPU's ring. The parent loads
and attaches the BPF object once and pins its perf event array in the BPF
filesystem; each child (``aperf-trace`` again, with the hidden ``--shard-of``)
opens the pin with ``cpus=`` its share of the online CPUs, so the children's map
locks cover disjoint slots (compatible owners) and together every CPU. The parent
prints the header, then copies the children's lines to its stdout, whole lines
only. At SIGINT/SIGTERM it passes SIGTERM on; each child stops as the tracer
does (what it had read is printed), and the parent ends once every child has.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence

import structlog

import aperf

from ..._rings.perf.source import online_cpus
from .output import LineOutput
from .preflight import OptionError, SetupError
from .render import HEADER, event_decoder
from .session import Printer, StopSignals, event_map, order_by, show_all, tracer_object

READY = "ready"  # a child's first line: its rings are open, events from now on are its
PIN_DIR = "/sys/fs/bpf"
log = structlog.get_logger("aperf.trace")


def shard_cpus(cpus: Sequence[int], shards: int) -> list[list[int]]:
    """``cpus`` dealt round-robin into ``shards`` non-empty, disjoint lists."""
    if not 1 <= shards <= len(cpus):
        raise OptionError(
            f"--shards {shards}: give 1 to {len(cpus)} (a shard reads at least one of "
            f"the {len(cpus)} online CPUs)"
        )
    return [list(cpus[index::shards]) for index in range(shards)]


def child_argv(args: argparse.Namespace, pin: str, cpus: Sequence[int]) -> list[str]:
    """The command line of the shard reading ``cpus`` of the map pinned at ``pin``."""
    argv = [
        sys.executable, "-m", "aperf", "trace", "--shard-of", pin,
        "--shard-cpus", ",".join(map(str, cpus)), "--object", str(args.object),
        "--pages", str(args.pages), "--wakeup", args.wakeup, "--loop", args.loop,
    ]
    return argv + ["--json"] * args.json + ["-v"] * args.verbose


@contextlib.contextmanager
def pinned(map_: aperf.Map) -> Iterator[str]:
    """The map pinned under a name of this process's own; unpinned on leaving."""
    pin = os.path.join(PIN_DIR, f"aperf_trace_{os.getpid()}_{map_.name}")
    try:
        map_.pin(pin)
    except aperf.AperfError as exc:
        raise SetupError(f"--shards needs the BPF filesystem at {PIN_DIR}: {exc}") from None
    try:
        yield pin
    finally:
        with contextlib.suppress(aperf.AperfError, OSError):
            map_.unpin(pin)


async def trace_sharded(args: argparse.Namespace) -> int:
    """Load once, start the shards, print their lines until they end (0 when all end well)."""
    out = await LineOutput.open()
    children: list[asyncio.subprocess.Process] = []

    def stop_children() -> None:
        out.stop()
        for child in children:
            if child.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    child.send_signal(signal.SIGTERM)

    try:
        with StopSignals() as stop, tracer_object(
            args.object, args.duration * 1_000_000, buffer="perf"
        ) as obj:
            shares = shard_cpus(online_cpus(), args.shards)
            with pinned(event_map(obj)) as pin:
                for cpus in shares:
                    children.append(await asyncio.create_subprocess_exec(
                        # stdin: a pipe never written, whose end tells the child its parent died
                        *child_argv(args, pin, cpus), stdin=asyncio.subprocess.PIPE,
                        stdout=asyncio.subprocess.PIPE,
                    ))
                    log.info(f"shard {children[-1].pid} reads CPUs {cpus}")
                stop.on_stop(stop_children)
                ready = await asyncio.gather(*(first_line(child) for child in children))
            if all(ready):  # the pin is gone: each child holds the map by its own fd
                if not args.json:
                    await out.write(HEADER)
                await asyncio.gather(*(copy_lines(child, out, stop_children)
                                       for child in children))
            else:
                stop_children()  # a shard could not start: it said why on stderr
            codes = [await child.wait() for child in children]
    finally:
        try:
            for child in children:
                if child.returncode is None:
                    child.kill()
                    await child.wait()
        finally:
            await out.aclose()
    return 0 if all(ready) and not any(codes) else 1


async def first_line(child: asyncio.subprocess.Process) -> bool:
    """Whether the child said it is ready (else it ended, with its reason on stderr)."""
    assert child.stdout is not None
    return (await child.stdout.readline()).rstrip(b"\n") == READY.encode()


async def copy_lines(
    child: asyncio.subprocess.Process, out: LineOutput, stop: Callable[[], None]
) -> None:
    """The child's lines to ``out`` until the child's stdout ends; if ``out``'s reader goes
    away, every child is stopped."""
    assert child.stdout is not None
    async for line in child.stdout:
        await out.write(line.rstrip(b"\n").decode("utf-8", "surrogateescape"))
        if out.broken:
            stop()
    # A child that ended with no newline at the end wrote nothing that is a line.


async def trace_shard(args: argparse.Namespace) -> int:
    """A child: read the CPUs ``--shard-cpus`` of the map pinned at ``--shard-of``."""
    cpus = [int(cpu) for cpu in args.shard_cpus.split(",")]
    out = await LineOutput.open()
    try:
        with StopSignals() as stop, aperf.BPFObject(args.object) as obj:  # for its BTF only
            stop.on_stop(out.stop)
            stream = aperf.PerfStream(
                args.shard_of, pages=args.pages, decoder=event_decoder(obj), wakeup=args.wakeup,
                cpus=cpus, order_by=order_by(args),  # in time order within the shard
            )
            async with stream:
                stop.on_stop(stream.close)
                on_parent_gone(out.stop, stream.close)
                await out.write(READY)
                await show_all(stream, Printer(out, args.json))
    finally:
        await out.aclose()
    return 0


def on_parent_gone(*actions: Callable[[], object]) -> None:
    """Run ``actions`` once stdin, the parent's pipe, ends: the parent died (even by SIGKILL),
    so no shard goes on reading for nobody."""
    loop = asyncio.get_running_loop()

    def readable() -> None:
        try:
            data = os.read(0, 4096)
        except BlockingIOError:
            return
        if not data:
            loop.remove_reader(0)
            for action in actions:
                action()

    os.set_blocking(0, False)
    loop.add_reader(0, readable)
