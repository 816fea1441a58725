"""The randomized family of workloads (rollout.sim.family) and its judge (rollout.sim.judge), in the simulator."""

import numpy as np
import pytest

from rollout.sim.family import MAX_REQUESTS, MAX_TOKENS_LIMIT, SHAPES, draw, peak_demand_tokens
from rollout.workloads import ProfileConfig, profile_requests

SEEDS = range(0, 60)


@pytest.fixture(scope="module")
def draws():
    return [draw(seed) for seed in SEEDS]


def test_a_seed_gives_the_same_workload_every_time(draws):
    again = draw(SEEDS[7])
    assert again == draws[7]
    first = [(r.prompt.token_ids, r.output_tokens, r.group) for r in profile_requests(again.profile, 1, again.seed)]
    assert first == [(r.prompt.token_ids, r.output_tokens, r.group)
                     for r in profile_requests(draws[7].profile, 1, draws[7].seed)]
    assert draw(SEEDS[8]).profile != again.profile


def test_every_parameter_stays_in_its_range_and_the_family_reaches_its_corners(draws):
    profiles = [d.profile for d in draws]
    assert all(8 <= p.num_prompts <= 2048 and 1 <= p.samples_per_prompt <= 16 for p in profiles)
    assert all(p.num_prompts * p.samples_per_prompt <= max(MAX_REQUESTS, p.num_prompts) for p in profiles)
    assert all(30 <= p.median_output <= 8000 and 0.2 <= p.sigma <= 1.5 for p in profiles)
    assert all(10 <= p.prompt_tokens <= 8000 and 0.6 <= p.drift <= 1.6 for p in profiles)
    assert all(16 <= p.max_output <= MAX_TOKENS_LIMIT for p in profiles)
    # The cut share is drawn up to a half; where max_tokens meets its limit, more may be cut.
    assert all(d.truncated_share <= 0.55 or d.profile.max_output == MAX_TOKENS_LIMIT for d in draws)
    # The cache: 5%-200% of the first pass's demand, or one request's full length where that is more.
    assert all(0.049 <= d.kv_share for d in draws)
    assert all(d.kv_share <= 2.01 or d.kv_capacity_tokens <= 2 * (
        d.profile.max_output + 4 * d.profile.prompt_tokens) for d in draws)
    # Its corners are reached: one-sample and many-sample prompts, one to three classes, one to three passes,
    # growth and shrinkage, new and the same prompts, caches far below and above the demand, every shape.
    classes = {1 + bool(p.long_share) + bool(p.mid_share) for p in profiles}
    assert classes == {1, 2, 3} and {p.iterations for p in profiles} == {1, 2, 3}
    assert min(p.samples_per_prompt for p in profiles) == 1 and max(p.samples_per_prompt for p in profiles) >= 12
    assert min(p.drift for p in profiles) < 0.8 and max(p.drift for p in profiles) > 1.3
    assert {p.new_prompts for p in profiles} == {True, False}
    assert min(d.kv_share for d in draws) < 0.1 and max(d.kv_share for d in draws) > 1.5
    assert {d.shape for d in draws} == set(SHAPES)
    assert max(d.truncated_share for d in draws) > 0.4 and min(d.truncated_share for d in draws) < 0.05


def test_a_three_class_mixture_puts_its_middle_class_between_the_others():
    profile = ProfileConfig(kind="mixture", num_prompts=3000, samples_per_prompt=1, median_output=100, sigma=0.1,
                            sample_sigma=0.01, long_share=0.2, long_ratio=20.0, mid_share=0.3, mid_ratio=4.0,
                            max_output=100_000, prompt_tokens=10)
    outputs = np.array([r.output_tokens for r in profile_requests(profile, 0, seed=3)])
    shares = [np.mean(outputs < 200), np.mean((outputs > 250) & (outputs < 800)), np.mean(outputs > 1200)]
    assert shares == pytest.approx([0.5, 0.3, 0.2], abs=0.03)
    # Without a middle class the draws are those the suite's mixture profiles always had.
    two = ProfileConfig(kind="mixture", num_prompts=50, samples_per_prompt=2)
    assert [r.output_tokens for r in profile_requests(two, 0, seed=1)] == [
        r.output_tokens for r in profile_requests(ProfileConfig(**{**two.__dict__, "mid_ratio": 7.0}), 0, seed=1)]


def test_the_peak_demand_counts_a_groups_prompt_once():
    profile = ProfileConfig(kind="mixture", num_prompts=4, samples_per_prompt=3, prompt_tokens=50, max_output=64)
    requests = profile_requests(profile, 0, seed=0)
    prompts = {r.group: len(r.prompt.token_ids) for r in requests}
    assert peak_demand_tokens(requests) == sum(prompts.values()) + sum(r.output_tokens for r in requests)


def test_the_judge_runs_each_scheduler_on_a_draw_and_reports_each_pass():
    from rollout.sim.judge import DEFAULT, ORACLE, REFERENCE, judge, report

    result = judge(3)
    passes = draw(3).profile.iterations
    assert result[REFERENCE]["ratio"] == 1.0 and len(result[DEFAULT]["pass_ratios"]) == passes
    assert result[ORACLE]["tokens_per_s"] > 0 and len(result["passes"]) == passes
    view = result["passes"][0]["vllm"]
    assert view["preemptions"] >= 0 and view["longest_wait_s"] >= 0
    text = report([result], "3")
    assert "seed 3:" in text and f"**{result[DEFAULT]['ratio']:.3f}x**" in text and "pass 1:" in text
