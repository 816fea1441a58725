"""A real run on the tiny model, killed (SIGKILL of the whole process group) at random points and interrupted
(SIGINT), then restarted with the same command: every (prompt id, sample index) ends up exactly once, nothing
durable is generated again, and the summary covers the whole set."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import datasets
import pytest

pytestmark = pytest.mark.engine

NUM_PROMPTS, N = 32, 8


@pytest.fixture
def prompt_set(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"Question {i}: what is {i} plus {i % 7}?"}) + "\n"
                            for i in range(NUM_PROMPTS)))
    return path


def command(tiny_model, prompt_set, out, *extra):
    # Samples of a fixed length, at most 4 at a time: the set takes ~25 s, so every kill lands mid-run even when an
    # fsync stalls for seconds and the next flush carries everything finished meanwhile (seen: 5 s, 110 samples).
    return [sys.executable, "-m", "rollout.generate", f"model.path={tiny_model}", f"data.source={prompt_set}",
            f"sampling.n={N}", "sampling.max_tokens=256", "sampling.ignore_eos=true", "policy.b_max=4",
            "model.kv_cache_memory_bytes=8388608",
            "output.progress=false", f"output.dir={out}", *extra]


def durable_lines(out):
    path = out / "samples.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_bytes().split(b"\n")[:-1]]


def start_and_stop(cmd, out, at_least, sig, whole_group):
    # Output to a file, not a pipe: nobody reads a pipe while the run goes, and a full one would stall it.
    log_path = out.parent / f"run-{time.monotonic_ns()}.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        deadline = time.monotonic() + 300
        seen = []
        while proc.poll() is None and time.monotonic() < deadline:
            seen.append((round(time.monotonic(), 2), len(durable_lines(out))))
            if seen[-1][1] >= at_least:
                break
            time.sleep(0.05)
        if whole_group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        proc.wait(timeout=120)
        if whole_group:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # engine processes left behind by the parent's death
            except ProcessLookupError:
                pass
    changes = [point for i, point in enumerate(seen) if i == 0 or point[1] != seen[i - 1][1]]
    return proc.returncode, log_path.read_text() + f"\n[test] (time, durable lines) as polled: {changes}"


def keys(records):
    return [(r["prompt_id"], r["sample_index"]) for r in records]


def test_killed_runs_resume_exactly_once(tiny_model, prompt_set, tmp_path):
    out = tmp_path / "out"
    cmd = command(tiny_model, prompt_set, out)
    rng = random.Random(7)
    total = NUM_PROMPTS * N
    seen = 0
    for _ in range(3):
        target = min(seen + rng.randint(5, 25), total // 4)
        returncode, log = start_and_stop(cmd, out, target, signal.SIGKILL, whole_group=True)
        assert returncode == -signal.SIGKILL
        records = durable_lines(out)
        assert len(set(keys(records))) == len(records)  # nothing durable was generated a second time
        assert len(records) >= seen
        seen = len(records)
        assert seen < total, log[-3000:]  # the kill landed mid-run, leaving work for the resumed run
    assert 0 < seen < total
    assert not (out / "summary.json").exists()

    # A changed setting is refused, with the difference named, and nothing already written is touched.
    before = (out / "samples.jsonl").read_bytes()
    changed = subprocess.run(command(tiny_model, prompt_set, out, "sampling.temperature=0.5"), capture_output=True,
                             text=True, timeout=300)
    assert changed.returncode == 2
    assert "sampling.temperature: 1.0 -> 0.5" in changed.stderr.strip().splitlines()[-1]
    assert (out / "samples.jsonl").read_bytes() == before

    finished = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert f"resuming: {seen} of {total}" in finished.stderr
    final = durable_lines(out)
    assert keys(final) == [(f"q{i}", j) for i in range(NUM_PROMPTS) for j in range(N)]  # once each, in order
    parquet = datasets.load_dataset("parquet", data_files=str(out / "samples.parquet"), split="train").to_list()
    assert keys(parquet) == keys(final)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_samples"] == total
    assert summary["samples_resumed"] == seen
    assert summary["samples_generated"] == total - seen
    assert summary["completion_tokens_total"] == sum(r["completion_tokens"] for r in final)

    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 2
    assert "holds a complete run" in again.stderr


def test_interrupt_stops_cleanly_and_resumes(tiny_model, prompt_set, tmp_path):
    out = tmp_path / "out"
    cmd = command(tiny_model, prompt_set, out)
    returncode, stderr = start_and_stop(cmd, out, 10, signal.SIGINT, whole_group=False)
    assert returncode == 130, stderr[-3000:]
    assert "run the same command again to resume" in stderr
    kept = durable_lines(out)
    assert len(kept) >= 10
    assert len(set(keys(kept))) == len(kept)

    forced = subprocess.run(command(tiny_model, prompt_set, out, "sampling.top_p=0.9", "output.force=true"),
                            capture_output=True, text=True, timeout=600)
    assert forced.returncode == 0, forced.stderr[-3000:]
    final = durable_lines(out)
    assert len(final) == NUM_PROMPTS * N == len(set(keys(final)))
    assert [r for r in final if r["prompt_id"] == kept[0]["prompt_id"] and
            r["sample_index"] == kept[0]["sample_index"]] == [kept[0]]
