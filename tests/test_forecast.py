"""Length-aware admission from censored length estimates, without an engine, and in the simulator."""

import math

import numpy as np
import pytest

import rollout.policy.forecast as forecast_module
from rollout.policy import PolicyConfig, StepState, make_policy
from rollout.policy.forecast import CensoredLengths, ForecastPolicy, expected_demand_admissions, survival_after
from rollout.policy.oracle import oracle_admissions


def view(running_tokens, running_generated, waiting_tokens, waiting_generated=None, *, blocks: int,
         block_size: int = 16, **arrays) -> StepState:
    """The step view of these running and waiting requests (the waiting have generated nothing unless told) and a
    cache of `blocks` blocks; `arrays`: the other per-request arrays (scale, group, shared) and max_tokens_bound."""
    running_tokens, waiting_tokens = np.asarray(running_tokens), np.asarray(waiting_tokens)
    if waiting_generated is None:
        waiting_generated = np.zeros(len(waiting_tokens), dtype=np.int64)
    return StepState(num_running=len(running_tokens), num_waiting=len(waiting_tokens), kv_capacity_blocks=blocks,
                     block_size=block_size, running_tokens=running_tokens,
                     running_generated=np.asarray(running_generated), waiting_tokens=waiting_tokens,
                     waiting_generated=np.asarray(waiting_generated), **arrays)


def admits(*args, theta: float, **kwargs) -> int:
    """Waiting requests `expected_demand_admissions` admits from `view(*args)` and an estimate `lengths`."""
    lengths = kwargs.pop("lengths")
    options = {k: kwargs.pop(k) for k in ("informed", "horizon_tokens", "pointwise_running_peak") if k in kwargs}
    return expected_demand_admissions(view(*args, **kwargs), lengths, theta, **options).count


def test_without_censoring_the_estimate_is_the_empirical_distribution():
    lengths = CensoredLengths(bin_tokens=16)
    rng = np.random.default_rng(0)
    sample = rng.integers(1, 400, 2000)
    for n in sample:
        lengths.observe(int(n))
    remaining, var = lengths.conditional(np.array([0, 200]))
    assert remaining[0] == pytest.approx(sample.mean(), abs=8)  # within half a bin
    # The bin of 200 starts at 192: the conditional mean of what lies past it.
    assert remaining[1] == pytest.approx(sample[sample >= 192].mean() - 200, abs=8)
    assert var[0] == pytest.approx(sample.var(), rel=0.05)


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


def test_survival_rows_are_probabilities_that_only_fall():
    lengths = CensoredLengths(bin_tokens=16)
    rng = np.random.default_rng(1)
    for n in rng.lognormal(5, 0.8, 300).astype(int):
        lengths.observe(int(n))
    alive = survival_after(lengths, rng.integers(0, 600, 50), horizon_bins=80)
    assert np.all(alive[:, 0] == 1.0)
    assert np.all((alive >= 0) & (alive <= 1))
    assert np.all(np.diff(alive, axis=1) <= 1e-12)
    assert np.all(alive[:, -1] < 1)  # 80 bins (1,280 tokens) on, some of every row has ended


def test_known_lengths_give_the_oracles_admissions():
    # Every request is 160 tokens long, and the estimate has seen enough of them to know it.
    lengths = CensoredLengths(bin_tokens=16)
    for _ in range(100):
        lengths.observe(160)
    alive = survival_after(lengths, np.array([0, 64]), horizon_bins=14)
    assert alive[0].tolist() == [1.0] * 11 + [0.0] * 3  # runs through bin 10 (tokens 160-175), then done
    assert alive[1].tolist() == [1.0] * 7 + [0.0] * 7
    rng = np.random.default_rng(3)
    for _ in range(30):
        running_generated = rng.integers(0, 160, 20)
        running_tokens = 100 + running_generated
        waiting_tokens = np.full(40, 100)
        blocks = int(rng.integers(375, 1250))
        capacity = 16 * blocks
        expected = oracle_admissions(running_tokens, 160 - running_generated, waiting_tokens, np.full(40, 160),
                                     capacity, 16)
        got = admits(running_tokens, running_generated, waiting_tokens, blocks=blocks, lengths=lengths, theta=0.0)
        # Bins of 16 tokens make it more careful by at most one bin per request, never bolder.
        careful = oracle_admissions(running_tokens, 160 - running_generated, waiting_tokens, np.full(40, 160),
                                    capacity - 16 * (20 + 40), 16)
        assert careful <= got <= expected


def test_spread_and_less_memory_admit_fewer():
    lengths = CensoredLengths(bin_tokens=16)
    rng = np.random.default_rng(4)
    for n in rng.lognormal(5, 0.8, 200).astype(int):
        lengths.observe(int(n))
    args = (np.full(30, 300), np.full(30, 150), np.full(200, 100))
    counts = [admits(*args, blocks=blocks, lengths=lengths, theta=theta) for blocks in (1875, 3750)
              for theta in (0.0, 1.645)]
    assert counts[1] < counts[0] and counts[3] <= counts[2]
    assert counts[0] < counts[2]
    assert admits(*args, blocks=6, lengths=lengths, theta=0.0) == 0  # the running ones alone overflow


def cold_state() -> StepState:
    return StepState(num_running=0, num_waiting=100, kv_capacity_blocks=1000, block_size=16,
                     pending_prompt_tokens_mean=100, pending_max_tokens_mean=1500,
                     running_tokens=np.zeros(0, int), running_remaining=np.zeros(0, int),
                     waiting_tokens=np.full(100, 100), waiting_remaining=np.full(100, 1500),
                     running_generated=np.zeros(0, int), waiting_generated=np.zeros(100, int))


def test_memory_cold_start_is_algorithm_1_then_forecast():
    policy = make_policy({"name": "forecast", "b_max": 256, "eps_m": 0.05, "min_observations": 4,
                          "forecast_after": 4, "forecast_cold_start": "memory"})
    assert isinstance(policy, ForecastPolicy) and policy.needs_requests
    state = cold_state()
    worst_case = policy.batch_cap(state)
    assert worst_case == 10  # 16,000 tokens / (100 + 1500) per request
    for n in (90, 100, 110, 120):  # short outputs seen: forecast admits far more than the worst case
        policy.observe_finished(100, n)
    assert policy.batch_cap(state) > 5 * worst_case


def test_memory_cold_start_stays_algorithm_1_until_a_share_of_the_running_have_finished():
    # With many running, 8 finishes are not enough (forecast_after_share): Algorithm 1 holds until 10% of the
    # running have finished; the gamma prior plays no part in this mode.
    settings = {"b_max": 512, "eps_m": 0.05, "min_observations": 8}
    forecast = make_policy({"name": "forecast", **settings, "forecast_cold_start": "memory"})
    algorithm_1 = make_policy({"name": "memory", **settings})
    state = StepState(num_running=200, num_waiting=300, kv_capacity_blocks=4000, block_size=16,
                      pending_prompt_tokens_mean=100, pending_max_tokens_mean=1500,
                      running_tokens=np.full(200, 150), running_remaining=np.full(200, 1450),
                      waiting_tokens=np.full(300, 100), waiting_remaining=np.full(300, 1500),
                      running_generated=np.full(200, 50), waiting_generated=np.zeros(300, int))
    for k in range(20):  # 10% of 200
        assert forecast.batch_cap(state) == algorithm_1.batch_cap(state), k
        assert forecast.last is None and not forecast.wants_requests(state), k  # no forecast ran
        for policy in (forecast, algorithm_1):
            policy.observe_finished(100, 40)
    forecast.batch_cap(state)
    assert forecast.last is not None


