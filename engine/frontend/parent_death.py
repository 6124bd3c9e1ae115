"""Processes that die with the process that started them: Linux's parent-death signal.

`arm(sig, parent_pid)` asks the kernel (`prctl(PR_SET_PDEATHSIG)`) to send this process `sig`
when its parent dies, even when the parent is killed with SIGKILL and runs no cleanup. It
survives `exec`; the signal follows the thread that forked the child, so children are started
from the thread that lives as long as the parent. Elsewhere than Linux there is no such signal,
and `arm` does nothing. Used by `helexa up` for its servers and apps (`apps.embedded.tether`) and
by the worker for its engine core process, which may be busy loading a model for a minute.
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


# Looked up at import, not between fork and exec, where a child should do as little as it can.
_prctl = _load_prctl()


def supported() -> bool:
    return _prctl is not None


def arm(sig: int, parent_pid: int) -> None:
    """Have this process receive `sig` when `parent_pid`, its parent, dies (no-op off Linux); if
    the parent is already gone, receive it now."""
    if _prctl is None:
        return
    if _prctl(PR_SET_PDEATHSIG, sig) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os.kill(os.getpid(), sig)
