"""One description of a scheduling step, shared by the vLLM adapter and the simulator: when the policy is asked
(`StepGate`), what it is shown of the running and waiting requests (`describe_requests`), and the order of the
calls that produce the step's cap (`decide`). Both callers hold their requests differently (vLLM's Request objects,
the simulator's own); they hand them over as `Requests` arrays, so that the GPU and the simulator decide alike from
one state.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import numpy as np

from rollout.policy.base import StepState

# Columns of a pass's request table, a row per request: what does not change while it runs. MAX_TOKENS is the
# request's own limit (in benchmarks, its imposed true length: shown to oracles only).
PROMPT, MAX_TOKENS, GROUP, SHARED, SCALE = range(5)
NUM_COLUMNS = 5
# The waiting queue is read in growing chunks: the cut at the free KV usually comes early, and a queue of
# thousands read whole at every asked step would cost more than the policy.
FIRST_CHUNK = 16
# Tail requests described for backfilling, at most: a backfill admits the few that fit beside the blocked head.
TAIL_LIMIT = 32


def shared_prompt_blocks(prompt_tokens: int, block_size: int) -> int:
    """Full prompt blocks a sample can share with its group's cached prompt. vLLM recomputes a prompt's last
    token, so a cache hit ends at the last full block before it (`max_cache_hit_length = num_tokens - 1`)."""
    return (prompt_tokens - 1) // block_size


class Requests(NamedTuple):
    """Requests in queue order: output tokens so far, rows in the pass, and those rows of the pass's table."""

    generated: np.ndarray  # int64
    rows: np.ndarray  # int64
    table: np.ndarray  # float, (n, NUM_COLUMNS)

    def head(self, n: int) -> "Requests":
        return Requests(self.generated[:n], self.rows[:n], self.table[:n])


NO_REQUESTS = Requests(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, NUM_COLUMNS)))


def concat(parts: list[Requests]) -> Requests:
    if not parts:
        return NO_REQUESTS
    if len(parts) == 1:
        return parts[0]
    return Requests(*(np.concatenate(column) for column in zip(*parts)))


@dataclass
class PassShape:
    """What a pass's requests share, for the description: `grouped`, some prompt has several samples (prefix
    caching on), so group columns are shown; `group_ids`, an upper bound on the group ids (0..group_ids-1);
    `scaled`, some request carried a predicted length scale, so scale columns are shown."""

    grouped: bool = False
    group_ids: int = 0
    scaled: bool = False


def promote_to_front(queue, positions: list[int]) -> None:
    """Move the requests of a deque `queue` at `positions` (indexes as Python's: from the front, or negative from
    the end) to its front, in the order of `positions` (a policy's `backfill`)."""
    n = len(queue)
    at = [p if p >= 0 else n + p for p in positions]
    chosen = [queue[i] for i in at]
    for i in sorted(at, reverse=True):  # the furthest back first: the positions of those still to delete stay put
        del queue[i]
    queue.extendleft(reversed(chosen))


def describe_requests(state: StepState, running: Requests, read_waiting: Callable[[int], Requests], *,
                      max_num_seqs: int, waiting_limit: int | None, shape: PassShape, true_lengths: bool,
                      read_tail: Callable[[int], Requests] | None = None) -> None:
    """Fill the StepState's per-request arrays. `read_waiting(n)` gives the next n waiting requests in queue order
    (fewer at the queue's end). Waiting requests are shown up to the cap's headroom (and `waiting_limit`) and only
    as far as their tokens fit the free KV, plus one: the first that does not fit tells the policy what admission
    waits for. A group's prompt blocks are held once (prefix caching): counted per sample, the cut showed the policy
    one waiting request a step while groups ran, and it admitted one sample a step, each step a prefill.
    `read_tail(n)` (a policy that backfills): the last n waiting requests, the last first; up to TAIL_LIMIT of
    them are shown (`tail_*`) where the head stops before the queue's end and the cap has room for more."""
    free_tokens = state.kv_free_blocks * state.block_size
    grouped = shape.grouped
    if grouped:
        held = np.zeros(shape.group_ids, dtype=bool)  # groups whose prompt blocks are in the cache
        group = running.table[:, GROUP].astype(np.int64)
        held[group[group >= 0]] = True
    headroom = max_num_seqs - len(running.rows)
    remaining = headroom if waiting_limit is None else min(headroom, waiting_limit)
    chunk_size, parts = FIRST_CHUNK, []
    while remaining > 0 and free_tokens >= 0:
        chunk = read_waiting(min(remaining, chunk_size))
        if not len(chunk.rows):
            break
        remaining -= len(chunk.rows)
        chunk_size *= 4
        need = chunk.table[:, PROMPT] + chunk.generated
        if grouped:
            group = chunk.table[:, GROUP].astype(np.int64)
            first = np.zeros(len(group), dtype=bool)
            first[np.unique(group, return_index=True)[1]] = True
            cached = (group >= 0) & (~first | held[np.maximum(group, 0)])
            need -= np.where(cached, chunk.table[:, SHARED], 0)
        need = np.cumsum(need)
        keep = min(int(np.searchsorted(need, free_tokens, side="right")) + 1, len(chunk.rows))
        parts.append(chunk.head(keep))
        if grouped:
            held[group[:keep][group[:keep] >= 0]] = True
        free_tokens -= need[keep - 1]
    waiting = concat(parts)
    sides = [("running", running), ("waiting", waiting)]
    tail = min(TAIL_LIMIT, state.num_waiting - len(waiting.rows), headroom - len(waiting.rows))
    if read_tail is not None and tail > 0:
        sides.append(("tail", read_tail(tail)))
    for side, requests in sides:
        generated, table = requests.generated, requests.table
        setattr(state, f"{side}_tokens", table[:, PROMPT].astype(np.int64) + generated)
        setattr(state, f"{side}_generated", generated)
        setattr(state, f"{side}_rows", requests.rows)
        if true_lengths:
            setattr(state, f"{side}_remaining", table[:, MAX_TOKENS].astype(np.int64) - generated)
        if grouped:
            setattr(state, f"{side}_group", table[:, GROUP].astype(np.int64))
            setattr(state, f"{side}_shared", table[:, SHARED].astype(np.int64))
        if shape.scaled:
            setattr(state, f"{side}_scale", table[:, SCALE])


