"""Leak detection: a steady growth of memory across steps, and which kinds of live tensors grew.

Usage::

    detector = LeakDetector(warmup_steps=20, window_steps=50, threshold_mb_per_step=1.0)
    for step in range(1, max_steps + 1):
        ...
        if (leak := detector.update(step, torch.cuda.memory_allocated())) is not None:
            print(leak.message())

    before = live_tensor_census(); run_a_few_steps(); print(tensor_growth(before, live_tensor_census()))

A leak here is memory that keeps growing at a steady rate after warm-up. A noisy but flat curve, or a one-off jump
(optimizer state allocated at the first step, a cache filled once) is not one: the detector fits a least-squares
line over the window and asks that the line explains the curve (R^2 and the slope's t-statistic) and that both
halves of the window grow.
"""

from __future__ import annotations

import gc
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

MB = 1024**2  # the MB in "MB/step" is 2**20 bytes, like the allocator's own numbers
# A slope from fewer readings than this cannot be told from allocator noise (simulated, 1 MB/step threshold: flat
# memory with +-20 MB noise warned in 16% of 1000-step runs with 10 readings; with 20, in none of 200 runs).
MIN_READINGS = 20
MIN_T = 6.0  # t-statistic of the slope: the growth must stand well clear of the noise around the line
MIN_R_SQUARED = 0.5  # a line must explain most of the variation: flat noise has R^2 near 0
FITS_PER_WINDOW = 50  # a long window is refitted every len/50 readings, so a reading costs O(50), not O(window)
HALF_WINDOW_RATIO = 0.5  # each half must grow at >= this share of the threshold: a single jump fills only one half

USUAL_CAUSES = (
    "accumulating a loss tensor across steps (`total += loss` keeps every step's autograd graph; "
    "use loss.item() or loss.detach())",
    "appending tensors to a list or dict every step (store .item() or .detach().cpu(), or bound the list)",
    "hooks registered every step and never removed (keep the handle and call handle.remove())",
    "unbounded caches or memo dicts keyed by batch, step or shape",
)


class TensorKind(NamedTuple):
    """What the census groups live tensors by."""

    shape: tuple[int, ...]
    dtype: str
    device: str

    def __str__(self) -> str:
        return f"{self.dtype.removeprefix('torch.')}[{', '.join(map(str, self.shape))}] on {self.device}"


@dataclass(frozen=True)
class TensorGrowth:
    """How many more live tensors of one kind there are, and how many bytes they hold."""

    kind: TensorKind
    count: int
    bytes: int

    def __str__(self) -> str:
        return f"+{self.count} x {self.kind} (+{self.bytes / MB:.1f} MB)"


@dataclass(frozen=True)
class LeakWarning:
    """A steady memory growth: its rate, where it was measured, and what usually causes it."""

    step: int
    rate_mb_per_step: float
    first_step: int
    last_step: int
    total_growth_mb: float
    r_squared: float
    source: str = "memory"
    tensor_growth: tuple[TensorGrowth, ...] = field(default=())
    census_since_step: int | None = None

    @property
    def window_steps(self) -> int:
        return self.last_step - self.first_step + 1

    def message(self) -> str:
        """The full warning: rate, window, total growth, leaked tensor kinds when known, usual causes."""
        lines = [
            f"possible memory leak: {self.source} grew {self.rate_mb_per_step:.1f} MB/step over steps "
            f"{self.first_step}-{self.last_step} ({self.window_steps} steps, {self.total_growth_mb:+.1f} MB in "
            f"total, R^2 {self.r_squared:.2f}).",
        ]
        if self.census_since_step is not None:
            lines.append(self._census_line())
        lines.append("Usual causes: " + "; ".join(USUAL_CAUSES) + ".")
        return "\n".join(lines)

    def _census_line(self) -> str:
        since = f"since step {self.census_since_step}"
        if not self.tensor_growth:
            return (f"No Python-visible tensor kind grew {since}: look for autograd graphs kept alive "
                    "(tensors saved for backward are not Python objects) or non-tensor memory.")
        return f"Live tensors that grew {since}: " + ", ".join(map(str, self.tensor_growth)) + "."

    def __str__(self) -> str:
        return self.message()


class _Reading(NamedTuple):
    step: int
    mb: float


