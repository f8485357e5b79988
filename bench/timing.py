"""What a call costs its thread, apart from time the OS kept it waiting for a CPU.

On a loaded machine the scheduler preempts a thread for a time slice (4-12 ms measured on a 2-core
box at load 6) in the middle of any call, however cheap: that is wall time the call did not cause.
``/proc/thread-self/schedstat`` counts the time this thread sat runnable on a run queue; wall time
minus that is the time the call ran or was blocked, which is what a call that waits (for a reply,
a lock, the GIL) costs. Where the kernel does not provide the file, the cost is the wall time.

The garbage collector is paused during the call: a full collection of the whole test process's
heap (10-116 ms, measured inside the full suite) would land in whichever call allocated last, and
is not that call's cost; the garbage is collected after, outside the timing.
"""

from __future__ import annotations

import os
import time
from typing import Callable, NamedTuple, TypeVar

from bench.common import gc_paused

SCHEDSTAT = "/proc/thread-self/schedstat"
HAVE_SCHEDSTAT = os.path.exists(SCHEDSTAT)

T = TypeVar("T")


class CallTime(NamedTuple):
    wall_s: float
    runqueue_s: float             # runnable, waiting for a CPU

    @property
    def cost_s(self) -> float:
        return self.wall_s - self.runqueue_s


def runqueue_wait_s() -> float:
    """This thread's total time waiting on a run queue so far (0 without schedstat)."""
    if not HAVE_SCHEDSTAT:
        return 0.0
    with open(SCHEDSTAT) as f:
        return int(f.read().split()[1]) * 1e-9


def timed(call: Callable[[], T]) -> tuple[T, CallTime]:
    with gc_paused():
        waited = runqueue_wait_s()
        started = time.perf_counter()
        result = call()
        wall_s = time.perf_counter() - started
        return result, CallTime(wall_s, runqueue_wait_s() - waited)
