"""The draft length from measured acceptance (rollout.policy.speculation): pure functions, no vLLM."""

import pytest

from rollout.policy.speculation import draft_length, expected_accepted, tokens_tested


def test_a_rejection_is_a_tested_token_and_a_full_acceptance_is_not_followed_by_one():
    assert tokens_tested(4, 4) == 4
    assert tokens_tested(4, 1) == 2  # one accepted, the second rejected, the last two never tested
    assert tokens_tested(4, 0) == 1


def test_expected_accepted_tokens_follow_the_geometric_model():
    assert expected_accepted(0.5, 3) == pytest.approx(0.5 + 0.25 + 0.125)
    assert expected_accepted(1.0, 4) == 4
    assert expected_accepted(0.3, 0) == 0


@pytest.mark.parametrize("accepted, tested, k", [
    (0, 0, 4),      # nothing measured yet: the prior's 1/2 brings 0.94 tokens, above 0.5
    (70, 100, 4),   # alpha 0.7: 1.7 tokens a step
    (1, 10, 0),     # alpha 1/6: 0.2 tokens, below the gain a verify step must bring
    (14, 100, 0),   # the acceptance measured on SmolLM2 at temperature 1 (docs/results.md)
])
def test_drafts_go_where_the_measured_acceptance_pays_for_them(accepted, tested, k):
    assert draft_length(accepted, tested, 4, min_gain=0.5) == k


def test_no_minimum_gain_always_drafts_and_no_draft_tokens_never():
    assert draft_length(0, 1000, 4, min_gain=0.0) == 4
    assert draft_length(1000, 1000, 0, min_gain=0.0) == 0