class Decision(NamedTuple):
    cap: int  # within [running, max_num_seqs], at least 1
    token_budget: int | None  # None: the engine's own
    steady_until: float  # the policy's answer stands before this step while nothing changes
    describe_s: float | None  # time spent describing the requests (None: not described, or not timed)


def decide(policy, state: StepState, running: Callable[[], Requests], waiting: Callable[[], Callable[[int], Requests]],
           *, max_num_seqs: int, shape: PassShape, max_step_tokens: int | None = None, sibling_order=None,
           reorder: Callable[[], None] | None = None, clock: Callable[[], float] | None = None,
           tail: Callable[[int], Requests] | None = None,
           promote: Callable[[list[int]], None] | None = None) -> Decision:
    """Ask the policy for this step's cap, in the order both callers follow. `running()` describes the running
    requests; `waiting()` starts a reader of the waiting queue (see `describe_requests`). Where probed groups'
    waiting siblings are to be put in their place (`sibling_order.dirty`, rollout.policy.probes), `reorder()` does
    it; it runs only
    where the policy reads the queue's head or the cap admits from it (a first pass's probes finish ~100 times
    between admission waves, and each reordering walks the queue). `clock` times the description. `tail(n)`: the
    last n waiting requests, the last first, and `promote(positions)` moves those at `positions` (as `promote_to_front`)
    to the queue's front: for a policy that `backfills` (None: the queue cannot be reordered, no backfill)."""
    wants_requests = policy.wants_requests(state)
    if sibling_order is not None and sibling_order.dirty and wants_requests:
        reorder()
    describe_s = None
    backfills = wants_requests and policy.backfills and tail is not None and promote is not None
    if wants_requests:
        started = clock() if clock is not None else 0.0
        describe_requests(state, running(), waiting(), max_num_seqs=max_num_seqs,
                          waiting_limit=policy.waiting_limit(), shape=shape, true_lengths=policy.reads_true_lengths,
                          read_tail=tail if backfills else None)
        if clock is not None:
            describe_s = clock() - started
    cap = min(max(policy.batch_cap(state), state.num_running, 1), max_num_seqs)
    reordered = False
    if sibling_order is not None and sibling_order.dirty and cap > state.num_running:
        reorder()
        reordered = True
    if backfills:
        picks = policy.backfill()
        if picks and not reordered:  # a reordering moved the described requests: their positions no longer hold
            promote(picks)
    budget = None
    if max_step_tokens is not None:
        budget = policy.token_budget(max_step_tokens, state.num_running)
    return Decision(cap, budget, policy.steady_until(), describe_s)


PREEMPTION_CANDIDATES = 8  # running requests put in line for preemption, at most (more in one step are rare)


def preemption_possible(free_blocks: int, num_running: int, token_budget: int, block_size: int) -> bool:
    """Whether a step may run out of KV blocks: each running request's next token can take a new block, and the
    step's prompt tokens (at most its token budget) theirs (speculative tokens not counted)."""
    return free_blocks < num_running + -(-token_budget // block_size)


def least_progress_last(running: list, progress: Callable[[Any], int]) -> None:
    """Puts the PREEMPTION_CANDIDATES running requests with the least `progress` (tokens generated, or computed)
    at the end of `running` (in place), the least last (of equals, the later admitted), the others in their order.
    vLLM's FCFS scheduler preempts from the end of its running list; by default it takes the last admitted, which
    after a preemption is the request just resumed, recomputed and preempted again."""
    if len(running) < 2:
        return
    low = heapq.nsmallest(PREEMPTION_CANDIDATES, range(len(running)), key=lambda i: (progress(running[i]), -i))
    moved = set(low)
    running[:] = [r for i, r in enumerate(running) if i not in moved] + [running[i] for i in reversed(low)]


class StepGate:
    """Whether the policy is asked at a step: only where something it reads changed since it last answered (an
    arrival, admission, finish or preemption: `events`) or the step it named (`steady_until`) has come. Most decode
    steps change nothing; the policy's last cap then stands."""

    def __init__(self) -> None:
        self.events: tuple | None = None
        self.steady_until = 0.0

    def steady(self, events: tuple, step: int) -> bool:
        return events == self.events and step < self.steady_until

    def answered(self, events: tuple, decision: Decision) -> None:
        self.events, self.steady_until = events, decision.steady_until
