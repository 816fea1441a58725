"""One scheduler over a benchmark profile's iterations in the simulator, as `rollout.suite.run_bench` runs it:
the same policy object across iterations, the oracle sorted by true length (a group's samples together), and
for `order=longest_first` the per-prompt memory the scheduler keeps (`PromptMemory`: the length scales, the
probes, the pass prior, its queue's order) with the driver's submission longest predicted first by it."""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from rollout.config import PolicyConfig
from rollout.policy import make_policy
from rollout.policy.length_stats import LengthStats, PromptLengths, prompt_key
from rollout.policy.probes import SiblingOrder, probe_first_order
from rollout.policy.prompt_memory import PromptMemory, arrival_order, pass_arrivals
from rollout.sim.engine import HOST_LINK_BYTES_PER_S, HostOffload, StepTimeModel, simulate
from rollout.suite import BenchConfig, learned_state, scheduler_policy
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
    recovered_tokens: int = 0  # of them, found in the prefix cache or host memory on resuming (SimResult)
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


def probes_first(settings: dict) -> bool:
    """Whether a scheduler's settings (`scheduler_settings`) have a pass's unseen prompts probed: RolloutEngine
    does it under policy.order `longest_first` with policy.probe_first."""
    return settings.get("order") == "longest_first" and settings.get("probe_first", PolicyConfig.probe_first)


def engine_submission(lengths: PromptLengths, requests: list, keys: list[str], probes: bool) -> list[int]:
    """Positions of a pass's `requests` (their prompts' `keys`) in the order RolloutEngine submits them under
    policy.order `longest_first`: longest predicted first by the scheduler's memory (`lengths`), and with `probes`
    a probe of each prompt never seen first and its siblings last."""
    from rollout.engine import submission_plan

    order = submission_plan(lengths, keys, "longest_first")
    if probes:
        unknown = np.isnan(lengths.predict(keys))
        positions, _ = probe_first_order([requests[i].group for i in order], [unknown[i] for i in order])
        order = [order[k] for k in positions]
    return order