def test_gamma_cold_start_forecasts_with_a_prior_of_the_max_tokens_mean():
    # The prior over the whole future (no first-wave horizon, see the next test), its margin unbounded
    def policy_of(shape: float) -> ForecastPolicy:
        return make_policy({"name": "forecast", "b_max": 256, "eps_m": 0.05, "forecast_cold_start_horizon": 0,
                            "forecast_cold_start_shape": shape, "forecast_margin_cap": 1.0})

    policy, state = policy_of(3.0), cold_state()
    prior = policy._estimate(state)
    mean, _ = prior.conditional(np.array([0]))
    assert mean[0] == pytest.approx(1500, abs=16)  # nothing finished: the prior's mean, within a bin
    # Requests finish at different times: the expected peak is below the sum of their demands (Algorithm 1's
    # 16,000 / 1,600), and a more concentrated prior (a larger shape) lets in no more than an exponential's
    # (shape 1, a memoryless tail).
    algorithm_1 = make_policy({"name": "memory", "b_max": 256, "eps_m": 0.05}).batch_cap(state)
    cap = policy.batch_cap(state)
    assert algorithm_1 < cap <= policy_of(1.0).batch_cap(state)
    assert policy_of(100.0).batch_cap(state) <= cap
    for n in range(40):  # the prior leaves once forecast_after lengths are in
        policy.observe_finished(100, 100)
    assert policy._estimate(state) is policy.lengths
    assert policy.batch_cap(state) > 4 * cap


def test_the_first_wave_holds_each_request_for_a_share_of_max_tokens():
    # The default first wave, 0.08 of max_tokens, against the prior's whole future; margins unbounded.
    horizon = make_policy({"name": "forecast", "b_max": 256, "eps_m": 0.05, "forecast_margin_cap": 1.0})
    whole = make_policy({"name": "forecast", "b_max": 256, "eps_m": 0.05, "forecast_cold_start_horizon": 0,
                         "forecast_margin_cap": 1.0})
    wave = horizon.batch_cap(cold_state())
    # 16,000 tokens, each request 100 + 0.08 x 1,500 tokens and a partly used block at most, less the margin.
    assert 3 * whole.batch_cap(cold_state()) < wave <= 16_000 // (100 + 0.08 * 1500 + 15)
    # Once a request of the pass has finished, both look forecast_horizon_tokens ahead.
    for policy in (horizon, whole):
        policy.observe_finished(100, 100)
    assert horizon.batch_cap(cold_state()) == whole.batch_cap(cold_state())


def test_the_prior_stays_until_a_share_of_the_running_requests_have_finished():
    policy = make_policy({"name": "forecast", "b_max": 512, "eps_m": 0.05})  # after 8, and 10% of the running
    state = StepState(num_running=200, num_waiting=10, kv_capacity_blocks=4000, block_size=16,
                      pending_prompt_tokens_mean=100, pending_max_tokens_mean=1500,
                      running_tokens=np.full(200, 150), running_remaining=np.full(200, 1450),
                      waiting_tokens=np.full(10, 100), waiting_remaining=np.full(10, 1500),
                      running_generated=np.full(200, 50), waiting_generated=np.zeros(10, int))
    for k in range(20):
        assert policy._estimate(state) is not policy.lengths, k  # 8 short finishes say little of 200 running
        policy.observe_finished(100, 40)
    assert policy._estimate(state) is policy.lengths


def test_no_request_is_forecast_to_run_past_the_max_tokens():
    # vLLM stops a request at its max_tokens; a fitted lognormal's tail (and the cold start's prior) runs past it.
    lengths = CensoredLengths()
    for n in range(100, 1100, 10):
        lengths.observe(n)  # a tail past 1,100 only from the lognormal fit
    # One request 100 tokens short of a 1,500-token max_tokens, 100 waiting with nothing generated.
    counts = [admits([100 + 1400], [1400], np.full(100, 100), blocks=750, lengths=lengths, theta=1.645,
                     max_tokens_bound=bound) for bound in (0, 1500)]
    assert counts[1] > counts[0], counts


def test_simulated_long_outputs_start_sooner_with_the_gamma_cold_start():
    # Long, spread-out outputs, KV enough for all at once: Algorithm 1's cold start (every request as long as
    # the mean, all at once) holds back requests that fit; the longest ones then start late.
    from rollout.sim.engine import StepTimeModel, simulate
    from rollout.workloads import ProfileConfig, profile_requests

    profile = ProfileConfig(num_prompts=128, prompt_tokens=64, median_output=300, sigma=0.9, max_output=1600)
    requests = [(len(r.prompt.token_ids), r.output_tokens) for r in profile_requests(profile, 0)]
    requests.append(requests.pop(int(np.argmax([out for _, out in requests]))))  # the longest comes last
    runs, first_cap = {}, {}
    for cold_start in ("memory", "gamma"):
        policy = make_policy({"name": "forecast", "b_max": 512, "eps_m": 0.05, "forecast_cold_start": cold_start})
        runs[cold_start] = simulate(requests, policy, kv_capacity_blocks=3200, block_size=16, max_num_seqs=512,
                                    token_budget=8192, step_time=StepTimeModel(), keep_trace=True)
        first_cap[cold_start] = runs[cold_start].trace[0][2]
        assert runs[cold_start].preemptions == 0
    assert first_cap["gamma"] == len(requests) > first_cap["memory"]
    assert runs["gamma"].makespan_s < runs["memory"].makespan_s


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


def test_a_scaled_request_runs_its_scale_times_as_long():
    lengths = CensoredLengths(bin_tokens=16)
    for n in np.random.default_rng(3).lognormal(5, 0.6, 500).astype(int):
        lengths.observe(int(n))
    plain = survival_after(lengths, np.array([0]), 20, stride=1)
    doubled = survival_after(lengths, np.array([0]), 20, stride=2, scale=np.array([2.0]))
    np.testing.assert_allclose(doubled, plain)  # 2j bins ahead at scale 2 is j bins of the estimate
    halved = survival_after(lengths, np.array([0]), 20, stride=1, scale=np.array([0.5]))
    assert halved[0, 10] <= plain[0, 10]


def test_predicted_long_requests_admit_fewer():
    lengths = CensoredLengths(bin_tokens=16)
    for n in np.random.default_rng(4).lognormal(5, 0.5, 400).astype(int):
        lengths.observe(int(n))
    args = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), np.full(200, 128))
    empty = np.zeros(0)

    def admitted_at(scale: float) -> int:
        return admits(*args, blocks=1875, lengths=lengths, theta=1.645, running_scale=empty,
                      waiting_scale=np.full(200, scale))

    plain = admits(*args, blocks=1875, lengths=lengths, theta=1.645)
    assert admitted_at(1.0) == plain
    assert admitted_at(0.5) > plain > admitted_at(3.0) > 0


