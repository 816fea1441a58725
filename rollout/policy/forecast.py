"""Length-aware admission from predicted lengths (issue #4): the oracle's rule with estimates instead of truth.

Output lengths are estimated with censoring: early in a pass the finished requests are the short ones, so the
finished lengths alone understate E[l_out]. Each running request that has generated g tokens says "l_out > g";
the Kaplan-Meier estimator over fixed-width bins combines both. From it, a running request's remaining length
is E[l_out - g | l_out > g] (conditional on what it already generated), and a fresh request's is E[l_out].

Admission then follows the oracle (`oracle.py`): waiting requests, in queue order, are admitted while the
forecast peak KV demand of everything running plus them, with a margin of theta standard deviations of the
summed remaining lengths, fits the cache.
"""

from __future__ import annotations

import math

import numpy as np

from rollout.policy.memory import clamp_cap
from rollout.policy.oracle import peak_kv_tokens
from rollout.policy.policies import MemoryPolicy, StepState


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

    def conditional(self, generated: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Mean and variance of the remaining output length of requests that have generated `generated` tokens
        and are still running; the running requests themselves are the censored observations."""
        generated = np.asarray(generated, dtype=np.int64)
        w = self.bin_tokens
        censored_bins = generated // w
        size = max(len(self.finished), int(censored_bins.max(initial=0)) + 2)
        events = np.pad(self.finished, (0, size - len(self.finished))).astype(float)
        censored = np.bincount(censored_bins, minlength=size).astype(float) if len(generated) else np.zeros(size)
        # At risk in bin k: every request whose length or censoring point is in bin k or later.
        at_risk = np.cumsum((events + censored)[::-1])[::-1]
        hazard = np.divide(events, at_risk, out=np.zeros(size), where=at_risk > 0)
        survival = np.cumprod(1.0 - hazard)  # P(l_out beyond bin k)
        mass = np.concatenate([[1.0], survival[:-1]]) - survival
        centers = (np.arange(size) + 0.5) * w
        # Mass never seen to finish (only censored past it) sits one bin past the longest request seen.
        mass = np.append(mass, survival[-1])
        centers = np.append(centers, (size + 0.5) * w)
        m0 = np.cumsum(mass[::-1])[::-1]
        m1 = np.cumsum((mass * centers)[::-1])[::-1]
        m2 = np.cumsum((mass * centers ** 2)[::-1])[::-1]
        b = np.minimum(censored_bins, len(mass) - 1)
        with np.errstate(invalid="ignore", divide="ignore"):
            mean_len = np.where(m0[b] > 0, m1[b] / m0[b], generated + w)
            var_len = np.where(m0[b] > 0, m2[b] / m0[b] - mean_len ** 2, 0.0)
        remaining = np.maximum(mean_len - generated, 1.0)
        return remaining, np.maximum(var_len, 0.0)


def forecast_admissions(running_tokens, running_mean, running_var, waiting_tokens, waiting_mean, waiting_var,
                        capacity_tokens: float, block_size: int, theta: float) -> int:
    """How many waiting requests (a prefix, in queue order) fit: forecast peak + theta * sd <= capacity."""
    def fits(m: int) -> bool:
        current = np.concatenate([running_tokens, waiting_tokens[:m]])
        mean = np.concatenate([running_mean, waiting_mean[:m]])
        spread = theta * math.sqrt(float(np.sum(running_var)) + float(np.sum(waiting_var[:m])))
        return peak_kv_tokens(current, np.ceil(mean), block_size) + spread <= capacity_tokens

    lo, hi = 0, len(waiting_tokens)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


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
        generated = np.concatenate([state.running_generated, state.waiting_generated])
        mean, var = self.lengths.conditional(generated)
        n = len(state.running_generated)
        admit = forecast_admissions(state.running_tokens, mean[:n], var[:n], state.waiting_tokens, mean[n:],
                                    var[n:], state.kv_capacity_blocks * state.block_size, state.block_size,
                                    self.theta)
        self.admitted_last = admit
        self.cap = clamp_cap(state.num_running + max(admit, 0 if state.num_running else 1), state.num_running,
                             self.min_cap, self.max_cap)
        return self.cap

    def trace_fields(self) -> dict:
        fields = super().trace_fields()
        fields["forecast_admitted"] = self.admitted_last
        return fields
