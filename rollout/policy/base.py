"""The policy interface: what a batch-size policy sees of a step (`StepState`), what it answers (`Policy`), the one
registry of policies by name (`POLICIES`, filled by `register`) and the guard that keeps a failing policy from
ending a rollout (`FallbackPolicy`).

Policy modules import this one, never the other way; `rollout.policy` imports them all, so the registry is
complete once the package is imported. The adapter (vLLM) and the simulator drive a policy through the same calls,
in the same order, from the same step description (`rollout.policy.step`).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import numpy as np

from rollout.policy.config import PolicyConfig
from rollout.policy.length_stats import LengthStats

# Not a policy: vLLM's own scheduler, untouched (no adapter, vLLM's default max_num_seqs); the benchmarks' baseline.
VLLM_DEFAULT = "vllm"


@dataclass
class StepState:
    """What a policy sees of the engine at one scheduling step.

    The per-request arrays are filled only for a policy that `wants_requests` at this step (they cost a pass over
    the requests); waiting requests in queue order, at most the head that the cap could admit, the policy's
    `waiting_limit` allows and the free KV holds plus one request (`rollout.policy.step.describe_requests`)."""

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
    # The largest max_tokens a request of the pass was given (0: not known): no request outputs more.
    max_tokens_bound: int = 0
    # Tokens each request holds (prompt and output so far) and its output tokens so far.
    running_tokens: Any = None
    waiting_tokens: Any = None
    running_generated: Any = None
    waiting_generated: Any = None
    # Output tokens each request has left before it ends: known only where a benchmark imposes every length through
    # max_tokens, so filled only for a policy that `reads_true_lengths` (the oracle); None for every other.
    running_remaining: Any = None
    waiting_remaining: Any = None
    # Predicted output length of each request's prompt relative to the average (None: all 1), from the driver's
    # per-prompt memory of earlier iterations.
    running_scale: Any = None
    waiting_scale: Any = None
    # Prefix caching: the requests of a group (the n samples of a prompt) share its full prompt blocks but the last
    # (`shared_prompt_blocks`). Each request's group id and the prompt tokens in those blocks (None: no prompt of
    # the pass has several samples).
    running_group: Any = None
    waiting_group: Any = None
    running_shared: Any = None
    waiting_shared: Any = None
    # Each request's row in its pass (the number `observe_finished` is given when it ends).
    running_rows: Any = None
    waiting_rows: Any = None
    # For a policy that `backfills`, where the head above does not reach the queue's end: its last requests, the
    # last first (the shortest-predicted where the queue is longest first), which the policy may admit ahead of
    # the head, as it may the head's own later rows (`Policy.backfill`). The waiting head's columns; None where
    # not described.
    tail_tokens: Any = None
    tail_generated: Any = None
    tail_remaining: Any = None
    tail_scale: Any = None
    tail_group: Any = None
    tail_shared: Any = None
    tail_rows: Any = None


def resumes_first(state: StepState, admitted: int) -> bool:
    """Whether the head's first request left out (after `admitted`) was preempted: it holds output tokens. Nothing
    is backfilled past it. A preempted request was admitted before the requests behind it (longest first, the
    pass's end) and has least output of those running; a request admitted past it takes the memory it needs to
    resume, and each finish lets in more of them, so it waits until the queue behind it is gone (up to 390 s of a
    464 s pass in the simulator's tail-bound runs) and ends the pass after the cache has emptied."""
    generated = state.waiting_generated
    return generated is not None and admitted < len(generated) and generated[admitted] > 0


def backfill_candidates(state: StepState, admitted: int) -> tuple[list[int], dict]:
    """Where the head's first `admitted` waiting requests are admitted and the next is not: the later rows of the
    described head, then the tail's (the last first), as queue positions (`Policy.backfill`), and their columns
    (`tokens`, `generated`, `remaining`, `scale`, `group`, `shared`: those the StepState carries)."""
    later = np.arange(admitted + 1, len(state.waiting_tokens))
    positions = later.tolist()
    tail = 0 if state.tail_tokens is None else len(state.tail_tokens)
    positions += [-1 - j for j in range(tail)]
    columns = {}
    for name in ("tokens", "generated", "remaining", "scale", "group", "shared"):
        head, end = getattr(state, f"waiting_{name}"), getattr(state, f"tail_{name}")
        if head is not None:
            columns[name] = head[later] if end is None else np.concatenate([head[later], end])
    return positions, columns


class Policy(ABC):
    """A batch-size policy: asked for the admission cap at a step, told what happens.

    Calls, per step where the policy is asked (see `steady_until`): `wants_requests`, `waiting_limit` (only if it
    wants requests), `batch_cap`, `backfill` (only if it backfills and wanted requests), `token_budget`,
    `steady_until`; after the step, `observe_step`; the finishes of a step are told together (`observe_finished`)
    before the next step asks. The caller clamps the cap to
    [running, b_max] and never lets it evict: lowering it only stops admissions.
    """

    name: ClassVar[str]
    # Whether the StepState must carry the per-request arrays at every asked step (see also `wants_requests`).
    needs_requests: ClassVar[bool] = False
    # Whether the StepState carries each request's remaining output (`*_remaining`): benchmark oracles only.
    reads_true_lengths: ClassVar[bool] = False
    # Benchmark references: valid only where max_tokens imposes each request's true length (ignore_eos).
    benchmark_only: ClassVar[bool] = False
    # Whether the policy admits past a blocked head (`backfill`); the StepState then carries the queue's tail.
    backfills: ClassVar[bool] = False
    # Which running requests the engine preempts first (`rollout.policy.config.PREEMPTION_ORDERS`): vLLM's own order
    # (the last admitted), or the least output or the least computed first; a policy may set it from its config.
    preemption_order: str = "vllm"

    def __init__(self, config: PolicyConfig, stats: LengthStats | None = None, graph_batch: int = 0) -> None:
        self.config = config
        self.stats = stats if stats is not None else LengthStats()
        self.max_cap = config.b_max

    @abstractmethod
    def batch_cap(self, state: StepState) -> int:
        """The admission cap for this step."""

    def start_pass(self, prior=None) -> None:
        """Requests arrive at an idle engine: a new pass over a prompt set (an RL iteration) begins. `prior`:
        expected output lengths of the pass, in the units of the requests' length scales (or None)."""

    def wants_requests(self, state: StepState) -> bool:
        """Whether this step's StepState must carry the per-request arrays."""
        return self.needs_requests

    def steady_until(self) -> float:
        """The step (StepState.step) before which this policy's answers (wants_requests, batch_cap, token_budget)
        stay as it last gave them while no request arrives, is admitted, finishes or is preempted: the caller then
        reuses the cap and does not ask. 0: ask at every step."""
        return 0

    def waiting_limit(self) -> int | None:
        """At most how many waiting requests (the queue's head) the per-request arrays describe; None: as many as
        the cap could admit."""
        return None

    def backfill(self) -> list[int]:
        """The waiting requests that the last `batch_cap`'s cap counts on top of the head's admissions, as queue
        positions: k for the described head's row k (`waiting_*`), -1 - j for the tail's row j (`tail_*`, -1 the
        last). The caller moves them to the queue's front, in this order, so that they are admitted first.
        Backfilling lets requests that fit use the memory a blocked head request (a long one, where the queue is
        longest first) cannot use yet, while the head keeps its place. [] by default."""
        return []

    def token_budget(self, max_step_tokens: int, num_running: int) -> int | None:
        """This step's token budget (chunked prefill), or None to leave vLLM's as configured."""
        return None

    def observe_finished(self, prompt_tokens: int, output_tokens: int, length_scale: float = 1.0,
                         group: int = -1, row: int = -1, aborted: bool = False) -> None:
        """A finished request; `length_scale` is how long its prompt's outputs were predicted to be relative to the
        average (1: nothing known); `group`: the group (prompt) of its sibling samples, -1 if none; `row`: its row in
        the pass, as the StepState's `*_rows` gave it (-1: not known). `aborted`: cancelled before it finished (a
        client that went away, a trainer's abort): it frees its memory, but its length so far is no length of its
        prompt's outputs, and no length statistic learns it."""
        if not aborted:
            self.stats.observe(prompt_tokens, output_tokens)

    def observe_step(self, latency_s: float, decode_requests: int, prefill_tokens: int) -> None:
        """One finished engine step: its latency, how many requests decoded, how many prompt tokens it ran."""

    def observe_preempted(self, computed_tokens: int) -> None:
        """The engine preempted a running request; its `computed_tokens` will be computed again."""

    def trace_fields(self) -> dict:
        """What the policy holds, for the step's trace record."""
        return {"stats_count": self.stats.count}


POLICIES: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    """Class decorator: the policy becomes `policy.name=<cls.name>`."""
    if cls.name in POLICIES or cls.name == VLLM_DEFAULT:
        raise ValueError(f"policy name {cls.name!r} is taken")
    POLICIES[cls.name] = cls
    return cls


def make_policy(config: PolicyConfig | dict, stats: LengthStats | None = None, graph_batch: int = 0) -> Policy:
    """The policy `config.name`, built from its settings. `config` may be the plain dict form of `PolicyConfig`
    (what travels in vLLM's additional_config). `graph_batch`: the engine's largest CUDA-graph decode batch (0: none),
    which `policy.graph_cap` holds the batch at."""
    if isinstance(config, dict):
        config = PolicyConfig.from_dict(config)
    if config.name not in POLICIES:
        raise ValueError(f"unknown policy {config.name!r}; choose one of {sorted(POLICIES)}")
    return POLICIES[config.name](config, stats, graph_batch)


# The methods FallbackPolicy guards, and what each answers once the policy has failed inside it.
_GUARDED = {"start_pass": None, "wants_requests": False, "steady_until": 0, "waiting_limit": None,
            "backfill": [], "token_budget": None, "observe_finished": None, "observe_step": None,
            "observe_preempted": None}


class FallbackPolicy:
    """Runs a policy; if any call raises, warns once and continues with a static cap (over the same statistics) for
    the rest of the run, so a policy bug costs throughput, never the rollout. Answers as `Policy` does."""

    def __init__(self, policy: Policy, fallback_cap: int) -> None:
        self.policy = policy
        self.fallback_cap = fallback_cap
        self.error: str | None = None
        for name, failed in _GUARDED.items():
            setattr(self, name, self._guarded(name, failed))

    def _guarded(self, name: str, failed):
        def call(*args):
            try:
                return getattr(self.policy, name)(*args)
            except Exception as exc:  # noqa: BLE001 - any policy failure degrades to the static cap
                self._fail(exc)
                return failed
        call.__name__ = name
        return call

    def __getattr__(self, name: str):  # name, stats, needs_requests, max_cap, ...: the running policy's
        return getattr(self.policy, name)

    def _fail(self, exc: Exception) -> None:
        self.error = f"{type(exc).__name__}: {exc}"
        logging.getLogger("rollout").warning("policy %s failed (%s); continuing with a static cap of %d",
                                             self.policy.name, self.error, self.fallback_cap)
        # The graph cap's limit while it was still measuring (a probe, or the graph's batch before any eager step)
        # is no decision: the static cap is bounded by what was configured, or by the graph it held.
        limit = self.policy.max_cap
        graph = getattr(self.policy, "graph", None)
        if graph is not None and not graph.held:
            limit = graph.max_cap
        config = replace(self.policy.config, name="static", b_max=limit, static_cap=min(self.fallback_cap, limit))
        self.policy = POLICIES["static"](config, self.policy.stats)

    def batch_cap(self, state: StepState) -> int:
        try:
            return self.policy.batch_cap(state)
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)
            return self.policy.batch_cap(state)

    def trace_fields(self) -> dict:
        fields = self.policy.trace_fields()
        if self.error:
            fields["policy_error"] = self.error
        return fields