def test_forecast_skips_the_request_pass_until_finishes_free_what_was_lacking(monkeypatch):
    def step(running: int, described: bool = False) -> StepState:
        state = StepState(num_running=running, num_waiting=10, kv_capacity_blocks=30, block_size=16)
        if described:
            state.running_tokens, state.running_generated = np.full(running, 116), np.full(running, 100)
            state.waiting_tokens, state.waiting_generated = np.full(10, 16), np.zeros(10, dtype=np.int64)
        return state

    def forecast(policy: ForecastPolicy, running: int) -> int:
        assert policy.wants_requests(step(running))
        return policy.batch_cap(step(running, described=True))

    def fresh() -> ForecastPolicy:
        # Without backfilling (with it, any finish calls for a forecast while the head is blocked) and with the
        # margin unbounded, as the numbers below assume.
        policy = ForecastPolicy(PolicyConfig(eps_m=0.05, b_max=64, min_observations=2, forecast_after=2,
                                             forecast_backfill=False, forecast_margin_cap=1.0,
                                             forecast_margin_cap_predicted=1.0))
        for n in (100, 120, 140):
            policy.observe_finished(16, n)
        assert forecast(policy, 4) == 4  # 480 tokens of cache, four requests heading for ~130 tokens each
        assert not policy.wants_requests(step(4))  # nothing changed: the answer is still 0
        assert policy.batch_cap(step(4)) == 4
        return policy

    # While few lengths are known, each finish moves the estimate: any finish calls for a forecast.
    policy = fresh()
    policy.observe_finished(16, 130)
    assert policy.wants_requests(step(3))
    # With more lengths known it takes more finishes to move it (here 40% of what is known).
    monkeypatch.setattr(forecast_module, "ESTIMATE_MOVE", 0.4)
    policy = fresh()
    policy.observe_finished(16, 130)
    assert policy.since.freed_tokens < policy.last.shortfall_tokens and not policy.wants_requests(step(3))
    policy.observe_finished(16, 130)
    assert policy.wants_requests(step(2))
    # Once the estimate is stable, only finishes that free what the first waiting request lacked.
    monkeypatch.setattr(forecast_module, "STABLE_COUNT", 0)
    policy = fresh()
    lacking = policy.last.shortfall_tokens
    assert lacking > 16 + 130  # the first waiting request overshoots by more than one finish frees
    policy.observe_finished(16, 130)
    assert not policy.wants_requests(step(3))
    policy.observe_finished(16, 130)
    policy.observe_finished(16, 130)
    assert policy.since.freed_tokens > lacking and policy.wants_requests(step(1))
    # A request that leaves without finishing (preempted) frees memory the finishes do not count.
    forecast(policy, 4)
    assert not policy.wants_requests(step(4))
    policy.observe_preempted(40)
    assert policy.wants_requests(step(3))


def test_forecasts_that_the_estimates_move_called_for_and_admitted_nothing_wait_longer(monkeypatch):
    """The estimate's move calls for a forecast after count * ESTIMATE_MOVE finishes; each that admitted nothing
    doubles that (to ESTIMATE_WAIT_MAX times), and one that admits resets it."""
    def step(running: int, described: bool = False) -> StepState:
        state = StepState(num_running=running, num_waiting=10, kv_capacity_blocks=30, block_size=16)
        if described:  # the cache is full now: nothing fits whatever the estimate says
            state.running_tokens = np.full(running, 480 // running)
            state.running_generated = np.full(running, 480 // running - 16)
            state.waiting_tokens = np.full(10, 16)
            state.waiting_generated = np.zeros(10, dtype=np.int64)
        return state

    monkeypatch.setattr(forecast_module, "ESTIMATE_MOVE", 0.05)
    policy = ForecastPolicy(PolicyConfig(eps_m=0.05, b_max=64, min_observations=2, forecast_after=2,
                                         forecast_backfill=False, forecast_margin_cap=1.0,
                                         forecast_margin_cap_predicted=1.0))
    for n in range(20):
        policy.observe_finished(16, 100 + n)
    assert policy.wants_requests(step(4)) and policy.batch_cap(step(4, described=True)) == 4
    waited = []
    for _ in range(4):
        finishes = 0
        while not policy.wants_requests(step(4)):
            policy.observe_finished(0, 1)  # frees too little to matter; only the estimate moves
            finishes += 1
        waited.append(finishes)
        assert policy.batch_cap(step(4, described=True)) == 4

    def due(known: int, wait: int) -> int:
        """f finishes after `known` call for a forecast once f >= max(1, (known + f) * ESTIMATE_MOVE) * wait."""
        f = 1
        while f < max(1.0, (known + f) * 0.05) * wait:
            f += 1
        return f

    known, expected = 20, []
    for k in range(4):  # the wait doubles from 1 until ESTIMATE_WAIT_MAX
        expected.append(due(known, min(2 ** k, forecast_module.ESTIMATE_WAIT_MAX)))
        known += expected[-1]
    assert waited == expected and waited[-1] > waited[0]
    # A forecast that admits resets the wait.
    roomy = step(2, described=True)
    roomy.running_tokens, roomy.running_generated = np.full(2, 40), np.full(2, 24)
    assert policy.batch_cap(roomy) > 2
    for _ in range(due(known, 1) - 1):
        policy.observe_finished(0, 1)
    assert not policy.wants_requests(step(2))
    policy.observe_finished(0, 1)
    assert policy.wants_requests(step(2))


def test_requests_a_forecast_admitted_stay_admitted_until_the_engine_schedules_them():
    """The engine's token budget may schedule fewer than a forecast admitted: the cap keeps room for the rest
    without forecasting again, and a forecast that had room for all it was shown looks again once they run."""
    policy = ForecastPolicy(PolicyConfig(eps_m=0.05, b_max=64, min_observations=2, forecast_after=2))
    for n in (10, 12, 14):
        policy.observe_finished(16, n)
    state = StepState(num_running=0, num_waiting=3, kv_capacity_blocks=1000, block_size=16,
                      running_tokens=np.zeros(0), running_generated=np.zeros(0, dtype=np.int64),
                      waiting_tokens=np.full(3, 16), waiting_generated=np.zeros(3, dtype=np.int64))
    assert policy.wants_requests(state) and policy.batch_cap(state) == 3  # all three fit
    one_scheduled = StepState(num_running=1, num_waiting=2, kv_capacity_blocks=1000, block_size=16)
    assert not policy.wants_requests(one_scheduled)
    assert policy.batch_cap(one_scheduled) == 3
    all_scheduled = StepState(num_running=3, num_waiting=5, kv_capacity_blocks=1000, block_size=16)
    assert policy.wants_requests(all_scheduled)


def test_a_new_pass_keeps_earlier_lengths_at_a_low_weight_or_takes_the_drivers_prior():
    policy = ForecastPolicy(PolicyConfig(eps_m=0.05, b_max=64, forecast_carry_over=0.25))
    for n in range(100):
        policy.observe_finished(16, 50 + n)
    policy.start_pass()
    assert policy.lengths.count == pytest.approx(25.0)
    mean_before, _ = policy.lengths.conditional(np.array([0]))
    assert mean_before[0] == pytest.approx(100, abs=10)  # the shape is kept, only its weight falls
    policy.start_pass(np.full(40, 400.0))
    assert policy.lengths.count == pytest.approx(10.0)
    mean_prior, _ = policy.lengths.conditional(np.array([0]))
    assert mean_prior[0] == pytest.approx(400, abs=16)  # the prior replaced what was there


def test_saved_statistics_seed_the_estimate_as_an_earlier_pass(tmp_path):
    from rollout.policy import LengthStats

    earlier = LengthStats()
    for n in range(400):
        earlier.observe(16, 200 + n % 100)
    earlier.save(tmp_path / "stats.json")
    policy = ForecastPolicy(PolicyConfig(eps_m=0.05, b_max=64, forecast_carry_over=0.25),
                            LengthStats.load(tmp_path / "stats.json"))
    assert policy.lengths.count == pytest.approx(400)
    policy.start_pass()  # the first pass of the new run: saved lengths count as an earlier pass
    assert policy.lengths.count == pytest.approx(100)
    mean, _ = policy.lengths.conditional(np.array([0]))
    assert mean[0] == pytest.approx(250, abs=10)
    # 100 >= forecast_after: the first steps already forecast, with no max_tokens known (no worst-case cold start)
    assert policy.wants_requests(StepState(num_running=0, num_waiting=5, kv_capacity_blocks=100, block_size=16))


@pytest.mark.engine
def test_prompt_memory_orders_and_scales_the_next_pass(tiny_model, tmp_path):
    from omegaconf import OmegaConf

    from rollout.config import RunConfig, validate
    from rollout.engine import RolloutEngine
    from rollout.policy.length_stats import PromptLengths, prompt_key
    from rollout.workloads import lognormal_workload

    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), {
        "model": {"path": str(tiny_model), "dtype": "float32", "num_gpu_blocks_override": 24,
                  "kv_cache_memory_bytes": 64 << 20, "max_model_len": 2048},
        "data": {"source": "synthetic"}, "sampling": {"n": 2, "ignore_eos": True},
        "policy": {"name": "forecast", "order": "longest_first", "b_max": 32}, "output": {"stats_in": None}}))
    validate(cfg)
    prompts, lengths = lognormal_workload(24, seed=5, median_output=120)
    with RolloutEngine(cfg, tmp_path) as engine:
        first = engine.generate(prompts, progress=False, max_tokens=lengths)
        second = engine.generate(prompts, progress=False, max_tokens=lengths)
    assert first.summary["prompt_lengths"]["prompts_predicted"] == 0
    assert not any(s.get("length_scaled") for s in first.trace)
    assert second.summary["prompt_lengths"]["prompts_predicted"] == len(prompts)
    assert any(s.get("length_scaled") for s in second.trace)  # the scheduler predicted from its own memory
    for run in (first, second):
        assert [r["completion_tokens"] for r in run.records] == [n for n in lengths for _ in range(2)]
    memory = PromptLengths.load(tmp_path / "prompt_lengths.json")
    keys = [prompt_key(p.token_ids) for p in prompts]
    np.testing.assert_allclose(memory.predict(keys), lengths)  # both passes had these lengths
    assert memory.last == {key: [n, n] for key, n in zip(keys, lengths)}  # the scheduler's, in its state_dir