def simulate_profile(bench: BenchConfig, profile: ProfileConfig, name: str, step_time: StepTimeModel, *,
                     kv_capacity_tokens: int, block_size: int = 16, token_budget: int = 16384,
                     keep_trace: bool = False, speculation=None, share=None) -> ProfileRun:
    """`share(iteration, requests)`: the positions of the requests this engine runs in that iteration (None: all),
    for one engine of several (data parallel), which learns only from what it runs. With the bench's
    `kv_offloading_gib`, the engine offloads KV blocks to that much host memory (`HostOffload`), a token's KV
    bytes being the profile's cache bytes over `kv_capacity_tokens`."""
    settings = scheduler_settings(bench, name)
    learns = settings.get("order") == "longest_first"
    probes = probes_first(settings)
    stats = lengths = None
    if bench.start_iteration:  # what the bench's engine starts from (`learned_state`)
        stats, lengths = learned_state(profile, bench.seed, bench.vocab_size, bench.start_iteration, settings)
    config = PolicyConfig.from_dict(settings)
    if bench.kv_offloading_gib:  # as the adapter under vLLM's KV connector
        config = config.under_kv_offloading()
    policy = make_policy(config, stats, graph_batch=step_time.graph_batch)  # as the adapter reads it from vLLM
    memory = PromptMemory(lengths, "longest_first", probes)  # the scheduler's (rollout.vllm.prompt_store)
    offload = None
    if bench.kv_offloading_gib:
        if not profile.kv_cache_memory_bytes:
            raise ValueError(f"profile {profile.name}: kv_offloading_gib needs its kv_cache_memory_bytes, which "
                             "gives a token's KV bytes")
        offload = HostOffload.from_bytes(bench.kv_offloading_gib * 2 ** 30,
                                         profile.kv_cache_memory_bytes / kv_capacity_tokens, HOST_LINK_BYTES_PER_S)
    run = ProfileRun()
    for iteration in range(bench.start_iteration, profile.iterations):
        requests = profile_requests(profile, iteration, bench.seed, bench.vocab_size)
        if share is not None:
            requests = [requests[k] for k in share(iteration, requests)]
        keys = [prompt_key(r.prompt.token_ids) for r in requests]
        rows = [(len(r.prompt.token_ids), r.output_tokens, 1.0, r.group) for r in requests]
        prior = None
        if name.split(":")[0] == "oracle":
            requests = longest_first(requests)
            rows = [(len(r.prompt.token_ids), r.output_tokens, 1.0, r.group) for r in requests]
        elif learns:
            order = engine_submission(memory.lengths, requests, keys, probes)
            requests, keys = [requests[i] for i in order], [keys[i] for i in order]
            # As the scheduler takes them: the pass's prior, each request's scale and probe, its queue's order.
            prior = memory.open_pass()
            arrivals = pass_arrivals(memory, keys)
            queue = arrival_order([False] * len(requests), [a.held for a in arrivals], [a.scale for a in arrivals])
            requests, keys, arrivals = [requests[k] for k in queue], [keys[k] for k in queue], [arrivals[k] for k in
                                                                                               queue]
            rows = [(len(r.prompt.token_ids), r.output_tokens, a.scale, r.group, a.probe_group, a.held)
                    for r, a in zip(requests, arrivals)]
        result = simulate(rows, policy,
                          kv_capacity_blocks=kv_capacity_tokens // block_size, block_size=block_size,
                          max_num_seqs=int(settings["b_max"]), token_budget=token_budget, step_time=step_time,
                          prior_lengths=prior, nominal_max_tokens=profile.max_output,
                          sibling_order=SiblingOrder() if probes else None,
                          requests_at_first_step=REQUESTS_AT_FIRST_STEP, keep_trace=keep_trace,
                          speculation=speculation, offload=offload)
        if learns:
            for key, r in zip(keys, requests):
                memory.finished(key, r.output_tokens)
            memory.close_pass()
        run.makespan_s += result.makespan_s
        run.generated_tokens += result.generated_tokens
        run.preemptions += result.preemptions
        run.recomputed_tokens += result.recomputed_tokens
        run.recovered_tokens += result.recovered_tokens
        run.per_iteration_tokens_per_s.append(result.tokens_per_s)
        run.per_iteration_makespan_s.append(result.makespan_s)
        run.last.append(result.last)
        run.longest.append(result.longest)
        run.traces.append(result.trace)
    return run


