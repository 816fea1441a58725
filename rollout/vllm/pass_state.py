"""The requests of the current pass (from requests arriving at an idle engine until none is left), as the policy is
told them. Reads vLLM Request objects, imports nothing of vLLM."""

from __future__ import annotations

from operator import attrgetter

import numpy as np

from rollout.policy.probes import SiblingOrder
from rollout.policy.step import GROUP, NUM_COLUMNS, PassShape, Requests, shared_prompt_blocks

request_id = attrgetter("request_id")
# A request's output so far: the length of its private token list (every supported vLLM keeps one behind the
# num_output_tokens property; rollout.vllm.versions checks it) is read without a Python call per request.
output_list = attrgetter("_output_token_ids")
computed = attrgetter("num_computed_tokens")


def started(requests) -> list[bool]:
    """Whether each request computed or generated anything (a preempted one did): such a request keeps its
    place in the waiting queue. Attribute reads without a Python call per request: a first pass of 2,048 requests
    may reorder ~100 times."""
    return [bool(a or b) for a, b in zip(map(len, map(output_list, requests)), map(computed, requests))]


class PassState:
    """Running sums for the cold-start demand estimate, kept O(1) per step, and a table row per request
    (`rollout.policy.step` columns) of what does not change while it runs, so that describing requests to the
    policy reads two attributes per request (output so far, id) instead of five.

    Invariant: every request of the pass has a row from `arrive` until the pass's last `finish`."""

    def __init__(self, share_prompts: bool, block_size: int) -> None:
        # Prefix caching shares a prompt's full blocks among the requests that carry it (GRPO's n samples).
        self.share_prompts = share_prompts
        self.block_size = block_size
        self.pending = 0  # requests arrived and not finished
        self.pending_prompt_tokens = 0
        self.pending_max_tokens = 0  # as the policy is told them (nominal)
        self.max_tokens_bound = 0  # the pass's largest max_tokens: no request outputs more
        self.scaled = False  # some request of the pass carried a predicted length scale
        self.groups: dict[int, int] = {}  # hash of a prompt's tokens -> its group id in the pass
        self.grouped_requests = 0  # requests of the pass with a group (prompt ids known, prefix caching on)
        self.rows: dict[str, int] = {}
        self.table = np.zeros((1024, NUM_COLUMNS))
        self.sibling_order = SiblingOrder()

    @property
    def shape(self) -> PassShape:
        # A prompt of one sample tells its siblings nothing: groups count only where some prompt has several.
        return PassShape(len(self.groups) < self.grouped_requests, len(self.groups), self.scaled)

    def mean_pending(self) -> tuple[float, float]:
        """The mean prompt tokens and nominal max_tokens of the requests not finished."""
        count = max(self.pending, 1)
        return self.pending_prompt_tokens / count, self.pending_max_tokens / count

    def arrive(self, request, nominal: int, scale: float) -> bool:
        """A request of the pass arrived; True if it opens the pass."""
        opens = self.pending == 0
        if opens:
            self.max_tokens_bound = 0
            self.scaled = False
        self.pending += 1
        self.pending_prompt_tokens += request.num_prompt_tokens
        self.pending_max_tokens += nominal
        self.max_tokens_bound = max(self.max_tokens_bound, nominal)
        self.scaled = self.scaled or scale != 1.0
        group, shared = -1, 0
        if self.share_prompts and request.prompt_token_ids is not None:
            group = self.groups.setdefault(hash(tuple(request.prompt_token_ids)), len(self.groups))
            shared = shared_prompt_blocks(request.num_prompt_tokens, self.block_size) * self.block_size
            self.grouped_requests += 1
        row = self.rows.setdefault(request.request_id, len(self.rows))
        if row >= len(self.table):
            self.table = np.concatenate([self.table, np.zeros_like(self.table)])
        self.table[row] = (request.num_prompt_tokens, request.max_tokens, group, shared, scale)
        return opens

    def finish(self, request, nominal: int) -> tuple[int, int]:
        """A request of the pass ended: its (row, group) as the policy is told them (-1: none)."""
        self.pending -= 1
        self.pending_prompt_tokens -= request.num_prompt_tokens
        self.pending_max_tokens -= nominal
        row = self.rows.get(request.request_id)
        grouped = len(self.groups) < self.grouped_requests
        group = int(self.table[row, GROUP]) if row is not None and grouped else -1
        if self.pending == 0:  # rows and groups are a pass's
            self.groups.clear()
            self.grouped_requests = 0
            self.rows.clear()
            self.sibling_order.forget()
        return (-1 if row is None else row), group

    def requests(self, requests: list) -> Requests:
        """`requests` (vLLM Request objects of the pass, in order) as the step description's arrays."""
        n = len(requests)
        generated = np.fromiter(map(len, map(output_list, requests)), np.int64, n)
        rows = np.fromiter(map(self.rows.__getitem__, map(request_id, requests)), np.int64, n)
        return Requests(generated, rows, self.table[rows])
