"""Batch-size policies: one small interface the vLLM adapter calls every step.

A policy answers `batch_cap(state)` (the admission cap for this step), is told of every finished request
through `observe_finished`, and reports what it holds through `trace_fields` for the per-step trace.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from rollout.policy.graph_cap import GraphCap
from rollout.policy.length_stats import LengthStats
from rollout.policy.memory import clamp_cap, clt_batch_bound, memory_batch_size, overflow_quantile, safety_buffer
from rollout.policy.sla import SLAController, StepWindow


def shared_prompt_blocks(prompt_tokens: int, block_size: int) -> int:
    """Full prompt blocks a sample can share with its group's cached prompt. vLLM recomputes a prompt's last
    token, so a cache hit ends at the last full block before it (`max_cache_hit_length = num_tokens - 1`)."""
    return (prompt_tokens - 1) // block_size


@dataclass
class StepState:
    """What a policy sees of the engine at one scheduling step."""

    num_running: int
    num_waiting: int
    kv_capacity_blocks: int
    block_size: int
    # Engine steps before this one (each decode step moves a running request one token on).
    step: int = 0
    kv_free_blocks: int | None = None  # free now (None: not known)
    # Cold-start demand estimate from requests not yet finished, in tokens.
    pending_prompt_tokens_mean: float = 0.0
    pending_max_tokens_mean: float = 0.0
    # The largest max_tokens among the pass's requests (0: not known): no request outputs more.
    max_tokens_bound: int = 0
    # Per-request arrays (tokens held, tokens still to generate up to max_tokens), filled only for policies
    # that set `needs_requests`; waiting requests in queue order, at most the cap's headroom of them (and the
    # policy's `waiting_limit`).
    running_tokens: Any = None
    running_remaining: Any = None
    waiting_tokens: Any = None
    waiting_remaining: Any = None
    # Output tokens generated so far (what a predictive policy may use; `remaining` reveals true lengths
    # when max_tokens is imposed, as in benchmarks).
    running_generated: Any = None
    waiting_generated: Any = None
    # Predicted output length of each request's prompt relative to the average (None: all 1), from the
    # driver's per-prompt memory of earlier iterations.
    running_scale: Any = None
    waiting_scale: Any = None
    # Prefix caching: requests of one group (the n samples of a prompt) share its full prompt blocks (but the
    # last, `shared_prompt_blocks`). Each request's group id and the prompt tokens in those blocks (None: nothing
    # shared).
    running_group: Any = None
    waiting_group: Any = None
    running_shared: Any = None
    waiting_shared: Any = None
    # Each request's row in its pass (the number `observe_finished` is given when it ends; None: not known).
    running_rows: Any = None
    waiting_rows: Any = None


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

    def start_pass(self, prior=None) -> None:
        """Requests arrive at an idle engine: a new pass over a prompt set (an RL iteration) begins. `prior`:
        expected output lengths of the pass, in the units of the requests' length scales (or None)."""

    def wants_requests(self, state: StepState) -> bool:
        """Whether this step's StepState must carry the per-request arrays (they cost a pass over requests)."""
        return self.needs_requests

    def steady_until(self) -> float:
        """The step (StepState.step) before which this policy's answers (wants_requests, batch_cap,
        token_budget) stay as it last gave them while no request arrives, is admitted, finishes or is
        preempted: the adapter then reuses the cap and skips the policy. 0: ask at every step."""
        return 0

    def waiting_limit(self) -> int | None:
        """At most how many waiting requests (the queue's head) the per-request arrays describe; None: as
        many as the cap could admit."""
        return None

    def observe_finished(self, prompt_tokens: int, output_tokens: int, length_scale: float = 1.0,
                         group: int = -1, row: int = -1) -> None:
        """A finished request; `length_scale` is how long its prompt's outputs were predicted to be relative
        to the average (1: nothing known); `group`: the group (prompt) of its sibling samples, -1 if none;
        `row`: its row in the pass, as the StepState's `*_rows` gave it (-1: not known)."""
        self.stats.observe(prompt_tokens, output_tokens)

    def observe_step(self, latency_s: float, decode_requests: int, prefill_tokens: int) -> None:
        """One finished engine step: its latency, how many requests decoded, how many prompt tokens it ran."""

    def observe_preempted(self, computed_tokens: int) -> None:
        """The engine preempted a running request; its `computed_tokens` will be computed again."""

    def token_budget(self, max_step_tokens: int, num_running: int) -> int | None:
        """This step's token budget (chunked prefill), or None to leave vLLM's as configured."""
        return None

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
                 min_observations: int = 8, stats: LengthStats | None = None, graph_batch: int = 0) -> None:
        super().__init__(max_cap, max_cap, stats)
        self.theta = overflow_quantile(eps_m)
        # Above the engine's largest CUDA-graph batch a step may cost more than the extra requests make: the cap
        # stays there unless measured steps say otherwise (graph_cap.GraphCap); `max_cap` is the limit in force.
        self.graph = GraphCap(graph_batch, max_cap) if 0 < graph_batch < max_cap else None
        if self.graph is not None:
            self.max_cap = self.graph.limit
        self.min_cap = min_cap
        self.update_every = update_every
        self.min_observations = min_observations
        self.safety_buffer_blocks: float | None = None
        self.finished_since_update = 0
        self.mean_demand_blocks = math.nan
        self.std_demand_blocks = math.nan

    def observe_finished(self, prompt_tokens: int, output_tokens: int, length_scale: float = 1.0,
                         group: int = -1, row: int = -1) -> None:
        super().observe_finished(prompt_tokens, output_tokens, length_scale, group, row)
        self.finished_since_update += 1

    def observe_step(self, latency_s: float, decode_requests: int, prefill_tokens: int) -> None:
        if self.graph is not None:
            self.max_cap = self.graph.observe(latency_s, decode_requests, prefill_tokens)

    def start_pass(self, prior=None) -> None:
        # b_0 of the new pass is sized at its first step with waiting requests, whether or not any runs yet: the
        # last pass's cap was for its lengths, and kept it admitted a stale wave (20 where 2 fitted, in CI).
        super().start_pass(prior)
        self.safety_buffer_blocks = None

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
        fields = {
            "stats_count": self.stats.count,
            "safety_buffer_blocks": self.safety_buffer_blocks,
            "mean_demand_blocks": None if math.isnan(self.mean_demand_blocks) else self.mean_demand_blocks,
            "std_demand_blocks": None if math.isnan(self.std_demand_blocks) else self.std_demand_blocks,
        }
        if self.graph is not None:
            fields["graph_limit"] = self.max_cap
        return fields


