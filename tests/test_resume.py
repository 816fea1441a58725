"""A real run on the tiny model, killed (SIGKILL of the driver alone, as the OOM killer sends it) at random points
and interrupted (SIGINT), then restarted with the same command: every (prompt id, sample index) ends up exactly once, nothing
durable is generated again, and the summary covers the whole set. The prompts and the samples hold every character
some line splitter takes for a line end: a run resumes whatever its text holds."""

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


# What str.splitlines breaks lines at besides "\n" and "\r" (JSON escapes "\r", and the control characters among
# these, itself).
LINE_BREAKING = "\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """The tiny model with tokens of its own that hold those characters (a fifth of its vocabulary, so that every
    sample holds each of them a few times)."""
    from rollout.models import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama-line-breaks",
                            extra_tokens=tuple(f"{c}{i}" for c in LINE_BREAKING for i in range(32)))


@pytest.fixture
def prompt_set(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"Question {i}:{LINE_BREAKING}what is {i} plus "
                                        f"{i % 7}?"}) + "\n" for i in range(NUM_PROMPTS)))
    return path


def command(tiny_model, prompt_set, out, *extra):
    # Samples of a fixed length, one at a time: a kill sent once some samples are durable lands mid-run, with
    # most of the set still to generate.
    return [sys.executable, "-m", "rollout.generate", f"model.path={tiny_model}", f"data.source={prompt_set}",
            f"sampling.n={N}", "sampling.max_tokens=256", "sampling.ignore_eos=true", "policy.b_max=1",
            "model.kv_cache_memory_bytes=8388608",
            "output.progress=false", f"output.dir={out}", *extra]


def durable_lines(out):
    path = out / "samples.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_bytes().split(b"\n")[:-1]]


def durable_count(out) -> int:
    try:
        return (out / "samples.jsonl").read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def starting(out):
    """The CLI has checked its input and is starting the engine: it writes config.yaml just before."""
    return lambda: (out / "config.yaml").exists()


def generated(out, more: int):
    """`more` samples beyond those durable now are durable: the engine is up and in the middle of the run."""
    target = durable_count(out) + more
    return lambda: durable_count(out) >= target


def session_processes(session):
    alive = []
    for proc in psutil.process_iter(["name"]):
        try:
            if os.getsid(proc.pid) == session and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except (ProcessLookupError, PermissionError, psutil.NoSuchProcess):
            pass
    return alive


# Only where a run hangs: the waits below return as soon as what they wait for happens.
HANG_S = 600


def outliving(session) -> list[str]:
    """The names (and states) of the session's processes still running once they end or HANG_S pass. An engine process that
    has exited counts as ended even while nobody has reaped it yet: orphaned by the kill, it waits as a zombie for
    the init process, which is slow to reap in some containers (psutil's waits count a zombie as running)."""
    deadline = time.monotonic() + HANG_S
    while (alive := session_processes(session)) and time.monotonic() < deadline:
        time.sleep(0.2)
    names = []
    for proc in alive:
        try:
            names.append(f"{proc.name()} ({proc.status()})")
        except psutil.NoSuchProcess:
            pass
    return names


def default_sigint() -> None:
    """In the child before it runs the command: SIGINT as a terminal's Ctrl-C finds it. A test run started in the
    background (`pytest ... &`, as some CI runners start it) ignores SIGINT, its children inherit that, and Python
    keeps an inherited ignore: the command would never see the test's Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_until(cmd, out, ready, sig):
    """Run the command and send it `sig` as soon as `ready()` holds (the run's progress, polled). The signal goes
    to the command alone (a SIGKILL as the OOM killer sends it). Returns its exit status, its output, whether
    the signal came before the run ended by itself, and the names of its session's processes that outlived it
    (the engine's, had they not ended with it), once they end or HANG_S pass."""
    log_path = out.parent / f"run-{time.monotonic_ns()}.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                preexec_fn=default_sigint)
        try:
            signalled = False
            while not signalled and proc.poll() is None:
                if ready():
                    proc.send_signal(sig)
                    signalled = True
                else:
                    time.sleep(0.2)
            proc.wait(timeout=HANG_S)
            left = outliving(proc.pid)
        finally:
            # Whatever is left, or a run that outlived the wait: it would run on through the tests after it.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return proc.returncode, log_path.read_text(), signalled, left


def keys(records):
    return [(r["prompt_id"], r["sample_index"]) for r in records]


def test_killed_runs_resume_exactly_once(tiny_model, prompt_set, tmp_path):
    out = tmp_path / "out"
    cmd = command(tiny_model, prompt_set, out)
    rng = random.Random(7)
    total = NUM_PROMPTS * N
    seen = 0
    for _ in range(2):
        # The driver alone is killed (as by the OOM killer), a random number of samples into the run: vLLM's
        # engine processes must not outlive it (they did, holding the model and spinning a core, until the
        # adapter tied them to it).
        returncode, log, signalled, left = run_until(cmd, out, generated(out, rng.randint(1, 24)), signal.SIGKILL)
        assert signalled, log[-3000:]  # the kill landed mid-run, leaving work for the resumed run
        assert returncode == -signal.SIGKILL, log[-3000:]
        assert left == [], (left, log[-3000:])
        records = durable_lines(out)
        assert len(set(keys(records))) == len(records)  # nothing durable was generated a second time
        assert seen < len(records) < total
        seen = len(records)
    assert not (out / "summary.json").exists()
    for text in ("prompt", "completion"):  # what the resumed run reads back holds each of them
        assert set(LINE_BREAKING) <= set("".join(r[text] for r in records)), text

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
    # What covers the whole set and what this run alone, named as such in the summary and the closing lines.
    resumed_keys = set(keys(records))
    generated_now = sum(r["completion_tokens"] for r in final if (r["prompt_id"], r["sample_index"]) not in resumed_keys)
    assert summary["all_samples"] == {"samples": total, "resumed": seen,
                                      "completion_tokens": sum(r["completion_tokens"] for r in final)}
    assert summary["this_run"]["samples"] == total - seen
    assert summary["this_run"]["generated_tokens"] == summary["generated_tokens"] == generated_now
    closing = finished.stdout.strip().splitlines()[-2:]
    assert closing[0].startswith(f"all samples: {total} in {out} ({seen} of them from an earlier run), "
                                 f"{summary['all_samples']['completion_tokens']} completion tokens"), closing
    assert closing[1].startswith(f"this run: {total - seen} samples, {generated_now} tokens in "), closing

    # The same command once the run is complete: nothing to do, the summary again, success; nothing touched.
    files = {path.name: path.read_bytes() for path in out.iterdir() if path.is_file()}
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    lines = again.stdout.strip().splitlines()
    assert lines[0].startswith(f"nothing to do: {out} holds this run, complete"), again.stdout
    assert lines[1:] == [closing[0], closing[1].replace("this run:", "last run:")]
    assert {path.name: path.read_bytes() for path in out.iterdir() if path.is_file()} == files


def test_interrupt_stops_cleanly_and_resumes(tiny_model, prompt_set, tmp_path):
    out = tmp_path / "out"
    cmd = command(tiny_model, prompt_set, out)
    total = NUM_PROMPTS * N
    # In the engine's startup: vLLM's main thread waits in C there, and the Ctrl-C was lost, the run going on
    # to the end, until the CLI watched for it (generate.exit_on_interrupt).
    returncode, log, signalled, left = run_until(cmd, out, starting(out), signal.SIGINT)
    assert signalled and returncode == 130 and "run the same command again to resume" in log, log[-3000:]
    assert left == [], log[-3000:]
    assert durable_count(out) < total and not (out / "summary.json").exists()  # it stopped, not ran to the end

    # In the middle of the run, once the engine has generated some samples.
    returncode, log, signalled, left = run_until(cmd, out, generated(out, 8), signal.SIGINT)
    assert signalled and returncode == 130, log[-3000:]
    assert left == [], log[-3000:]
    assert "run the same command again to resume" in log
    kept = durable_lines(out)
    assert 8 <= len(kept) < total
    assert len(set(keys(kept))) == len(kept)

    forced = subprocess.run(command(tiny_model, prompt_set, out, "sampling.top_p=0.9", "output.force=true"),
                            capture_output=True, text=True, timeout=600)
    assert forced.returncode == 0, forced.stderr[-3000:]
    final = durable_lines(out)
    assert len(final) == NUM_PROMPTS * N == len(set(keys(final)))
    assert [r for r in final if r["prompt_id"] == kept[0]["prompt_id"] and
            r["sample_index"] == kept[0]["sample_index"]] == [kept[0]]

