"""A discrete-event simulator of vLLM V1's scheduling loop, driven by the same policy objects as the adapter.

Per step, the policy is asked as the adapter asks it (rollout.policy.step: the same gate, description and call
order); then, as vLLM's `Scheduler.schedule()` does: running requests first (decode one token, or the next chunk of
a prefill), allocating KV blocks and preempting the newest running request (recompute) when blocks run out;
then, only if nothing was preempted, waiting requests in FCFS order while the cap, the token budget and the
blocks for the whole prompt allow. With `share_prompts` (vLLM's prefix caching, on by default), the requests of
a group (the n samples of a prompt) share its full prompt blocks: held once while any member runs, and a
member admitted while they are held computes only the rest. With `offload` (vLLM's KV offloading to host
memory), a preempted request that resumes loads its full blocks back instead of computing them again
(`HostOffload`). Step time comes from a fitted model (`StepTimeModel`). Not modelled: async scheduling's one-step
overlap, cached blocks that outlive their holders.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from rollout.policy import StepState
from rollout.policy.probes import SiblingOrder, reorder_siblings
from rollout.policy.prompt_memory import arrival_order
from rollout.policy.step import (NUM_COLUMNS, PassShape, Requests, StepGate, decide, least_progress_last,
                                 preemption_possible, promote_to_front, shared_prompt_blocks)


@dataclass
class StepTimeModel:
    """seconds = base + per_seq * decode_seqs + per_kv_token * kv_tokens_read + per_prefill_token * prefill_tokens
    + per_mixed_step if the step runs any prefill (on GPU such a step leaves the decode-only CUDA graph)
    + per_eager_step if it decodes more requests than `graph_batch` (0: no CUDA graphs), past the largest graph.
    An eager step has no graph to leave: prefill costs it only its tokens. The terms are fitted to measured steps
    (rollout.sim.fit); docs/results.md has the fits and how well they predict held-out runs."""

    base: float = 0.01
    per_seq: float = 2e-5
    per_kv_token: float = 1e-8
    per_prefill_token: float = 5e-5
    per_mixed_step: float = 0.0
    graph_batch: int = 0
    per_eager_step: float = 0.0

    def __call__(self, decode_seqs: int, kv_tokens: int, prefill_tokens: int) -> float:
        eager = 0 < self.graph_batch < decode_seqs
        return (self.base + self.per_seq * decode_seqs + self.per_kv_token * kv_tokens
                + self.per_prefill_token * prefill_tokens
                + (self.per_eager_step if eager else self.per_mixed_step if prefill_tokens else 0.0))

    def __str__(self) -> str:
        return (f"{self.base * 1e3:.2f} ms + {self.per_seq * 1e6:.2f} us/seq + {self.per_kv_token * 1e9:.1f} ns/KV "
                f"token + {self.per_prefill_token * 1e6:.2f} us/prefill token + {self.per_mixed_step * 1e3:.2f} ms "
                "per step with prefill" + (f" under the graph + {self.per_eager_step * 1e3:.2f} ms per step decoding "
                                           f"over {self.graph_batch} requests" if self.graph_batch else ""))


# One H200, vLLM 0.26, the 8B shape (docs/results.md, "Speculative decoding's cost"): a step's time with
# speculation configured (synchronous scheduling, V1 runner, FULL graphs) over the default's, by batch size. FULL
# graphs of mixed batches give wrong samples with real weights (docs/results.md): these factors are a lower bound
# on a correct engine's.
SYNC_STEP_FACTORS = ((1, 1.33), (16, 1.47), (64, 1.65), (256, 1.71))


@dataclass
class Speculation:
    """Speculative decoding, for projections: the acceptance is given, not measured. Where at most `max_batch`
    requests decode, each verifies `draft_tokens` drafts and accepts each with probability `acceptance` until the
    first rejection (the standard geometric model), plus the token it samples itself; such a step costs
    `verify_step_s` plus `verify_token_s` per draft token more (a least-squares fit to the measured verify steps,
    rough: their spread is about +-50%). An engine configured for speculation schedules synchronously: its steps take
    `SYNC_STEP_FACTORS` times the default's, every step where `whole_pass` (one engine for the pass), only the
    speculating ones otherwise (an ideal switch between a default engine and a speculating one)."""

    draft_tokens: int
    acceptance: float
    max_batch: int
    whole_pass: bool = True
    verify_step_s: float = 0.5e-3
    verify_token_s: float = 25e-6
    seed: int = 0

    def sync_factor(self, batch: int) -> float:
        sizes, factors = zip(*SYNC_STEP_FACTORS)
        return float(np.interp(math.log(max(batch, 1)), np.log(sizes), factors))


@dataclass
class HostOffload:
    """vLLM's native KV offloading (`model.kv_offloading_gib`): every full block a request computes is also written
    to host memory, which keeps the last `capacity_tokens` written (older blocks are evicted first). A preempted
    request that resumes finds its full blocks there if no more than that was written since its preemption, and
    loads them in `load_s_per_token` each (the host link's bandwidth over a token's KV bytes), added to the step
    that resumes it: vLLM loads asynchronously while other requests' steps run, so this bounds the cost from
    above. The writes, asynchronous on their own stream, are taken as free."""

    capacity_tokens: int
    load_s_per_token: float

    @classmethod
    def from_bytes(cls, host_bytes: float, kv_bytes_per_token: float, link_bytes_per_s: float) -> HostOffload:
        return cls(int(host_bytes // kv_bytes_per_token), kv_bytes_per_token / link_bytes_per_s)


# The host link the simulator loads offloaded blocks over: a quarter of PCIe 5.0 x16's 64 GB/s a direction (an
# H200's), below what pinned-memory copies reach, so that loads are not underpriced.
HOST_LINK_BYTES_PER_S = 16e9


@dataclass
class SimRequest:
    prompt_tokens: int
    output_tokens: int
    length_scale: float = 1.0  # predicted length relative to the average (the scheduler's per-prompt memory)
    group: int | None = None  # requests of one group share the prompt (prefix caching)
    probe_group: int | None = None  # a first-pass probe's group (rollout/policy/probes.py): its place may move
    held: bool = False  # a probed prompt's sample after its probe: it waits behind every other request
    row: int = -1  # its place in the pass (what the policy is told when it finishes)
    generated: int = 0
    computed: int = 0  # tokens whose KV is in the cache
    blocks: int = 0  # blocks of its own (not the group's shared prompt blocks)
    shared_blocks: int = 0  # the group's prompt blocks it uses while running
    started_s: float | None = None  # the clock when it was first admitted
    recomputed: int = 0  # its computed tokens thrown away by preemptions
    preemptions: int = 0
    finished_s: float | None = None
    thrown: int = 0  # computed tokens its last preemption threw away, until it resumes
    stored: int = 0  # of them, those in host memory (HostOffload)
    stored_at: int = 0  # tokens written to host memory by all requests before its preemption

    @property
    def target(self) -> int:  # tokens held: the prompt and every token generated so far
        return self.prompt_tokens + self.generated

    @property
    def decoding(self) -> bool:  # only the last sampled token lacks its KV: a one-token decode step
        return self.generated > 0 and self.computed == self.target - 1


@dataclass
class CriticalPath:
    """One request of a pass: the one that finished it (`SimResult.last`: whatever delayed it delayed the pass) or
    its longest (`SimResult.longest`: where the pass is bound by its longest requests' decode, the two are one).
    `started_s`: when it was first admitted (its wait); `recomputed_tokens`: what its preemptions threw away;
    `finished_s - started_s` over `output_tokens`: how fast its steps ran."""

    output_tokens: int
    started_s: float
    finished_s: float
    recomputed_tokens: int
    preemptions: int


@dataclass
class SimResult:
    makespan_s: float
    generated_tokens: int
    preemptions: int
    recomputed_tokens: int
    steps: int
    # With keep_trace, per step: (clock, running, cap, KV share used, preemptions so far, waiting, running
    # requests of the pass's longest tenth by true length).
    trace: list = field(default_factory=list)
    last: CriticalPath | None = None  # the request that finished the pass
    longest: CriticalPath | None = None  # the pass's longest request (the latest to finish of the longest)
    # Of the recomputed tokens, those a resumed request did not compute again: its group's prompt blocks, held by
    # a sibling (prefix caching), or its blocks loaded from host memory (`HostOffload`). The adapter's
    # `recovered_tokens`.
    recovered_tokens: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.makespan_s if self.makespan_s else 0.0


def simulate(requests, policy, **options) -> SimResult:
    """`simulate_steps` run to its end: the pass's `SimResult`."""
    steps = simulate_steps(requests, policy, **options)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def simulate_steps(requests: list[tuple[int, int]], policy, *, kv_capacity_blocks: int, block_size: int,
                   max_num_seqs: int, token_budget: int, step_time: StepTimeModel, keep_trace: bool = False,
                   prior_lengths=None, share_prompts: bool = True, nominal_max_tokens: int | None = None,
                   sibling_order: SiblingOrder | None = None, requests_at_first_step: int | None = None,
                   ask_every_step: bool = False, speculation: Speculation | None = None, feed=None,
                   order_arrivals: bool = False, offload: HostOffload | None = None):
    """Run `requests` ((prompt tokens, output tokens[, predicted length scale[, group[, probe group[, held]]]]),
    in arrival order) to completion under `policy`, a step at a time: yields the clock after each step and returns
    the `SimResult`, so several engines (data parallel) advance in the order of their clocks.
    `nominal_max_tokens`: the max_tokens the policy is told, as the benchmark tells the adapter (None: each
    request's own length, a request whose max_tokens is its length). `sibling_order`: reorders the waiting
    requests of probed groups as their samples finish, as the adapter. `offload`: vLLM's KV offloading to host
    memory (None: off). `requests_at_first_step`: how many requests the engine holds at its first step (None:
    all); the rest arrive before the second, as vLLM's front end streams a batch into the engine core's process.
    `ask_every_step`: call the policy at every step, also where its `steady_until` says its answer stands (the
    adapter does not). `speculation`: speculative decoding as `Speculation` models it (None: none).
    `feed(clock, waiting, running, cap)`: the positions in `requests` that reach the engine after a step (and
    before the first), as a data-parallel dispatcher hands them over; then only those run, and the pass ends when
    the engine is empty and `feed` gives none. `order_arrivals`: the waiting queue is put in `arrival_order` as
    requests arrive, as the adapter does with its per-prompt memory."""
    queue = [SimRequest(*r, row=k) for k, r in enumerate(requests)]
    first = 0 if feed is not None else len(queue) if requests_at_first_step is None else max(
        requests_at_first_step, 1)
    waiting: deque[SimRequest] = deque()
    late = [] if feed is not None else queue[first:]
    policy.start_pass(prior_lengths)
    running: list[SimRequest] = []
    free = kv_capacity_blocks
    holders: dict[int, int] = {}  # group -> running members holding its shared prompt blocks

    def prompt_blocks(r: SimRequest) -> int:  # full prompt blocks a group member can share
        return shared_prompt_blocks(r.prompt_tokens, block_size) if share_prompts and r.group is not None else 0

    def release(r: SimRequest) -> int:  # blocks freed when r stops running
        freed, r.blocks = r.blocks, 0
        if r.shared_blocks:
            holders[r.group] -= 1
            if holders[r.group] == 0:
                freed += r.shared_blocks
            r.shared_blocks = 0
        return freed

    clock, steps, preemptions, recomputed, generated, finished = 0.0, 0, 0, 0, 0, 0
    recovered = written = 0  # written: tokens computed so far, by all requests (HostOffload's write-through)
    gate, cap, step_budget = StepGate(), max_num_seqs, token_budget
    progress = {"vllm": None, "least_output": lambda r: r.generated,
                "least_computed": lambda r: r.computed}[policy.preemption_order]  # the adapter's PROGRESS
    spec_rng = None if speculation is None else np.random.default_rng(speculation.seed)
    pending_prompt = pending_max = 0  # over the requests that have reached the engine and not finished

    def arrive(batch: list[SimRequest]) -> None:
        nonlocal pending_prompt, pending_max
        if order_arrivals and batch:
            placed = set(map(id, waiting))  # held samples already waiting keep their places
            items = [*waiting, *batch]
            order = arrival_order([r.generated > 0 or r.computed > 0 or (r.held and id(r) in placed) for r in items],
                                  [r.held for r in items], [r.length_scale for r in items])
            waiting.clear()
            waiting.extend(items[k] for k in order)
        else:
            waiting.extend(batch)
        pending_prompt += sum(r.prompt_tokens for r in batch)
        pending_max += sum(nominal_max_tokens or r.output_tokens for r in batch)

    arrive(queue[:first])
    if feed is not None:
        arrive([queue[k] for k in feed(0.0, 0, 0, cap)])
    max_tokens_bound = nominal_max_tokens or max((r[1] for r in requests), default=0)
    trace = []
    # The pass's longest tenth by true length: how many of them run at a step shows whether the critical path
    # (the long class of a tail-bound pass) gets the cache or waits behind the rest.
    longest_tenth = float(np.quantile([r.output_tokens for r in queue], 0.9)) if keep_trace and queue else 0.0
    # The pass's request table, as the adapter keeps it (rollout.policy.step columns): MAX_TOKENS is each request's
    # true length, shown to oracles only.
    table = np.array([(r.prompt_tokens, r.output_tokens, -1 if r.group is None else r.group,
                       prompt_blocks(r) * block_size, r.length_scale) for r in queue], dtype=float).reshape(-1, NUM_COLUMNS)
    groups = [r.group for r in queue if r.group is not None]
    shape = PassShape(grouped=share_prompts and len(set(groups)) < len(groups), group_ids=max(groups, default=-1) + 1,
                      scaled=any(r.length_scale != 1.0 for r in queue))

    def describe(requests) -> Requests:
        n = len(requests)
        rows = np.fromiter((r.row for r in requests), np.int64, n)
        return Requests(np.fromiter((r.generated for r in requests), np.int64, n), rows, table[rows])

    def waiting_reader():
        head = iter(waiting)
        return lambda n: describe(list(itertools.islice(head, n)))

    def reorder() -> None:
        items = list(waiting)
        reordered = reorder_siblings(items, sibling_order, [r.probe_group for r in items],
                                     [r.generated > 0 for r in items])
        waiting.clear()
        waiting.extend(reordered)

    def fed_when_empty() -> bool:  # the engine ran dry: what the dispatcher hands over now, if anything
        if feed is None:
            return False
        arrive([queue[k] for k in feed(clock, 0, 0, cap)])
        return bool(waiting)

    while waiting or running or fed_when_empty():
        events = (len(running), len(waiting), finished, preemptions)
        if ask_every_step or not gate.steady(events, steps):
            pending = len(waiting) + len(running)
            state = StepState(num_running=len(running), num_waiting=len(waiting), step=steps,
                              kv_capacity_blocks=kv_capacity_blocks, block_size=block_size, kv_free_blocks=free,
                              pending_prompt_tokens_mean=pending_prompt / pending,
                              pending_max_tokens_mean=pending_max / pending, max_tokens_bound=max_tokens_bound)
            decision = decide(policy, state, lambda: describe(running), waiting_reader, max_num_seqs=max_num_seqs,
                              shape=shape, max_step_tokens=token_budget, sibling_order=sibling_order,
                              reorder=reorder, tail=lambda n: describe(list(itertools.islice(reversed(waiting), n))),
                              promote=lambda picks: promote_to_front(waiting, picks))
            gate.answered(events, decision)
            cap = decision.cap
            step_budget = token_budget if decision.token_budget is None else max(decision.token_budget, 1)
        budget, scheduled, preempted, load_s = step_budget, [], False, 0.0
        drafting = speculation is not None and len(running) <= speculation.max_batch
        accepted: dict[int, int] = {}  # id(request) -> draft tokens it accepts this step
        if progress is not None and preemption_possible(free, len(running), step_budget, block_size):
            least_progress_last(running, progress)
        i = 0
        while i < len(running) and budget > 0:
            r = running[i]
            n = min(r.target - r.computed, budget) if r.computed < r.target else 1
            if drafting and r.decoding and r.output_tokens - r.generated > 1:
                n = min(1 + speculation.draft_tokens, budget)  # its last token and the drafts, verified together
            need = math.ceil((r.computed + n) / block_size) - r.shared_blocks - r.blocks
            while need > free and running:
                victim = running.pop()  # vLLM FCFS: the last admitted goes first
                free += release(victim)
                recomputed += victim.computed
                victim.recomputed += victim.computed
                victim.thrown = victim.computed
                if offload is not None:
                    victim.stored, victim.stored_at = victim.computed // block_size * block_size, written
                victim.preemptions += 1
                policy.observe_preempted(victim.computed)
                victim.computed = 0
                waiting.appendleft(victim)
                preemptions += 1
                preempted = True
                if victim is r:
                    break
            if i >= len(running) or running[i] is not r:
                continue
            r.blocks += need
            free -= need
            scheduled.append((r, n))
            budget -= n
            if n > 1 and r.decoding:
                draws = spec_rng.geometric(1.0 - speculation.acceptance) - 1 if speculation.acceptance < 1 else n
                accepted[id(r)] = int(min(draws, n - 1, r.output_tokens - r.generated - 1))
            i += 1
        while not preempted and waiting and len(running) < cap and budget > 0:
            r = waiting[0]
            shared = prompt_blocks(r)
            cached = shared if shared and holders.get(r.group, 0) else 0  # prefix-cache hit on the group's prompt
            if math.ceil(r.target / block_size) - cached > free:  # the whole prompt must fit before admission
                break
            r.computed = min(cached * block_size, r.target - 1)  # vLLM recomputes at least the last token
            if r.stored and written - r.stored_at + r.stored <= offload.capacity_tokens and r.stored > r.computed:
                loaded = min(r.stored, r.target - 1) - r.computed
                load_s += loaded * offload.load_s_per_token
                r.computed += loaded
            recovered += min(r.computed, r.thrown)
            r.thrown = r.stored = 0
            n = min(r.target - r.computed, budget)
            waiting.popleft()
            running.append(r)
            if r.started_s is None:
                r.started_s = clock
            if shared:
                if not cached:
                    free -= shared  # the first member allocates the group's prompt blocks
                holders[r.group] = holders.get(r.group, 0) + 1
                r.shared_blocks = shared
            r.blocks = max(math.ceil((r.computed + n) / block_size) - shared, 0)
            free -= r.blocks
            scheduled.append((r, n))
            budget -= n
        if not scheduled:
            raise ValueError(f"no progress: {len(waiting)} waiting requests, none fits {kv_capacity_blocks} blocks")
        decode = sum(1 for r, _ in scheduled if r.decoding)
        prefill = sum(n for r, n in scheduled if not r.decoding)
        kv_read = sum(r.computed for r, _ in scheduled)
        duration = step_time(decode, kv_read, prefill) + load_s
        if speculation is not None and (speculation.whole_pass or accepted):
            duration *= speculation.sync_factor(decode)
        if accepted:
            drafts = sum(n - 1 for r, n in scheduled if id(r) in accepted)
            duration += speculation.verify_step_s + speculation.verify_token_s * drafts
        clock += duration
        policy.observe_step(duration, decode, prefill)
        steps += 1
        for r, n in scheduled:
            if id(r) in accepted:  # a verify step: the accepted drafts and one token of its own
                gained = 1 + accepted[id(r)]
                r.computed += gained
                written += gained
                r.generated += gained
                generated += gained
            else:
                was_prefill = r.computed < r.target
                r.computed += n
                written += n
                if was_prefill and r.computed < r.target:
                    continue  # a prefill chunk that does not finish the prompt samples nothing
                r.generated += 1
                generated += 1
            if r.generated >= r.output_tokens:
                running.remove(r)
                r.finished_s = clock
                finished += 1
                free += release(r)
                pending_prompt -= r.prompt_tokens
                pending_max -= nominal_max_tokens or r.output_tokens
                policy.observe_finished(r.prompt_tokens, r.output_tokens, r.length_scale,
                                        -1 if r.group is None else r.group, r.row)
                if sibling_order is not None and r.probe_group is not None:
                    sibling_order.observe(r.probe_group, r.output_tokens)
        if late:
            arrive(late)
            late = []
        if feed is not None and running:
            arrive([queue[k] for k in feed(clock, len(waiting), len(running), cap)])
        if keep_trace:
            trace.append((clock, len(running), cap, 1 - free / kv_capacity_blocks, preemptions, len(waiting),
                          sum(r.output_tokens >= longest_tenth for r in running)))
        yield clock
    def path(r: SimRequest | None) -> CriticalPath | None:
        return None if r is None else CriticalPath(r.output_tokens, r.started_s, r.finished_s, r.recomputed,
                                                   r.preemptions)

    ran = [r for r in queue if r.finished_s is not None]
    last = max(ran, key=lambda r: (r.finished_s, r.output_tokens), default=None)
    longest = max(ran, key=lambda r: (r.output_tokens, r.finished_s), default=None)
    return SimResult(clock, generated, preemptions, recomputed, steps, trace, path(last), path(longest), recovered)
