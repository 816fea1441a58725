"""Algorithm 2 (the SLA bisection) and the combined policy min(b_mem, b_sla), without an engine."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollout.policy import SLAController, SLAPolicy, StepState, StepWindow, make_policy


def run_search(search, latency_of, updates, rng, noise_s, steps_per_window=8):
    """Drive the search as the engine does: the batch that runs is the proposal; latency is read per window."""
    proposals = []
    for _ in range(updates):
        batch = search.value
        readings = latency_of(batch) + rng.normal(0.0, noise_s, steps_per_window)
        search.update(float(np.mean(readings)), batch)
        proposals.append(search.value)
    return np.array(proposals)


def linear(intercept_s, slope_s):
    return lambda b: intercept_s + slope_s * b


def test_converges_to_the_largest_batch_meeting_the_bound_on_a_noisy_linear_curve():
    rng = np.random.default_rng(0)
    curve = linear(0.010, 0.0004)  # 10 ms + 0.4 ms per request: 50 ms at b = 100
    search = SLAController(target_s=0.050, minimum=1, maximum=512, relax=4, hold=2)
    proposals = run_search(search, curve, updates=80, rng=rng, noise_s=0.004)
    settled = proposals[-40:]
    assert abs(np.median(settled) - 100) <= 4
    assert settled.min() >= 88 and settled.max() <= 112  # within alpha + delta + noise of b* = 100
    # The latency it settles at is the bound, within the tolerance band.
    assert abs(curve(np.median(settled)) - 0.050) <= 0.0025 + 0.0004 * 4


def test_follows_the_curve_when_it_moves():
    rng = np.random.default_rng(1)
    search = SLAController(target_s=0.050, minimum=1, maximum=512)
    run_search(search, linear(0.010, 0.0004), updates=60, rng=rng, noise_s=0.002)
    # Longer contexts: every request now costs twice as much per step; b* falls from 100 to 50.
    proposals = run_search(search, linear(0.010, 0.0008), updates=60, rng=rng, noise_s=0.002)
    assert abs(np.median(proposals[-20:]) - 50) <= 4
    # And back: the relaxed upper bound lets it climb again.
    proposals = run_search(search, linear(0.010, 0.0004), updates=80, rng=rng, noise_s=0.002)
    assert abs(np.median(proposals[-20:]) - 100) <= 4


def test_too_slow_takes_the_batch_as_upper_bound_and_relaxes_the_lower():
    search = SLAController(target_s=0.05, minimum=2, maximum=100, relax=5, hold=2, tolerance_s=0.005)
    search.low, search.high = 20.0, 80.0
    search.update(0.08, 60)
    assert (search.low, search.high) == (15.0, 60.0)
    assert search.value == 37
    search.low = 4.0
    search.update(0.08, 30)
    assert (search.low, search.high) == (2.0, 30.0)  # never below the minimum


def test_too_fast_takes_the_batch_as_lower_bound_and_relaxes_the_upper():
    search = SLAController(target_s=0.05, minimum=2, maximum=100, relax=5, hold=2, tolerance_s=0.005)
    search.low, search.high = 20.0, 80.0
    search.update(0.02, 50)
    assert (search.low, search.high) == (50.0, 85.0)
    search.update(0.02, 10)  # a batch smaller than the lower bound (too few requests) proves nothing new
    assert (search.low, search.high) == (50.0, 90.0)
    search.high = 98.0
    search.update(0.02, 60)
    assert search.high == 100.0  # never above the maximum


def test_on_target_holds_a_narrow_interval_around_the_batch():
    search = SLAController(target_s=0.05, minimum=2, maximum=100, relax=5, hold=3, tolerance_s=0.005)
    search.update(0.052, 40)
    assert (search.low, search.high) == (37.0, 43.0)
    assert search.value == 40
    search.update(0.048, 99.5)
    assert (search.low, search.high) == (96.5, 100.0)


def test_default_tolerance_is_five_percent_and_bad_settings_rejected():
    assert SLAController(0.040, 1, 8).tolerance_s == pytest.approx(0.002)
    with pytest.raises(ValueError):
        SLAController(0.0, 1, 8)
    with pytest.raises(ValueError):
        SLAController(0.05, 9, 8)


@given(st.integers(1, 64), st.integers(0, 512), st.floats(0, 20), st.floats(0, 20),
       st.lists(st.tuples(st.floats(0, 1.0), st.floats(0, 2000)), max_size=60))
def test_bounds_always_respected(minimum, extra, relax, hold, readings):
    maximum = minimum + extra
    search = SLAController(0.05, minimum, maximum, relax, hold)
    for latency, batch in readings:
        search.update(latency, batch)
        assert minimum <= search.low <= search.high <= maximum
        assert minimum <= search.value <= maximum


def test_step_window_averages_full_windows_only():
    window = StepWindow(3)
    assert window.add(0.01, 4) is None
    assert window.add(0.02, 5) is None
    assert window.add(0.03, 6) == pytest.approx((0.02, 5.0))
    assert window.add(0.05, 1) is None
    weighted = StepWindow(2)
    weighted.add(0.010, 30, weight=30)
    assert weighted.add(0.040, 10, weight=10) == pytest.approx((0.0175, 20.0))  # (0.3 + 0.4) / 40


def state(running=0, waiting=100, blocks=10_000, block_size=16):
    return StepState(num_running=running, num_waiting=waiting, kv_capacity_blocks=blocks, block_size=block_size,
                     pending_prompt_tokens_mean=100, pending_max_tokens_mean=400)


def sla_policy(**kw):
    settings = dict(name="sla", b_max=256, eps_m=0.05, d_sla_ms=50, sla_window=1, sla_relax=4, sla_hold=2)
    settings.update(kw)
    return make_policy(settings)


def test_combined_cap_is_the_smaller_of_memory_and_latency():
    policy = sla_policy()
    assert isinstance(policy, SLAPolicy)
    # Memory is ample (10k blocks of 16 for ~32 blocks a request: ~300 requests); the latency search starts at
    # the middle of [1, 256] and is the binding one.
    assert policy.batch_cap(state()) == 128
    for _ in range(30):  # every decode step at 60 ms: too slow, the search lowers the cap
        policy.observe_step(0.060, decode_requests=policy.batch_search.value, prefill_tokens=0)
    assert policy.batch_cap(state()) < 20
    # A small KV cache: memory binds below the latency search's proposal.
    tight = sla_policy()
    cap = tight.batch_cap(state(blocks=300))
    assert cap == tight.memory_cap < tight.batch_search.value
    # Never below what already runs: nothing is preempted to meet the bound.
    assert policy.batch_cap(state(running=50)) == 50


def test_prefill_steps_drive_the_token_budget_and_every_decoding_step_the_cap():
    policy = sla_policy(sla_chunk=True)
    budget = policy.token_budget(max_step_tokens=2048, num_running=10)
    assert budget == 10 + (32 + 2048) // 2
    cap_before = policy.batch_search.value
    for _ in range(20):  # mixed steps too slow: the chunk shrinks; their decodes waited too, so the cap follows
        policy.observe_step(0.200, decode_requests=10, prefill_tokens=policy.chunk_search.value)
    assert policy.token_budget(2048, 10) < 10 + 100
    assert policy.batch_search.value < cap_before
    cap_after_mixed = policy.batch_search.value
    for _ in range(20):  # decode-only steps well under the bound: the cap grows, the chunk is untouched
        chunk = policy.chunk_search.value
        policy.observe_step(0.010, decode_requests=policy.batch_search.value, prefill_tokens=0)
        assert policy.chunk_search.value == chunk
    assert policy.batch_search.value > cap_after_mixed
    cap = policy.batch_search.value
    for _ in range(5):  # a prefill-only step (nothing decoding) says nothing about the cap
        policy.observe_step(0.500, decode_requests=0, prefill_tokens=policy.chunk_search.value)
    assert policy.batch_search.value == cap
    assert policy.token_budget(2048, 10) <= 2048
    assert sla_policy(sla_chunk=False).token_budget(2048, 10) is None
    assert sla_policy().token_budget(2048, 10) is None  # off unless asked for


def test_sla_needs_a_latency_bound():
    with pytest.raises(ValueError, match="d_sla_ms"):
        make_policy(dict(name="sla", b_max=8, eps_m=0.05))


def test_in_the_simulator_the_cap_settles_where_the_mean_step_meets_the_bound():
    """Steps of 5 ms + 0.1 ms a request: a 15 ms bound is met by 100 requests a step, about where the search
    holds the running batch while requests wait (a static cap of 256 would run 30 ms steps)."""
    from rollout.sim import StepTimeModel, simulate

    model = StepTimeModel(base=0.005, per_seq=1e-4, per_kv_token=0.0, per_prefill_token=1e-6, per_mixed_step=0.0)
    result = simulate([(32, 64)] * 1500, sla_policy(b_max=256, d_sla_ms=15, sla_window=8), kv_capacity_blocks=100_000,
                      block_size=16, max_num_seqs=256, token_budget=8192, step_time=model, keep_trace=True)
    clock = np.array([row[0] for row in result.trace])
    settled = slice(len(clock) // 4, 3 * len(clock) // 4)  # past the search's first windows, before the drain
    step_s = np.diff(np.r_[0.0, clock])[settled]
    caps = np.array([row[2] for row in result.trace])[settled]
    assert abs(step_s.mean() - 0.015) < 0.0015  # the tolerance (5%) and a window's noise
    assert 85 <= np.median(caps) <= 110


@pytest.mark.engine
def test_the_engine_gives_the_sla_policy_its_steps_and_runs_its_cap_and_token_budget(tiny_model, tmp_path):
    """In the real engine the adapter tells the policy each step's latency and sets the cap and the token
    budget it answers. A bound no step meets (a microsecond, on any machine) drives both searches to their
    least: one request, and prompt chunks of sla_chunk_min_tokens."""
    from omegaconf import OmegaConf

    from rollout.config import RunConfig, validate
    from rollout.engine import RolloutEngine
    from rollout.workloads import lognormal_workload

    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), {
        "model": {"path": str(tiny_model), "dtype": "float32", "kv_cache_memory_bytes": 64 << 20,
                  "max_num_batched_tokens": 2048},
        "data": {"source": "synthetic"}, "sampling": {"n": 1, "ignore_eos": True},
        "policy": {"name": "sla", "b_max": 32, "d_sla_ms": 0.001, "sla_chunk": True, "sla_chunk_min_tokens": 32},
        "output": {"stats_in": None}}))
    validate(cfg)
    prompts, _ = lognormal_workload(64, seed=3)
    with RolloutEngine(cfg, tmp_path) as engine:
        trace = engine.generate(prompts, progress=False, max_tokens=[16] * len(prompts)).trace
    # The searches start at the middle of their ranges: [1, 32] requests, [32, 2048] prompt tokens a step (the
    # budget: what runs, none at the first step, and that chunk).
    assert trace[0]["sla_cap"] == 16 and trace[0]["token_budget"] == (32 + 2048) // 2
    assert all(s["scheduled_tokens"] <= s["token_budget"] for s in trace)  # vLLM keeps to the budget it is given
    busy = [s for s in trace if s["waiting"]]
    settled = busy[len(busy) // 2:]
    assert len(settled) > 100
    assert all(s["cap"] == 1 and s["sla_high"] == 1 for s in settled)
    # The chunk search moves once per window of steps with prompt tokens (one in 16 here): down to its least.
    chunks = [s["sla_chunk_tokens"] for s in trace]
    assert all(later <= earlier for earlier, later in zip(chunks, chunks[1:])) and busy[-1]["sla_chunk_tokens"] == 32
    assert all(s["token_budget"] <= s["running"] + s["sla_chunk_tokens"] for s in trace)
    assert sum(s["decode_requests"] for s in trace) + sum(s["prefill_tokens"] for s in trace) == sum(
        s["scheduled_tokens"] for s in trace)
