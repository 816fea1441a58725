import math

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from rollout.policy import (CLTPolicy, FallbackPolicy, LengthStats, MemoryPolicy, PolicyConfig, StaticPolicy, StepState,
                            clamp_cap, clt_batch_bound, make_policy, memory_batch_size, overflow_quantile, safety_buffer)

capacity = st.floats(min_value=1.0, max_value=1e6)
mean = st.floats(min_value=0.05, max_value=5e3)
std = st.floats(min_value=0.0, max_value=5e3)
eps = st.floats(min_value=1e-4, max_value=0.5)


def fits(b: int, kv: float, mu: float, sigma: float, theta: float) -> bool:
    return b * mu + theta * sigma * math.sqrt(b) <= kv * (1 + 1e-9) + 1e-9


@given(capacity, mean, std, eps)
def test_closed_form_is_the_largest_feasible_batch(kv, mu, sigma, eps_m):
    theta = overflow_quantile(eps_m)
    bound = clt_batch_bound(kv, mu, sigma, theta)
    b = math.floor(bound)
    assume(b < 200000)
    # Brute force: scan b upward from 0 while the CLT constraint holds.
    brute = 0
    while fits(brute + 1, kv, mu, sigma, theta):
        brute += 1
    assert abs(b - brute) <= 1  # floating-point ties at the boundary
    if b > 0:
        assert fits(b, kv, mu, sigma, theta)


@given(capacity, mean, std, eps)
def test_safety_buffer_is_the_fluctuation_reserve(kv, mu, sigma, eps_m):
    theta = overflow_quantile(eps_m)
    bound = clt_batch_bound(kv, mu, sigma, theta)
    buffer = safety_buffer(kv, mu, sigma, theta)
    assert buffer == pytest.approx(theta * sigma * math.sqrt(bound), rel=1e-6, abs=1e-6 * kv)
    assert 0.0 <= buffer <= kv * (1 + 1e-9)
    # Algorithm 1 with a fresh buffer reproduces the CLT bound.
    assert abs(memory_batch_size(kv, buffer, mu) - math.floor(bound)) <= 1


def test_known_values():
    theta = overflow_quantile(0.05)
    assert theta == pytest.approx(1.6448536, rel=1e-6)
    # 100 requests of mean 10, std 10 blocks: 100*10 + 1.645*10*10 = 1164.5 blocks.
    assert clt_batch_bound(1164.4853627, 10.0, 10.0, theta) == pytest.approx(100.0, rel=1e-6)
    assert clt_batch_bound(1000, 10, 0.0, theta) == pytest.approx(100.0)
    assert memory_batch_size(1000, 164.5, 10) == 83


@pytest.mark.parametrize("bad", [0.0, 1.0, -0.1, 1.5])
def test_eps_outside_open_unit_interval_rejected(bad):
    with pytest.raises(ValueError, match="eps_m"):
        overflow_quantile(bad)


@given(st.floats(allow_nan=True, allow_infinity=True), st.integers(0, 5000), st.integers(1, 64),
       st.integers(64, 4096))
def test_clamp_bounds(b, running, lo, hi):
    cap = clamp_cap(b, running, lo, hi)
    assert isinstance(cap, int)
    assert cap <= hi
    assert cap >= min(max(running, lo), hi)
    if not math.isnan(b) and max(running, lo) <= b <= hi:  # within the bounds: the batch size itself
        assert cap == math.floor(b)


def state(running=10, waiting=50, kv=1000, bs=16, prompt=100.0, max_tokens=400.0):
    return StepState(num_running=running, num_waiting=waiting, kv_capacity_blocks=kv, block_size=bs,
                     pending_prompt_tokens_mean=prompt, pending_max_tokens_mean=max_tokens)


def test_cold_start_uses_prompt_plus_max_tokens():
    policy = MemoryPolicy(PolicyConfig(name="memory", eps_m=0.05, b_max=512, min_observations=8))
    # 100 + 400 tokens = 32 blocks of 16 tokens; no spread known yet, so no buffer.
    assert policy.batch_cap(state(running=1)) == 1000 // 32
    assert policy.safety_buffer_blocks == 0.0


def test_cap_kept_when_nothing_waits_or_nothing_runs():
    policy = MemoryPolicy(PolicyConfig(name="memory", eps_m=0.05, b_max=512))
    assert policy.batch_cap(state(running=0, waiting=0)) == 512  # nothing to size yet
    first = policy.batch_cap(state(running=0))  # b_0: the first wave is sized from the cold-start demand
    assert first == 1000 // 32
    assert policy.batch_cap(state(running=5, waiting=0, kv=10)) == first
    assert policy.batch_cap(state(running=0, waiting=100, kv=10)) == first
    assert policy.batch_cap(state(running=1, waiting=100, kv=64)) == 2


def test_a_new_pass_sizes_its_first_wave_afresh():
    policy = MemoryPolicy(PolicyConfig(name="memory", eps_m=0.05, b_max=512))
    assert policy.batch_cap(state(running=0)) == 1000 // 32
    # Within a pass nothing running keeps b_{t-1}; a new pass (longer max_tokens here) sizes b_0 again.
    longer = state(running=0, max_tokens=1500.0)  # 100 + 1,500 tokens: 100 blocks
    assert policy.batch_cap(longer) == 1000 // 32
    policy.start_pass()
    assert policy.batch_cap(longer) == 1000 // 100


