import gzip
import math
import json
from pathlib import Path

import numpy as np
import pytest

from rollout.policy import PolicyConfig, make_policy
from rollout.sim import StepTimeModel, fit_step_time, simulate
from rollout.workloads import ProfileConfig, profile_requests

ROOT = Path(__file__).resolve().parent.parent
MODEL = StepTimeModel(base=0.01, per_seq=1e-4, per_kv_token=1e-7, per_prefill_token=1e-5, per_mixed_step=2e-3)


def workload(n=200, seed=0):
    profile = ProfileConfig(num_prompts=n, prompt_tokens=64, median_output=150, max_output=800)
    return [(len(r.prompt.token_ids), r.output_tokens) for r in profile_requests(profile, 0, seed)]


@pytest.mark.parametrize("name", ["static", "memory", "memory-clt", "oracle"])
def test_every_token_is_generated(name):
    requests = workload()
    result = simulate(requests, make_policy({"name": name, "b_max": 128, "eps_m": 0.05}), kv_capacity_blocks=600,
                      block_size=16, max_num_seqs=128, token_budget=2048, step_time=MODEL)
    assert result.generated_tokens == sum(o for _, o in requests)
    assert result.makespan_s > 0
    if name == "oracle":
        assert result.preemptions == 0


def test_tight_cache_preempts_and_ample_cache_does_not():
    requests = workload()
    static = make_policy({"name": "static", "b_max": 256})
    tight = simulate(requests, static, kv_capacity_blocks=300, block_size=16, max_num_seqs=256, token_budget=4096,
                     step_time=MODEL)
    ample = simulate(requests, make_policy({"name": "static", "b_max": 256}), kv_capacity_blocks=100000,
                     block_size=16, max_num_seqs=256, token_budget=4096, step_time=MODEL)
    assert tight.preemptions > 0 and tight.recomputed_tokens > 0
    assert ample.preemptions == 0
    assert ample.makespan_s < tight.makespan_s


def test_kv_offloading_loads_a_preempted_requests_full_blocks_back_while_host_memory_holds_them():
    """With vLLM's KV offloading a resumed request loads its full blocks from host memory and computes again only
    its last partial block (recovered: all the rest), in less time than recomputing; where host memory keeps less
    than was written since the preemption, its blocks are gone and it computes everything again."""
    from rollout.sim.engine import HostOffload

    kwargs = dict(kv_capacity_blocks=300, block_size=16, max_num_seqs=256, token_budget=4096, step_time=MODEL)
    static = {"name": "static", "b_max": 256}
    requests = workload()
    plain = simulate(requests, make_policy(static), **kwargs)
    ample = simulate(requests, make_policy(static), **kwargs, offload=HostOffload(10 ** 9, 1e-9))
    scant = simulate(requests, make_policy(static), **kwargs, offload=HostOffload(16, 1e-9))
    assert plain.preemptions > 0 and plain.recovered_tokens == 0  # no groups: no prefix-cache hits either
    assert ample.preemptions > 0 and 0 < ample.recomputed_tokens - ample.recovered_tokens < 16 * ample.preemptions
    assert ample.makespan_s < plain.makespan_s
    assert scant.recovered_tokens == 0 and scant.makespan_s == plain.makespan_s


def test_the_policy_hears_of_every_preemption_and_step():
    class Listening(type(make_policy({"name": "static", "b_max": 256}))):
        def __init__(self, *args):
            super().__init__(*args)
            self.preempted, self.recomputed, self.steps = 0, 0, []

        def observe_preempted(self, computed_tokens):
            self.preempted += 1
            self.recomputed += computed_tokens

        def observe_step(self, latency_s, decode_requests, prefill_tokens):
            self.steps.append((latency_s, decode_requests, prefill_tokens))

    policy = Listening(PolicyConfig(name="static", b_max=256))
    result = simulate(workload(), policy, kv_capacity_blocks=300, block_size=16, max_num_seqs=256,
                      token_budget=4096, step_time=MODEL)
    assert policy.preempted == result.preemptions > 0 and policy.recomputed == result.recomputed_tokens
    assert len(policy.steps) == result.steps
    assert sum(latency for latency, _, _ in policy.steps) == pytest.approx(result.makespan_s)