def policy_with_lengths(config: PolicyConfig, median: float, sigma: float, seed: int) -> ForecastPolicy:
    """A forecast policy that has seen 200 finished lengths, lognormal around `median` (prompts of 16 tokens)."""
    policy = ForecastPolicy(config)
    for n in np.random.default_rng(seed).lognormal(np.log(median), sigma, 200):
        policy.observe_finished(16, int(n))
    return policy


def test_the_forecast_reports_its_margin_as_the_safety_buffer():
    # The margin unbounded (forecast_margin_cap 1): theta alone sets it.
    policy = policy_with_lengths(PolicyConfig(eps_m=0.05, b_max=64, forecast_after=8, forecast_margin_cap=1.0), 100,
                                 0.5, 3)
    state = StepState(num_running=4, num_waiting=20, kv_capacity_blocks=60, block_size=16,
                      running_tokens=np.full(4, 60), running_generated=np.full(4, 44),
                      waiting_tokens=np.full(20, 16), waiting_generated=np.zeros(20, dtype=np.int64))
    policy.batch_cap(state)
    admit, margin, *_ = expected_demand_admissions(state, policy.lengths, policy.theta, margin_cap=policy.margin_cap)
    assert 0 < admit < 20 and admit == policy.last.admitted
    assert margin > 0 and policy.trace_fields()["safety_buffer_blocks"] == pytest.approx(margin / 16)
    # a larger overflow allowance keeps less free
    loose = expected_demand_admissions(state, policy.lengths, 0.5, margin_cap=policy.margin_cap)
    assert loose.count >= admit and loose.margin_tokens < margin


@pytest.mark.parametrize("predicted", [False, True])
def test_the_margin_is_bounded_tighter_where_requests_carry_predicted_lengths(predicted):
    # A wide spread and a small overflow allowance: theta standard deviations would keep more than the cache free.
    policy = policy_with_lengths(PolicyConfig(eps_m=0.001, b_max=64, forecast_after=8, forecast_margin_cap=0.2,
                                              forecast_margin_cap_predicted=0.1), 100, 1.0, 3)
    # Scale columns are shown only where the pass's requests carry their prompts' predicted lengths.
    scales = dict(running_scale=np.ones(4), waiting_scale=np.ones(20)) if predicted else {}
    state = StepState(num_running=4, num_waiting=20, kv_capacity_blocks=60, block_size=16,
                      running_tokens=np.full(4, 60), running_generated=np.full(4, 44),
                      waiting_tokens=np.full(20, 16), waiting_generated=np.zeros(20, dtype=np.int64), **scales)
    policy.batch_cap(state)
    unbounded = expected_demand_admissions(state, policy.lengths, policy.theta)
    assert unbounded.margin_tokens > 60 * 16 and unbounded.count == 0
    assert policy.last.margin_blocks == pytest.approx(60 * (0.1 if predicted else 0.2))
    assert policy.last.admitted == (8 if predicted else 6)  # the room the tighter bound frees is admitted


