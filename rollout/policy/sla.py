"""Algorithm 2 of the paper: a noisy binary search for the largest batch whose decode step meets a latency bound.

The search keeps an interval [low, high] (b_low, b_high, starting at B_min, B_max) and proposes its midpoint.
After each window of steps it reads the mean step latency and the mean batch that actually ran, and moves the
bounds in one of three cases (tolerance eps_D around the target D_SLA):

- too slow (latency > D_SLA + eps_D): the batch that ran is too large, so it becomes the upper bound; the lower
  bound steps back by `relax` (alpha), because one noisy window may have lied and the curve may have moved;
- too fast (latency < D_SLA - eps_D): the batch that ran is feasible, so it raises the lower bound; the upper
  bound steps out by `relax`, to look for more;
- on target: the search has converged; the interval shrinks to the batch that ran, +/- `hold` (delta).

The paper's pseudo-code for the three cases was not available to us; this is our reading of its description
(bisection on [B_min, B_max] driven by recent mean decode latency vs D_SLA, with alpha, delta and eps_D), and the
tests pin its behaviour: convergence on a noisy latency curve, each case, and the bounds.

The same controller, in tokens instead of requests, sizes the chunked-prefill token budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class SLAController:
    """Bisection state for one knob (the batch cap, or the per-step token budget)."""

    target_s: float  # D_SLA, seconds per step
    minimum: int  # B_min
    maximum: int  # B_max
    relax: float = 4.0  # alpha: how far the opposite bound steps back out after each decision
    hold: float = 2.0  # delta: half-width of the interval kept around a batch that met the target
    tolerance_s: float | None = None  # eps_D; None: 5% of the target
    low: float = field(init=False)
    high: float = field(init=False)
    updates: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if not self.target_s > 0:
            raise ValueError(f"latency target must be > 0, got {self.target_s}")
        if not 1 <= self.minimum <= self.maximum:
            raise ValueError(f"need 1 <= minimum <= maximum, got {self.minimum}, {self.maximum}")
        if self.tolerance_s is None:
            self.tolerance_s = 0.05 * self.target_s
        self.low, self.high = float(self.minimum), float(self.maximum)

    @property
    def value(self) -> int:
        """The current proposal: the midpoint of the interval."""
        return int(math.floor((self.low + self.high) / 2))

    def update(self, mean_latency_s: float, mean_batch: float) -> int:
        """Move the bounds from one window's mean step latency and the mean batch that ran in it."""
        ran = min(max(mean_batch, self.minimum), self.maximum)
        if mean_latency_s > self.target_s + self.tolerance_s:
            self.high = min(self.high, ran)
            self.low = max(self.minimum, self.low - self.relax)
        elif mean_latency_s < self.target_s - self.tolerance_s:
            self.low = max(self.low, ran)
            self.high = min(self.maximum, self.high + self.relax)
        else:
            self.low = max(self.minimum, ran - self.hold)
            self.high = min(self.maximum, ran + self.hold)
        # A window that contradicts the interval (noise, or a moved curve) must not leave it empty.
        self.low = min(self.low, self.high)
        self.updates += 1
        return self.value


@dataclass
class StepWindow:
    """Means of step latency and batch over the last `size` steps, handed over once the window is full.

    Latency is averaged with weights: weighting each step by the requests it decoded gives the mean time
    between tokens those requests saw, which a step-count mean understates when slow steps carry more of them.
    """

    size: int = 8
    _latency: float = 0.0
    _weight: float = 0.0
    _batch: float = 0.0
    _count: int = 0

    def add(self, latency_s: float, batch: float, weight: float = 1.0) -> tuple[float, float] | None:
        self._latency += latency_s * weight
        self._weight += weight
        self._batch += batch
        self._count += 1
        if self._count < self.size:
            return None
        means = (self._latency / self._weight if self._weight else 0.0, self._batch / self._count)
        self._latency = self._weight = self._batch = 0.0
        self._count = 0
        return means
