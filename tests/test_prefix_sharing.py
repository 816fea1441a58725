"""Prefix sharing: the n samples of a prompt share its full prompt blocks through vLLM's prefix cache;
the policies count them once, the simulator models them, and the adapter reports them from real requests."""

import numpy as np
import pytest

from rollout.policy import make_policy
from rollout.policy.forecast import Groups, shared_prompt_holding
from rollout.policy.oracle import oracle_admissions
from rollout.sim import StepTimeModel, simulate

MODEL = StepTimeModel(base=5e-3, per_seq=2e-5, per_kv_token=1e-8, per_prefill_token=2e-5, per_mixed_step=5e-3)


def test_a_groups_shared_prompt_counts_once_while_any_member_runs():
    rng = np.random.default_rng(0)
    alive = rng.random((7, 5))
    group = np.array([3, 1, 3, 3, 1, 8, 3])
    shared = np.array([64, 32, 64, 64, 32, 0, 64], dtype=float)
    holding = shared_prompt_holding(alive, Groups(group), shared)
    for g in (3, 1):
        rows = group == g
        expected = shared[rows][0] * (1 - np.prod(1 - alive[rows], axis=0))  # P(any member alive)
        np.testing.assert_allclose((holding * alive)[rows].sum(axis=0), expected)
    assert np.all(holding[group == 8] == 0)
    assert np.all(holding[0] == 64)  # a group's first row always carries the prompt


def test_group_sums_cover_earlier_rows_of_the_same_group_only():
    rng = np.random.default_rng(1)
    group = rng.integers(-1, 12, 60)  # -1: a request without a group (no prompt ids): never summed with others
    values = rng.random((60, 3))
    expected = np.zeros_like(values)
    for i in range(60):
        if group[i] >= 0:
            expected[i] = values[:i][group[:i] == group[i]].sum(axis=0)
    np.testing.assert_allclose(Groups(group).earlier_sum(values), expected)
    assert not Groups(np.arange(5)) and not Groups(np.full(4, -1))  # alone in their groups: nothing shared


def test_the_oracle_admits_more_when_samples_share_their_prompt():
    # 8 samples of one 160-token prompt, 40 tokens each: 8 x 200 tokens apart, 160 + 8 x 40 (+ blocks) shared.
    tokens, remaining = np.full(8, 160), np.full(8, 40)
    group, shared = np.zeros(8, dtype=np.int64), np.full(8, 160)
    empty = np.array([], dtype=np.int64)
    blind = oracle_admissions(empty, empty, tokens, remaining, 1000, 16)
    sharing = oracle_admissions(empty, empty, tokens, remaining, 1000, 16, empty, group, empty, shared)
    assert blind == 4 and sharing == 8
    # The shared blocks stay until the group's last member ends, even when that member arrives last.
    late = np.array([1, 1, 1, 400])
    assert oracle_admissions(empty, empty, np.full(4, 160), late, 500, 16, empty,  # 575 with the prompt held
                             np.zeros(4, dtype=np.int64), empty, np.full(4, 160)) == 3


def grpo_requests(groups=12, samples=8, prompt=256, seed=0):
    rng = np.random.default_rng(seed)
    latent = rng.lognormal(np.log(150), 0.6, groups)
    return [(prompt, int(np.clip(rng.lognormal(np.log(latent[g]), 0.3), 1, 1000)), 1.0, g)
            for g in range(groups) for _ in range(samples)]


