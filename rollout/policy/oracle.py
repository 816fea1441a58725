"""The length oracle: admission that knows every request's true output length (a benchmark reference, never a
default). It admits waiting requests, in queue order, while the peak KV demand of everything running over the
forecast's horizon (`forecast_horizon_tokens` steps ahead; 0: until every request ends) stays within the cache;
fed longest-first, it keeps the cache full. Within the horizon nothing is preempted; past it requests may outrun
the cache as finishes fail to free enough, and then vLLM preempts in the forecast's order
(`forecast_preemption`): the oracle takes the forecast's rule whole, with true lengths for estimates.
"""

from __future__ import annotations

import math

import numpy as np

from rollout.policy.memory import clamp_cap
from rollout.policy.base import StepState, backfill_candidates, register, resumes_first
from rollout.policy.policies import StaticPolicy


def peak_kv_tokens(current: np.ndarray, remaining: np.ndarray, block_size: int = 1, fixed: np.ndarray | None = None,
                   fixed_until: np.ndarray | None = None, horizon: int = 0) -> float:
    """Largest future KV demand (tokens) of requests holding `current` tokens that each grow by one token per
    step for `remaining` more steps and then free everything; each active request may waste up to one block.
    `fixed` tokens (shared prompt blocks) are held, without growing, until `fixed_until` steps. `horizon` (0:
    none): the largest demand within that many steps ahead."""
    if len(current) == 0:
        return 0.0
    order = np.argsort(remaining, kind="stable")
    rem = remaining[order].astype(float)
    if horizon:
        # At the horizon every request still running counts as if it finished there: the demand evaluated at
        # min(end, horizon) is largest where the first of them does.
        rem = np.minimum(rem, float(horizon))
    cur = current[order].astype(float)
    # Demand changes only when a request finishes: evaluate at each finish time t = rem[k], where requests
    # k..n-1 are still active, each holding cur + t tokens rounded up to a block.
    active_tokens = np.cumsum(cur[::-1])[::-1]
    active = len(rem) - np.arange(len(rem))
    demand = active_tokens + active * (rem + block_size - 1)
    if fixed is not None and len(fixed):
        by_end = np.argsort(fixed_until)
        held_from = np.concatenate([np.cumsum(np.asarray(fixed, dtype=float)[by_end][::-1])[::-1], [0.0]])
        demand = demand + held_from[np.searchsorted(np.asarray(fixed_until)[by_end], rem, side="left")]
    return float(np.max(demand))


def _with_shared_prompts(tokens, remaining, group, shared):
    """Each request's own tokens, and per group its shared prompt tokens held until its last member ends."""
    ids, inverse = np.unique(group, return_inverse=True)
    until = np.zeros(len(ids))
    np.maximum.at(until, inverse, remaining)
    fixed = np.zeros(len(ids))
    np.maximum.at(fixed, inverse, shared)
    return tokens - shared, fixed, until


def _peak(tokens, remaining, block_size, group=None, shared=None, horizon: int = 0) -> float:
    """`peak_kv_tokens` of requests; with groups and shared prompt tokens, a group's shared blocks count once."""
    tokens = np.asarray(tokens, dtype=float)
    fixed = until = None
    if shared is not None:
        tokens, fixed, until = _with_shared_prompts(tokens, remaining, group, np.asarray(shared, dtype=float))
    return peak_kv_tokens(tokens, remaining, block_size, fixed, until, horizon)


def oracle_admissions(running_tokens: np.ndarray, running_remaining: np.ndarray, waiting_tokens: np.ndarray,
                      waiting_remaining: np.ndarray, capacity_tokens: float, block_size: int,
                      running_group=None, waiting_group=None, running_shared=None, waiting_shared=None,
                      horizon: int = 0) -> int:
    """How many of the waiting requests (a prefix, in queue order) fit without the peak (within `horizon` steps;
    0: ever) exceeding capacity. With groups and shared prompt tokens (prefix caching), a group's shared prompt
    blocks count once."""
    sharing = running_shared is not None and waiting_shared is not None

    def fits(m: int) -> bool:
        return _peak(np.concatenate([running_tokens, waiting_tokens[:m]]),
                     np.concatenate([running_remaining, waiting_remaining[:m]]), block_size,
                     np.concatenate([running_group, waiting_group[:m]]) if sharing else None,
                     np.concatenate([running_shared, waiting_shared[:m]]) if sharing else None,
                     horizon) <= capacity_tokens

    lo, hi = 0, len(waiting_tokens)  # the peak grows with m: binary search for the largest m that fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def oracle_backfill(tokens: np.ndarray, remaining: np.ndarray, candidate_tokens: np.ndarray,
                    candidate_remaining: np.ndarray, capacity_tokens: float, block_size: int, group=None, shared=None,
                    candidate_group=None, candidate_shared=None, horizon: int = 0) -> list[int]:
    """The candidates (indices, first fit in the order given) that fit beside the requests `tokens` and
    `remaining` describe (the running and those admitted) without the peak (within `horizon` steps) exceeding
    capacity; with groups and shared prompt tokens, as `oracle_admissions`."""
    sharing = shared is not None and candidate_shared is not None
    picks: list[int] = []
    for k in range(len(candidate_tokens)):
        rows = picks + [k]
        if _peak(np.concatenate([tokens, candidate_tokens[rows]]),
                 np.concatenate([remaining, candidate_remaining[rows]]), block_size,
                 np.concatenate([group, candidate_group[rows]]) if sharing else None,
                 np.concatenate([shared, candidate_shared[rows]]) if sharing else None, horizon) <= capacity_tokens:
            picks.append(k)
    return picks