def test_a_request_longer_than_the_cache_alone_still_finishes():
    result = simulate([(40, 500)], make_policy({"name": "static", "b_max": 4}), kv_capacity_blocks=100,
                      block_size=16, max_num_seqs=4, token_budget=512, step_time=MODEL)
    assert result.generated_tokens == 500 and result.preemptions == 0


def test_fit_recovers_a_known_step_time_model(tmp_path):
    rng = np.random.default_rng(0)
    capacity = 100000
    steps, t = [], 0.0
    for _ in range(3000):
        running = int(rng.integers(1, 300))
        scheduled = running + int(rng.integers(0, 2000)) * int(rng.random() < 0.2)
        kv = float(rng.random())
        steps.append([t, running, scheduled, kv, 0])
        t += MODEL(running, kv * capacity, scheduled - running)
    path = tmp_path / "steps-x.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write(json.dumps({"scheduler": "static-64", "rep": 0, "kv_capacity_tokens": capacity, "steps": steps}))
    from rollout.sim.fit import step_rows

    model, error = fit_step_time(step_rows(path))
    assert model.per_mixed_step == pytest.approx(MODEL.per_mixed_step, rel=1e-3)
    assert model.base == pytest.approx(MODEL.base, rel=1e-3)
    assert model.per_seq == pytest.approx(MODEL.per_seq, rel=1e-3)
    assert model.per_kv_token == pytest.approx(MODEL.per_kv_token, rel=1e-3)
    assert model.per_prefill_token == pytest.approx(MODEL.per_prefill_token, rel=1e-3)
    assert error < 1e-6


def test_fit_keeps_slow_prefill_steps_and_drops_hiccups(tmp_path):
    # Big prefills are the slow steps that price prefill (and so recomputation); a slow decode-only step is
    # a host hiccup and must not be read as a step.
    model = StepTimeModel(base=5e-3, per_seq=25e-6, per_kv_token=0.0, per_prefill_token=17e-6, per_mixed_step=5e-3)
    rng = np.random.default_rng(1)
    steps, t = [], 0.0
    for i in range(2000):
        running = int(rng.integers(50, 250))
        prefill = 0 if i == 700 else int(rng.choice([0, 0, 0, 300, 16000]))
        steps.append([t, running, running + prefill, 0.5, 0])
        t += model(running, 0, prefill) + (1.0 if i == 700 else 0.0)  # one 1 s stall of the host
    path = tmp_path / "steps-y.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write(json.dumps({"scheduler": "vllm", "rep": 0, "kv_capacity_tokens": 1000, "steps": steps}))
    from rollout.sim.fit import step_rows

    fitted, _ = fit_step_time(step_rows(path), per_kv_token=0.0)
    assert fitted.per_prefill_token == pytest.approx(17e-6, rel=1e-3)
    assert fitted.per_mixed_step == pytest.approx(5e-3, rel=1e-2)
    assert fitted.base == pytest.approx(5e-3, rel=1e-2)


def test_a_prompt_larger_than_the_cache_is_an_error_not_a_hang():
    with pytest.raises(ValueError, match="no progress"):
        simulate([(4000, 10)], make_policy({"name": "static", "b_max": 4}), kv_capacity_blocks=10, block_size=16,
                 max_num_seqs=4, token_budget=8192, step_time=MODEL)


def simulator_check(tmp_path, name: str, steps: str, *extra: str) -> dict:
    """`python -m rollout.sim` on recorded GPU runs (tests/data/sim), its step-time model fitted to the H100
    kv-bound runs: the one profile it compares, as its results.json holds it."""
    from rollout.sim.__main__ import main

    data = ROOT / "tests/data/sim"
    out = tmp_path / name
    assert main(["--config", str(ROOT / "configs/bench/gpu.yaml"), "--steps", str(data / steps),
                 "--fit", str(data / "kv-bound-h100-steps.jsonl.gz"), "--per-kv-token-ns", "40",
                 "--out", str(out), *extra]) == 0
    assert (out / "results.md").read_text().startswith("### ")  # the tables, for a reader
    [profile] = json.loads((out / "results.json").read_text())["profiles"]
    return profile