def test_the_simulator_stores_and_computes_a_groups_prompt_once():
    # One group: 8 samples of a 256-token prompt (16 blocks), 10 output tokens each. Shared: the first 15
    # blocks; each sample holds the 16th of its own (vLLM recomputes a prompt's last token) and one for its
    # output: 15 + 8 x 2 = 31 blocks.
    requests = [(256, 10, 1.0, 0)] * 8
    kwargs = dict(kv_capacity_blocks=31, block_size=16, max_num_seqs=64, token_budget=4096, step_time=MODEL,
                  keep_trace=True)
    shared = simulate(requests, make_policy({"name": "static", "b_max": 64}), **kwargs)
    apart = simulate(requests, make_policy({"name": "static", "b_max": 64}), share_prompts=False, **kwargs)
    assert shared.generated_tokens == apart.generated_tokens == 80
    assert shared.preemptions == 0 and max(running for _, running, *_ in shared.trace) == 8
    assert max(running for _, running, *_ in apart.trace) == 1  # 17 blocks each: one at a time
    assert shared.makespan_s < apart.makespan_s / 4  # and the prompt is computed once, not eight times
    more = simulate(grpo_requests(), make_policy({"name": "static", "b_max": 256}), kv_capacity_blocks=400,
                    block_size=16, max_num_seqs=256, token_budget=4096, step_time=MODEL)
    assert more.generated_tokens == sum(r[1] for r in grpo_requests())


@pytest.mark.parametrize("name", ["oracle", "forecast"])
def test_policies_that_count_shared_prompts_fill_the_cache_without_preempting(name):
    requests = grpo_requests(groups=24)
    # The policies are told max_tokens 1,000, the cap the lengths are drawn under, not each request's length.
    kwargs = dict(kv_capacity_blocks=600, block_size=16, max_num_seqs=256, token_budget=4096, step_time=MODEL,
                  nominal_max_tokens=1000)
    # The margin unbounded (forecast_margin_cap 1): the test is of the demand that shared prompts add, which a
    # margin bounded at a few percent of the cache lets overshoot.
    result = simulate(requests, make_policy({"name": name, "b_max": 256, "eps_m": 0.05, "forecast_margin_cap": 1.0}),
                      keep_trace=True, **kwargs)
    assert result.generated_tokens == sum(r[1] for r in requests)
    assert result.recomputed_tokens <= 0.01 * result.generated_tokens
    if name == "oracle":
        assert result.preemptions == 0
    # More than the 600 * 16 / (256 + 150) ~ 24 requests that fit when every sample holds its own prompt.
    assert max(running for _, running, *_ in result.trace) > 40


@pytest.mark.engine
def test_the_adapter_reports_prompt_blocks_shared_by_a_groups_samples(tiny_model, tmp_path):
    from omegaconf import OmegaConf

    from rollout.config import RunConfig, validate
    from rollout.data import Prompt
    from rollout.engine import RolloutEngine

    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), {
        # A 512-token budget prefills under two prompts a step, so samples start and finish on different steps
        # however the requests reach the engine (all at once, samples of equal length finish together and the
        # forecast sees no running request to share with).
        "model": {"path": str(tiny_model), "dtype": "float32", "kv_cache_memory_bytes": 64 << 20,
                  "max_model_len": 1024, "max_num_batched_tokens": 512},
        "data": {"source": "synthetic"}, "sampling": {"n": 4, "max_tokens": 24, "ignore_eos": True},
        "policy": {"name": "forecast", "b_max": 16, "forecast_after": 1, "min_observations": 1},
        "output": {"stats_in": None}}))
    validate(cfg)
    rng = np.random.default_rng(1)
    # 300-token prompts: two full blocks of 128 tokens (the CPU block size) each, shared by the 4 samples.
    prompts = [Prompt(prompt_id=f"p{i}", text="", token_ids=rng.integers(10, 900, 300).tolist()) for i in range(12)]
    with RolloutEngine(cfg, tmp_path) as engine:
        result = engine.generate(prompts, progress=False)
    block = engine.header["block_size"]
    prompt_blocks = 300 // block * block  # what each sample after a group's first does not hold again
    seen = [s["shared_prompt_tokens"] for s in result.trace if s.get("shared_prompt_tokens")]
    assert seen and all(n % prompt_blocks == 0 for n in seen) and max(seen) >= 3 * prompt_blocks
    assert result.summary["generated_tokens"] == 12 * 4 * 24


