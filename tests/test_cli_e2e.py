"""The CLI end to end on the tiny model: complete outputs, a summary, and statistics reused by the next run."""

import json
import math
import os
import re
import subprocess
import sys

import datasets
import pytest

from rollout.policy import LengthStats, overflow_quantile, safety_buffer

pytestmark = pytest.mark.engine

N = 4
PROMPTS = [
    {"id": "p0", "prompt": "What is 3 plus 4?", "answer": "7"},
    {"id": "p1", "prompt": "Question 12: what is 12 plus 2?", "answer": "14"},
    {"id": "p2", "prompt": [{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": "What is 9 plus 9?"}], "answer": "18"},
    {"id": "p3", "prompt": "The answer is", "answer": "0"},
    {"id": "p4", "prompt": "Question 7: what is 7 plus 10?", "answer": "17"},
    {"id": "p5", "prompt": "what is 1 plus 1?", "answer": "2"},
]
TOO_LONG = {"id": "long", "prompt": "plus " * 1500, "answer": "0"}  # left out: data.long_prompts=skip
VLLM_INFO_LINE = re.compile(r"\bINFO \d\d-\d\d \d\d:\d\d:\d\d ")  # vLLM's log format: level, date, time
VLLM_WARNING_LINE = re.compile(r"\bWARNING \d\d-\d\d \d\d:\d\d:\d\d ")


def generate(tiny_model, prompt_set, out_dir, *extra):
    args = [sys.executable, "-m", "rollout.generate", f"model.path={tiny_model}", f"data.source={prompt_set}",
            f"sampling.n={N}", "sampling.max_tokens=200", "sampling.logprobs=0",
            "model.max_model_len=1024", "data.long_prompts=skip",
            "policy.name=memory", "policy.b_max=16", "policy.min_observations=4",  # Algorithm 1: its buffer is checked
            "output.progress=false", f"output.dir={out_dir}", *extra]
    # The user's environment, less a VLLM_LOGGING_LEVEL (which would win over output.vllm_log_level): an engine
    # that an earlier test's module built in this process may have left the one it wrote.
    env = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_LEVEL"}
    result = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    (out_dir / "console.txt").write_text(result.stdout + result.stderr)
    return json.loads((out_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def two_runs(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    prompt_set = root / "prompts.jsonl"
    prompt_set.write_text("".join(json.dumps(p) + "\n" for p in [*PROMPTS[:3], TOO_LONG, *PROMPTS[3:]]))
    first = generate(tiny_model, prompt_set, root / "first")
    # The first run gives no KV cache size, as a user's own first run does; the second gives one.
    second = generate(tiny_model, prompt_set, root / "second", f"output.stats_in={root / 'first' / 'length_stats.json'}",
                      "output.vllm_log_level=INFO", "model.kv_cache_memory_bytes=8388608")
    return root, first, second


def test_outputs_are_complete(two_runs):
    root, first, _ = two_runs
    rows = datasets.load_dataset("json", data_files=str(root / "first" / "samples.jsonl"), split="train").to_list()
    table = datasets.load_dataset("parquet", data_files=str(root / "first" / "samples.parquet"), split="train")
    for row, stored in zip(rows, table.to_list()):
        assert stored.pop("logprobs") == pytest.approx(row.pop("logprobs"), rel=1e-12)
        assert stored == row
    rows = datasets.load_dataset("json", data_files=str(root / "first" / "samples.jsonl"), split="train").to_list()
    assert sorted((r["prompt_id"], r["sample_index"]) for r in rows) == sorted(
        (p["id"], j) for p in PROMPTS for j in range(N))
    for r in rows:
        assert r["completion_tokens"] == len(r["completion_token_ids"]) == len(r["logprobs"])
        assert 1 <= r["completion_tokens"] <= 200
        assert r["finish_reason"] in ("stop", "length")
        assert r["prompt_tokens"] == len(r["prompt_token_ids"])
        assert all(lp <= 0.0 for lp in r["logprobs"])
        assert r["answer"] == next(p["answer"] for p in PROMPTS if p["id"] == r["prompt_id"])
    # The user's own prompts as they are: no system prompt from the demo preset.
    p0 = next(r for r in rows if r["prompt_id"] == "p0")
    assert p0["prompt"] == "<|im_start|>user\nWhat is 3 plus 4?<|im_end|>\n<|im_start|>assistant\n"
    assert first["num_samples"] == len(PROMPTS) * N
    assert first["generated_tokens"] == sum(r["completion_tokens"] for r in rows)


def test_summary_reports_throughput_caps_and_statistics(two_runs):
    root, first, _ = two_runs
    assert [s["prompt_id"] for s in first["skipped_prompts"]] == ["long"]
    assert first["skipped_prompts"][0]["location"] == "line 4"
    assert first["generated_tokens_per_s"] > 0
    assert first["preemptions"] == first["preemptions_in_trace"]  # vLLM's metrics are read
    assert first["series"] and first["series"][0]["cap"] >= 1
    assert first["length_stats"]["count"] == len(PROMPTS) * N
    assert (root / "first" / "trace.png").stat().st_size > 0
    assert (root / "first" / "length_stats.json").is_file()


def test_second_run_starts_from_saved_statistics(two_runs):
    root, first, second = two_runs
    saved = LengthStats.load(root / "first" / "length_stats.json")
    assert saved.count == len(PROMPTS) * N
    assert second["first_step_stats_count"] == saved.count
    assert second["length_stats"]["prior"] == str(root / "first" / "length_stats.json")
    assert second["length_stats"]["count"] == 2 * saved.count
    # The second run's first safety buffer is the one the saved statistics give.
    trace = [json.loads(line) for line in (root / "second" / "trace.jsonl").read_text().splitlines()]
    header, steps = trace[0], [t for t in trace if "step" in t]
    mean, var = saved.demand_blocks(header["block_size"])
    expected = safety_buffer(header["kv_capacity_blocks"], mean, math.sqrt(var), overflow_quantile(0.05))
    first_buffer = next(s["safety_buffer_blocks"] for s in steps if s.get("safety_buffer_blocks") is not None)
    assert first_buffer == pytest.approx(expected, abs=1e-3)
    assert first_buffer > 0


def test_vllm_logs_only_warnings_unless_asked(two_runs):
    """vLLM's INFO lines (engine start, throughput every 10 s) stay off the console by default, and so do the
    start-up notices of vLLM, torch and Triton that ask nothing of the user (rollout.vllm.logs), in the engine's
    processes too, and vLLM's kill of an engine slow to end; the second run asked for all of vLLM's lines with
    output.vllm_log_level=INFO. Its metrics are read at both levels."""
    from rollout.vllm.logs import NOTICES

    root, first, second = two_runs
    quiet, loud = ((root / run / "console.txt").read_text() for run in ("first", "second"))
    assert not VLLM_INFO_LINE.search(quiet), quiet[-4000:]
    assert not VLLM_WARNING_LINE.search(quiet), quiet[-4000:]
    for noise in ("Triton", "FutureWarning", "Warning: NUMA", "Loading safetensors checkpoint", "force killing"):
        assert noise not in quiet, quiet[-4000:]
    assert VLLM_INFO_LINE.search(loud)
    assert any(notice in loud for notices in NOTICES.values() for notice in notices)
    assert second["preemptions"] == second["preemptions_in_trace"]


def test_a_run_without_a_kv_cache_size_gets_one_sized_for_its_prompts(two_runs, tiny_model):
    """On the CPU, vLLM's own default would take most of the host's memory: the first run, given no size, gets
    what its samples hold at once (rollout.cpu_memory), and one line says so."""
    from rollout.cpu_memory import kv_bytes_per_token
    from rollout.engine import engine_dtype

    root, first, second = two_runs
    per_token = kv_bytes_per_token(str(tiny_model), engine_dtype("auto"))
    console = (root / "first" / "console.txt").read_text()
    assert "model.kv_cache_memory_bytes is unset: the CPU engine's KV cache gets " in console
    assert "what the prompt set's samples hold at once" in console
    held = sum(min(r["prompt_tokens"] + 200, 1024) for r in datasets.load_dataset(
        "json", data_files=str(root / "first" / "samples.jsonl"), split="train").to_list())
    # vLLM keeps whole blocks, one of them its null block; the size is rounded up to a whole MiB.
    block = first["block_size"]
    assert held - 2 * block < first["kv_capacity_tokens"] <= held + 2 ** 20 // per_token
    assert 8388608 // per_token - 2 * block < second["kv_capacity_tokens"] <= 8388608 // per_token