def test_the_simulator_check_on_a_committed_gpu_run_with_and_without_the_policys_time(tmp_path):
    args = ("only=[real]", "profiles.4.num_prompts=512", "schedulers=[vllm,forecast]")

    def simulated(profile: dict) -> dict:
        return {r["scheduler"]: (r["measured_tokens_per_s"], r["simulated_tokens_per_s"])
                for r in profile["schedulers"]}

    plain = simulated(simulator_check(tmp_path, "plain", "real-h100", *args))
    timed = simulated(simulator_check(tmp_path, "timed", "real-h100", "--policy-time", *args))
    assert set(plain) == set(timed) == {"vllm", "forecast"}
    for name in ("vllm", "forecast"):
        measured, sim = timed[name]
        assert abs(sim / measured - 1) < 0.10  # the simulator's accuracy goal, on a profile it was not fitted to
    assert timed["vllm"] == plain["vllm"]  # vLLM's own scheduler has no policy of ours to pay for
    assert timed["forecast"][1] < plain["forecast"][1]


def test_the_simulator_ranks_grpo_groups_as_the_gpu_did(tmp_path):
    """H100 runs at the config's size (256 prompts x 8, 2 iterations), held out from the fit: the simulator
    ranks the schedulers as the GPU did."""
    profile = simulator_check(tmp_path, "grpo", "grpo-groups-h100", "--policy-time", "only=[grpo-groups]",
                              "schedulers=[vllm,forecast,forecast-lpt]")
    assert profile["profile"] == "grpo-groups" and len(profile["schedulers"]) == 3
    for r in profile["schedulers"]:
        assert abs(r["error"]) < 0.10
        assert r["error"] == pytest.approx(r["simulated_tokens_per_s"] / r["measured_tokens_per_s"] - 1)
    assert profile["ranking_measured"] == ["forecast-lpt", "forecast", "vllm"]
    assert profile["ranking_simulated"] == profile["ranking_measured"]


def test_scheduler_settings_in_a_name_are_typed_as_on_the_command_line():
    from rollout.sim.runs import scheduler_settings
    from rollout.suite import load_bench_config

    bench = load_bench_config(None, [])
    settings = scheduler_settings(bench, "forecast:forecast_margin_feedback=false:eps_m=0.2:forecast_after=8")
    assert settings["forecast_margin_feedback"] is False and settings["eps_m"] == 0.2
    assert settings["forecast_after"] == 8
    policy = make_policy(scheduler_settings(bench, "forecast:forecast_margin_feedback=false"))
    assert policy.margin_feedback is False  # the text "false" is not a true value
    assert make_policy(scheduler_settings(bench, "forecast:forecast_margin_feedback=true")).margin_feedback


def test_fit_prices_steps_past_the_largest_graph_apart(tmp_path):
    model = StepTimeModel(base=0.008, per_seq=3e-5, per_kv_token=0.0, per_prefill_token=1.5e-5, per_mixed_step=3e-3,
                          graph_batch=200, per_eager_step=0.02)
    rng = np.random.default_rng(2)
    steps, t = [], 0.0
    for _ in range(3000):
        running = int(rng.integers(1, 400))
        scheduled = running + int(rng.integers(0, 2000)) * int(rng.random() < 0.2)
        steps.append([t, running, scheduled, 0.5, 0])
        t += model(running, 0, scheduled - running)
    path = tmp_path / "steps-g.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write(json.dumps({"scheduler": "vllm", "rep": 0, "kv_capacity_tokens": 1000, "steps": steps}))
    from rollout.sim.fit import step_rows

    fitted, error = fit_step_time(step_rows(path), per_kv_token=0.0, graph_batch=200)
    assert (fitted.graph_batch, fitted.per_eager_step) == (200, pytest.approx(0.02, rel=1e-3))
    assert fitted.base == pytest.approx(0.008, rel=1e-3) and error < 1e-6
    blind, _ = fit_step_time(step_rows(path), per_kv_token=0.0)  # one line through both sides of the edge
    assert blind.per_eager_step == 0.0 and blind.per_seq > 2 * 3e-5  # the edge read as a cost per request


