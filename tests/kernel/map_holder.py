"""A reader in a process of its own, for tests/kernel/test_map_lock.py.

``python tests/kernel/map_holder.py PIN MODE [fork] [wait] [ignored...]`` opens the map
pinned at PIN (or the map fd PIN, inherited, when it is a number; MODE:
``iterate``/``run``/``trio``/``poll``, how it reads) and prints, one line each,
flushed: ``ready <pid>`` once the map is open; ``count <n>`` for every hundredth
sample; and when the stream ends ``taken <taker pid> <samples>`` (a
TakenOverError) or ``error <type> <message>``. With ``fork``, it first forks a
child that inherits the open stream and sleeps, printing ``child <pid>``. With
``wait``, it prints ``pid <pid>`` and waits for a line on stdin before it opens
the map. Further arguments are ignored (they show in its command line).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import anyio

import aperf

PIN: str | int = int(sys.argv[1]) if sys.argv[1].isdigit() else sys.argv[1]
MODE = sys.argv[2]
FORK = "fork" in sys.argv[3:]
WAIT = "wait" in sys.argv[3:]
count = 0


def say(*words: object) -> None:
    print(*words, flush=True)


def on_sample(sample: Any) -> None:
    global count
    count += 1
    if count % 100 == 0:
        say("count", count)


def opened() -> None:
    if FORK:
        child = os.fork()
        if child == 0:
            time.sleep(60)  # holds the inherited stream, reads nothing
            os._exit(0)
        say("child", child)
    say("ready", os.getpid())


async def read_async() -> None:
    async with aperf.PerfStream(PIN, on_sample=on_sample if MODE != "iterate" else None) as s:
        opened()
        if MODE == "iterate":
            async for event in s:
                if isinstance(event, aperf.Sample):
                    on_sample(event)
        else:
            await s.run()


def read_sync() -> None:
    with aperf.PerfBuffer(PIN, on_sample=on_sample) as pb:
        opened()
        while True:
            pb.poll(100)


try:
    if WAIT:
        say("pid", os.getpid())
        sys.stdin.readline()
    if MODE == "poll":
        read_sync()
    else:
        anyio.run(read_async, backend="trio" if MODE == "trio" else "asyncio")
except aperf.TakenOverError as exc:
    say("taken", exc.pid, count)
except Exception as exc:
    say("error", type(exc).__name__, exc)
