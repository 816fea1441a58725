"""The draft source for tail speculation: what it proposes from siblings, earlier rollouts and a request's own text."""

import random

import pytest

from rollout.drafts import DraftSource, IndexedText

PROMPT = [900, 901, 902, 903]


def test_a_request_gets_what_followed_its_last_tokens_in_a_siblings_output():
    source = DraftSource(key_tokens=2)
    source.track("b", PROMPT + [1, 2, 3, 4, 5, 6, 7])  # a sibling further along
    assert source.propose("a", PROMPT + [1, 2, 3], None, ["a", "b"], k=3) == [4, 5, 6]
    assert source.propose("a", PROMPT + [1, 2, 3, 4, 5, 6], None, ["b"], k=3) == [7]  # what is left of it
    assert source.propose("c", PROMPT + [8, 8, 9], None, ["b"], k=3) == []  # nothing matches
    assert source.propose("d", PROMPT + [1, 2, 3], None, ["b"], k=0) == []


def test_the_longest_match_wins_and_of_equal_ones_siblings_then_the_latest_rollout_then_its_own_text():
    source = DraftSource(key_tokens=2)
    source.track("sibling", [7, 2, 3, 50])  # matches the last two tokens
    source.remember("p", [1, 2, 3, 60])  # matches the last three
    assert source.propose("r", [0, 1, 2, 3], "p", ["sibling"], k=1) == [60]
    source.remember("p", [5, 2, 3, 70])
    # Three matches of two tokens: the sibling's first, then the latest rollout's.
    assert source.propose("s", [0, 9, 2, 3], "p", ["sibling"], k=1) == [50]
    assert source.propose("t", [0, 9, 2, 3], "p", [], k=1) == [70]
    # Its own text: prompt lookup, the latest earlier occurrence.
    assert source.propose("u", [5, 6, 7, 8, 9, 5, 6, 7, 1, 5, 6, 7], None, [], k=2) == [1, 5]


def test_earlier_rollouts_are_kept_per_prompt_within_their_bounds():
    source = DraftSource(key_tokens=2, rollouts_per_prompt=2, prompts=2)
    for value in (10, 11, 12):
        source.remember("p", [1, 2, value])
    assert [text.tokens[-1] for text in source.history["p"]] == [11, 12]  # the latest two
    source.remember("q", [1, 2, 20])
    source.propose("x", [1, 2], "p", [], k=1)  # p used: q is now the least recently used
    source.remember("r", [1, 2, 30])
    assert list(source.history) == ["p", "r"]
    source.track("live", [1, 2, 3])
    source.forget("live")
    assert "live" not in source.live
    with pytest.raises(ValueError):
        DraftSource(key_tokens=4, longest=3)


def brute_force_match(text, context, key_tokens, longest):
    """The longest suffix of `context` (key_tokens..longest tokens) in `text` followed by a token; the latest."""
    for length in range(min(longest, len(context)), key_tokens - 1, -1):
        suffix = context[-length:]
        for start in range(len(text) - length - 1, -1, -1):
            if text[start:start + length] == suffix:
                return length, start + length
    return 0, -1


def test_the_index_kept_as_tokens_arrive_finds_what_a_search_of_the_whole_text_finds():
    rng = random.Random(3)
    for _ in range(300):
        key_tokens, longest = rng.randint(1, 3), rng.randint(3, 8)
        tokens = [rng.randint(0, 3) for _ in range(rng.randint(0, 60))]
        text = IndexedText(key_tokens)
        cut = rng.randint(0, len(tokens))
        text.extend(tokens[:cut])
        text.sync(tokens)  # the rest arrives later, as a running request's output does
        context = tokens[-rng.randint(0, 12):] if rng.random() < 0.5 else [rng.randint(0, 3) for _ in range(10)]
        expected = brute_force_match(tokens, context, key_tokens, longest)
        assert text.best_match(context, longest) == expected, (tokens, context, key_tokens, longest)


def test_measured_acceptance_is_kept_per_prompt_within_the_bound_and_halved_at_a_new_pass():
    source = DraftSource(prompts=2)
    assert source.measured("a") == (0.0, 0.0)
    source.verified("a", 3, 4)
    source.verified("a", 0, 1)
    source.verified("b", 1, 2)
    assert source.measured("a") == (3.0, 5.0)
    source.new_pass()
    assert source.measured("a") == (1.5, 2.5) and source.measured("b") == (0.5, 1.0)
    source.verified("c", 2, 2)  # a third prompt: the least recently verified goes
    assert source.measured("a") == (0.0, 0.0) and source.measured("b") == (0.5, 1.0)
