import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from rollout.policy import PolicyConfig, StepState, make_policy
from rollout.policy.oracle import oracle_admissions, peak_kv_tokens

requests = st.lists(st.tuples(st.integers(1, 300), st.integers(0, 200)), min_size=0, max_size=25)


def brute_peak(current, remaining, block_size, horizon=None):
    """Step the requests one token at a time and take the largest total (whole blocks), up to `horizon` steps."""
    peak = 0
    for t in range(0, min(max(remaining, default=0), 10 ** 9 if horizon is None else horizon) + 1):
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


@given(requests, st.integers(1, 250))
def test_the_peak_within_a_horizon_is_the_largest_demand_up_to_it(reqs, horizon):
    current = np.array([c for c, _ in reqs], dtype=np.int64)
    remaining = np.array([r for _, r in reqs], dtype=np.int64)
    assert peak_kv_tokens(current, remaining, 1, horizon=horizon) == brute_peak(current.tolist(), remaining.tolist(),
                                                                                1, horizon)


def test_the_oracle_takes_the_forecasts_horizon_and_order_of_preemption():
    """Past its horizon the oracle, like the forecast, lets admitted requests outrun the cache: two requests of 16
    prompt tokens and 600 output tokens, 50 blocks of 16 tokens. Within a horizon of 200 tokens both fit (and
    vLLM then preempts the one that generated less); to their end (39 blocks each) only one does."""
    state = StepState(num_running=0, num_waiting=2, kv_capacity_blocks=50, block_size=16)
    state.running_tokens = state.running_remaining = np.zeros(0, dtype=np.int64)
    state.waiting_tokens, state.waiting_remaining = np.full(2, 16), np.full(2, 600)
    caps = {horizon: make_policy({"name": "oracle", "b_max": 8, "forecast_min_wave": 0.0,
                                  "forecast_horizon_tokens": horizon}).batch_cap(state) for horizon in (0, 200)}
    assert caps == {0: 1, 200: 2}
    assert make_policy({"name": "oracle", "b_max": 8}).preemption_order == "least_output"


@given(requests, requests, st.integers(0, 5000))
def test_admissions_are_the_largest_prefix_that_fits(running, waiting, capacity):
    arr = lambda xs, i: np.array([x[i] for x in xs], dtype=np.int64)  # noqa: E731
    m = oracle_admissions(arr(running, 0), arr(running, 1), arr(waiting, 0), arr(waiting, 1), capacity, 1)

    def peak_with(k):
        return brute_peak(arr(running, 0).tolist() + arr(waiting, 0)[:k].tolist(),
                          arr(running, 1).tolist() + arr(waiting, 1)[:k].tolist(), 1)

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


def _crowded(num_running: int, fits: int) -> StepState:
    """`num_running` requests 10 tokens from their end (the peak) and a queue of which exactly `fits` fit."""
    running_tokens = np.full(num_running, 100)
    state = StepState(num_running=num_running, num_waiting=50, kv_capacity_blocks=(num_running + fits) * 110 + 50,
                      block_size=1, running_tokens=running_tokens, running_remaining=np.full(num_running, 10),
                      waiting_tokens=np.full(50, 100), waiting_remaining=np.full(50, 100))
    return state


def test_the_oracle_admits_in_waves_and_searches_again_only_after_finishes():
    policy = make_policy({"name": "oracle", "b_max": 1024})  # min_wave 0.08: 8 of 100 running
    assert policy.batch_cap(_crowded(100, 3)) == 100  # 3 fit now: too few, they wait for the wave
    later = StepState(num_running=100, num_waiting=50, kv_capacity_blocks=1, block_size=1)
    assert not policy.wants_requests(later)  # true lengths: no finish, the same answer
    assert policy.batch_cap(later) == 100  # and no request starts that the search did not admit
    for _ in range(4):
        policy.observe_finished(100, 100)
    assert not policy.wants_requests(later)
    policy.observe_finished(100, 100)  # 3 fitted, a wave is 8: five finishes later it looks again
    assert policy.wants_requests(later)
    assert policy.batch_cap(_crowded(100, 8)) == 108
    trickle = make_policy({"name": "oracle", "b_max": 1024, "forecast_min_wave": 0.0})
    assert trickle.batch_cap(_crowded(100, 3)) == 103
    assert trickle.wants_requests(later)  # without waves it searches at every step


