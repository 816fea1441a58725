"""Batch-size policies: one small interface the vLLM adapter calls every step.

A policy answers `batch_cap(state)` (the admission cap for this step), is told of every finished request
through `observe_finished`, and reports what it holds through `trace_fields` for the per-step trace.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from rollout.policy.length_stats import LengthStats
from rollout.policy.memory import clamp_cap, clt_batch_bound, memory_batch_size, overflow_quantile, safety_buffer


@dataclass
class StepState:
    """What a policy sees of the engine at one scheduling step."""

    num_running: int
    num_waiting: int
    kv_capacity_blocks: int
    block_size: int
    # Cold-start demand estimate from requests not yet finished, in tokens.
    pending_prompt_tokens_mean: float = 0.0
    pending_max_tokens_mean: float = 0.0
    # Per-request arrays (tokens held, tokens still to generate up to max_tokens), filled only for policies
    # that set `needs_requests`; waiting requests in queue order, at most the cap's headroom of them.
    running_tokens: Any = None
    running_remaining: Any = None
    waiting_tokens: Any = None
    waiting_remaining: Any = None


class StaticPolicy:
    """A fixed cap, as vLLM's max_num_seqs; still gathers statistics for the next iteration."""

    name = "static"
    needs_requests = False

    def __init__(self, cap: int, max_cap: int, stats: LengthStats | None = None) -> None:
        self.cap = min(cap, max_cap)
        self.max_cap = max_cap
        self.stats = stats or LengthStats()

    def batch_cap(self, state: StepState) -> int:
        return clamp_cap(self.cap, state.num_running, 1, self.max_cap)

    def observe_finished(self, prompt_tokens: int, output_tokens: int) -> None:
        self.stats.observe(prompt_tokens, output_tokens)

    def trace_fields(self) -> dict:
        return {"stats_count": self.stats.count}


class MemoryPolicy(StaticPolicy):
    """Algorithm 1: b_t = floor((eta - L0) / mean demand), L0 refreshed every `update_every` finished requests.

    The cap is recomputed only when requests both wait and run; otherwise the previous cap stands. Until
    `min_observations` requests have finished (counting a loaded prior), the demand of a request is taken as
    its prompt plus its max_tokens, with no spread: the worst case, since nothing is known yet.
    """

    name = "memory"

    def __init__(self, eps_m: float, max_cap: int, min_cap: int = 1, update_every: int = 16,
                 min_observations: int = 8, stats: LengthStats | None = None) -> None:
        super().__init__(max_cap, max_cap, stats)
        self.theta = overflow_quantile(eps_m)
        self.min_cap = min_cap
        self.update_every = update_every
        self.min_observations = min_observations
        self.safety_buffer_blocks: float | None = None
        self.finished_since_update = 0
        self.mean_demand_blocks = math.nan
        self.std_demand_blocks = math.nan

    def observe_finished(self, prompt_tokens: int, output_tokens: int) -> None:
        super().observe_finished(prompt_tokens, output_tokens)
        self.finished_since_update += 1

    def _demand(self, state: StepState) -> tuple[float, float]:
        if self.stats.count >= self.min_observations:
            mean, var = self.stats.demand_blocks(state.block_size)
            return mean, math.sqrt(max(var, 0.0))
        worst = state.pending_prompt_tokens_mean + state.pending_max_tokens_mean
        return math.ceil(worst / state.block_size) if worst > 0 else math.nan, 0.0

    def _refresh_due(self) -> bool:
        return self.safety_buffer_blocks is None or self.finished_since_update >= self.update_every

    def batch_cap(self, state: StepState) -> int:
        self.stats.set_block_size(state.block_size)
        # Algorithm 1 keeps b_{t-1} unless requests both wait and run; b_0 is computed at the first step that
        # has waiting requests, so the very first admission wave is sized too.
        initialized = self.safety_buffer_blocks is not None
        if not state.num_waiting or (initialized and not state.num_running):
            return clamp_cap(self.cap, state.num_running, self.min_cap, self.max_cap)
        mean, std = self._demand(state)
        if math.isnan(mean):
            return clamp_cap(self.cap, state.num_running, self.min_cap, self.max_cap)
        self.mean_demand_blocks, self.std_demand_blocks = mean, std
        if self._refresh_due():
            self.safety_buffer_blocks = safety_buffer(state.kv_capacity_blocks, mean, std, self.theta)
            self.finished_since_update = 0
        self.cap = clamp_cap(self._batch_size(state, mean, std), state.num_running, self.min_cap, self.max_cap)
        return self.cap

    def _batch_size(self, state: StepState, mean: float, std: float) -> float:
        return memory_batch_size(state.kv_capacity_blocks, self.safety_buffer_blocks, mean)

    def trace_fields(self) -> dict:
        return {
            "stats_count": self.stats.count,
            "safety_buffer_blocks": self.safety_buffer_blocks,
            "mean_demand_blocks": None if math.isnan(self.mean_demand_blocks) else self.mean_demand_blocks,
            "std_demand_blocks": None if math.isnan(self.std_demand_blocks) else self.std_demand_blocks,
        }