class CLTPolicy(MemoryPolicy):
    """The exact CLT closed form, recomputed from the current statistics at every step."""

    name = "memory-clt"

    def _refresh_due(self) -> bool:
        return True

    def _batch_size(self, state: StepState, mean: float, std: float) -> float:
        return math.floor(clt_batch_bound(state.kv_capacity_blocks, mean, std, self.theta))


class SLAPolicy(MemoryPolicy):
    """The paper's combined cap min(b_mem, b_sla): Algorithm 1 for memory, Algorithm 2 (`sla.SLAController`)
    for the latency bound, read from every step that decodes. Steps that also run prompt tokens drive a second
    search of the same kind over the prefill chunk, which sets the step's token budget (running decodes +
    chunk), so that mixed steps meet the bound too. The bound is on the mean step latency, as in the paper."""

    name = "sla"

    def __init__(self, target_s: float, eps_m: float, max_cap: int, min_cap: int = 1, update_every: int = 16,
                 min_observations: int = 8, stats: LengthStats | None = None, tolerance_s: float | None = None,
                 relax: float = 4.0, hold: float = 2.0, window: int = 8, chunk: bool = False,
                 chunk_min_tokens: int = 32, chunk_relax_tokens: float = 64.0,
                 chunk_hold_tokens: float = 32.0, graph_batch: int = 0) -> None:
        super().__init__(eps_m, max_cap, min_cap, update_every, min_observations, stats, graph_batch)
        self.batch_search = SLAController(target_s, min_cap, max_cap, relax, hold, tolerance_s)
        self.decode_window = StepWindow(window)
        self.chunk = chunk
        self.chunk_settings = (chunk_min_tokens, chunk_relax_tokens, chunk_hold_tokens)
        self.chunk_search: SLAController | None = None  # sized once the engine's token budget is known
        self.mixed_window = StepWindow(window)
        self.memory_cap = max_cap

    def batch_cap(self, state: StepState) -> int:
        self.memory_cap = super().batch_cap(state)  # keeps Algorithm 1's own b_{t-1} in self.cap
        return clamp_cap(min(self.memory_cap, self.batch_search.value), state.num_running, self.min_cap,
                         self.max_cap)

    def observe_step(self, latency_s: float, decode_requests: int, prefill_tokens: int) -> None:
        super().observe_step(latency_s, decode_requests, prefill_tokens)
        # A decoding request waits for every step it is part of, prompt chunks included: those are its decode
        # latency. Steps that ran prompt tokens also tell the chunk search how large a chunk the bound allows.
        if decode_requests and (means := self.decode_window.add(latency_s, decode_requests, decode_requests)):
            self.batch_search.update(*means)
        if prefill_tokens and self.chunk_search is not None and (
                means := self.mixed_window.add(latency_s, prefill_tokens)):
            self.chunk_search.update(*means)

    def token_budget(self, max_step_tokens: int, num_running: int) -> int | None:
        if not self.chunk:
            return None
        if self.chunk_search is None:
            low, relax, hold = self.chunk_settings
            self.chunk_search = SLAController(self.batch_search.target_s, min(low, max_step_tokens),
                                              max_step_tokens, relax, hold, self.batch_search.tolerance_s)
        return min(max_step_tokens, num_running + self.chunk_search.value)

    def trace_fields(self) -> dict:
        fields = super().trace_fields()
        search = self.batch_search
        fields.update(memory_cap=self.memory_cap, sla_cap=search.value, sla_low=search.low, sla_high=search.high)
        if self.chunk_search is not None:
            fields["sla_chunk_tokens"] = self.chunk_search.value
        return fields


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

    def start_pass(self, prior=None) -> None:
        try:
            self.policy.start_pass(prior)
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    def wants_requests(self, state: StepState) -> bool:
        try:
            return self.policy.wants_requests(state)
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)
            return False

    def steady_until(self) -> float:
        try:
            return self.policy.steady_until()
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)
            return 0

    def waiting_limit(self) -> int | None:
        try:
            return self.policy.waiting_limit()
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)
            return None

    def _fail(self, exc: Exception) -> None:
        self.error = f"{type(exc).__name__}: {exc}"
        logging.getLogger("rollout").warning("policy %s failed (%s); continuing with a static cap of %d",
                                             self.policy.name, self.error, self.fallback_cap)
        # The graph cap's limit while it was still measuring (a probe, or the graph's batch before any eager
        # step) is no decision: the static cap is bounded by what was configured, or by the graph it held.
        limit = self.policy.max_cap
        graph = getattr(self.policy, "graph", None)
        if graph is not None and not graph.held:
            limit = graph.max_cap
        self.policy = StaticPolicy(self.fallback_cap, limit, self.policy.stats)

    def batch_cap(self, state: StepState) -> int:
        try:
            return self.policy.batch_cap(state)
        except Exception as exc:  # noqa: BLE001 - any policy failure degrades to the static cap
            self._fail(exc)
            return self.policy.batch_cap(state)

    def observe_finished(self, prompt_tokens: int, output_tokens: int, length_scale: float = 1.0,
                         group: int = -1, row: int = -1) -> None:
        try:
            self.policy.observe_finished(prompt_tokens, output_tokens, length_scale, group, row)
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    def observe_step(self, latency_s: float, decode_requests: int, prefill_tokens: int) -> None:
        try:
            self.policy.observe_step(latency_s, decode_requests, prefill_tokens)
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    def observe_preempted(self, computed_tokens: int) -> None:
        try:
            self.policy.observe_preempted(computed_tokens)
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    def token_budget(self, max_step_tokens: int, num_running: int) -> int | None:
        try:
            return self.policy.token_budget(max_step_tokens, num_running)
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)
            return None

    def trace_fields(self) -> dict:
        fields = self.policy.trace_fields()
        if self.error:
            fields["policy_error"] = self.error
        return fields


