"""One scheduler over a benchmark profile's iterations in the simulator, as `rollout.suite.run_bench` runs it:
the same policy object across iterations, the oracle sorted by true length (a group's samples together), and
for `order=longest_first` the per-prompt length memory that `RolloutEngine` keeps (submission order, length
scales, the pass prior)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from rollout.config import PolicyConfig
from rollout.policy import make_policy
from rollout.policy.length_stats import PromptLengths, prompt_key
from rollout.policy.probes import SiblingOrder, probe_first_order
from rollout.sim.engine import StepTimeModel, simulate
from rollout.suite import BenchConfig, scheduler_policy
from rollout.workloads import ProfileConfig, longest_first, profile_requests

VLLM_DEFAULT_MAX_NUM_SEQS = 1024  # vLLM's offline default (`LLM`) on a GPU of 70 GiB or more
# Requests in vLLM's engine at its first step of a pass: its front end hands a pass over during that step, whose
# prefill the rest arrive in (1-6 requests at the first step on the GPU suite's 8B shape: docs/results.md).
REQUESTS_AT_FIRST_STEP = 4


@dataclass
class ProfileRun:
    makespan_s: float = 0.0
    generated_tokens: int = 0
    preemptions: int = 0
    recomputed_tokens: int = 0
    per_iteration_tokens_per_s: list = field(default_factory=list)
    per_iteration_makespan_s: list = field(default_factory=list)
    last: list = field(default_factory=list)  # each iteration's CriticalPath (rollout.sim.engine)
    longest: list = field(default_factory=list)  # each iteration's longest request, as a CriticalPath
    traces: list = field(default_factory=list)  # each iteration's step trace, with keep_trace (rollout.sim.engine)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.makespan_s if self.makespan_s else 0.0


def scheduler_settings(bench: BenchConfig, name: str) -> dict:
    """A bench scheduler name (with its `:key=value` settings, see `scheduler_policy`); `vllm` is a static cap
    at vLLM's default max_num_seqs."""
    base, _, options = name.partition(":")
    if base == "vllm":
        name = f"static-{VLLM_DEFAULT_MAX_NUM_SEQS}" + (":" + options if options else "")
    return scheduler_policy(bench, name)


def simulate_profile(bench: BenchConfig, profile: ProfileConfig, name: str, step_time: StepTimeModel, *,
                     kv_capacity_tokens: int, block_size: int = 16, token_budget: int = 16384,
                     keep_trace: bool = False, speculation=None, share=None) -> ProfileRun:
    """`share(iteration, requests)`: the positions of the requests this engine runs in that iteration (None: all),
    for one engine of several (data parallel), which learns only from what it runs."""
    settings = scheduler_settings(bench, name)
    probes = settings.get("order") == "longest_first" and settings.get("probe_first", PolicyConfig.probe_first)
    policy = make_policy(settings, graph_batch=step_time.graph_batch)  # as the adapter reads it from vLLM
    memory = PromptLengths()
    run = ProfileRun()
    for iteration in range(profile.iterations):
        requests = profile_requests(profile, iteration, bench.seed, bench.vocab_size)
        if share is not None:
            requests = [requests[k] for k in share(iteration, requests)]
        keys = [prompt_key(r.prompt.token_ids) for r in requests]
        scales, prior, probed = np.ones(len(requests)), None, [None] * len(requests)
        if name.split(":")[0] == "oracle":
            requests = longest_first(requests)
        elif settings.get("order") == "longest_first":
            scales = memory.scales(keys)
            prior = memory.prior(keys, scales) if memory.last else None
            order = sorted(range(len(requests)), key=lambda i: -scales[i])
            if probes:  # as RolloutEngine: a probe of each unknown prompt, its siblings last
                unknown = np.isnan(memory.predict(keys))
                positions, probed = probe_first_order([requests[i].group for i in order], [unknown[i] for i in order])
                order = [order[k] for k in positions]
            requests, keys, scales = [requests[i] for i in order], [keys[i] for i in order], scales[order]
        result = simulate([(len(r.prompt.token_ids), r.output_tokens, s, r.group, g)
                           for r, s, g in zip(requests, scales, probed)], policy,
                          kv_capacity_blocks=kv_capacity_tokens // block_size, block_size=block_size,
                          max_num_seqs=int(settings["b_max"]), token_budget=token_budget, step_time=step_time,
                          prior_lengths=prior, nominal_max_tokens=profile.max_output,
                          sibling_order=SiblingOrder() if probes else None,
                          requests_at_first_step=REQUESTS_AT_FIRST_STEP, keep_trace=keep_trace,
                          speculation=speculation)
        by_prompt: dict[str, list[int]] = {}
        for key, r in zip(keys, requests):
            by_prompt.setdefault(key, []).append(r.output_tokens)
        for key, lengths in by_prompt.items():
            memory.update(key, lengths)
        run.makespan_s += result.makespan_s
        run.generated_tokens += result.generated_tokens
        run.preemptions += result.preemptions
        run.recomputed_tokens += result.recomputed_tokens
        run.per_iteration_tokens_per_s.append(result.tokens_per_s)
        run.per_iteration_makespan_s.append(result.makespan_s)
        run.last.append(result.last)
        run.longest.append(result.longest)
        run.traces.append(result.trace)
    return run
