"""SIGTERM / Ctrl-C end a run between steps, so the trainer can write a final checkpoint.

The first signal only sets a flag that the loop checks after each optimizer step; a second Ctrl-C interrupts at
once (the previous checkpoint is still intact: checkpoints are atomic).

Usage::

    with InterruptGuard() as guard:
        while not guard.requested: train_step()
"""

from __future__ import annotations

import signal
import threading
from types import FrameType


class InterruptGuard:
    """Turns SIGTERM and the first SIGINT into a flag (only in the main thread; elsewhere a no-op)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.requested: str | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt  # second Ctrl-C: stop now
        self.requested = signal.Signals(signum).name

    def __enter__(self) -> InterruptGuard:
        if self.enabled:
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