def test_between_searches_the_oracle_admits_only_what_its_last_search_did():
    policy = make_policy({"name": "oracle", "b_max": 1024})
    assert policy.batch_cap(_crowded(100, 20)) == 120
    # The token budget let 12 of them start; one request finished (the search is due at the next step).
    policy.observe_finished(100, 100)
    partly = StepState(num_running=111, num_waiting=38, kv_capacity_blocks=1, block_size=1)
    assert policy.batch_cap(partly) == 119  # the 8 admitted that have not started, not the freed place


def test_in_waves_the_oracle_still_preempts_nothing_and_leaves_the_decode_graph_less_often():
    from rollout.sim import StepTimeModel, simulate

    rng = np.random.default_rng(0)
    requests = [(64, int(n)) for n in np.clip(rng.lognormal(np.log(120), 0.8, 400), 1, 600)]
    model = StepTimeModel(base=5e-3, per_seq=2e-5, per_kv_token=0.0, per_prefill_token=1.7e-5, per_mixed_step=5e-3)

    class Counting(type(make_policy({"name": "oracle", "b_max": 8}))):
        prefill_steps = 0

        def observe_step(self, latency_s, decode_requests, prefill_tokens):
            self.prefill_steps += prefill_tokens > 0

    runs = {}
    for min_wave in (0.0, 0.08):
        policy = Counting(PolicyConfig(name="oracle", b_max=256, forecast_min_wave=min_wave))
        result = simulate(requests, policy, kv_capacity_blocks=600, block_size=16, max_num_seqs=256,
                          token_budget=8192, step_time=model)
        assert result.preemptions == 0 and result.generated_tokens == sum(n for _, n in requests)
        runs[min_wave] = (policy.prefill_steps, result.tokens_per_s)
    assert runs[0.08][0] < runs[0.0][0] / 2, runs
    assert runs[0.08][1] > runs[0.0][1], runs


def test_the_oracle_searches_again_when_the_whole_queue_it_saw_fitted():
    """vLLM's front end hands a pass to the engine over its first step: the oracle sees a few requests, all fit.
    Waiting for a finish would hold those few alone until the first of them ended."""
    policy = make_policy({"name": "oracle", "b_max": 1024})
    first = StepState(num_running=0, num_waiting=4, kv_capacity_blocks=100_000, block_size=16)
    first.running_tokens = first.running_remaining = np.zeros(0, dtype=np.int64)
    first.waiting_tokens, first.waiting_remaining = np.full(4, 100), np.full(4, 4000)
    assert policy.batch_cap(first) == 4
    arrived = StepState(num_running=4, num_waiting=500, kv_capacity_blocks=100_000, block_size=16)
    assert policy.wants_requests(arrived)


def test_requests_that_reach_the_engine_after_its_first_step_wait_for_no_finish_under_the_oracle():
    from rollout.sim import StepTimeModel, simulate

    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(120), 0.8, 300), 1, 800)
    requests = sorted(((64, int(n)) for n in lengths), key=lambda r: -r[1])  # longest first, as the oracle's
    model = StepTimeModel(base=5e-3, per_seq=2e-5, per_kv_token=0.0, per_prefill_token=1.7e-5, per_mixed_step=5e-3)
    runs = {}
    for at_first_step in (None, 3):
        result = simulate(requests, make_policy({"name": "oracle", "b_max": 256}), kv_capacity_blocks=600,
                          block_size=16, max_num_seqs=256, token_budget=8192, step_time=model, keep_trace=True,
                          requests_at_first_step=at_first_step)
        assert result.generated_tokens == sum(n for _, n in requests)
        runs[at_first_step] = result
    assert runs[3].trace[0][1] == 3  # the simulator's engine held three requests at its first step
    assert runs[3].trace[1][1] > 3  # and admitted more at the next, with the longest of the three far from done
    assert runs[3].makespan_s < runs[None].makespan_s * 1.01


