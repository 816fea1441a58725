"""A randomized family of rollout workloads, the judge of whether a policy ever loses to vLLM's default.

`draw(seed)` draws every parameter of a workload independently (so the family's corners are reached): prompts
8-2,048 with 1-16 samples each (at most MAX_REQUESTS a pass), output lengths from one lognormal or a two- or
three-class mixture whose class is fixed per prompt, up to half the samples cut at max_tokens, prompt lengths
10-8,000 and their spread, 1-3 iterations growing or shrinking 0.6-1.6x each, new prompts or the same, a KV cache
of 5%-200% of the first pass's peak demand, and one of three model shapes; a pass of more than MAX_PASS_TOKENS
output tokens keeps fewer prompts. Seeds DEV_SEEDS are for development,
REPORT_SEEDS the report, never tuned on. Deterministic: a seed gives the same workload on any machine.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from rollout.sim.engine import StepTimeModel
from rollout.sim.fit import h200_step_model
from rollout.workloads import ProfileConfig, profile_requests

DEV_SEEDS = range(0, 100)
REPORT_SEEDS = range(100, 300)
MAX_REQUESTS = 8000  # a pass's requests at most (prompts x samples)
MAX_TOKENS_LIMIT = 32768  # the largest max_tokens drawn: what RL trainers give reasoning models
# A pass's output tokens at most: a draw past it keeps fewer prompts (at least 8), its lengths and its cache's share
# of the demand as drawn, so that the judge runs 200 draws on two cores in about half an hour.
MAX_PASS_TOKENS = 2_000_000
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Shape:
    """A model shape as the simulator prices it: KV bytes per token, and its compute per token against the 8B
    shape the step-time model was fitted to (decode and prefill terms scale with it; a step's fixed cost does
    not)."""

    name: str
    kv_bytes_per_token: int
    compute: float

    def step_model(self) -> StepTimeModel:
        model = h200_step_model(self.kv_bytes_per_token)
        return dataclasses.replace(model, per_seq=model.per_seq * self.compute,
                                   per_prefill_token=model.per_prefill_token * self.compute)


# configs/models: Llama-3.1-8B (32 layers x 8 KV heads x 128), Qwen2.5-7B (28 x 4 x 128), Llama-3.2-1B (16 x 8 x 64);
# compute by parameter count.
SHAPES = (Shape("llama-3.1-8b", 131072, 1.0), Shape("qwen2.5-7b", 57344, 7.6 / 8.0),
          Shape("llama-3.2-1b", 32768, 1.24 / 8.0))


@dataclass
class Draw:
    """One workload of the family: its profile (kind `mixture`), the model shape, and the KV cache in tokens."""

    seed: int
    profile: ProfileConfig
    shape: Shape
    kv_capacity_tokens: int
    kv_share: float  # the cache against the first pass's peak demand (every request at its full length at once)
    truncated_share: float  # of the first pass's samples, those cut at max_tokens

    def describe(self) -> str:
        p = self.profile
        classes = (f", {p.mid_share:.0%} x{p.mid_ratio:.1f}" if p.mid_share else "") + (
            f", {p.long_share:.0%} x{p.long_ratio:.1f}" if p.long_share else "")
        return (f"seed {self.seed}: {p.num_prompts} prompts x {p.samples_per_prompt}, output median "
                f"{p.median_output} sigma {p.sigma:.2f}/{p.sample_sigma:.2f}{classes}, max_tokens {p.max_output} "
                f"({self.truncated_share:.0%} cut), prompt {p.prompt_tokens} sigma {p.prompt_sigma:.2f}, "
                f"{p.iterations} pass(es) x{p.drift:.2f}{' new prompts' if p.new_prompts else ''}, KV "
                f"{self.kv_share:.0%} of demand ({self.kv_capacity_tokens} tokens), {self.shape.name}")


def _log_uniform(rng: np.random.Generator, low: float, high: float) -> float:
    return float(math.exp(rng.uniform(math.log(low), math.log(high))))


def peak_demand_tokens(requests) -> int:
    """The KV tokens a pass holds with every request at its full length at once: a prompt's tokens once per group
    (prefix caching shares them among its samples), every sample's output."""
    prompts = {r.group: len(r.prompt.token_ids) for r in requests}
    return sum(prompts.values()) + sum(r.output_tokens for r in requests)


def draw(seed: int) -> Draw:
    """The family's workload of `seed`."""
    rng = np.random.default_rng([seed, 69])
    num_prompts = round(_log_uniform(rng, 8, 2048))
    samples = min(round(_log_uniform(rng, 1, 16)), max(MAX_REQUESTS // num_prompts, 1))
    classes = int(rng.integers(1, 4))
    long_share = float(rng.uniform(0.05, 0.5)) if classes >= 2 else 0.0
    long_ratio = _log_uniform(rng, 3, 30) if classes >= 2 else 1.0
    mid_share = float(rng.uniform(0.05, 0.5)) * (1 - long_share) if classes == 3 else 0.0
    mid_ratio = float(long_ratio ** rng.uniform(0.3, 0.7)) if classes == 3 else 1.0
    profile = ProfileConfig(
        name=f"family-{seed}", kind="mixture", num_prompts=num_prompts, samples_per_prompt=samples,
        prompt_tokens=round(_log_uniform(rng, 10, 8000)), prompt_sigma=float(rng.uniform(0.0, 1.0)),
        median_output=round(_log_uniform(rng, 30, 8000)), sigma=float(rng.uniform(0.2, 1.5)),
        sample_sigma=float(rng.uniform(0.05, 0.8)), long_share=long_share, long_ratio=long_ratio,
        mid_share=mid_share, mid_ratio=mid_ratio, iterations=int(rng.integers(1, 4)),
        drift=_log_uniform(rng, 0.6, 1.6), new_prompts=bool(rng.random() < 0.5), max_output=1 << 30)
    cut = float(rng.uniform(0.0, 0.5))  # the share of the first pass's samples max_tokens cuts
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    kv_share = _log_uniform(rng, 0.05, 2.0)
    first = profile_requests(profile, 0, seed)
    uncut = np.array([r.output_tokens for r in first])
    if uncut.sum() > MAX_PASS_TOKENS and profile.num_prompts > 8:
        profile.num_prompts = max(int(profile.num_prompts * MAX_PASS_TOKENS / uncut.sum()), 8)
        first = profile_requests(profile, 0, seed)
        uncut = np.array([r.output_tokens for r in first])
    profile.max_output = min(max(int(np.quantile(uncut, 1 - cut)), 16), MAX_TOKENS_LIMIT)
    # The first pass as the profile now draws it: the same draws, cut at max_tokens.
    for request in first:
        request.output_tokens = min(request.output_tokens, profile.max_output)
    truncated = float(np.mean([r.output_tokens >= profile.max_output for r in first]))
    # Every request must fit the cache alone, as vLLM requires of max_model_len.
    longest = max(len(r.prompt.token_ids) for r in first) + profile.max_output
    demand = peak_demand_tokens(first)
    capacity = max(round(kv_share * demand), longest + 2 * BLOCK_SIZE)
    capacity = -(-capacity // BLOCK_SIZE) * BLOCK_SIZE
    profile.kv_cache_memory_bytes = capacity * shape.kv_bytes_per_token
    return Draw(seed, profile, shape, capacity, capacity / demand, truncated)