def test_buffer_refreshed_every_k_finished_requests():
    stats = LengthStats()
    policy = MemoryPolicy(PolicyConfig(name="memory", eps_m=0.05, b_max=4096, update_every=4, min_observations=2),
                          stats)
    for length in (100, 300):
        policy.observe_finished(50, length)
    policy.batch_cap(state(kv=4000))
    buffer = policy.safety_buffer_blocks
    assert buffer > 0
    for length in (1000, 20, 1500):  # three finishes: not yet K=4
        policy.observe_finished(50, length)
        policy.batch_cap(state(kv=4000))
        assert policy.safety_buffer_blocks == buffer
    policy.observe_finished(50, 900)
    policy.batch_cap(state(kv=4000))
    mean, var = stats.demand_blocks(16)
    assert policy.safety_buffer_blocks == pytest.approx(safety_buffer(4000, mean, math.sqrt(var), policy.theta))
    assert policy.safety_buffer_blocks != buffer


def test_clt_policy_recomputes_every_step():
    stats = LengthStats()
    for length in range(50, 2000, 37):
        stats.observe(40, length)
    policy = CLTPolicy(PolicyConfig(name="memory-clt", eps_m=0.01, b_max=4096), stats)
    mean, var = stats.demand_blocks(16)
    expected = math.floor(clt_batch_bound(3000, mean, math.sqrt(var), overflow_quantile(0.01)))
    assert policy.batch_cap(state(running=2, kv=3000)) == expected


@given(st.lists(st.tuples(st.integers(1, 2000), st.integers(0, 4000)), max_size=40),
       st.lists(st.tuples(st.integers(0, 600), st.integers(0, 600), st.integers(1, 100000)), min_size=1,
                max_size=30),
       st.sampled_from(["static", "memory", "memory-clt"]), st.integers(1, 8), st.integers(8, 512),
       st.sampled_from([16, 128]))
def test_cap_always_within_running_and_b_max(observations, steps, name, b_min, b_max, bs):
    policy = make_policy({"name": name, "b_max": b_max, "b_min": b_min, "eps_m": 0.05, "update_every": 3,
                          "min_observations": 2})
    obs = iter(observations)
    for running, waiting, kv in steps:
        cap = policy.batch_cap(state(running=running, waiting=waiting, kv=kv, bs=bs))
        assert min(max(running, b_min if name != "static" else 1), b_max) <= cap <= b_max
        for pair in [next(obs, None)]:
            if pair:
                policy.observe_finished(*pair)


def test_zero_length_requests_do_not_divide_by_zero():
    # Zero demand, as the cold start's prompt and max_tokens or as measured: only b_max limits the batch.
    policy = MemoryPolicy(PolicyConfig(name="memory", eps_m=0.05, b_max=64, min_observations=0))
    assert policy.batch_cap(state(running=3, prompt=0.0, max_tokens=0.0)) == 64
    for _ in range(10):
        policy.observe_finished(0, 0)
    assert policy.batch_cap(state(running=3)) == 64
    assert policy.mean_demand_blocks == 0


def test_static_policy_caps_at_its_value():
    policy = StaticPolicy(PolicyConfig(name="static", static_cap=32, b_max=256))
    assert policy.batch_cap(state(running=10)) == 32
    assert policy.batch_cap(state(running=40)) == 40  # never below the running count


def test_unknown_policy_rejected():
    with pytest.raises(ValueError, match="unknown policy 'sla-magic'"):
        make_policy({"name": "sla-magic", "b_max": 8})


class BrokenPolicy(MemoryPolicy):
    """A policy with a bug that shows only once statistics arrive."""

    def batch_cap(self, state):
        if self.stats.count >= 3:
            raise ZeroDivisionError("bug in the policy")
        return super().batch_cap(state)


def test_policy_failure_falls_back_to_static_cap_with_a_warning(caplog):
    guarded = FallbackPolicy(BrokenPolicy(PolicyConfig(name="memory", eps_m=0.05, b_max=128)), fallback_cap=96)
    assert guarded.batch_cap(state(running=1)) == 1000 // 32
    for length in (10, 20, 30):
        guarded.observe_finished(5, length)
    with caplog.at_level("WARNING", logger="rollout"):
        assert guarded.batch_cap(state(running=4)) == 96
    assert "policy memory failed (ZeroDivisionError: bug in the policy)" in caplog.text
    assert guarded.trace_fields()["policy_error"] == "ZeroDivisionError: bug in the policy"
    assert guarded.stats.count == 3  # the statistics survive the switch
    guarded.observe_finished(5, 40)
    assert guarded.stats.count == 4
    assert guarded.batch_cap(state(running=120)) == 120  # the static cap still never evicts


def test_kv_cache_smaller_than_one_request():
    policy = MemoryPolicy(PolicyConfig(name="memory", eps_m=0.05, b_max=64, min_observations=1))
    policy.observe_finished(4000, 4000)
    assert policy.batch_cap(state(running=0, kv=3)) == 1  # b_min: one request may still run
    assert policy.batch_cap(state(running=1, kv=3)) == 1


def test_single_request_and_empty_statistics():
    policy = CLTPolicy(PolicyConfig(name="memory-clt", eps_m=0.05, b_max=4096, min_observations=0))
    mean, var = policy.stats.demand_blocks(16)  # what empty statistics give
    expected = math.floor(clt_batch_bound(1000, mean, math.sqrt(var), policy.theta))
    assert policy.batch_cap(state(running=0, waiting=1)) == expected
    policy.observe_finished(7, 0)
    # One finished request of one block, no spread: the cache holds 1,000 of them.
    assert policy.batch_cap(state(running=1, waiting=1)) == 1000