@given(requests, requests, st.integers(0, 5000))
def test_backfill_takes_each_tail_request_that_still_fits_beside_the_running_and_those_taken(running, tail, capacity):
    from rollout.policy.oracle import oracle_backfill

    arr = lambda xs, i: np.array([x[i] for x in xs], dtype=np.int64)  # noqa: E731
    picks = oracle_backfill(arr(running, 0), arr(running, 1), arr(tail, 0), arr(tail, 1), capacity, 1)
    taken: list[int] = []
    for k in range(len(tail)):  # first fit, by the brute-force peak
        rows = taken + [k]
        peak = brute_peak(arr(running, 0).tolist() + arr(tail, 0)[rows].tolist(),
                          arr(running, 1).tolist() + arr(tail, 1)[rows].tolist(), 1)
        if peak <= capacity:
            taken.append(k)
    assert picks == taken


def blocked_long_head() -> StepState:
    """One long request runs; the next long one cannot fit beside it at its peak; four requests wait at the
    queue's end, three of them short."""
    return StepState(num_running=1, num_waiting=5, kv_capacity_blocks=100, block_size=16,
                     running_tokens=np.array([200]), running_remaining=np.array([1200]),
                     waiting_tokens=np.array([100]), waiting_remaining=np.array([1500]),
                     tail_tokens=np.array([50, 50, 50, 50]), tail_remaining=np.array([40, 40, 40, 2000]),
                     tail_rows=np.arange(4))


def test_a_blocked_long_head_lets_the_short_tail_in_and_never_preempts():
    # One long request runs; the next long cannot fit beside it at its peak. Short requests at the queue's end
    # end long before the running one needs the memory: the oracle admits them ahead of the blocked head.
    policy = make_policy({"name": "oracle", "b_max": 64, "forecast_min_wave": 0.0})
    state = blocked_long_head()
    assert policy.batch_cap(state) == 1 + 3
    assert policy.backfill() == [-1, -2, -3]  # queue positions, the last first; the fourth fits no better


def test_nothing_is_backfilled_past_a_preempted_head():
    # The same queue, but the blocked head was preempted (it holds 30 output tokens): the short tail would take the
    # memory it needs to resume, and while requests keep finishing it would wait for the whole queue behind it.
    policy = make_policy({"name": "oracle", "b_max": 64, "forecast_min_wave": 0.0})
    state = blocked_long_head()
    state.waiting_generated = np.array([30])
    state.tail_generated = np.zeros(4, dtype=np.int64)
    assert policy.batch_cap(state) == 1
    assert policy.backfill() == []
    state.waiting_generated = np.array([0])  # never started: passed as before
    assert policy.batch_cap(state) == 1 + 3


def test_a_cap_without_a_search_counts_no_earlier_backfill():
    policy = make_policy({"name": "oracle", "b_max": 64, "forecast_min_wave": 0.0})
    blocked = blocked_long_head()
    policy.batch_cap(blocked)
    assert policy.backfill() == [-1, -2, -3]
    empty = np.array([], dtype=np.int64)
    drained = StepState(num_running=4, num_waiting=0, kv_capacity_blocks=100, block_size=16,
                        running_tokens=np.full(4, 60), running_remaining=np.full(4, 5),
                        waiting_tokens=empty, waiting_remaining=empty)
    policy.batch_cap(drained)
    assert policy.backfill() == []  # those positions are of a queue that has changed since
