"""Children that die with the process that started them: Linux's parent-death signal.

`helexa up` starts servers and apps that must not outlive it, even when it is killed with SIGKILL
and runs no cleanup at all. `dies_with_us(sig)` is a `preexec_fn` that asks the kernel
(`prctl(PR_SET_PDEATHSIG)`) to send the child `sig` when its parent dies; it survives `exec`. The
signal follows the thread that forked the child, so children are started from the main thread.
Elsewhere than Linux there is no such signal, and children are only stopped by a living parent.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1


def _load_prctl() -> Callable[[int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


# Looked up now, not between fork and exec, where the child should do as little as it can.
_prctl = _load_prctl()


def dies_with_us(sig: int) -> Callable[[], None] | None:
    """A `preexec_fn` that has the child receive `sig` when this process dies (None off Linux)."""
    if _prctl is None:
        return None
    prctl, parent = _prctl, os.getpid()

    def arm() -> None:
        if prctl(PR_SET_PDEATHSIG, sig) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent:  # the parent died before the signal was armed
            os.kill(os.getpid(), sig)

    return arm
