"""How many draft tokens a request verifies, from the acceptance its prompt's drafts have met (no vLLM import).

A verify step accepts a request's drafts up to the first rejection. With a per-token acceptance alpha (the standard
geometric model), k drafts bring alpha + alpha^2 + ... + alpha^k accepted tokens a step. A draft token is tested
where it is accepted or is the first rejected, so alpha's maximum-likelihood estimate is accepted / tested, here
with a uniform Beta(1, 1) prior: a prompt without drafts so far starts at 1/2.
"""

from __future__ import annotations


def tokens_tested(drafted: int, accepted: int) -> int:
    """Draft tokens a verify step tested: the accepted ones and, where one was rejected, that one."""
    return accepted + (1 if accepted < drafted else 0)


def expected_accepted(alpha: float, k: int) -> float:
    """Accepted tokens a verify step of k drafts brings, each accepted with probability alpha until the first
    rejection."""
    return sum(alpha ** i for i in range(1, k + 1))


def draft_length(accepted: float, tested: float, k_max: int, min_gain: float) -> int:
    """k_max where the drafts of a prompt whose drafts so far had `accepted` of `tested` tokens accepted are expected
    to bring at least `min_gain` accepted tokens a verify step of k_max, else 0 (no drafts: no verify cost)."""
    alpha = (accepted + 1.0) / (tested + 2.0)
    return k_max if k_max > 0 and expected_accepted(alpha, k_max) >= min_gain else 0
