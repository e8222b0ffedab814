"""Runs of identical perf records found with NumPy: the columnar consumers' run finder.

``format.split_span``'s ``run_end`` for one span, at C speed (``PerfRecords.columnar_split``
imports this module, and NumPy, when a consumer first asks for arrays): for long runs
it costs a tenth of the pure one (measured: 1.5 against 20 ns per record at 87,000
records), which is most of what arrays cost per sample.
"""

from __future__ import annotations

import numpy as np

from ..seam import RunEnd

_CHECKS_PER_SPAN = 8  # NumPy checks of a span; then the pure run finder (see RunFinder)
_U8, _U4 = np.dtype("<u8"), np.dtype("<u4")


class RunFinder:
    """``format.split_span``'s ``run_end`` for one span, at C speed: where the run
    of records identical to the one at ``pos`` ends (``pos`` if fewer than two are in
    line). The 12 header bytes of every record after it are compared at once (an 8-byte
    and a 4-byte column), and any difference ends the run, exactly there.

    Each check costs the rest of the span, so a span cut into many runs (an overloaded
    ring: lost record, sample, lost record...) would cost its length squared: after a
    few checks the rest of the span goes to the pure parser.
    """

    __slots__ = ("checks", "pure")

    def __init__(self, pure: RunEnd) -> None:
        self.checks = _CHECKS_PER_SPAN
        self.pure = pure  # the format's own, for what NumPy does not check

    def __call__(self, span: bytes, pos: int, size: int, end: int) -> int:
        count = (end - pos) // size
        if count < 2:
            return pos
        if size % 8 or self.checks <= 0:  # perf records are 8-aligned; others: pure
            return self.pure(span, pos, size, end)
        self.checks -= 1
        step = size // 8
        heads = np.frombuffer(span, _U8, count * step, pos)[::step]  # type, misc, size
        raws = np.frombuffer(span, _U4, count * step * 2, pos)[2 :: step * 2]  # raw size
        differ = (heads != heads[0]) | (raws != raws[0])
        if not differ.any():
            return pos + count * size
        same = int(differ.argmax())
        return pos + same * size if same >= 2 else pos