@register
class OraclePolicy(StaticPolicy):
    """Cap = running + the waiting requests whose true lengths still fit the cache at its peak over the forecast's
    horizon, admitted in waves of at least `min_wave` x the running requests (or the whole queue), as the forecast
    admits."""

    name = "oracle"
    needs_requests = True
    reads_true_lengths = True
    benchmark_only = True
    backfills = True
    admitted_last: int | None = None

    def __init__(self, config, stats=None, graph_batch: int = 0) -> None:
        super().__init__(config, stats, graph_batch)
        self.cap = self.max_cap
        min_wave = config.forecast_min_wave
        # Admitting whatever fits at every step trickles prompts into many steps, each out of the decode-only
        # CUDA graph: the oracle then runs slower than the forecast it should bound (docs/results.md).
        self.min_wave = min_wave
        # The forecast's horizon and order of preemption (see the module's docstring): admitting only what fits at
        # its true peak until the pass's end keeps room free that the forecast fills, and the reference then
        # lost to vLLM's default where a long request is a large share of the cache (docs/results.md).
        self.horizon_tokens = config.forecast_horizon_tokens
        self.preemption_order = config.forecast_preemption
        self._finishes_wanted = 0  # finishes before the next search (0: search at every step)
        self._admitted_up_to = 0  # running requests at the last search plus those it admitted, less finishes since
        self.picks: list[int] = []  # queue positions this cap counts past the blocked head (`backfill`)

    def start_pass(self, prior=None) -> None:
        super().start_pass(prior)
        self.admitted_last = None
        self._finishes_wanted = self._admitted_up_to = 0

    def observe_finished(self, prompt_tokens: int, output_tokens: int, length_scale: float = 1.0,
                         group: int = -1, row: int = -1, aborted: bool = False) -> None:
        super().observe_finished(prompt_tokens, output_tokens, length_scale, group, row, aborted)
        self._finishes_wanted -= 1
        self._admitted_up_to -= 1

    def wants_requests(self, state: StepState) -> bool:
        # True lengths make the future peak exact: until a request finishes the same search gives the same answer,
        # and a search at every step costs a sort of the described requests per probe.
        return not state.num_running or self._finishes_wanted <= 0

    def waiting_limit(self) -> int | None:
        # Each step searches the described queue (a sort per probe), which costs with the queue's length. Most
        # steps admit a few; a limit that all fitted doubles at the next step.
        return None if self.admitted_last is None else max(256, 2 * self.admitted_last)

    def batch_cap(self, state: StepState) -> int:
        self.picks = []  # a cap without a search counts none: an earlier search's positions no longer hold
        if not state.num_waiting:
            return clamp_cap(self.cap, state.num_running, 1, self.max_cap)
        if state.waiting_tokens is None:  # no search this step: only what the last one admitted may start
            self.cap = clamp_cap(self._admitted_up_to, state.num_running, 1, self.max_cap)
            return self.cap
        capacity = state.kv_capacity_blocks * state.block_size
        admit = oracle_admissions(state.running_tokens, state.running_remaining, state.waiting_tokens,
                                  state.waiting_remaining, capacity, state.block_size, state.running_group,
                                  state.waiting_group, state.running_shared, state.waiting_shared, self.horizon_tokens)
        blocked = admit < len(state.waiting_tokens)  # the head's first request left out waits
        if blocked and not resumes_first(state, admit):
            positions, candidates = backfill_candidates(state, admit)
            sharing = state.running_shared is not None
            picked = oracle_backfill(
                np.concatenate([state.running_tokens, state.waiting_tokens[:admit]]),
                np.concatenate([state.running_remaining, state.waiting_remaining[:admit]]),
                candidates["tokens"], candidates["remaining"], capacity, state.block_size,
                np.concatenate([state.running_group, state.waiting_group[:admit]]) if sharing else None,
                np.concatenate([state.running_shared, state.waiting_shared[:admit]]) if sharing else None,
                candidates.get("group"), candidates.get("shared"), self.horizon_tokens)
            self.picks = [positions[k] for k in picked]
        # All it was shown fit (the description stops at the cache's free blocks, or the whole queue, while vLLM's
        # front end is still handing it the pass): more may fit at the next step. Waiting for a finish there
        # holds a pass's first few requests alone until the shortest of them ends.
        self._finishes_wanted = 1 if self.min_wave and blocked else 0
        wave = math.ceil(self.min_wave * state.num_running)
        admit += len(self.picks)
        if state.num_running and 0 < admit and blocked and admit < wave:
            self._finishes_wanted = wave - admit  # about a request fits per finish
            admit, self.picks = 0, []
        self.admitted_last = admit
        self._admitted_up_to = state.num_running + admit
        # Admit at least one request into an empty engine, or nothing would ever run.
        self.cap = clamp_cap(state.num_running + max(admit, 0 if state.num_running else 1), state.num_running, 1,
                             self.max_cap)
        return self.cap

    def backfill(self) -> list[int]:
        return self.picks

    def trace_fields(self) -> dict:
        return {**super().trace_fields(), "backfilled": len(self.picks)}