POLICIES = {cls.name: cls for cls in (StaticPolicy, MemoryPolicy, CLTPolicy, SLAPolicy)}
# Length-aware policies (rollout/policy/forecast.py), built lazily: they import this module.
LENGTH_AWARE_POLICIES = ("forecast",)
# Benchmark references, never defaults: "oracle" reads true lengths from max_tokens; "vllm" runs vLLM's own
# scheduler untouched (no adapter, vLLM's default max_num_seqs).
BENCHMARK_POLICIES = ("oracle", "vllm")


def make_policy(settings: dict, stats: LengthStats | None = None) -> StaticPolicy:
    """Build a policy from the plain dict form of `PolicyConfig` (what travels in vLLM's additional_config)."""
    name = settings["name"]
    max_cap = int(settings["b_max"])
    if name == "oracle":
        from rollout.policy.oracle import OraclePolicy

        return OraclePolicy(max_cap, max_cap, stats, min_wave=float(settings.get("forecast_min_wave", 0.08)))
    if name not in POLICIES and name not in LENGTH_AWARE_POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose one of {sorted([*POLICIES, *LENGTH_AWARE_POLICIES])}")
    if name == "static":
        return StaticPolicy(int(settings.get("static_cap") or max_cap), max_cap, stats)
    memory = dict(eps_m=float(settings["eps_m"]), max_cap=max_cap, min_cap=int(settings.get("b_min", 1)),
                  update_every=int(settings.get("update_every", 16)),
                  min_observations=int(settings.get("min_observations", 8)), stats=stats,
                  graph_batch=int(settings.get("graph_batch") or 0) if settings.get("graph_cap") else 0)
    if name == "sla":
        if not settings.get("d_sla_ms"):
            raise ValueError("policy sla needs d_sla_ms, the step latency bound in milliseconds")
        eps_ms = settings.get("sla_eps_ms")
        return SLAPolicy(
            target_s=float(settings["d_sla_ms"]) / 1e3, tolerance_s=None if eps_ms is None else float(eps_ms) / 1e3,
            relax=float(settings.get("sla_relax", 4)), hold=float(settings.get("sla_hold", 2)),
            window=int(settings.get("sla_window", 8)), chunk=bool(settings.get("sla_chunk", False)),
            chunk_min_tokens=int(settings.get("sla_chunk_min_tokens", 32)),
            chunk_relax_tokens=float(settings.get("sla_chunk_relax_tokens", 64)),
            chunk_hold_tokens=float(settings.get("sla_chunk_hold_tokens", 32)), **memory)
    if name == "forecast":
        from rollout.policy.forecast import ForecastPolicy

        return ForecastPolicy(forecast_after=int(settings.get("forecast_after", 8)),
                              cold_start=str(settings.get("forecast_cold_start", "gamma")),
                              cold_start_shape=float(settings.get("forecast_cold_start_shape", 3.0)),
                              cold_start_horizon=float(settings.get("forecast_cold_start_horizon", 0.08)),
                              forecast_after_share=float(settings.get("forecast_after_share", 0.1)),
                              pointwise_running_peak=bool(settings.get("forecast_pointwise_running_peak", True)),
                              min_wave=float(settings.get("forecast_min_wave", 0.08)),
                              carry_over=float(settings.get("forecast_carry_over", 0.05)),
                              margin_feedback=bool(settings.get("forecast_margin_feedback", False)),
                              siblings=bool(settings.get("forecast_siblings", True)),
                              tail_confidence=float(settings.get("forecast_tail_confidence", 1.5)), **memory)
    return POLICIES[name](**memory)