class CLTPolicy(MemoryPolicy):
    """The exact CLT closed form, recomputed from the current statistics at every step."""

    name = "memory-clt"

    def _refresh_due(self) -> bool:
        return True

    def _batch_size(self, state: StepState, mean: float, std: float) -> float:
        return math.floor(clt_batch_bound(state.kv_capacity_blocks, mean, std, self.theta))


class FallbackPolicy:
    """Runs a policy; if it ever raises, warns once and continues with a static cap (over the same statistics)
    for the rest of the run, so a policy bug costs throughput, never the rollout."""

    def __init__(self, policy: StaticPolicy, fallback_cap: int) -> None:
        self.policy = policy
        self.fallback_cap = fallback_cap
        self.error: str | None = None

    @property
    def name(self) -> str:
        return self.policy.name

    @property
    def stats(self) -> LengthStats:
        return self.policy.stats

    @property
    def needs_requests(self) -> bool:
        return self.policy.needs_requests

    def _fail(self, exc: Exception) -> None:
        self.error = f"{type(exc).__name__}: {exc}"
        logging.getLogger("rollout").warning("policy %s failed (%s); continuing with a static cap of %d",
                                             self.policy.name, self.error, self.fallback_cap)
        self.policy = StaticPolicy(self.fallback_cap, self.policy.max_cap, self.policy.stats)

    def batch_cap(self, state: StepState) -> int:
        try:
            return self.policy.batch_cap(state)
        except Exception as exc:  # noqa: BLE001 - any policy failure degrades to the static cap
            self._fail(exc)
            return self.policy.batch_cap(state)

    def observe_finished(self, prompt_tokens: int, output_tokens: int) -> None:
        try:
            self.policy.observe_finished(prompt_tokens, output_tokens)
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    def trace_fields(self) -> dict:
        fields = self.policy.trace_fields()
        if self.error:
            fields["policy_error"] = self.error
        return fields


POLICIES = {cls.name: cls for cls in (StaticPolicy, MemoryPolicy, CLTPolicy)}
# Benchmark references, never defaults: "oracle" reads true lengths from max_tokens; "vllm" runs vLLM's own
# scheduler untouched (no adapter, vLLM's default max_num_seqs).
BENCHMARK_POLICIES = ("oracle", "vllm")


def make_policy(settings: dict, stats: LengthStats | None = None) -> StaticPolicy:
    """Build a policy from the plain dict form of `PolicyConfig` (what travels in vLLM's additional_config)."""
    name = settings["name"]
    max_cap = int(settings["b_max"])
    if name == "oracle":
        from rollout.policy.oracle import OraclePolicy

        return OraclePolicy(max_cap, max_cap, stats)
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose one of {sorted(POLICIES)}")
    if name == "static":
        return StaticPolicy(int(settings.get("static_cap") or max_cap), max_cap, stats)
    return POLICIES[name](
        eps_m=float(settings["eps_m"]), max_cap=max_cap, min_cap=int(settings.get("b_min", 1)),
        update_every=int(settings.get("update_every", 16)),
        min_observations=int(settings.get("min_observations", 8)), stats=stats,
    )