class LeakDetector:
    """Warns when memory grows steadily by more than `threshold_mb_per_step` after `warmup_steps`.

    Usage: ``leak = LeakDetector(20, 50, 1.0).update(step, bytes_in_use)`` (None, or a :class:`LeakWarning`)

    Readings may come every step or every N steps. The window holds the readings of the last `window_steps`
    steps, and at least :data:`MIN_READINGS` readings (readings every 10 steps need 200 steps). Warm-up counts
    from the first step seen, so a resumed run warms up again. After a warning the window starts afresh: a
    persistent leak warns at most once per window.
    """

    def __init__(self, warmup_steps: int = 20, window_steps: int = 50, threshold_mb_per_step: float = 1.0,
                 source: str = "memory") -> None:
        if window_steps < 2 or threshold_mb_per_step <= 0:
            raise ValueError("LeakDetector needs window_steps >= 2 and threshold_mb_per_step > 0")
        self.warmup_steps = warmup_steps
        self.window_steps = window_steps
        self.threshold_mb_per_step = threshold_mb_per_step
        self.source = source
        self._first_step: int | None = None
        self._last_step: int | None = None
        self._window: deque[_Reading] = deque()
        self._full = False
        self._until_check = 0

    @property
    def window_start(self) -> int | None:
        """Step of the oldest reading in the current window (None during warm-up or right after a warning)."""
        return self._window[0].step if self._window else None

    @property
    def suspect(self) -> bool:
        """Whether the readings so far in the window already grow faster than half the threshold (3 or more):
        the moment a tensor census baseline is worth its cost (one pass over all Python objects)."""
        points = list(self._window)
        return len(points) >= 3 and _fit_line(points)[0] > self.threshold_mb_per_step * HALF_WINDOW_RATIO

    def reset(self) -> None:
        """Forget everything, warm-up included."""
        self._first_step = self._last_step = None
        self._window.clear()
        self._full = False
        self._until_check = 0

    def update(self, step: int, bytes_in_use: float) -> LeakWarning | None:
        """Add one reading; returns a :class:`LeakWarning` when the window shows a steady leak."""
        if self._last_step is not None and step <= self._last_step:
            self.reset()  # steps went backwards: a new run (or a restart) reuses this detector
        if self._first_step is None:
            self._first_step = step
        self._last_step = step
        if step < self._first_step + self.warmup_steps:
            return None
        self._add(_Reading(step, bytes_in_use / MB))
        self._until_check -= 1
        if not self._full or self._until_check > 0:
            return None
        self._until_check = len(self._window) // FITS_PER_WINDOW
        leak = self._check()
        if leak is not None:
            self._window.clear()  # at most one warning per window
            self._full = False
        return leak

    def _add(self, reading: _Reading) -> None:
        self._window.append(reading)
        while len(self._window) > MIN_READINGS and self._window[0].step <= reading.step - self.window_steps:
            self._window.popleft()
            self._full = True  # older readings fell out: the window spans window_steps
        span = reading.step - self._window[0].step + 1
        self._full = self._full or (span >= self.window_steps and len(self._window) >= MIN_READINGS)

    def _check(self) -> LeakWarning | None:
        points = list(self._window)
        slope, r_squared = _fit_line(points)
        if slope <= self.threshold_mb_per_step or r_squared < MIN_R_SQUARED or _t_squared(r_squared, points) < MIN_T**2:
            return None
        half = (len(points) + 1) // 2  # odd counts share the middle reading
        min_half_slope = self.threshold_mb_per_step * HALF_WINDOW_RATIO
        if min(_fit_line(points[:half])[0], _fit_line(points[-half:])[0]) < min_half_slope:
            return None  # the growth sits in one half: a one-off jump or a ramp that stopped, not a leak
        return LeakWarning(
            step=points[-1].step, rate_mb_per_step=slope, first_step=points[0].step, last_step=points[-1].step,
            total_growth_mb=points[-1].mb - points[0].mb, r_squared=r_squared, source=self.source,
        )


def _fit_line(points: list[_Reading]) -> tuple[float, float]:
    """Least-squares slope (MB/step) and R^2 of MB against step."""
    n = len(points)
    if n < 2:
        return 0.0, 0.0
    mean_x = sum(p.step for p in points) / n
    mean_y = sum(p.mb for p in points) / n
    sxx = sum((p.step - mean_x) ** 2 for p in points)
    syy = sum((p.mb - mean_y) ** 2 for p in points)
    sxy = sum((p.step - mean_x) * (p.mb - mean_y) for p in points)
    if sxx == 0 or syy == 0:
        return 0.0, 0.0
    return sxy / sxx, sxy * sxy / (sxx * syy)


def _t_squared(r_squared: float, points: list[_Reading]) -> float:
    """Squared t-statistic of the fitted slope (infinite for a perfect line)."""
    return float("inf") if r_squared >= 1 else r_squared * (len(points) - 2) / (1 - r_squared)


def live_tensor_census() -> Counter[TensorKind]:
    """Count the live Python-visible tensors by (shape, dtype, device). Costs one pass over ``gc.get_objects()``.

    Usage: ``before = live_tensor_census(); ...; tensor_growth(before, live_tensor_census())``

    Holds no reference to any tensor. Tensors that only C++ holds (saved for backward, inside the allocator cache)
    are not Python objects and are not counted.
    """
    census: Counter[TensorKind] = Counter()
    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance asks obj.__class__, which proxies and deprecated aliases intercept
        if not issubclass(type(obj), torch.Tensor):
            continue
        try:
            census[TensorKind(tuple(obj.shape), str(obj.dtype), str(obj.device))] += 1
        except Exception:  # tensor subclasses without real storage may refuse .shape/.device: skip them
            continue
    return census


def tensor_growth(before: Counter[TensorKind], after: Counter[TensorKind], top: int = 5) -> list[TensorGrowth]:
    """The tensor kinds whose live count grew from `before` to `after`, most bytes first (at most `top`)."""
    grown = [TensorGrowth(kind, count, count * _kind_bytes(kind))
             for kind, count in (after - before).items()]
    return sorted(grown, key=lambda g: (g.bytes, g.count), reverse=True)[:top]


def _kind_bytes(kind: TensorKind) -> int:
    numel = 1
    for size in kind.shape:
        numel *= size
    dtype = getattr(torch, kind.dtype.removeprefix("torch."), None)
    itemsize = dtype.itemsize if isinstance(dtype, torch.dtype) else 0
    return numel * itemsize