@pytest.mark.engine
def test_the_forecast_admits_a_whole_group_while_other_groups_run(tiny_model, tmp_path):
    """The queue the adapter describes counts a running group's prompt blocks once. Counted per sample, two
    running groups of 6-block prompts already 'filled' this 64-block cache, the policy saw one waiting
    request a step and admitted one sample a step, each admission a prefill step of its own."""
    from omegaconf import OmegaConf

    from rollout.config import RunConfig, validate
    from rollout.data import Prompt
    from rollout.engine import RolloutEngine

    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), {
        "model": {"path": str(tiny_model), "dtype": "float32", "num_gpu_blocks_override": 64,
                  "kv_cache_memory_bytes": 64 << 20, "max_model_len": 1024},
        "data": {"source": "synthetic"}, "sampling": {"n": 8, "max_tokens": 64, "ignore_eos": True},
        "policy": {"name": "forecast", "b_max": 64}, "output": {"stats_in": None}}))
    validate(cfg)
    rng = np.random.default_rng(2)
    # 768-token prompts: 6 full blocks of 128 (the CPU block size), held once for a group's 8 samples; groups
    # of different output lengths finish at different steps, while others run.
    prompts = [Prompt(prompt_id=f"p{i}", text="", token_ids=rng.integers(10, 900, 768).tolist()) for i in range(10)]
    lengths = [8, 48, 16, 40, 24, 56, 8, 32, 16, 40]
    with RolloutEngine(cfg, tmp_path) as engine:
        result = engine.generate(prompts, progress=False, max_tokens=lengths)
    assert engine.header["block_size"] == 128
    waves = [s["forecast_admitted"] for s in result.trace
             if s.get("waiting") and s.get("running", 0) >= 16 and s.get("forecast_admitted")]
    assert waves and max(waves) >= 4, waves
    assert result.summary["generated_tokens"] == 8 * sum(lengths)


@pytest.mark.engine
def test_vllm_shares_a_prompts_full_blocks_but_the_last(tiny_model, tmp_path):
    """vLLM recomputes a prompt's last token, so a cached prompt of exactly two blocks lends a later sample only
    its first block: each of the 3 later samples writes the second prompt block again and one for its output.
    The adapter and the simulator count shared blocks by this rule ((prompt tokens - 1) // block size)."""
    from omegaconf import OmegaConf

    from rollout.config import RunConfig, validate
    from rollout.data import Prompt
    from rollout.engine import RolloutEngine

    blocks = 48
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), {
        # A 256-token budget prefills one prompt a step: a sample's prompt is cached before the next looks it up.
        "model": {"path": str(tiny_model), "dtype": "float32", "num_gpu_blocks_override": blocks,
                  "kv_cache_memory_bytes": 64 << 20, "max_model_len": 1024, "max_num_batched_tokens": 256},
        "data": {"source": "synthetic"}, "sampling": {"n": 4, "max_tokens": 40, "ignore_eos": True},
        "policy": {"name": "forecast", "b_max": 8}, "output": {"stats_in": None}}))
    validate(cfg)
    prompt = Prompt(prompt_id="p", text="", token_ids=np.random.default_rng(5).integers(10, 900, 256).tolist())
    with RolloutEngine(cfg, tmp_path) as engine:
        result = engine.generate([prompt], progress=False)
    assert engine.header["block_size"] == 128
    together = [s for s in result.trace if s.get("running") == 4]
    assert together
    # The first sample: 2 prompt blocks + 1 output block; each later one: 1 (its copy of the last prompt
    # block) + 1 output block. Sharing both prompt blocks would hold 3 + 3 x 1 = 6.
    used = max(round(s["kv_usage"] * blocks) for s in together)
    assert used == 3 + 3 * 2, used
    assert result.summary["generated_tokens"] == 4 * 40
