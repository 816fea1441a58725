"""Draft tokens for speculative decoding that need no draft model: text a request is likely to repeat.

In RL rollouts the same prompts come back every iteration with n samples each, so a request's continuation often
appears already in its siblings' outputs (the other samples of its prompt, running or finished), in the prompt's
rollouts of earlier iterations, or in its own prompt and output (RhymeRL's history drafts, Seer's sibling drafts,
prompt lookup). `DraftSource` finds the longest recent match of a request's last tokens in those texts and
proposes the tokens that followed it. It holds plain token lists and no vLLM object: the scheduler asks it each
step for the requests it lets speculate.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable, Sequence


@dataclass
class IndexedText:
    """A token list that grows at its end, with the positions of each `key_tokens`-gram in it (latest last), kept up
    to date as tokens arrive: a lookup costs the matches of the request's last tokens, not the text's length."""

    key_tokens: int
    tokens: list[int] = field(default_factory=list)
    starts: dict[tuple, list[int]] = field(default_factory=dict)

    def extend(self, tokens: Sequence[int]) -> None:
        first_new = len(self.tokens)
        self.tokens.extend(tokens)
        n = self.key_tokens
        for start in range(max(first_new - n + 1, 0), len(self.tokens) - n + 1):
            self.starts.setdefault(tuple(self.tokens[start:start + n]), []).append(start)

    def sync(self, tokens: Sequence[int]) -> None:
        """Catch up with `tokens`, of which this text is a prefix (a running request's tokens so far)."""
        if len(tokens) > len(self.tokens):
            self.extend(tokens[len(self.tokens):])

    def best_match(self, context: Sequence[int], longest: int) -> tuple[int, int]:
        """(match length, position after the match) of the longest suffix of `context`, up to `longest` tokens and
        at least `key_tokens`, that occurs here followed by at least one token; of equally long ones the latest.
        (0, -1) where none. Where this text is the context itself, its own end is no match (nothing follows it)."""
        n = self.key_tokens
        if len(context) < n:
            return 0, -1
        limit = len(self.tokens) - 1  # a match must leave a token to propose
        best, after = 0, -1
        for start in reversed(self.starts.get(tuple(context[-n:]), ())):
            end = start + n  # the match is tokens[start:end]
            if end > limit:
                continue
            length = n
            while length < longest and start - (length - n) > 0 and length < len(context) and \
                    self.tokens[start - (length - n) - 1] == context[-length - 1]:
                length += 1
            if length > best:
                best, after = length, end
                if length >= longest:
                    break
        return best, after


class DraftSource:
    """Drafts from a request's siblings, its prompt's earlier rollouts and its own text (prompt and output).

    `remember` keeps a finished rollout under its prompt's key for later passes: at most `rollouts_per_prompt` of
    them (the latest) for at most `prompts` prompts (the least recently used go first), so the memory stays bounded
    however long training runs. `propose` matches the request's last tokens (`key_tokens` at least, `longest` at
    most) in every text it is given and returns up to k tokens that followed the longest match; of equally long
    ones, the first source in the order siblings, earlier rollouts, own text. `verified` keeps, per prompt and
    within the same bound on prompts, how many draft tokens its requests' verify steps accepted of those they
    tested: what the scheduler sets the drafts' length from (rollout.policy.speculation)."""

    def __init__(self, key_tokens: int = 3, longest: int = 16, rollouts_per_prompt: int = 16,
                 prompts: int = 4096) -> None:
        if key_tokens < 1 or longest < key_tokens:
            raise ValueError(f"need 1 <= key_tokens <= longest, got {key_tokens} and {longest}")
        self.key_tokens, self.longest = key_tokens, longest
        self.rollouts_per_prompt, self.prompts = rollouts_per_prompt, prompts
        self.history: OrderedDict[str, list[IndexedText]] = OrderedDict()
        self.live: dict[str, IndexedText] = {}  # request id -> its tokens so far (prompt and output), indexed
        # Prompt key -> [accepted, tested] draft tokens of its requests' verify steps, for as many prompts.
        self.acceptance: OrderedDict[str, list[float]] = OrderedDict()

    def remember(self, prompt_key: str, output_tokens: Sequence[int]) -> None:
        """A finished rollout of the prompt `prompt_key`, kept for its later passes."""
        text = IndexedText(self.key_tokens)
        text.extend(output_tokens)
        kept = self.history.setdefault(prompt_key, [])
        kept.append(text)
        del kept[:-self.rollouts_per_prompt]
        self.history.move_to_end(prompt_key)
        while len(self.history) > self.prompts:
            self.history.popitem(last=False)

    def verified(self, prompt_key: str, accepted: int, tested: int) -> None:
        """A verify step of a request of `prompt_key` accepted `accepted` of the `tested` draft tokens."""
        counts = self.acceptance.setdefault(prompt_key, [0.0, 0.0])
        counts[0] += accepted
        counts[1] += tested
        self.acceptance.move_to_end(prompt_key)
        while len(self.acceptance) > self.prompts:
            self.acceptance.popitem(last=False)

    def measured(self, prompt_key: str) -> tuple[float, float]:
        """Accepted and tested draft tokens of `prompt_key` so far (0, 0 where none)."""
        accepted, tested = self.acceptance.get(prompt_key, (0.0, 0.0))
        return accepted, tested

    def new_pass(self) -> None:
        """A pass starts, with new weights since the last: the acceptance measured so far counts half."""
        for counts in self.acceptance.values():
            counts[0] /= 2
            counts[1] /= 2

    def track(self, request_id: str, tokens: Sequence[int]) -> IndexedText:
        """The indexed text of a running request, caught up with its `tokens` so far."""
        text = self.live.get(request_id)
        if text is None:
            text = self.live[request_id] = IndexedText(self.key_tokens)
        text.sync(tokens)
        return text

    def forget(self, request_id: str) -> None:
        """A request that ended: its live text goes (`remember` keeps what later passes need)."""
        self.live.pop(request_id, None)

    def propose(self, request_id: str, tokens: Sequence[int], prompt_key: str | None, siblings: Iterable[str],
                k: int) -> list[int]:
        """Up to k draft tokens for the request `request_id` whose tokens so far are `tokens`: what followed the
        longest match of its last tokens among its running `siblings` (request ids tracked here), the earlier
        rollouts of `prompt_key`, and its own earlier text. [] where nothing matches."""
        if k <= 0:
            return []
        own = self.track(request_id, tokens)
        sources = [self.live[s] for s in siblings if s != request_id and s in self.live]
        if prompt_key is not None and prompt_key in self.history:
            self.history.move_to_end(prompt_key)
            sources += reversed(self.history[prompt_key])  # the latest rollout first
        sources.append(own)
        best, draft = 0, []
        for text in sources:
            length, after = text.best_match(tokens, self.longest)
            if length > best:
                best, draft = length, text.tokens[after:after + k]
                if length >= self.longest:
                    break
        return list(draft)
