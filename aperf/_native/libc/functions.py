"""libc's functions, each declared on first use (importing aperf loads no library),
and the one syscall aperf makes by number through libc's ``syscall``: membarrier."""

from __future__ import annotations

import ctypes
import os
from typing import Any

_functions: dict[str, Any] = {}


def libc_function(name: str, restype: Any, *argtypes: Any) -> Any:
    """A libc function, declared on first use (importing aperf loads no library)."""
    fn = _functions.get(name)
    if fn is None:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
        fn.argtypes = list(argtypes)
        fn.restype = restype
        _functions[name] = fn
    return fn


_SYS_MEMBARRIER = {"x86_64": 324, "aarch64": 283}
_MEMBARRIER_CMD_GLOBAL = 1  # implemented with synchronize_rcu()


def rcu_grace_period() -> bool:
    """Wait until every BPF program running now has returned (an RCU grace period, by
    ``membarrier(MEMBARRIER_CMD_GLOBAL)``): one that read a map slot just before it was
    deleted has then finished writing. False where this cannot be waited for."""
    number = _SYS_MEMBARRIER.get(os.uname().machine)
    if number is None:
        return False
    syscall = ctypes.CDLL(None, use_errno=True).syscall  # libc's; variadic, so typed here
    return int(syscall(ctypes.c_long(number), ctypes.c_int(_MEMBARRIER_CMD_GLOBAL),
                       ctypes.c_uint(0))) == 0
