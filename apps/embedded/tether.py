"""Children that die with the process that started them: Linux's parent-death signal.

`helexa up` starts servers and apps that must not outlive it, even when it is killed with SIGKILL
and runs no cleanup at all. `dies_with_us(sig)` is a `preexec_fn` that asks the kernel
(`prctl(PR_SET_PDEATHSIG)`) to send the child `sig` when its parent dies; it survives `exec`. The
signal follows the thread that forked the child, so children are started from the main thread.
Elsewhere than Linux there is no such signal, and children are only stopped by a living parent.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from engine.frontend import parent_death


def dies_with_us(sig: int) -> Callable[[], None] | None:
    """A `preexec_fn` that has the child receive `sig` when this process dies (None off Linux)."""
    if not parent_death.supported():
        return None
    parent = os.getpid()

    def arm() -> None:
        parent_death.arm(sig, parent)

    return arm
