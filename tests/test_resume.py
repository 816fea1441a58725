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
import psutil
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
    # Samples of a fixed length, one at a time: the set takes ~80 s, so a kill lands mid-run even though, on
    # 2 busy cores, this test's process was seen not to be scheduled for up to ~19 s while the run went on.
    return [sys.executable, "-m", "rollout.generate", f"model.path={tiny_model}", f"data.source={prompt_set}",
            f"sampling.n={N}", "sampling.max_tokens=256", "sampling.ignore_eos=true", "policy.b_max=1",
            "model.kv_cache_memory_bytes=8388608",
            "output.progress=false", f"output.dir={out}", *extra]


def durable_lines(out):
    path = out / "samples.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_bytes().split(b"\n")[:-1]]


def session_processes(session):
    alive = []
    for proc in psutil.process_iter(["name"]):
        try:
            if os.getsid(proc.pid) == session and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc.info["name"])
        except (ProcessLookupError, PermissionError, psutil.NoSuchProcess):
            pass
    return alive


def run_for(cmd, out, seconds, sig):
    """Run the command and send it `sig` after `seconds`, timed by coreutils `timeout`: on 2 busy cores this
    test's own process was seen not to be scheduled for over a minute while the run went on, so a kill timed
    from here (by polling samples.jsonl) landed after the run had finished. The signal goes to the command
    alone (a SIGKILL as the OOM killer sends it). Returns its exit status, its output, and the processes of its
    session still alive a minute after it died (the engine's, had they outlived it); None for a SIGKILL before
    the run wrote a sample: in vLLM's startup an engine process waits up to 5 minutes for its parent's
    handshake, and nothing of ours runs in it yet to end it sooner."""
    log_path = out.parent / f"run-{time.monotonic_ns()}.log"
    written = len(durable_lines(out))
    left = None
    with log_path.open("w") as log:
        proc = subprocess.Popen(["timeout", "--foreground", "--preserve-status", "-s", sig.name, f"{seconds:.1f}",
                                 *cmd], stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            proc.wait(timeout=seconds + 300)
            if sig != signal.SIGKILL or len(durable_lines(out)) > written:
                deadline = time.monotonic() + 60
                while (left := session_processes(proc.pid)) and time.monotonic() < deadline:
                    time.sleep(1)
        finally:
            # Whatever is left, or a run that outlived the wait (which left it running on both cores through the
            # tests after it).
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return proc.returncode, log_path.read_text(), left


def keys(records):
    return [(r["prompt_id"], r["sample_index"]) for r in records]


def test_killed_runs_resume_exactly_once(tiny_model, prompt_set, tmp_path):
    out = tmp_path / "out"
    cmd = command(tiny_model, prompt_set, out)
    rng = random.Random(7)
    total = NUM_PROMPTS * N
    seen = kills = checked = 0
    early = 0  # kills that landed before the engine was up: each next one waits longer (a slow machine's start)
    while kills < 2 or (seen == 0 and kills < 6):
        # The driver alone is killed (as by the OOM killer): once its engine runs, vLLM's engine processes must
        # not outlive it (they did, holding the model and spinning a core, until the adapter tied them to it).
        returncode, log, left = run_for(cmd, out, rng.uniform(26, 40) + 15 * early, signal.SIGKILL)
        kills += 1
        assert returncode in (-signal.SIGKILL, 128 + signal.SIGKILL), log[-3000:]
        assert left in ([], None), (left, log[-3000:])
        checked += left == []
        records = durable_lines(out)
        assert len(set(keys(records))) == len(records)  # nothing durable was generated a second time
        assert len(records) >= seen
        seen = len(records)
        early += seen == 0
        assert seen < total, log[-3000:]  # the kill landed mid-run, leaving work for the resumed run
    assert 0 < seen < total and checked
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
    # During the engine's startup (40-60 s on 2 cores): vLLM's main thread waits in C there, and the Ctrl-C was
    # lost, the run going on to the end, until the CLI watched for it (generate.exit_on_interrupt).
    started = time.monotonic()
    returncode, stderr, left = run_for(cmd, out, 20, signal.SIGINT)
    assert returncode == 130 and "run the same command again to resume" in stderr, stderr[-3000:]
    assert left == [] and time.monotonic() - started < 80, stderr[-3000:]

    # Well after the engine is up, in the middle of the run.
    returncode, stderr, left = run_for(cmd, out, 90, signal.SIGINT)
    assert returncode == 130, stderr[-3000:]
    assert left == [], stderr[-3000:]
    assert "run the same command again to resume" in stderr
    kept = durable_lines(out)
    assert len(kept) >= 1
    assert len(set(keys(kept))) == len(kept)

    forced = subprocess.run(command(tiny_model, prompt_set, out, "sampling.top_p=0.9", "output.force=true"),
                            capture_output=True, text=True, timeout=600)
    assert forced.returncode == 0, forced.stderr[-3000:]
    final = durable_lines(out)
    assert len(final) == NUM_PROMPTS * N == len(set(keys(final)))
    assert [r for r in final if r["prompt_id"] == kept[0]["prompt_id"] and
            r["sample_index"] == kept[0]["sample_index"]] == [kept[0]]