def test_a_step_past_the_largest_graph_pays_for_its_prefill_tokens_only():
    model = StepTimeModel(base=0.008, per_seq=0.0, per_kv_token=0.0, per_prefill_token=1e-5, per_mixed_step=3e-3,
                          graph_batch=512, per_eager_step=0.02)
    # Under the graph a step with prefill leaves the decode-only graph; past it every step is eager already.
    assert model(512, 0, 100) - model(512, 0, 0) == pytest.approx(100 * 1e-5 + 3e-3)
    assert model(1024, 0, 100) - model(1024, 0, 0) == pytest.approx(100 * 1e-5)


def test_the_policy_is_told_the_nominal_max_tokens_not_the_imposed_lengths():
    # Requests of 8 tokens: told their own max_tokens, Algorithm 1's cold start (every request as long as the
    # mean max_tokens) fits them all; told a trainer's limit of 1,000, it fits what 1,032 tokens each allow.
    requests = [(32, 8)] * 100
    kwargs = dict(kv_capacity_blocks=512, block_size=16, max_num_seqs=64, token_budget=4096, step_time=MODEL,
                  keep_trace=True)

    def first_cap(**extra):
        policy = make_policy({"name": "memory", "b_max": 64, "eps_m": 0.05, "min_observations": 1000})
        return simulate(requests, policy, **kwargs, **extra).trace[0][2]

    assert first_cap() == 64
    assert first_cap(nominal_max_tokens=1000) < 8  # 512 * 16 / (32 + 1000) less the safety buffer


@pytest.mark.parametrize("kind, requests, blocks", [("lognormal", 256, 512), ("grpo", 64 * 8, 2048)])
def test_skipping_the_steps_the_forecast_called_steady_changes_nothing(kind, requests, blocks):
    """The adapter (and the simulator, as it) asks the policy only where a request arrived, was admitted,
    finished or was preempted, or where the policy's `steady_until` step has come: the same run as asking at
    every step, with a fraction of the asks. (Both workloads run differently if steady_until leaves out the step
    at which a request left out would overshoot.)"""
    grpo = kind == "grpo"
    profile = ProfileConfig(kind=kind, num_prompts=requests // 8 if grpo else requests, samples_per_prompt=8,
                            prompt_tokens=256 if grpo else 128, median_output=400 if grpo else 200, sigma=0.8,
                            max_output=4096 if grpo else 1024)
    work = [(len(r.prompt.token_ids), r.output_tokens, 1.0, r.group) for r in profile_requests(profile, 0, seed=0)]
    runs, asks = [], []
    for every in (True, False):
        policy = make_policy({"name": "forecast", "b_max": 1024, "eps_m": 0.05})
        count = [0]
        ask = policy.wants_requests

        def counted(state, ask=ask, count=count):
            count[0] += 1
            return ask(state)

        policy.wants_requests = counted
        result = simulate(work, policy, kv_capacity_blocks=blocks, block_size=16, max_num_seqs=1024,
                          token_budget=16384, step_time=MODEL, nominal_max_tokens=profile.max_output,
                          ask_every_step=every)
        runs.append((result.makespan_s, result.preemptions, result.recomputed_tokens, result.steps))
        asks.append(count[0])
    assert runs[0] == runs[1]
    assert asks[0] == runs[0][3] and asks[1] < asks[0] / 2


def test_the_result_names_the_request_that_finished_the_pass_and_when_it_started():
    short, long = [(16, 20)] * 12, [(16, 400)]
    policy = make_policy({"name": "static", "b_max": 4})
    kwargs = dict(kv_capacity_blocks=1000, block_size=16, max_num_seqs=4, token_budget=4096, step_time=MODEL)
    last = simulate(short + long, policy, **kwargs).last  # FIFO: the long request starts after the short ones
    assert last.output_tokens == 400 and last.started_s > 0 and last.recomputed_tokens == last.preemptions == 0
    first = simulate(long + short, make_policy({"name": "static", "b_max": 4}), **kwargs)
    assert first.last.output_tokens == 400 and first.last.started_s == 0.0
    assert first.makespan_s < simulate(short + long, make_policy({"name": "static", "b_max": 4}), **kwargs).makespan_s
    assert first.last.finished_s == first.makespan_s