@pytest.mark.parametrize("predicted", [False, True])
def test_under_kv_offloading_the_forecast_admits_on_the_expected_demand(predicted):
    """Where a preempted request loads its blocks back from host memory, the margin is
    forecast_margin_cap_offloading (0 by default) in every pass: the state of the test above admits what the
    expected demand alone leaves room for, more than either bound there."""
    config = PolicyConfig(eps_m=0.001, b_max=64, forecast_after=8, forecast_margin_cap=0.2,
                          forecast_margin_cap_predicted=0.1)
    policy = policy_with_lengths(config.under_kv_offloading(), 100, 1.0, 3)
    scales = dict(running_scale=np.ones(4), waiting_scale=np.ones(20)) if predicted else {}
    state = StepState(num_running=4, num_waiting=20, kv_capacity_blocks=60, block_size=16,
                      running_tokens=np.full(4, 60), running_generated=np.full(4, 44),
                      waiting_tokens=np.full(20, 16), waiting_generated=np.zeros(20, dtype=np.int64), **scales)
    policy.batch_cap(state)
    expected = expected_demand_admissions(state, policy.lengths, 0.0)
    assert policy.last.margin_blocks == 0 and expected.margin_tokens == 0
    assert policy.last.admitted == expected.count > 8


@pytest.mark.parametrize("horizon", [1000, 0])
def test_past_the_cold_start_the_forecast_holds_demand_within_the_cache_for_its_horizon(horizon):
    """Running requests forecast to outgrow the cache 4,000 tokens from now, and not within 1,000: looking 1,000
    tokens ahead admits what fits until then (and exactly what the forecast cut there admits); looking to the
    end (0) admits nothing."""
    config = PolicyConfig(b_max=64, forecast_after=8, forecast_horizon_tokens=horizon)
    policy = policy_with_lengths(config, 4000, 0.05, 5)
    state = StepState(num_running=4, num_waiting=10, kv_capacity_blocks=400, block_size=16,
                      running_tokens=np.full(4, 116), running_generated=np.full(4, 100),
                      waiting_tokens=np.full(10, 16), waiting_generated=np.zeros(10, dtype=np.int64))
    assert expected_demand_admissions(state, policy.lengths, policy.theta).shortfall_tokens > 0  # the running alone
    cap = policy.batch_cap(state)
    if horizon:
        near = expected_demand_admissions(state, policy.lengths, policy.theta, horizon_tokens=1000,
                                          backfill=True, margin_cap=policy.margin_cap)
        assert 0 < policy.last.admitted == near.count + len(near.backfill) < 10
        assert cap == 4 + policy.last.admitted
    else:
        assert policy.last.admitted == 0 and cap == 4


def test_the_weighted_censored_fit_is_scipys_maximum_likelihood():
    from scipy import stats

    from rollout.policy.forecast import censored_normal_fit

    rng = np.random.default_rng(3)
    lengths = np.round(rng.normal(5.0, 0.8, 600), 1)
    limits = np.round(rng.uniform(3.0, 6.5, 600), 1)
    finished, running = lengths[lengths <= limits], limits[lengths > limits]  # running: known to exceed
    expected = stats.norm.fit(stats.CensoredData(uncensored=finished, right=running))
    values, weights = np.unique(finished, return_counts=True)
    censored, censored_weights = np.unique(running, return_counts=True)
    fitted = censored_normal_fit(values, weights.astype(float), censored, censored_weights.astype(float))
    np.testing.assert_allclose(fitted, expected, rtol=2e-3)
    assert fitted[0] > finished.mean()  # the censored ones pull the mean up: finished alone are the short ones


def test_the_fit_holds_early_in_a_pass_where_most_requests_still_run():
    """A pass's first finishes are its short requests, all else censored: Newton's steps still land on scipy's
    maximum; with nothing finished (no maximum) the fit still answers."""
    from scipy import stats

    from rollout.policy.forecast import censored_normal_fit

    rng = np.random.default_rng(11)
    lengths = np.round(rng.normal(7.0, 0.9, 2000), 2)
    limit = np.quantile(lengths, 0.03)  # 3% finished
    finished, running = lengths[lengths <= limit], np.full(int(np.sum(lengths > limit)), limit)
    expected = stats.norm.fit(stats.CensoredData(uncensored=finished, right=running))
    values, weights = np.unique(finished, return_counts=True)
    fitted = censored_normal_fit(values, weights.astype(float), np.array([limit]), np.array([float(len(running))]))
    np.testing.assert_allclose(fitted, expected, rtol=2e-3)
    mean, sd = censored_normal_fit(np.array([]), np.array([]), np.array([5.0, 6.0]), np.array([3.0, 4.0]))
    assert np.isfinite(mean) and sd > 0


def test_the_fits_standard_errors_are_the_textbook_ones_without_censoring_and_grow_with_it():
    from rollout.policy.forecast import censored_normal_fit

    rng = np.random.default_rng(5)
    sample = np.round(rng.normal(5.0, 0.8, 2000), 2)
    values, weights = np.unique(sample, return_counts=True)
    none = np.array([])
    mean, sd, se_mean, se_log_sd = censored_normal_fit(values, weights.astype(float), none, none,
                                                       standard_errors=True)
    assert se_mean == pytest.approx(sd / np.sqrt(2000), rel=0.02)
    assert se_log_sd == pytest.approx(1 / np.sqrt(2 * 2000), rel=0.02)
    # The same count with most of it censored at 5.5 (known only to run longer): less is known.
    finished = sample[sample <= 5.5]
    values, weights = np.unique(finished, return_counts=True)
    censored = np.array([5.5])
    _, _, se_censored, _ = censored_normal_fit(values, weights.astype(float), censored,
                                               np.array([float(len(sample) - len(finished))]), standard_errors=True)
    assert se_censored > 1.05 * se_mean


