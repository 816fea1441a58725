"""The benchmark's synthetic workloads (rollout/workloads.py): what each kind promises of its lengths."""

import numpy as np

from rollout.workloads import ProfileConfig, max_prompt_tokens, profile_requests


def per_prompt(requests):
    lengths: dict[int, list[int]] = {}
    prompts = {}
    for r in requests:
        lengths.setdefault(r.group, []).append(r.output_tokens)
        prompts[r.group] = r.prompt.token_ids
    return lengths, prompts


def test_a_mixture_keeps_each_prompts_class_and_grows_the_long_class_between_iterations():
    profile = ProfileConfig(name="tail", kind="mixture", num_prompts=400, samples_per_prompt=4, prompt_tokens=300,
                            prompt_sigma=0.8, median_output=200, sigma=0.3, sample_sigma=0.2, long_share=0.2,
                            long_ratio=10.0, long_drift=1.5, drift=1.0, max_output=100_000, iterations=2)
    first, prompts = per_prompt(profile_requests(profile, 0, seed=3))
    second, prompts_again = per_prompt(profile_requests(profile, 1, seed=3))
    assert prompts == prompts_again  # the same prompts come back
    assert all(len(v) == 4 for v in first.values()) and len(first) == 400
    median = {g: np.median(v) for g, v in first.items()}
    long = {g for g, m in median.items() if m > 200 * np.sqrt(10)}  # the classes are 10x apart, each 30% wide
    assert 0.12 < len(long) / 400 < 0.28
    # A prompt's class does not change; the long class grows by long_drift, the rest stays.
    assert {g for g, v in second.items() if np.median(v) > 200 * np.sqrt(10)} == long
    growth = {g: np.log(np.median(second[g]) / median[g]) for g in first}
    assert abs(np.exp(np.mean([growth[g] for g in long])) - 1.5) < 0.1
    assert abs(np.exp(np.mean([growth[g] for g in first if g not in long])) - 1.0) < 0.05
    lengths = [len(p) for p in prompts.values()]
    assert max(lengths) <= max_prompt_tokens(profile) == 1200 and np.percentile(lengths, 90) > 2 * 300 * 0.8


def test_a_mixture_is_seeded_and_capped_at_max_output():
    profile = ProfileConfig(kind="mixture", num_prompts=50, samples_per_prompt=2, max_output=300, long_ratio=20.0)
    a = [(len(r.prompt.token_ids), r.output_tokens) for r in profile_requests(profile, 0, seed=1)]
    assert a == [(len(r.prompt.token_ids), r.output_tokens) for r in profile_requests(profile, 0, seed=1)]
    assert max(n for _, n in a) == 300 and min(n for _, n in a) >= 1