def test_the_trace_counts_the_running_requests_of_the_passs_longest_tenth():
    # Two long requests among eighteen short ones (a tenth): FIFO with four at a time runs the short ones first.
    short, long = [(16, 20)] * 18, [(16, 400)] * 2
    kwargs = dict(kv_capacity_blocks=1000, block_size=16, max_num_seqs=4, token_budget=4096, step_time=MODEL,
                  keep_trace=True)
    late = [step[6] for step in simulate(short + long, make_policy({"name": "static", "b_max": 4}), **kwargs).trace]
    early = [step[6] for step in simulate(long + short, make_policy({"name": "static", "b_max": 4}), **kwargs).trace]
    assert max(late) == max(early) == 2
    assert early[0] == 2 and late[0] == 0  # first at the first step, or only once the short ones have run
    assert late.index(2) > 5 * 18 // 4


def test_the_oracle_runs_short_requests_beside_a_long_one_and_never_delays_or_preempts_the_longest():
    # Longest first, as the oracle submits: two long requests whose peaks do not fit together, then short ones.
    # Without backfilling the short ones would wait behind the second long one until the first ended.
    requests = [(16, 600), (16, 590)] + [(16, 30)] * 10
    policy = make_policy({"name": "oracle", "b_max": 64, "forecast_min_wave": 0.0})
    result = simulate(requests, policy, kv_capacity_blocks=60, block_size=16, max_num_seqs=64, token_budget=4096,
                      step_time=MODEL)
    assert result.preemptions == 0
    assert result.longest.output_tokens == 600 and result.longest.started_s == 0.0
    assert result.longest.preemptions == 0 and result.longest.recomputed_tokens == 0
    assert result.last.output_tokens == 590  # the short ones all ended before it: they ran beside the first


def test_preemption_takes_the_request_that_computed_least_not_the_long_one_admitted_last():
    from rollout.policy.policies import StaticPolicy

    class LeastProgressFirst(StaticPolicy):  # a static cap, preempting as the oracle does
        preemption_order = "least_computed"

    # Six shorter requests, then a long one with a long prompt, all admitted at once: at 200 tokens each the
    # shorter ones alone hold 84 blocks of the 80-block cache.
    requests = [(16, 300)] * 6 + [(400, 600)]
    kwargs = dict(kv_capacity_blocks=80, block_size=16, max_num_seqs=8, token_budget=4096, step_time=MODEL)
    fcfs = simulate(requests, StaticPolicy(PolicyConfig(name="static", b_max=8)), **kwargs)
    ours = simulate(requests, LeastProgressFirst(PolicyConfig(name="static", b_max=8)), **kwargs)
    assert fcfs.longest.output_tokens == ours.longest.output_tokens == 600
    assert fcfs.longest.preemptions > 0  # vLLM's FCFS order: the last admitted, the long one, goes
    # Shorter ones went instead, each throwing away less (though here more of them in all), and the long one,
    # the pass's end, ran through.
    assert ours.preemptions > 0 and ours.longest.preemptions == 0
    assert ours.recomputed_tokens / ours.preemptions < fcfs.recomputed_tokens / fcfs.preemptions
    assert ours.makespan_s < fcfs.makespan_s


@pytest.mark.parametrize("order", ["least_output", "vllm", "least_computed"])
def test_the_longest_request_admitted_first_runs_through_unless_preemption_counts_computed_tokens(order):
    from rollout.policy.policies import StaticPolicy

    class Ordered(StaticPolicy):
        preemption_order = order

    # The longest request first (longest-first admission), with the shortest prompt, then six shorter ones with
    # longer prompts, all admitted at once: their prompts take 79 of the 80 blocks, outgrown within 9 tokens.
    requests = [(16, 900)] + [(200, 300)] * 6
    result = simulate(requests, Ordered(PolicyConfig(name="static", b_max=8)), kv_capacity_blocks=80,
                      block_size=16, max_num_seqs=8, token_budget=4096, step_time=MODEL)
    assert result.preemptions > 0 and result.longest.output_tokens == 900 and result.longest.started_s == 0.0
    # The pass's end: by output or in vLLM's order the shorter ones go, and it runs through; by computed tokens
    # it goes first (its prompt is the shortest) and waits.
    assert (result.longest.preemptions == 0) == (order != "least_computed")


