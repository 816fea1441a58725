"""Tail speculation from the scheduler (policy.spec_draft_tokens): drafts it chooses for the requests it lets
speculate, where vLLM takes drafts from the scheduler (its `custom_class` speculative method, 0.24-0.33). vLLM
verifies what each request's `spec_token_ids` holds at schedule(); the worker's proposer (`NoWorkerDrafts`)
proposes none. Reads and sets vLLM Request objects, imports nothing of vLLM."""

from __future__ import annotations

from rollout.drafts import DraftSource
from rollout.policy.length_stats import prompt_key
from rollout.policy.speculation import draft_length, tokens_tested


class TailDrafts:
    """Each decoding request's drafts for a step where at most `max_batch` run, none elsewhere: from its running
    siblings (the same prompt), its prompt's earlier rollouts and its own text; the length per prompt from what
    its drafts were accepted at."""

    def __init__(self, draft_tokens: int, max_batch: int, min_gain: float) -> None:
        self.draft_tokens = draft_tokens
        self.max_batch = max_batch
        self.min_gain = min_gain
        self.source = DraftSource()
        self.drafted = False  # whether the last step set drafts

    def new_pass(self) -> None:
        self.source.new_pass()

    def set(self, running: list, keys: dict[str, str]) -> None:
        """The drafts of this step's `running` requests; `keys` maps request ids to their prompts' keys (filled
        here for requests without one)."""
        if len(running) > self.max_batch:
            if self.drafted:  # drafts set for a request vLLM did not schedule stay until cleared
                for request in running:
                    request.spec_token_ids = []
                self.drafted = False
            return  # otherwise the worker's proposer (none) left every request without drafts
        self.drafted = True
        groups: dict[str, list[str]] = {}
        for request in running:
            key = keys.get(request.request_id)
            if key is None:
                key = keys[request.request_id] = prompt_key(request.prompt_token_ids)
            groups.setdefault(key, []).append(request.request_id)
            self.source.track(request.request_id, request.all_token_ids)
        for request in running:
            if request.is_prefill_chunk or not request.num_output_tokens:
                request.spec_token_ids = []
                continue
            key = keys[request.request_id]
            room = request.max_tokens - request.num_output_tokens - 1  # drafts past max_tokens are never used
            k = draft_length(*self.source.measured(key), self.draft_tokens, self.min_gain)
            request.spec_token_ids = self.source.propose(request.request_id, request.all_token_ids, key,
                                                         groups[key], min(k, max(room, 0)))

    def step_verified(self, key: str | None, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """vLLM verified a request's drafts (of the prompt `key`, None: unknown) in the step being read."""
        if key is not None:
            self.source.verified(key, num_accepted_tokens, tokens_tested(num_draft_tokens, num_accepted_tokens))

    def finished(self, request, key: str | None) -> None:
        """A request ended: its output kept as drafts for its prompt's later requests."""
        key = key or prompt_key(request.prompt_token_ids)
        if request.num_output_tokens:
            self.source.remember(key, list(request.output_token_ids))
        self.source.forget(request.request_id)


class NoWorkerDrafts:
    """vLLM's `custom_class` proposer for the worker when the scheduler drafts: it proposes nothing, so the drafts
    verified are the ones the scheduler puts in each request's `spec_token_ids`."""

    def __init__(self, vllm_config) -> None:
        pass

    def load_model(self, model) -> None:
        pass

    def propose(self, sampled_token_ids, *args, **kwargs) -> list[list[int]]:
        return [[] for _ in sampled_token_ids]
