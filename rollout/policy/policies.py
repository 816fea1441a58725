"""The paper's policies over the step interface (`rollout.policy.base`): a static cap, Algorithm 1 (`memory`),
the exact CLT bound at every step (`memory-clt`) and Algorithm 2 with Algorithm 1 (`sla`)."""

from __future__ import annotations

import math

from rollout.policy.base import Policy, StepState, register
from rollout.policy.config import PolicyConfig
from rollout.policy.graph_cap import GraphCap
from rollout.policy.length_stats import LengthStats
from rollout.policy.memory import clamp_cap, clt_batch_bound, memory_batch_size, overflow_quantile, safety_buffer
from rollout.policy.sla import SLAController, StepWindow


@register
class StaticPolicy(Policy):
    """A fixed cap (`static_cap`, else b_max), as vLLM's max_num_seqs; still gathers statistics for the next
    iteration."""

    name = "static"

    def __init__(self, config: PolicyConfig, stats: LengthStats | None = None, graph_batch: int = 0) -> None:
        super().__init__(config, stats, graph_batch)
        self.cap = min(config.static_cap or config.b_max, self.max_cap)

    def batch_cap(self, state: StepState) -> int:
        return clamp_cap(self.cap, state.num_running, 1, self.max_cap)


@register
class MemoryPolicy(Policy):
    """Algorithm 1: b_t = floor((eta - L0) / mean demand), L0 refreshed every `update_every` finished requests.

    The cap is recomputed only when requests both wait and run; otherwise the previous cap stands. Until
    `min_observations` requests have finished (counting a loaded prior), the demand of a request is taken as
    its prompt plus its max_tokens, with no spread: the worst case, since nothing is known yet.
    """

    name = "memory"

    def __init__(self, config: PolicyConfig, stats: LengthStats | None = None, graph_batch: int = 0) -> None:
        super().__init__(config, stats, graph_batch)
        self.cap = self.max_cap
        self.theta = overflow_quantile(config.eps_m)
        # Above the engine's largest CUDA-graph batch a step may cost more than the extra requests make: with
        # `graph_cap` the cap stays there unless measured steps say otherwise (graph_cap.GraphCap); `max_cap` is
        # the limit in force.
        graph_batch = graph_batch if config.graph_cap else 0
        self.graph = GraphCap(graph_batch, self.max_cap) if 0 < graph_batch < self.max_cap else None
        if self.graph is not None:
            self.max_cap = self.graph.limit
        self.min_cap = config.b_min
        self.update_every = config.update_every
        self.min_observations = config.min_observations
        self.safety_buffer_blocks: float | None = None
        self.finished_since_update = 0
        self.mean_demand_blocks = math.nan
        self.std_demand_blocks = math.nan

    def observe_finished(self, prompt_tokens: int, output_tokens: int, length_scale: float = 1.0,
                         group: int = -1, row: int = -1, aborted: bool = False) -> None:
        super().observe_finished(prompt_tokens, output_tokens, length_scale, group, row, aborted)
        self.finished_since_update += not aborted

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


@register
class CLTPolicy(MemoryPolicy):
    """The exact CLT closed form, recomputed from the current statistics at every step."""

    name = "memory-clt"

    def _refresh_due(self) -> bool:
        return True

    def _batch_size(self, state: StepState, mean: float, std: float) -> float:
        return math.floor(clt_batch_bound(state.kv_capacity_blocks, mean, std, self.theta))


@register
class SLAPolicy(MemoryPolicy):
    """The paper's combined cap min(b_mem, b_sla): Algorithm 1 for memory, Algorithm 2 (`sla.SLAController`)
    for the latency bound, read from every step that decodes. Steps that also run prompt tokens drive a second
    search of the same kind over the prefill chunk, which sets the step's token budget (running decodes +
    chunk), so that mixed steps meet the bound too. The bound is on the mean step latency, as in the paper."""

    name = "sla"

    def __init__(self, config: PolicyConfig, stats: LengthStats | None = None, graph_batch: int = 0) -> None:
        super().__init__(config, stats, graph_batch)
        target_s = config.d_sla_ms / 1e3
        tolerance_s = None if config.sla_eps_ms is None else config.sla_eps_ms / 1e3
        self.batch_search = SLAController(target_s, self.min_cap, config.b_max, config.sla_relax, config.sla_hold,
                                          tolerance_s)
        self.decode_window = StepWindow(config.sla_window)
        self.chunk = config.sla_chunk
        self.chunk_settings = (config.sla_chunk_min_tokens, config.sla_chunk_relax_tokens,
                               config.sla_chunk_hold_tokens)
        self.chunk_search: SLAController | None = None  # sized once the engine's token budget is known
        self.mixed_window = StepWindow(config.sla_window)
        self.memory_cap = config.b_max

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
