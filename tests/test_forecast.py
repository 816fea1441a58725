"""Length-aware admission from censored length estimates (issue #4), without an engine, and in the simulator."""

import numpy as np
import pytest

from rollout.policy import StepState, make_policy
from rollout.policy.forecast import CensoredLengths, ForecastPolicy, forecast_admissions
from rollout.policy.oracle import oracle_admissions


def test_without_censoring_the_estimate_is_the_empirical_distribution():
    lengths = CensoredLengths(bin_tokens=16)
    rng = np.random.default_rng(0)
    sample = rng.integers(1, 400, 2000)
    for n in sample:
        lengths.observe(int(n))
    remaining, var = lengths.conditional(np.array([0, 200]))
    assert remaining[0] == pytest.approx(sample.mean(), abs=8)  # within half a bin
    tail = sample[sample >= 208]  # bin of 200 starts at 192; conditional mean of what lies past it
    assert remaining[1] == pytest.approx(sample[sample >= 192].mean() - 200, abs=8)
    assert var[0] == pytest.approx(sample.var(), rel=0.05)
    assert len(tail) > 0


def test_running_requests_correct_the_early_short_bias():
    # Half the requests are short (~50) and done, half are long (~600) and still running at 300 tokens.
    lengths = CensoredLengths(bin_tokens=16)
    for n in range(40, 60):
        lengths.observe(n)
    running = np.full(20, 300)
    naive_mean = np.mean(range(40, 60))
    remaining, _ = lengths.conditional(np.concatenate([[0], running]))
    assert remaining[0] > 3 * naive_mean  # E[l_out] counts the long ones that have not finished
    assert np.all(remaining[1:] >= 16)  # a running request past every finished length still has a future


def test_with_exact_means_and_no_spread_admission_matches_the_oracle():
    rng = np.random.default_rng(3)
    for _ in range(50):
        running_tokens = rng.integers(10, 500, 20)
        running_remaining = rng.integers(1, 300, 20)
        waiting_tokens = rng.integers(10, 200, 40)
        waiting_remaining = rng.integers(1, 300, 40)
        capacity = float(rng.integers(5000, 30000))
        expected = oracle_admissions(running_tokens, running_remaining, waiting_tokens, waiting_remaining,
                                     capacity, 16)
        got = forecast_admissions(running_tokens, running_remaining.astype(float), np.zeros(20), waiting_tokens,
                                  waiting_remaining.astype(float), np.zeros(40), capacity, 16, theta=1.645)
        assert got == expected
    # Spread only ever admits fewer.
    spread = forecast_admissions(running_tokens, running_remaining.astype(float), np.full(20, 900.0),
                                 waiting_tokens, waiting_remaining.astype(float), np.full(40, 900.0), capacity, 16,
                                 theta=1.645)
    assert spread <= expected


def test_cold_start_is_algorithm_1_then_forecast():
    policy = make_policy({"name": "forecast", "b_max": 256, "eps_m": 0.05, "min_observations": 4})
    assert isinstance(policy, ForecastPolicy) and policy.needs_requests
    state = StepState(num_running=0, num_waiting=100, kv_capacity_blocks=1000, block_size=16,
                      pending_prompt_tokens_mean=100, pending_max_tokens_mean=1500,
                      running_tokens=np.zeros(0, int), running_remaining=np.zeros(0, int),
                      waiting_tokens=np.full(100, 100), waiting_remaining=np.full(100, 1500),
                      running_generated=np.zeros(0, int), waiting_generated=np.zeros(100, int))
    worst_case = policy.batch_cap(state)
    assert worst_case == 10  # 16,000 tokens / (100 + 1500) per request
    for n in (90, 100, 110, 120):  # short outputs seen: forecast admits far more than the worst case
        policy.observe_finished(100, n)
    assert policy.batch_cap(state) > 5 * worst_case


def test_simulated_kv_bound_workload_preempts_less_than_algorithm_1():
    from rollout.sim.engine import StepTimeModel, simulate
    from rollout.workloads import ProfileConfig, profile_requests

    profile = ProfileConfig(num_prompts=256, prompt_tokens=128, median_output=200, sigma=0.8, max_output=1024)
    requests = [(len(r.prompt.token_ids), r.output_tokens) for r in profile_requests(profile, 0)]
    runs = {}
    for name in ("memory", "forecast"):
        policy = make_policy({"name": name, "b_max": 512, "eps_m": 0.05})
        runs[name] = simulate(requests, policy, kv_capacity_blocks=1024, block_size=16, max_num_seqs=512,
                              token_budget=8192, step_time=StepTimeModel())
        assert runs[name].generated_tokens == sum(out for _, out in requests)
    assert runs["forecast"].recomputed_tokens < runs["memory"].recomputed_tokens
