"""A process holding slots of a map's lock, for tests/kernel/test_map_lock.py and
tests/unit/test_map_lock.py (no BPF: the map id may be made up).

``python tests/lock_holder.py MAP_ID SLOTS [wait] [ignored...]`` (SLOTS: comma
separated) prints, one line each, flushed: with ``wait``, ``pid <pid>``, then it
waits for a line on stdin; ``held`` once it holds the slots (or ``busy
<message>`` and it exits); then for each take-over notice ``taken <taker pid>``
when a taker accepted the map (it gives it up) or ``notice`` when none did; and
``released`` once a line on stdin made it let go, then it exits. Further
arguments are ignored (they show in its command line).
"""

from __future__ import annotations

import os
import select
import sys

import aperf
from aperf._rings import map_lock as ml


def say(*words: object) -> None:
    print(*words, flush=True)


def main() -> None:
    map_id, slots = int(sys.argv[1]), [int(s) for s in sys.argv[2].split(",")]
    if "wait" in sys.argv[3:]:
        say("pid", os.getpid())
        sys.stdin.readline()
    try:
        lock = ml.lock_map(map_id, "test", slots)
    except aperf.BusyResourceError as exc:
        say("busy", exc)
        return
    assert lock is not None
    say("held")
    while True:
        ready, _, _ = select.select([sys.stdin, lock.notice], [], [])
        if lock.notice in ready:
            error = lock.taken_over()
            if error is not None:
                lock.give_up()
                say("taken", error.pid)
            else:
                say("notice")
        if sys.stdin in ready:
            sys.stdin.readline()
            lock.release()
            say("released")
            return


main()
