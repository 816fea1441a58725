"""What preemptions cost: the computed tokens they throw away, and of those, what the resumed requests find again
in the prefix cache or load from host memory (KV offloading). Reads vLLM Request objects, imports nothing of vLLM."""

from __future__ import annotations


class Recomputation:
    """The step's thrown-away tokens, and the preempted requests not resumed yet with the tokens each threw away:
    vLLM keeps their blocks in its prefix cache until they are reused (and with KV offloading in host memory), and
    a resumed request computes again only what its prefix hit lacks."""

    def __init__(self) -> None:
        self.preempted = 0  # requests preempted since the engine started
        self.step_recomputed = 0  # computed tokens thrown away by this step's preemptions
        self.thrown: dict[str, int] = {}

    def new_step(self) -> None:
        self.step_recomputed = 0

    def preempting(self, request) -> None:
        self.step_recomputed += request.num_computed_tokens  # to be prefilled again
        self.thrown[request.request_id] = request.num_computed_tokens
        self.preempted += 1

    def recovered(self, scheduled: dict[str, int], requests: dict) -> int:
        """Of the tokens that preemptions threw away, those the requests resumed by this step (`scheduled`: request
        id -> tokens scheduled) found again: after schedule() a resumed request's computed tokens are its prefix hit
        plus what it was scheduled."""
        if not self.thrown:
            return 0
        recovered = 0
        for request_id in self.thrown.keys() & scheduled.keys():
            hit = requests[request_id].num_computed_tokens - scheduled[request_id]
            recovered += min(max(hit, 0), self.thrown.pop(request_id))
        return recovered

    def forget(self, request_id: str) -> None:
        """The request ended (aborted while preempted: it never resumes)."""
        self.thrown.pop(request_id, None)