def test_speculation_advances_a_decoding_request_by_its_accepted_drafts_and_costs_a_verify_step():
    from rollout.sim import Speculation

    requests = [(16, 400)]
    kwargs = dict(kv_capacity_blocks=100, block_size=16, max_num_seqs=4, token_budget=4096, step_time=MODEL)
    plain = simulate(requests, make_policy({"name": "static", "b_max": 4}), **kwargs)
    always = simulate(requests, make_policy({"name": "static", "b_max": 4}), **kwargs,
                      speculation=Speculation(draft_tokens=4, acceptance=1.0, max_batch=8))
    never = simulate(requests, make_policy({"name": "static", "b_max": 4}), **kwargs,
                     speculation=Speculation(draft_tokens=4, acceptance=0.0, max_batch=8))
    assert plain.generated_tokens == always.generated_tokens == never.generated_tokens == 400
    assert always.steps == 1 + math.ceil(399 / 5)  # the prefill samples one, then 5 a step
    assert never.steps == plain.steps == 400 and never.makespan_s > plain.makespan_s  # verify steps cost more
    half = simulate(requests, make_policy({"name": "static", "b_max": 4}), **kwargs,
                    speculation=Speculation(draft_tokens=4, acceptance=0.5, max_batch=8))
    expected_per_step = (1 - 0.5 ** 5) / (1 - 0.5)  # 1 + accepted, accepted truncated at 4
    assert abs(399 / (half.steps - 1) - expected_per_step) < 0.25
    # Above max_batch nothing is drafted; a whole-pass configuration still pays the synchronous step there.
    wide = simulate(requests, make_policy({"name": "static", "b_max": 4}), **kwargs,
                    speculation=Speculation(draft_tokens=4, acceptance=1.0, max_batch=0))
    switched = simulate(requests, make_policy({"name": "static", "b_max": 4}), **kwargs,
                        speculation=Speculation(draft_tokens=4, acceptance=1.0, max_batch=0, whole_pass=False))
    assert wide.steps == switched.steps == 400 and switched.makespan_s == plain.makespan_s < wide.makespan_s


def test_data_parallel_engines_take_what_another_has_not_started(tmp_path):
    """The prompts alternate long and short, so the first pass's split of equal predictions (longest processing
    time first, ties in the set's order) gives one engine every long prompt; engines fed from the dispatcher's
    queues, the idle one taking from the other's, end the pass together instead."""
    from rollout.sim.runs import simulate_parallel, simulate_profile
    from rollout.suite import load_bench_config

    samples = tmp_path / "samples.jsonl"
    samples.write_text("".join(json.dumps({"prompt_id": f"p{i}", "prompt_tokens": 64,
                                           "completion_tokens": 600 if i % 2 == 0 else 60}) + "\n"
                               for i in range(48) for _ in range(2)))
    profile = ProfileConfig(name="alternating", kind="recorded", lengths_file=str(samples), num_prompts=48,
                            samples_per_prompt=2, max_output=1024, iterations=2, drift=1.0)
    bench = load_bench_config(None, [])
    times, longest = simulate_parallel(bench, profile, "forecast-lpt", MODEL, engines=2, kv_capacity_tokens=2048)
    assert times.shape == longest.shape == (2, 2)
    assert times[0].max() / times[0].mean() < 1.1  # the first pass, balanced by stealing
    assert times[1].max() / times[1].mean() < 1.1  # the second, by the memory's predicted work as well
    static = [simulate_profile(bench, profile, "forecast-lpt", MODEL, kv_capacity_tokens=2048,
                               share=lambda iteration, requests, e=e: [k for k, r in enumerate(requests)
                                                                       if r.group % 2 == e]).per_iteration_makespan_s[0]
              for e in range(2)]
    assert max(static) / np.mean(static) > 1.5  # what the same split does without stealing


def test_vllms_own_scheduler_runs_every_pass_of_a_profile_and_ours_preempts_less(tmp_path):
    """rollout.sim.vllm_loop on the CPU tail-bound profile (12 prompts x 4, two passes) over a KV cache of 1,024
    tokens, less than a pass's demand: each pass, on one scheduler, generates every token the profile draws, and
    ours (longest first, the forecast) preempts less than vLLM's default, which admits all that fits now."""
    from rollout.sim.vllm_loop import profile_run
    from rollout.suite import load_bench_config

    bench = load_bench_config(str(Path(__file__).parents[1] / "configs" / "bench" / "cpu-tail.yaml"), [])
    profile = bench.profiles[0]
    drawn = [sum(r.output_tokens for r in profile_requests(profile, k, bench.seed, bench.vocab_size))
             for k in range(profile.iterations)]
    preemptions = {}
    for name in ("vllm", "forecast-lpt"):
        passes = profile_run(bench, profile, name, StepTimeModel(), tmp_path / name, kv_bytes_per_token=65536)
        assert [result.generated_tokens for result, _ in passes] == drawn
        preemptions[name] = sum(result.preemptions for result, _ in passes)
    assert preemptions["forecast-lpt"] < preemptions["vllm"], preemptions


