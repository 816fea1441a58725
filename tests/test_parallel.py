"""Data parallel rollouts: shares balanced by predicted work, two engines giving one engine's outputs."""

import json
import subprocess
import sys

import pytest

from rollout.parallel import split_by_work


def test_shares_cover_every_prompt_once_with_balanced_work():
    work = [100, 5, 5, 5, 5, 40, 40, 20, 1, 1]
    shares = split_by_work(work, 2)
    assert sorted(i for share in shares for i in share) == list(range(len(work)))
    assert all(share == sorted(share) for share in shares)  # each keeps the set's order
    loads = [sum(work[i] for i in share) for share in shares]
    assert max(loads) - min(loads) <= 20  # by count the split would be 5/5 whatever the work
    assert split_by_work([3.0], 3) == [[0], [], []]


PROMPTS = [{"id": f"p{i}", "prompt": f"Question {i}: what is {i} plus {2 * i}?", "answer": str(3 * i)}
           for i in range(8)]


def run(tiny_model, prompt_set, out_dir, *extra):
    args = [sys.executable, "-m", "rollout.generate", f"model.path={tiny_model}", f"data.source={prompt_set}",
            # (a later data.source in `extra` wins)
            "data.system_prompt=null", "sampling.n=2", "sampling.max_tokens=24", "sampling.temperature=0",
            "sampling.ignore_eos=true", "model.kv_cache_memory_bytes=8388608", "model.max_model_len=512",
            "policy.b_max=8", "output.progress=false", f"output.dir={out_dir}", *extra]
    result = subprocess.run(args, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [json.loads(line) for line in (out_dir / "samples.jsonl").read_text().splitlines()]
    return rows, json.loads((out_dir / "summary.json").read_text())


@pytest.mark.engine
def test_two_engines_give_the_outputs_of_one(tiny_model, tmp_path):
    prompt_set = tmp_path / "prompts.jsonl"
    prompt_set.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    one, _ = run(tiny_model, prompt_set, tmp_path / "one")
    two, summary = run(tiny_model, prompt_set, tmp_path / "two", "model.data_parallel_size=2")
    assert summary["engines"] == 2 and sum(summary["prompts_per_engine"]) == len(PROMPTS)
    assert all(n > 0 for n in summary["prompts_per_engine"])
    assert [(r["prompt_id"], r["sample_index"], r["group_index"]) for r in two] == [
        (p["id"], j, i) for i, p in enumerate(PROMPTS) for j in range(2)]  # merged in the set's order
    key = lambda r: (r["prompt_id"], r["sample_index"])  # noqa: E731
    assert {key(r): r["completion_token_ids"] for r in two} == {key(r): r["completion_token_ids"] for r in one}
    assert summary["generated_tokens"] == sum(r["completion_tokens"] for r in two) == 8 * 2 * 24


@pytest.mark.engine
def test_two_engines_score_in_the_parent(tiny_model, tmp_path):
    # reasoning-gym scorers are closures that cannot travel to the engine processes: the parent scores.
    source = ("data.source=reasoning_gym:basic_arithmetic", "data.num_prompts=6", "sampling.n=1")
    one, one_summary = run(tiny_model, "unused", tmp_path / "one", *source)
    two, summary = run(tiny_model, "unused", tmp_path / "two", *source, "model.data_parallel_size=2")
    assert all("reward" in r for r in one) and all("reward" in r for r in two)
    key = lambda r: (r["prompt_id"], r["sample_index"])  # noqa: E731
    scored = lambda rows: {key(r): (r["completion"], r["reward"]) for r in rows}  # noqa: E731
    assert scored(two) == scored(one)
    assert summary["reward_mean"] == pytest.approx(one_summary["reward_mean"])