def test_the_tail_leans_long_by_its_uncertainty_less_as_lengths_come_in():
    rng = np.random.default_rng(6)
    sample = rng.lognormal(np.log(1500), 0.9, 4000)

    def lean(finished: int, group_size: int = 1) -> float:
        """How much longer a running request past every finished one is expected to run with the tail pushed
        by its uncertainty than with the fit itself; the finished in groups of `group_size` samples a prompt."""
        remaining = []
        for confidence in (0.0, 1.5):
            lengths = CensoredLengths(bin_tokens=16, tail_confidence=confidence)
            done = np.sort(sample[:finished + 200])[:finished]  # the first to finish are the short ones
            for k, n in enumerate(done):
                lengths.observe_finished(float(n), group=k // group_size if group_size > 1 else -1)
            running = np.full(200, done.max() + 32)  # 200 still running, past every finished one
            remaining.append(lengths.conditional(running)[0][0])
        return remaining[1] / remaining[0] - 1

    assert lean(16) > 2 * lean(1000) > 0
    # Samples of one prompt say less than as many prompts would: the tail leans further.
    assert lean(1000, group_size=8) > lean(1000)


def test_a_groups_samples_count_once_before_the_estimate_rests_on_the_data():
    # Eight samples of one prompt, all short, finish first: one observation of its difficulty, not eight.
    policy = make_policy({"name": "forecast", "b_max": 256, "eps_m": 0.05, "forecast_after": 8})
    state = cold_state()
    for row in range(8):
        policy.observe_finished(100, 60 + row, group=0, row=row)
    assert policy.lengths.observed == 1 and policy.lengths.design_effect == 8
    assert policy._estimate(state) is not policy.lengths  # the prior still weighs 7 of 15
    for group in range(1, 8):
        policy.observe_finished(100, 60, group=group, row=7 + group)
    assert policy.lengths.observed == 8 and policy._estimate(state) is policy.lengths
    assert policy.lengths.design_effect == 15 / 8
    ungrouped = make_policy({"name": "forecast", "b_max": 256, "eps_m": 0.05, "forecast_after": 8})
    for row in range(8):
        ungrouped.observe_finished(100, 60 + row)
    assert ungrouped.lengths.observed == 8 and ungrouped.lengths.design_effect == 1
    policy.start_pass()
    assert policy.lengths.design_effect == 1 and policy.lengths.observed == pytest.approx(15 * 0.05)


def test_forecasting_the_queue_a_prefix_at_a_time_gives_the_whole_queues_answer(monkeypatch):
    rng = np.random.default_rng(5)
    lengths = CensoredLengths(bin_tokens=16)
    for n in rng.lognormal(5.5, 0.7, 300):
        lengths.observe(n)
    cases = []
    for _ in range(40):
        running, waiting = int(rng.integers(0, 60)), int(rng.integers(1, 400))
        group = rng.integers(-1, 50, running + waiting)  # some alone, some in groups, some in none
        shared = np.where(group >= 0, 128, 0)
        blocks = int(rng.choice([500, 1250, 3125, 9375, 25_000]))
        cases.append(view(100 + rng.integers(0, 600, running), rng.integers(0, 600, running), np.full(waiting, 200),
                          blocks=blocks, running_group=group[:running], waiting_group=group[running:],
                          running_shared=shared[:running], waiting_shared=shared[running:]))
    windowed = [expected_demand_admissions(case, lengths, 1.64) for case in cases]
    monkeypatch.setattr(forecast_module, "FIRST_WINDOW", 10_000)  # the whole queue at once
    whole = [expected_demand_admissions(case, lengths, 1.64) for case in cases]
    assert [a.count for a in windowed] == [a.count for a in whole]
    np.testing.assert_allclose([a.margin_tokens for a in windowed], [a.margin_tokens for a in whole], rtol=1e-9)
    np.testing.assert_allclose([a.shortfall_tokens for a in windowed], [a.shortfall_tokens for a in whole],
                               rtol=1e-9)
    counts = [a.count for a in whole]
    assert min(counts) < 16 and max(counts) > 64  # within the first window, and past the second


def test_the_policy_describes_a_limited_head_of_the_queue_once_forecasting():
    policy = ForecastPolicy(PolicyConfig(eps_m=0.05, b_max=1024))
    assert policy.waiting_limit() is None  # before the first forecast the whole queue may matter
    policy.batch_cap(cold_state())
    assert 0 < policy.last.admitted < 100
    assert policy.waiting_limit() == forecast_module.WAITING_LIMIT
    # A limit that all fitted grows: 300 short requests into an ample cache all fit.
    for _ in range(50):
        policy.observe_finished(16, 50)
    roomy = view(np.zeros(0, int), np.zeros(0, int), np.full(300, 16), blocks=100_000)
    assert policy.batch_cap(roomy) == 300 and policy.waiting_limit() == 600
    # Once nothing waits Algorithm 1 decides, and the next forecast may again see the whole queue.
    policy.batch_cap(StepState(num_running=300, num_waiting=0, kv_capacity_blocks=100_000, block_size=16))
    assert policy.waiting_limit() is None


def test_preemption_feedback_widens_the_margin_on_preemption_and_narrows_it_while_unused():
    def state() -> StepState:
        return StepState(num_running=4, num_waiting=10, kv_capacity_blocks=30, block_size=16,
                         running_tokens=np.full(4, 116), running_generated=np.full(4, 100),
                         waiting_tokens=np.full(10, 16), waiting_generated=np.zeros(10, dtype=np.int64))

    # The margin unbounded (forecast_margin_cap=1): the feedback scales theta, and a bound would hide it.
    fixed = ForecastPolicy(PolicyConfig(eps_m=0.05, b_max=64, min_observations=2, forecast_after=2,
                                        forecast_margin_cap=1.0, forecast_margin_cap_predicted=1.0))
    policy = ForecastPolicy(PolicyConfig(eps_m=0.05, b_max=64, min_observations=2, forecast_after=2,
                                         forecast_margin_feedback=True, forecast_margin_cap=1.0,
                                         forecast_margin_cap_predicted=1.0))
    for p in (fixed, policy):
        for n in (100, 120, 140):
            p.observe_finished(16, n)
    fixed.batch_cap(state())
    policy.observe_preempted(200)
    policy.batch_cap(state())
    assert policy.margin.scale == forecast_module.MARGIN_WIDEN
    assert policy.last.margin_blocks > fixed.last.margin_blocks  # the margin the forecast keeps free widened
    assert policy.trace_fields()["margin_scale"] == forecast_module.MARGIN_WIDEN
    # Forecasts that admit nothing, with nothing preempted: the margin sits unused and narrows to its least.
    narrowing = math.log(forecast_module.MARGIN_SCALE_MIN / forecast_module.MARGIN_WIDEN) / math.log(
        forecast_module.MARGIN_NARROW)
    for _ in range(forecast_module.MARGIN_QUIET_FORECASTS + math.ceil(narrowing) + 8):
        policy.batch_cap(state())
    assert policy.last.admitted == 0 and policy.margin.scale == forecast_module.MARGIN_SCALE_MIN
    assert policy.last.margin_blocks < fixed.last.margin_blocks
    assert "margin_scale" not in fixed.trace_fields()  # off by default



def deterministic_policy(length: int = 200) -> ForecastPolicy:
    """Every length `length`; without backfilling (with it, any finish calls for a forecast while the head is
    blocked) and with the margin unbounded, as the tests' numbers assume."""
    policy = ForecastPolicy(PolicyConfig(eps_m=0.05, b_max=64, min_observations=2, forecast_after=2,
                                         forecast_backfill=False, forecast_margin_cap=1.0,
                                         forecast_margin_cap_predicted=1.0))
    for _ in range(50):
        policy.observe_finished(16, length)
    return policy


def described(running: int, free_blocks: int, generated: int = 0, waiting: int = 10, prompt: int = 16,
              step: int = 0) -> StepState:
    """`running` requests of a 16-token prompt that generated `generated` tokens, rows 0.., then `waiting` ones
    with `prompt` tokens; a 2400-token cache; engine step `step`."""
    state = StepState(num_running=running, num_waiting=waiting, kv_capacity_blocks=150, block_size=16,
                      kv_free_blocks=free_blocks, step=step)
    state.running_tokens, state.running_generated = np.full(running, 16 + generated), np.full(running, generated)
    state.waiting_tokens, state.waiting_generated = np.full(waiting, prompt), np.zeros(waiting, dtype=np.int64)
    state.running_rows, state.waiting_rows = np.arange(running), running + np.arange(waiting)
    return state


def test_a_request_that_does_not_fit_now_waits_for_the_cache_to_free_what_it_lacks():
    policy = deterministic_policy()
    # 10 requests near their end hold 2260 of the 2400 tokens: a 200-token prompt overshoots now.
    assert policy.batch_cap(described(10, free_blocks=5, generated=195, prompt=200)) == 10
    assert policy.last.admitted == 0 and policy.last.overshoot.tokens_ahead == 0
    lacking = policy.last.shortfall_tokens
    # Finishes whose blocks the running requests' new tokens took: nothing fits yet, however many finish
    # (the estimate has no say in what is held now).
    for _ in range(3):
        policy.observe_finished(16, 200)
    assert policy.since.freed_tokens > lacking and not policy.wants_requests(described(7, free_blocks=5))
    assert not policy.wants_requests(described(7, free_blocks=5 + int(lacking // 16) - 1))
    assert policy.wants_requests(described(7, free_blocks=5 + int(lacking // 16) + 1))


def test_a_request_that_overshoots_later_waits_for_finishes_beyond_those_expected(monkeypatch):
    monkeypatch.setattr(forecast_module, "STABLE_COUNT", 0)  # finishes no longer move the estimate enough to matter
    policy = deterministic_policy()
    # Fresh requests heading for 200 tokens each: 10 of them fit the cache all the way, an 11th would at
    # their end, not now.
    assert policy.batch_cap(described(10, free_blocks=130)) == 10
    overshoot = policy.last.overshoot
    assert policy.last.admitted == 0 and overshoot.tokens_ahead > 100
    assert 0 < policy.last.shortfall_tokens < 216  # one running request's share there is more than it lacks
    policy.observe_finished(16, 30)  # a finish the forecast cannot place frees nothing there
    assert not policy.wants_requests(described(9, free_blocks=130))
    policy.observe_finished(16, 30, row=3)  # one that was to run past then did not
    assert policy.wants_requests(described(8, free_blocks=130))
    # Without a finish the forecast is out of date once that time has come: its policy says so beforehand
    # (steady_until), and the steps until then need not ask it.
    policy = deterministic_policy()
    policy.batch_cap(described(10, free_blocks=130, step=100))
    ahead = int(policy.last.overshoot.tokens_ahead)
    assert policy.steady_until() == 100 + ahead
    for step in range(101, 100 + ahead):
        assert not policy.wants_requests(described(10, free_blocks=130, step=step))
    assert policy.wants_requests(described(10, free_blocks=130, step=100 + ahead))


def test_while_the_cap_binds_the_forecast_waits_for_room_worth_admitting_into():
    policy = ForecastPolicy(PolicyConfig(eps_m=0.05, b_max=1024, min_observations=2, forecast_after=2))
    for _ in range(50):
        policy.observe_finished(16, 200)
    first = StepState(num_running=0, num_waiting=2000, kv_capacity_blocks=100_000, block_size=16,
                      kv_free_blocks=100_000)
    first.running_tokens = first.running_generated = first.running_rows = np.zeros(0, dtype=np.int64)
    first.waiting_tokens, first.waiting_generated = np.full(1024, 16), np.zeros(1024, dtype=np.int64)
    first.waiting_rows = np.arange(1024)
    assert policy.batch_cap(first) == 1024 and policy.last.admitted == 1024  # ample memory: the cap binds

    def running(n: int) -> StepState:
        return StepState(num_running=n, num_waiting=976, kv_capacity_blocks=100_000, block_size=16,
                         kv_free_blocks=90_000)
    # A few finished: room for a few, not yet worth a forecast over a thousand running requests (nor a step
    # with prefill for them); the cap holds the running count meanwhile.
    for _ in range(4):
        policy.observe_finished(16, 200)
    assert not policy.wants_requests(running(1020)) and policy.batch_cap(running(1020)) == 1020
    for _ in range(20):
        policy.observe_finished(16, 200)
    assert policy.wants_requests(running(1000))


def test_survival_never_exceeds_one_where_interpolation_rounds_up():
    # (above + (now - above) * 1) / now rounds to 1.0000000000000002 for these two: a survival over 1 makes a
    # demand's variance negative, its sd NaN, and no admission ever fits (a pass stalls at one request).
    now, above = 0.004998958136876471, 0.0010628500471110392
    reach = np.array([1.0, now, above, 0.0])
    ahead = np.array([[0.0, 0.5, 1.0]])  # fractional bins ahead (scaled requests) take the interpolation
    alive = forecast_module._alive(np.array([1]), reach, ahead)
    assert alive.max() <= 1.0 and alive[0, 0] == 1.0
    lengths = CensoredLengths(bin_tokens=16)
    for n in (20, 40, 40, 300):
        lengths.observe(n)
    assert admits([300.0], [30], np.full(4, 100.0), blocks=6250, lengths=lengths, theta=1.6,
                  running_scale=np.array([1.3]), waiting_scale=np.full(4, 1.3)) == 4


def test_the_running_requests_are_tested_at_each_future_time_not_at_their_worst_of_each():
    # Long running requests 900 tokens in: their expected demand is highest now, its spread later (who ends
    # when). Adding the largest spread to the largest demand admits nothing where the pointwise test (the one
    # admissions pass) has room.
    lengths = CensoredLengths(bin_tokens=16)
    for n in np.random.default_rng(1).lognormal(np.log(1200), 0.5, 400).astype(int):
        lengths.observe(int(n))

    def admit(blocks: int, pointwise: bool):
        return expected_demand_admissions(view(np.full(60, 1000), np.full(60, 900), np.full(50, 100), blocks=blocks),
                                          lengths, 1.645, pointwise_running_peak=pointwise)

    # Each test's own peak for the running requests alone: what they overshoot a cache of no tokens by.
    worst_of_each = admit(0, False).shortfall_tokens
    pointwise = admit(0, True).shortfall_tokens
    assert pointwise < worst_of_each
    between = int((pointwise + 0.5 * (worst_of_each - pointwise)) // 16)
    assert admit(between, False).count == 0
    assert admit(between, True).count > 0
    # With room for everyone the two agree.
    assert admit(10**8, False).count == admit(10**8, True).count == 50


def test_admissions_come_in_waves_of_a_share_of_the_running():
    # kv-bound-like: short outputs, a cache far smaller than the demand. Admitting whatever fits at each finish
    # puts prompt tokens into most steps (each leaves vLLM's decode-only CUDA graph); a wave of 8% of the
    # running count puts them into few, and the cache stays about as full.
    from rollout.sim.engine import StepTimeModel, simulate
    from rollout.workloads import ProfileConfig, profile_requests

    profile = ProfileConfig(num_prompts=512, prompt_tokens=128, median_output=200, sigma=0.8, max_output=1024)
    requests = [(len(r.prompt.token_ids), r.output_tokens) for r in profile_requests(profile, 0)]
    runs = {}
    for wave in (0.0, 0.08):
        policy = make_policy({"name": "forecast", "b_max": 512, "eps_m": 0.05, "forecast_min_wave": wave})
        runs[wave] = simulate(requests, policy, kv_capacity_blocks=2048, block_size=16, max_num_seqs=512,
                              token_budget=8192, step_time=StepTimeModel(), keep_trace=True,
                              nominal_max_tokens=profile.max_output)
        assert runs[wave].generated_tokens == sum(out for _, out in requests)
    admitting = {wave: int(np.sum(np.diff([row[1] for row in run.trace]) > 0)) for wave, run in runs.items()}
    assert admitting[0.08] < 0.5 * admitting[0.0]
    mean_running = {wave: np.mean([row[1] for row in run.trace]) for wave, run in runs.items()}
    assert mean_running[0.08] > 0.9 * mean_running[0.0]


def test_a_wave_too_small_waits_for_finishes_before_the_next_forecast():
    def policy(wave):
        p = make_policy({"name": "forecast", "b_max": 512, "eps_m": 0.05, "forecast_min_wave": wave,
                         "forecast_margin_cap": 1.0})
        for n in np.random.default_rng(2).lognormal(np.log(200), 0.6, 200).astype(int):
            p.observe_finished(100, int(n))
        return p

    # 100 running well into a short distribution; the cache has room for a few of the 50 waiting.
    state = StepState(num_running=100, num_waiting=50, kv_capacity_blocks=1750, block_size=16,
                      pending_prompt_tokens_mean=100, pending_max_tokens_mean=1024, max_tokens_bound=1024,
                      running_tokens=np.full(100, 250), running_remaining=np.full(100, 50),
                      waiting_tokens=np.full(50, 100), waiting_remaining=np.full(50, 200),
                      running_generated=np.full(100, 150), waiting_generated=np.zeros(50, int),
                      kv_free_blocks=150)
    fits = policy(0.0).batch_cap(state) - state.num_running
    assert 0 < fits < 8  # a few fit: fewer than 8% of the running
    waves = policy(0.08)
    assert waves.batch_cap(state) == state.num_running  # so none is admitted
    skipped = StepState(**{**state.__dict__, "running_tokens": None, "running_generated": None,
                           "waiting_tokens": None, "waiting_generated": None})
    for k in range(forecast_module.WAVE_WAIT * (math.ceil(0.08 * 100) - fits)):
        # no forecast until WAVE_WAIT times as many as the wave lacked have finished
        assert not waves.wants_requests(skipped), k
        waves.observe_finished(100, 200)
    assert waves.wants_requests(skipped)


def grouped_long_state(blocks: int = 4000) -> tuple[StepState, CensoredLengths]:
    """Two groups of eight long samples running a third of the way, then short single requests waiting; lengths
    spread widely, so the groups' demands (their samples moving together) carry a wide margin."""
    lengths = CensoredLengths(bin_tokens=16)
    rng = np.random.default_rng(5)
    for n in rng.lognormal(np.log(2000), 0.6, 300).astype(int):
        lengths.observe(int(n))
    state = view(np.full(16, 900), np.full(16, 700), np.full(60, 200), blocks=blocks,
                 running_group=np.repeat([0, 1], 8), running_shared=np.zeros(16, dtype=np.int64),
                 waiting_group=np.arange(2, 62), waiting_shared=np.zeros(60, dtype=np.int64))
    return state, lengths


def test_the_margin_kept_free_is_at_most_its_share_of_the_cache():
    state, lengths = grouped_long_state()
    capacity = state.kv_capacity_blocks * state.block_size
    free = expected_demand_admissions(state, lengths, 1.645)
    assert free.margin_tokens > 0.3 * capacity  # the groups' spread: a third of the cache kept free
    bounded = expected_demand_admissions(state, lengths, 1.645, margin_cap=0.2)
    assert bounded.margin_tokens <= 0.2 * capacity + 1e-6
    assert bounded.count > free.count
    # Where the margin is under the bound, the bound changes nothing.
    assert expected_demand_admissions(state, lengths, 0.1, margin_cap=0.2) == \
        expected_demand_admissions(state, lengths, 0.1)
    # The policy bounds it by its setting.
    policy = ForecastPolicy(PolicyConfig(eps_m=0.05, b_max=256, forecast_after=8, forecast_backfill=False,
                                         forecast_margin_cap=0.2))
    policy.lengths = lengths
    policy.batch_cap(state)
    assert policy.last.admitted == bounded.count
    assert policy.last.margin_blocks * state.block_size == pytest.approx(bounded.margin_tokens)


def test_forecast_backfill_runs_short_requests_beside_a_blocked_long_head():
    # Every length is 100 tokens in the estimate's units; scales make the running two 1,000 (half done), the head
    # of the queue 2,000 and the ten behind it 100. The head does not fit beside the running ones (2,600 tokens of
    # cache: 2,800 at 500 tokens ahead); it fits once they end, and the short ones are gone long before.
    lengths = CensoredLengths(bin_tokens=16)
    for _ in range(50):
        lengths.observe(100)
    state = view(np.full(2, 600), np.full(2, 500), np.r_[100, np.full(10, 50)], blocks=2600 // 16,
                 running_scale=np.full(2, 10.0), waiting_scale=np.r_[20.0, np.ones(10)])
    assert expected_demand_admissions(state, lengths, 0.0) == expected_demand_admissions(state, lengths, 0.0,
                                                                                          backfill=False)
    blocked = expected_demand_admissions(state, lengths, 0.0)
    assert blocked.count == 0 and blocked.backfill == ()
    filled = expected_demand_admissions(state, lengths, 0.0, backfill=True)
    assert filled.count == 0  # the head waits
    # Short ones run beside the running ones, as many as fit there: about 1,200 tokens at 100 ahead, some 165
    # tokens each at their peak.
    assert list(filled.backfill) == list(range(1, 1 + len(filled.backfill))) and 5 <= len(filled.backfill) <= 8
    policy = ForecastPolicy(PolicyConfig(eps_m=0.05, b_max=64, forecast_after=8))
    assert policy.backfills  # the default


def test_forecast_backfill_never_passes_a_preempted_request():
    # The scene above, but the head was preempted after 40 output tokens: the short ones behind it would take the
    # memory it needs to resume, each finish letting in more of them, and the pass's longest request would wait
    # for the whole queue. It resumes first; nothing is admitted past it.
    lengths = CensoredLengths(bin_tokens=16)
    for _ in range(50):
        lengths.observe(100)
    scene = dict(blocks=2600 // 16, running_scale=np.full(2, 10.0), waiting_scale=np.r_[20.0, np.ones(10)])
    preempted = view(np.full(2, 600), np.full(2, 500), np.r_[140, np.full(10, 50)], np.r_[40, np.zeros(10, int)],
                     **scene)
    waits = expected_demand_admissions(preempted, lengths, 0.0, backfill=True)
    assert waits.count == 0 and waits.backfill == ()
    fresh = view(np.full(2, 600), np.full(2, 500), np.r_[140, np.full(10, 50)], **scene)
    passed = expected_demand_admissions(fresh, lengths, 0.0, backfill=True)
    assert passed.count == 0 and len(passed.backfill) >= 5
    # The policy, as the adapter and the simulator ask it: the preempted head keeps the cap at the running ones.
    policy = ForecastPolicy(PolicyConfig(eps_m=0.05, b_max=64, forecast_after=8, forecast_min_wave=0.0))
    policy.lengths = lengths
    assert policy.batch_cap(preempted) == 2 and policy.backfill() == []