def test_a_later_pass_alone_starts_from_what_the_earlier_ones_taught(tmp_path):
    """start_iteration=1: only the second pass runs, and vLLM's scheduler with our adapter starts from the
    statistics and per-prompt memory the first pass would have left (files, as a trainer's next iteration finds
    them): at the pass's end each prompt's memory blends the first pass's mean with the second's. In the
    simulator, that fresh start runs the pass within 3% of the scheduler that ran the first pass itself."""
    from rollout.policy.length_stats import PromptLengths, prompt_key
    from rollout.sim.runs import simulate_profile
    from rollout.sim.vllm_loop import profile_run
    from rollout.suite import load_bench_config

    config = str(Path(__file__).parents[1] / "configs" / "bench" / "cpu-tail.yaml")
    bench = load_bench_config(config, ["start_iteration=1"])
    profile = bench.profiles[0]
    first, second = (profile_requests(profile, k, bench.seed, bench.vocab_size) for k in range(2))
    passes = profile_run(bench, profile, "forecast-lpt", StepTimeModel(), tmp_path, kv_bytes_per_token=65536)
    assert [result.generated_tokens for result, _ in passes] == [sum(r.output_tokens for r in second)]
    memory = PromptLengths.load(tmp_path / "state" / "prompt_lengths.json")

    def means(requests):
        out = {}
        for r in requests:
            out.setdefault(prompt_key(r.prompt.token_ids), []).append(r.output_tokens)
        return {key: np.mean(v) for key, v in out.items()}

    before, after = means(first), means(second)
    assert set(memory.mean) == set(after)
    for key, mean in memory.mean.items():
        assert mean == pytest.approx(memory.keep * before[key] + (1 - memory.keep) * after[key])

    alone = simulate_profile(bench, profile, "forecast-lpt", MODEL, kv_capacity_tokens=1024)
    both = simulate_profile(load_bench_config(config, []), profile, "forecast-lpt", MODEL, kv_capacity_tokens=1024)
    assert len(alone.per_iteration_makespan_s) == 1 and alone.generated_tokens == sum(r.output_tokens for r in second)
    assert alone.per_iteration_makespan_s[0] == pytest.approx(both.per_iteration_makespan_s[1], rel=0.03)


def test_start_iteration_must_leave_a_pass_to_run():
    from rollout.config import ConfigError
    from rollout.suite import load_bench_config

    config = str(Path(__file__).parents[1] / "configs" / "bench" / "cpu-tail.yaml")
    with pytest.raises(ConfigError, match=r"start_iteration=2: .*tail-bound has 2"):
        load_bench_config(config, ["start_iteration=2"])


@pytest.mark.parametrize("kv_bytes_per_token", [57344, 131072])
def test_vllms_offloading_in_the_loop_holds_as_many_blocks_as_the_models_kv_fills(tmp_path, kv_bytes_per_token):
    """rollout.sim.vllm_loop's scheduler has a cache spec of a few bytes a token; the host memory its offloading
    is given is measured in the model's KV, so that it holds as many blocks as on the GPU (vLLM divides it by a
    block's bytes rounded up to an alignment)."""
    from rollout.sim.vllm_loop import build_scheduler, config_only_model

    host = 32 * 2 ** 30
    scheduler = build_scheduler(config_only_model(tmp_path / "model"), None, num_blocks=64, block_size=16,
                                host_offload_bytes=host, kv_bytes_per_token=kv_bytes_per_token)
    try:
        manager = scheduler.connector.connector_scheduler.manager  # vLLM's CPUOffloadingManager (a block a chunk)
        assert manager._num_chunks == host // (kv_bytes_per_token * 16)
    finally:
        scheduler.shutdown()