def simulate_parallel(bench: BenchConfig, profile: ProfileConfig, name: str, step_time: StepTimeModel, *,
                      engines: int, kv_capacity_tokens: int, block_size: int = 16,
                      token_budget: int = 16384) -> tuple[np.ndarray, np.ndarray]:
    """`rollout.parallel.ParallelEngines` in the simulator: `engines` engines, each with its own policy across
    iterations, over the profile's prompts. The split, the queues and the work stealing are the real
    `Dispatcher`'s, fed as `EngineWorker.run` feeds its engine (twice the cache's tokens at the start, then
    as `waiting_wanted` says; stealing when none waits); the split comes from one per-prompt memory of all engines'
    samples, and each engine's scheduler opens its pass with it (its scales, its prior) and puts its queue in
    order as requests arrive. The engines advance in the order of their clocks, so each takes from the
    queues as they stand at its time. Returns each iteration's pass time per engine and the time its longest
    request took from its start to its end (both iteration x engine): the longest of those is a pass time no
    split can beat at the steps' speed."""
    from rollout.engine import Job, submission_order
    from rollout.parallel import Dispatcher, predicted_work, probes_unknown, split_by_work, waiting_wanted
    from rollout.sim.engine import simulate_steps

    settings = scheduler_settings(bench, name)
    probes = probes_first(settings)
    start = bench.start_iteration
    stats, memory = (learned_state(profile, bench.seed, bench.vocab_size, start, settings) if start
                     else (None, PromptLengths()))
    # Each engine's scheduler reads the statistics from the files on its own: a copy each.
    policies = [make_policy(settings, stats and LengthStats.from_dict(stats.to_dict()),
                            graph_batch=step_time.graph_batch) for _ in range(engines)]
    b_max = max(int(settings["b_max"]), 1)
    times, paths = [], []
    for iteration in range(start, profile.iterations):
        requests = profile_requests(profile, iteration, bench.seed, bench.vocab_size)
        groups: dict[int, list[int]] = {}
        for k, r in enumerate(requests):
            groups.setdefault(r.group, []).append(k)
        ids = list(groups)
        prompts = [requests[groups[g][0]].prompt for g in ids]
        keys = [prompt_key(p.token_ids) for p in prompts]
        known = ~np.isnan(memory.predict(keys))
        learned = PromptMemory(memory, "longest_first", probes)  # what every engine's scheduler opens the pass with
        prior = learned.open_pass() if settings.get("order") == "longest_first" else None
        scales = [learned.scale(k) if settings.get("order") == "longest_first" else 1.0 for k in keys]
        work = predicted_work(prompts, max(len(v) for v in groups.values()), profile.max_output, memory)
        jobs = [Job(j, prompts[j], list(range(len(groups[g]))), bool(known[j])) for j, g in enumerate(ids)]
        queues = [sorted([(float(work[j]), jobs[j]) for j in share], key=lambda item: -item[0])
                  for share in split_by_work(work, engines)]
        dispatcher = Dispatcher(queues, expected=len(requests))
        probing = probes_unknown(jobs, probes)
        index_of = {g: j for j, g in enumerate(ids)}
        # A prompt's samples all go to one engine, whose scheduler probes it where it is unknown and has several:
        # its first sample is the probe, the others held.
        probed = [probes and not known[index_of[r.group]] and len(groups[r.group]) > 1 for r in requests]
        table = [(len(r.prompt.token_ids), r.output_tokens, float(scales[index_of[r.group]]), r.group,
                  index_of[r.group] if p else None, p and k != groups[r.group][0])
                 for k, (r, p) in enumerate(zip(requests, probed))]

        def feeder(rank: int):
            first = [True]

            def feed(clock: float, waiting: int, running: int, cap: int) -> list[int]:
                wanted = waiting_wanted(cap, running, probing)
                if first[0]:
                    first[0], taken = False, dispatcher.take(rank, b_max, steal=False, tokens=2 * kv_capacity_tokens)
                elif waiting >= wanted:
                    return []
                else:
                    taken = dispatcher.take(rank, wanted - waiting, steal=waiting == 0)
                pairs = submission_order(taken or [], probes)  # as PassRun.submit
                return [groups[ids[job.index]][s] for job, s in pairs]
            return feed

        runs = [simulate_steps(table, policies[rank], kv_capacity_blocks=kv_capacity_tokens // block_size,
                               block_size=block_size, max_num_seqs=int(settings["b_max"]),
                               token_budget=token_budget, step_time=step_time,
                               prior_lengths=prior, order_arrivals=settings.get("order") == "longest_first",
                               nominal_max_tokens=profile.max_output,
                               sibling_order=SiblingOrder() if probes else None, feed=feeder(rank))
                for rank in range(engines)]
        clocks, longest_s, heap = [0.0] * engines, [0.0] * engines, [(0.0, rank) for rank in range(engines)]
        while heap:
            _, rank = heapq.heappop(heap)
            try:
                heapq.heappush(heap, (next(runs[rank]), rank))
            except StopIteration as done:
                clocks[rank] = done.value.makespan_s
                path = done.value.longest
                longest_s[rank] = 0.0 if path is None else path.finished_s - path.started_s
        times.append(clocks)
        paths.append(longest_s)
        for j, g in enumerate(ids):
            memory.update(keys[j], [requests[k].output_tokens for k in groups[g]])
    return np.array(times), np.array(paths)
