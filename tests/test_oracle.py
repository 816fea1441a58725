import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from rollout.policy import StepState, make_policy
from rollout.policy.oracle import oracle_admissions, peak_kv_tokens

requests = st.lists(st.tuples(st.integers(1, 300), st.integers(0, 200)), min_size=0, max_size=25)


def brute_peak(current, remaining, block_size):
    """Step the requests one token at a time and take the largest total (whole blocks)."""
    peak = 0
    for t in range(0, max(remaining, default=0) + 1):
        total = sum(-(-(c + t) // block_size) * block_size for c, r in zip(current, remaining) if r >= t)
        peak = max(peak, total)
    return peak


@given(requests, st.sampled_from([1, 16]))
def test_peak_bounds_the_block_rounded_simulation(reqs, block_size):
    current = np.array([c for c, _ in reqs], dtype=np.int64)
    remaining = np.array([r for _, r in reqs], dtype=np.int64)
    peak = peak_kv_tokens(current, remaining, block_size)
    exact = brute_peak(current.tolist(), remaining.tolist(), block_size)
    assert exact <= peak <= exact + len(reqs) * (block_size - 1)
    if block_size == 1:
        assert peak == exact


@given(requests, requests, st.integers(0, 5000))
def test_admissions_are_the_largest_prefix_that_fits(running, waiting, capacity):
    arr = lambda xs, i: np.array([x[i] for x in xs], dtype=np.int64)  # noqa: E731
    m = oracle_admissions(arr(running, 0), arr(running, 1), arr(waiting, 0), arr(waiting, 1), capacity, 1)

    def peak_with(k):
        return brute_peak(arr(running, 0).tolist() + arr(waiting, 0)[:k].tolist(),
                          arr(running, 1).tolist() + arr(waiting, 1)[:k].tolist(), 1)

    assert 0 <= m <= len(waiting)
    if m > 0:
        assert peak_with(m) <= capacity
    if m < len(waiting):
        assert peak_with(m + 1) > capacity


def test_oracle_policy_admits_into_an_empty_engine_and_respects_b_max():
    policy = make_policy({"name": "oracle", "b_max": 4})
    empty = np.array([], dtype=np.int64)
    state = StepState(num_running=0, num_waiting=3, kv_capacity_blocks=1, block_size=16,
                      running_tokens=empty, running_remaining=empty,
                      waiting_tokens=np.array([100, 100, 100]), waiting_remaining=np.array([500, 500, 500]))
    assert policy.batch_cap(state) == 1  # nothing fits, but one request must run
    roomy = StepState(num_running=0, num_waiting=6, kv_capacity_blocks=10000, block_size=16,
                      running_tokens=empty, running_remaining=empty,
                      waiting_tokens=np.full(6, 10), waiting_remaining=np.full(6, 10))
    assert policy.batch_cap(roomy) == 4


def test_the_oracle_order_keeps_a_prompts_samples_together_longest_group_first():
    from rollout.data import Prompt
    from rollout.workloads import Request, longest_first

    prompt = Prompt(prompt_id="p", text="", token_ids=[1])
    # Group 0 holds the longest sample; group 1 the next two; a sort of samples alone would interleave them.
    requests = [Request(prompt, n, g) for n, g in [(50, 0), (400, 1), (900, 0), (300, 1), (10, 2), (600, 1)]]
    ordered = longest_first(requests)
    assert [(r.group, r.output_tokens) for r in ordered] == [(0, 900), (0, 50), (1, 600), (1, 400), (1, 300),
                                                               (2, 10)]


def test_the_oracle_describes_the_queue_head_after_its_first_step():
    # The first step of a pass sees the whole queue; later steps a head twice what it last admitted (>= 256).
    policy = make_policy({"name": "oracle", "b_max": 4096})
    assert policy.waiting_limit() is None
    state = StepState(num_running=0, num_waiting=1000, kv_capacity_blocks=100_000, block_size=16)
    state.running_tokens = state.running_remaining = np.zeros(0, dtype=np.int64)
    state.waiting_tokens, state.waiting_remaining = np.full(1000, 100), np.full(1000, 50)
    assert policy.batch_cap(state) == 1000
    assert policy.waiting_limit() == 2000
    policy.start_pass()
    assert policy.waiting_limit() is None
