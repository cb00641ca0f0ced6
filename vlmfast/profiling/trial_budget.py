"""A time limit for one measured trial of `vlmfast doctor --apply`, so that no single change holds the table up.

The trial that needs it is torch.compile's: with a cold compile cache (a new machine, a fresh
``TORCHINDUCTOR_CACHE_DIR``) inductor compiles and builds C++ kernels for the whole model before the first step,
which took 94 s of a 111 s ``doctor --apply --steps 8`` of the built-in task on 2 idle cores (17 s for all of it
once the cache is warm). Past the limit the trial is abandoned and its row says "not measured" and why; the other
trials and the baseline are measured as before. (Dynamo's eager backend would make the trial quick, but it compiles
nothing, so it would measure no gain.)

The limit is a real-time timer (``SIGALRM``) whose handler raises :class:`TrialBudgetExceeded`, a BaseException, so
that no ``except Exception`` on the way (compile's fallback to eager, dynamo's error wrapping) turns it into a
result. It applies in the main thread of a single process only: a rank that gave up alone would leave the others in a
collective; elsewhere the trial runs unbounded.

Usage::

    with trial_budget(30.0):          # raises TrialBudgetExceeded after 30 s
        evidence = run(changed_spec)
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

__all__ = ["TRIAL_BUDGET_FACTOR", "TRIAL_BUDGET_MIN_S", "TrialBudgetExceeded", "trial_budget", "trial_budget_for"]

TRIAL_BUDGET_MIN_S = 20.0  # what a warm-cache compile of a small model takes on 2 cores, with room
TRIAL_BUDGET_FACTOR = 3.0  # x the baseline run: a change may triple the run (a recompile, a smaller micro-batch)


class TrialBudgetExceeded(BaseException):
    """A trial ran past its time limit; ``seconds`` is the limit."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"over the {seconds:.0f} s trial limit")
        self.seconds = seconds


def trial_budget_for(baseline_s: float, minimum_s: float = TRIAL_BUDGET_MIN_S) -> float:
    """The limit for each trial: TRIAL_BUDGET_FACTOR x the baseline run's seconds, at least `minimum_s`."""
    return max(minimum_s, TRIAL_BUDGET_FACTOR * baseline_s)


def _can_interrupt() -> bool:
    single = int(os.environ.get("WORLD_SIZE", "1")) <= 1
    return single and hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


@contextmanager
def trial_budget(seconds: float | None) -> Iterator[None]:
    """Raise :class:`TrialBudgetExceeded` in the block once `seconds` have passed (None or 0: no limit; not in a
    thread or under several ranks, see the module docstring)."""
    if not seconds or not _can_interrupt():
        yield
        return

    def expire(signum: int, frame: FrameType | None) -> None:
        raise TrialBudgetExceeded(seconds)

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
