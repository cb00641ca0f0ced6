"""SIGTERM / Ctrl-C end a run between steps, so the trainer can write a final checkpoint.

The first signal only sets a flag that the loop checks after each optimizer step; a second Ctrl-C interrupts at
once (the previous checkpoint is still intact: checkpoints are atomic).

Schedulers (Slurm, Kubernetes, a terminal's Ctrl-C) signal the whole process group, DataLoader workers included.
A worker killed by it would take the main process down before its final checkpoint (torch's SIGCHLD handler raises
"DataLoader worker ... killed by signal" wherever the main process is), so workers ignore SIGTERM and SIGINT
unless their own loader's process sends it (:func:`worker_ignores_stop_signals`, the loader's ``worker_init_fn``):
the main process alone decides when to stop, and shuts its workers down as usual.

Usage::

    with InterruptGuard() as guard:
        while not guard.requested: train_step()
    DataLoader(data, num_workers=2, worker_init_fn=functools.partial(worker_ignores_stop_signals, main_pid=os.getpid()))
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def worker_ignores_stop_signals(worker_id: int, init: Callable[[int], None] | None = None,
                                main_pid: int | None = None) -> None:
    """A DataLoader ``worker_init_fn``: the worker ignores SIGINT, and SIGTERM unless its loader's process sent it
    (`main_pid`, or the parent); then runs `init` (the user's own).

    Runs after torch's worker signal handlers (``_worker_loop``). torch's SIGTERM handler exits on the parent's
    SIGTERM and re-raises anyone else's, so a scheduler's SIGTERM to the process group killed the worker and, through
    torch's SIGCHLD handler, the main process. Here SIGTERM is blocked and a thread takes it with ``sigwaitinfo``,
    which tells who sent it: the loader's own shutdown (``terminate()``, also at interpreter exit) still ends the
    worker at once; other senders are ignored. A worker also exits when the main process is gone (torch's watchdog).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not hasattr(signal, "sigwaitinfo"):  # macOS, Windows: torch's own SIGTERM handling stays
        if init is not None:
            init(worker_id)
        return
    senders = {os.getppid(), main_pid or os.getppid()}
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # threads started from here on inherit the mask

    def take_sigterm() -> None:
        while True:
            if signal.sigwaitinfo({signal.SIGTERM}).si_pid in senders:
                os._exit(0)  # as torch's own handler does for its parent's SIGTERM

    threading.Thread(target=take_sigterm, name="vlmfast-worker-sigterm", daemon=True).start()
    if init is not None:
        init(worker_id)


@contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """Block SIGINT/SIGTERM in this thread meanwhile (a signal that arrives waits, then is handled as usual).

    Around the start of DataLoader workers: a worker inherits the mask of the thread that forks it, so a signal
    that reaches it before :func:`worker_ignores_stop_signals` runs stays pending instead of killing it.
    """
    if not hasattr(signal, "sigwaitinfo"):  # no sigwaitinfo in the workers to take a pending signal: leave it
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


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
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
