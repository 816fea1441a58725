"""The benchmark's synthetic workloads (rollout/workloads.py): what each kind promises of its lengths."""

import json

import numpy as np
import pytest

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


@pytest.mark.parametrize("kind", ["mixture", "grpo"])
def test_new_prompts_draws_each_later_iteration_its_own_prompts_from_the_same_distribution(kind):
    common = dict(kind=kind, num_prompts=600, samples_per_prompt=4, prompt_tokens=300, median_output=200, sigma=0.3,
                  sample_sigma=0.2, long_share=0.2, long_ratio=10.0, long_drift=1.5, drift=1.0, max_output=100_000,
                  iterations=3)
    if kind == "mixture":
        common["prompt_sigma"] = 0.8
    same, fresh = ProfileConfig(**common), ProfileConfig(**common, new_prompts=True)
    # The first iteration is the one without new prompts, to the token.
    assert [(r.prompt.token_ids, r.output_tokens) for r in profile_requests(fresh, 0, seed=5)] == \
        [(r.prompt.token_ids, r.output_tokens) for r in profile_requests(same, 0, seed=5)]
    seen = [per_prompt(profile_requests(fresh, k, seed=5)) for k in range(3)]
    keys = [{tuple(p) for p in prompts.values()} for _, prompts in seen]
    assert not keys[0] & keys[1] and not keys[1] & keys[2]  # no prompt comes back
    assert keys[1] != {tuple(p) for p in per_prompt(profile_requests(same, 1, seed=5))[1].values()}
    # ... but the lengths come from the same distribution, drift included: each iteration's median per prompt
    # against the same iteration without new prompts.
    for k in (1, 2):
        a = np.median([np.median(v) for v in seen[k][0].values()])
        b = np.median([np.median(v) for v in per_prompt(profile_requests(same, k, seed=5))[0].values()])
        assert abs(np.log(a / b)) < 0.15
    if kind == "mixture":  # the long class keeps its share and grows by long_drift per iteration
        for k in (1, 2):
            medians = np.array([np.median(v) for v in seen[k][0].values()])
            long = medians > 200 * np.sqrt(10) * 1.5 ** k
            assert 0.14 < long.mean() < 0.26
            assert abs(np.median(medians[long]) / (2000 * 1.5 ** k) - 1) < 0.15


def test_a_recorded_profile_cannot_draw_new_prompts(tmp_path):
    from rollout.config import ConfigError
    from rollout.suite import load_bench_config

    config = tmp_path / "bench.yaml"
    config.write_text("model: tiny\nschedulers: [vllm]\nprofiles:\n  - name: mine\n    kind: recorded\n"
                      f"    lengths_file: {tmp_path / 'run'}\n    new_prompts: true\n")
    with pytest.raises(ConfigError, match=r"\['mine'\]: new_prompts: a recorded profile's prompts"):
        load_bench_config(str(config), [])


def test_a_mixture_is_seeded_and_capped_at_max_output():
    profile = ProfileConfig(kind="mixture", num_prompts=50, samples_per_prompt=2, max_output=300, long_ratio=20.0)
    a = [(len(r.prompt.token_ids), r.output_tokens) for r in profile_requests(profile, 0, seed=1)]
    assert a == [(len(r.prompt.token_ids), r.output_tokens) for r in profile_requests(profile, 0, seed=1)]
    assert max(n for _, n in a) == 300 and min(n for _, n in a) >= 1


def write_run(folder, rows):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "samples.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return folder


def sample(prompt_id, prompt_tokens, completion_tokens, **extra):
    return {"prompt_id": prompt_id, "sample_index": 0, "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens, "completion": "...", **extra}


def test_a_recorded_run_replays_its_prompts_and_lengths_and_resamples_them_later(tmp_path):
    rows = [sample("a", 30, n) for n in (100, 110)] + [sample("b", 7, n) for n in (2000, 2100)]
    run = write_run(tmp_path / "run", [rows[0], rows[2], rows[1], rows[3]])  # samples interleaved, as they finish
    profile = ProfileConfig(kind="recorded", lengths_file=str(run), num_prompts=10, samples_per_prompt=2,
                            max_output=4096, drift=1.5, iterations=2)
    first = profile_requests(profile, 0)
    assert [(len(r.prompt.token_ids), r.output_tokens, r.group) for r in first] == [
        (30, 100, 0), (30, 110, 0), (7, 2000, 1), (7, 2100, 1)]
    assert max_prompt_tokens(profile) == 30
    second = profile_requests(profile, 1)
    assert [r.prompt.token_ids for r in second] == [r.prompt.token_ids for r in first]  # the same prompts
    assert all(r.output_tokens in (150, 165) for r in second[:2])  # each prompt keeps its own lengths, grown
    assert all(r.output_tokens in (3000, 3150) for r in second[2:])
    more = ProfileConfig(kind="recorded", lengths_file=str(run / "samples.jsonl"), num_prompts=1,
                         samples_per_prompt=5, max_output=105)
    drawn = profile_requests(more, 0)
    assert len(drawn) == 5 and {r.output_tokens for r in drawn} <= {100, 105}  # drawn, capped at max_output


@pytest.mark.parametrize("content, message", [
    (None, "no such file"),
    ("", "no samples"),
    ('{"prompt_id": "a", "prompt_tokens": 3, "completion_tokens": 5}\n{"prompt_id": "a"}\n',
     "line 2: a sample needs prompt_id, prompt_tokens, completion_tokens"),
    ('{"prompt_id": "a", "prompt_tokens": 3, "completion_tokens": 5}\n\nnot json\n', "line 3: not a JSON object"),
    ('{"prompt_id": "a", "prompt_tokens": 0, "completion_tokens": 5}\n', "line 1: prompt_tokens must be"),
])
def test_a_bad_recorded_run_is_named_with_its_line(tmp_path, content, message):
    from rollout.data import DataError

    path = tmp_path / "samples.jsonl"
    if content is not None:
        path.write_text(content)
    profile = ProfileConfig(kind="recorded", lengths_file=str(path))
    with pytest.raises(DataError, match=message):
        profile_requests(profile, 0)


def test_the_bench_refuses_a_recorded_profile_without_its_file_before_any_engine(tmp_path, capsys):
    from rollout.bench import main

    config = tmp_path / "bench.yaml"
    config.write_text("model: tiny\nschedulers: [vllm]\nprofiles:\n  - name: mine\n    kind: recorded\n"
                      f"    lengths_file: {tmp_path / 'missing'}\n")
    assert main(["--config", str(config), f"out_dir={tmp_path / 'out'}"]) == 2
    assert "no such file" in capsys.readouterr().err
