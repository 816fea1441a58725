"""Length-aware admission from predicted lengths (issue #4): the oracle's rule with estimates instead of truth.

Output lengths are estimated with censoring: early in a pass the finished requests are the short ones, so the
finished lengths alone understate E[l_out]. Each running request that has generated g tokens says "l_out > g";
the Kaplan-Meier estimator over fixed-width bins combines both. From it, a running request's remaining length
is E[l_out - g | l_out > g] (conditional on what it already generated), and a fresh request's is E[l_out].

Admission then follows the oracle (`oracle.py`) with expectations: waiting requests, in queue order, are
admitted while, at every future time, the expected KV demand of everything running plus them (each request's
tokens weighted by the probability it is still running then) plus theta standard deviations fits the cache.
"""

from __future__ import annotations

import numpy as np

from rollout.policy.memory import clamp_cap
from rollout.policy.policies import MemoryPolicy, StepState


MAX_POINTS = 48


class CensoredLengths:
    """Kaplan-Meier estimate of the output-length distribution over bins of `bin_tokens` tokens."""

    def __init__(self, bin_tokens: int = 16) -> None:
        self.bin_tokens = bin_tokens
        self.finished = np.zeros(64, dtype=np.int64)  # finished requests per length bin
        self.count = 0

    def observe(self, output_tokens: int) -> None:
        k = output_tokens // self.bin_tokens
        if k >= len(self.finished):
            self.finished = np.pad(self.finished, (0, max(k + 1, 2 * len(self.finished)) - len(self.finished)))
        self.finished[k] += 1
        self.count += 1

    def reach(self, generated: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The censored (Kaplan-Meier) estimate: reach[k] = P(l_out reaches bin k), with `generated`, the output
        so far of requests still running, as the censored observations. Also returns their bins. Mass never seen
        to finish (only censored past it) ends one bin past the longest request seen."""
        generated = np.asarray(generated, dtype=np.int64)
        bins = generated // self.bin_tokens
        size = max(len(self.finished), int(bins.max(initial=0)) + 2)
        events = np.pad(self.finished, (0, size - len(self.finished))).astype(float)
        censored = np.bincount(bins, minlength=size).astype(float) if len(generated) else np.zeros(size)
        at_risk = np.cumsum((events + censored)[::-1])[::-1]  # length or censoring point in bin k or later
        hazard = np.divide(events, at_risk, out=np.zeros(size), where=at_risk > 0)
        return bins, np.concatenate([[1.0], np.cumprod(1.0 - hazard), [0.0]])

    def conditional(self, generated: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Mean and variance of the remaining output length of running requests that have generated
        `generated` tokens."""
        generated = np.asarray(generated, dtype=np.int64)
        bins, reach = self.reach(generated)
        mass = reach[:-1] - reach[1:]  # P(l_out ends in bin k)
        centers = (np.arange(len(mass)) + 0.5) * self.bin_tokens
        m0, m1, m2 = (np.cumsum((mass * centers ** p)[::-1])[::-1] for p in (0, 1, 2))
        with np.errstate(invalid="ignore", divide="ignore"):
            mean_len = np.where(m0[bins] > 0, m1[bins] / m0[bins], generated + self.bin_tokens)
            var_len = np.where(m0[bins] > 0, m2[bins] / m0[bins] - mean_len ** 2, 0.0)
        return np.maximum(mean_len - generated, 1.0), np.maximum(var_len, 0.0)


def survival_after(lengths: CensoredLengths, generated: np.ndarray, horizon_bins: int,
                   stride: int = 1) -> np.ndarray:
    """P(a running request that has generated g tokens is still running j * stride bins later),
    j = 0..horizon_bins-1, one row per request."""
    bins, reach = lengths.reach(generated)
    reach = np.concatenate([reach, np.zeros(horizon_bins * stride)])
    index = bins[:, None] + stride * np.arange(horizon_bins)[None, :]
    base = reach[bins][:, None]
    return np.divide(reach[index], base, out=(index == bins[:, None]).astype(float), where=base > 0)


def expected_demand_admissions(running_tokens: np.ndarray, running_generated: np.ndarray,
                               waiting_tokens: np.ndarray, waiting_generated: np.ndarray,
                               lengths: CensoredLengths, capacity_tokens: float, block_size: int,
                               theta: float) -> int:
    """How many waiting requests (a prefix, in queue order) fit: at every future time (in bins of output
    tokens), the expected KV demand of running and admitted requests plus theta standard deviations stays
    within the cache. A request holding c tokens demands c + t (plus a partly used block) at t steps ahead if it
    is still running then, with the probability `survival_after` gives."""
    generated = np.concatenate([running_generated, waiting_generated])
    span = max(len(lengths.finished), int(generated.max(initial=0)) // lengths.bin_tokens + 1) + 2
    # At most ~MAX_POINTS future times are checked (policy time stays far below a step's).
    stride = -(-span // MAX_POINTS)
    horizon = -(-span // stride) + 1
    steps = np.arange(horizon) * stride * lengths.bin_tokens
    tokens = np.concatenate([running_tokens, waiting_tokens]).astype(float)
    alive = survival_after(lengths, generated, horizon, stride)
    held = tokens[:, None] + steps[None, :] + (block_size - 1)
    mean = held * alive
    var = held ** 2 * alive * (1.0 - alive)
    n = len(running_tokens)
    base_mean, base_var = mean[:n].sum(axis=0), var[:n].sum(axis=0)
    if base_mean.max(initial=0.0) + theta * np.sqrt(base_var.max(initial=0.0)) > capacity_tokens:
        return 0
    total_mean = base_mean[None, :] + np.cumsum(mean[n:], axis=0)
    total_var = base_var[None, :] + np.cumsum(var[n:], axis=0)
    fits = np.all(total_mean + theta * np.sqrt(total_var) <= capacity_tokens, axis=1)
    return int(np.argmin(fits)) if not fits.all() else len(fits)  # demand grows with m: the first misfit ends it


class ForecastPolicy(MemoryPolicy):
    """Admission by the forecast peak KV of running and admitted requests, from censored length estimates.

    Until `min_observations` requests have finished it behaves as Algorithm 1 (worst-case cold start)."""

    name = "forecast"
    needs_requests = True

    def __init__(self, *args, bin_tokens: int = 16, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lengths = CensoredLengths(bin_tokens)
        self.admitted_last = 0

    def observe_finished(self, prompt_tokens: int, output_tokens: int) -> None:
        super().observe_finished(prompt_tokens, output_tokens)
        self.lengths.observe(output_tokens)

    def batch_cap(self, state: StepState) -> int:
        if (self.lengths.count < self.min_observations or state.running_generated is None
                or not state.num_waiting):
            return super().batch_cap(state)
        admit = expected_demand_admissions(state.running_tokens, state.running_generated, state.waiting_tokens,
                                           state.waiting_generated, self.lengths,
                                           state.kv_capacity_blocks * state.block_size, state.block_size,
                                           self.theta)
        self.admitted_last = admit
        self.cap = clamp_cap(state.num_running + max(admit, 0 if state.num_running else 1), state.num_running,
                             self.min_cap, self.max_cap)
        return self.cap

    def trace_fields(self) -> dict:
        fields = super().trace_fields()
        fields["forecast_admitted"] = self.admitted_last
        return fields
