"""The policy's settings: one dataclass, the `policy.*` section of the run configuration. It travels to the
engine process as a plain dict in vLLM's additional_config and is rebuilt there whole (no omegaconf, no vLLM)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional


@dataclass
class PolicyConfig:
    name: str = "forecast"  # forecast | memory | memory-clt | sla | static (oracle: benchmarks only)
    b_max: int = 256  # B_max, also vLLM's max_num_seqs (buffers are sized from it)
    b_min: int = 1
    static_cap: Optional[int] = None  # static policy's cap; None: b_max
    eps_m: float = 0.05  # allowed probability that the admitted batch outgrows the KV cache
    update_every: int = 16  # K: refresh the safety buffer every K finished requests
    min_observations: int = 8  # until then, demand = prompt + max_tokens
    forgetting: str = "none"  # none | window | exponential
    window: int = 2048
    decay: float = 0.999
    # sla (Algorithm 2 with Algorithm 1): D_SLA, the bound on a step's latency (the time between tokens).
    d_sla_ms: Optional[float] = None
    sla_eps_ms: Optional[float] = None  # eps_D, the band around D_SLA read as on target; None: 5% of d_sla_ms
    sla_relax: float = 4.0  # alpha, in requests: how far the search's other bound steps back out per decision
    sla_hold: float = 2.0  # delta, in requests: half-width kept around a batch that met the bound
    sla_window: int = 8  # steps averaged per decision
    # Also size the token budget of steps that run prompt tokens (the paper's chunked-prefill use). Off by
    # default: on an H200 it lowered capacity under a 30 ms bound (docs/benchmarks.md, "Capacity under an SLA").
    sla_chunk: bool = False
    sla_chunk_min_tokens: int = 32
    sla_chunk_relax_tokens: float = 64.0
    sla_chunk_hold_tokens: float = 32.0
    # forecast: finished lengths (a prompt's samples counting once) needed before the estimate rests on them
    # alone, and the weight of each earlier pass's length when a new pass starts. Until then (cold start):
    # gamma = a gamma prior (this shape, mean of the requests' max_tokens) stands in for the missing lengths;
    # memory = Algorithm 1's worst case.
    forecast_after: int = 8
    forecast_carry_over: float = 0.05
    forecast_cold_start: str = "gamma"  # gamma | memory
    forecast_cold_start_shape: float = 3.0
    # The first wave of a pass with nothing known holds each request for this share of its max_tokens (0: for
    # the prior's whole future); the prior then stays until this share of the running requests have finished.
    forecast_cold_start_horizon: float = 0.08
    forecast_after_share: float = 0.1
    # The running requests' own forecast is held to the test admissions pass, at each future time (false: their
    # largest expected demand plus their largest spread wherever each falls, the rule before stop 24).
    forecast_pointwise_running_peak: bool = True
    # A forecast admits nothing until this share of the running requests fit (or the whole queue): admissions
    # come in waves, fewer steps leave the decode-only CUDA graph for prompt tokens.
    forecast_min_wave: float = 0.08
    # Standard errors by which the fitted lognormal tail is pushed toward longer lengths (0: the fit itself).
    forecast_tail_confidence: float = 1.5
    # Narrow the forecast's margin while nothing is preempted and admissions wait, widen it on preemption.
    forecast_margin_feedback: bool = False
    # Sibling updates: within a pass, a group's finished samples (and its running ones' output so far) move
    # the length estimate of the group's other samples (GRPO's n samples of a prompt; no effect on groups of one).
    forecast_siblings: bool = True
    # Submission order of a pass. longest_first: prompts whose outputs were longest in earlier passes go
    # first (the driver's per-prompt memory, saved beside the length statistics as prompt_lengths.json;
    # unseen prompts rank at the mean), and each request carries its predicted relative length to the
    # scheduler (the forecast policy scales its length estimate by it).
    order: str = "longest_first"  # longest_first | fifo
    # With longest_first, prompts whose lengths are unknown (a first pass) send one sample ahead; the rest wait at
    # the end and are ordered as those probes finish, a group whose probe still runs first (rollout/policy/probes.py).
    # No effect with fifo. On by default since stop 28: +1.9% to +3.4% on an H200's grpo-groups (docs/benchmarks.md).
    probe_first: bool = True
    # Hold the running batch at the engine's largest CUDA-graph batch (vLLM: 512 unless configured) unless its
    # measured steps say a larger one makes more tokens a second (memory, memory-clt, sla, forecast). Off by
    # default: on H100s it tied (docs/benchmarks.md, stop 16).
    graph_cap: bool = False

    @classmethod
    def from_dict(cls, settings: dict) -> "PolicyConfig":
        """Rebuilt from its plain dict form (what travels in vLLM's additional_config), then validated."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise ValueError(f"policy settings: unknown key(s) {', '.join(unknown)}")
        config = cls(**settings)
        config.validate()
        return config

    def validate(self) -> None:
        """Every check of the policy's settings (the policies trust them)."""
        if self.name == "sla" and not (self.d_sla_ms is not None and self.d_sla_ms > 0):
            raise ValueError(f"policy.name=sla needs policy.d_sla_ms > 0 (the step latency bound in ms), got {self.d_sla_ms}")
        if not 0 <= self.forecast_min_wave < 1:
            raise ValueError(f"policy.forecast_min_wave must be in [0, 1), got {self.forecast_min_wave}")
        if self.forecast_cold_start not in ("gamma", "memory"):
            raise ValueError(f"policy.forecast_cold_start must be gamma or memory, got {self.forecast_cold_start!r}")
        if not self.forecast_cold_start_shape > 0:
            raise ValueError(f"policy.forecast_cold_start_shape must be > 0, got {self.forecast_cold_start_shape}")
