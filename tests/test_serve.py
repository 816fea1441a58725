"""Our scheduler inside `vllm serve`, with nothing of our driver: a real OpenAI-compatible server process started
by the test, passes of prompts with n samples sent at once over HTTP, and what the scheduler learned kept in its
state_dir across a restart."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from rollout.policy.length_stats import prompt_key

pytestmark = pytest.mark.engine

STARTUP_S = 300  # a server's start on 2 CPU cores: the engine's process, the model, the KV cache
# Prompt -> output tokens (imposed with ignore_eos): each prompt's samples run as long as each other.
# The blocker, sent first, runs while the others arrive (the engine admits it at once, being idle): its first
# sample's 300 steps outlast the 0.3 s the others take to be sent.
PROMPTS = {"blocker": ([41, 42, 43], 300), "short": ([11, 12, 13, 14, 15, 16], 6),
           "middle": ([21, 22, 23, 24, 25], 20), "long": ([31, 32, 33, 34], 60)}
ORDER = ["blocker", "short", "middle", "long"]  # the order each pass sends them in
SAMPLES = 3
ALL_BUT_ONE = len(PROMPTS) * SAMPLES - 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`vllm serve` on the tiny model with our scheduler and `settings` as additional_config["rollout"]."""

    def __init__(self, model, settings: dict, log_path) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                   "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32", "--max-model-len", "512",
                   "--enforce-eager", "--kv-cache-memory-bytes", str(64 << 20), "--max-num-seqs", "32",
                   "--seed", "0", "--scheduler-cls", "rollout.vllm_adapter.RolloutScheduler",
                   "--additional-config", json.dumps({"rollout": settings})]
        self.log = open(log_path, "w")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                        env=dict(os.environ, HF_HUB_OFFLINE="1", VLLM_LOGGING_LEVEL="WARNING"))
        self.log_path = log_path
        started = time.monotonic()
        while time.monotonic() - started < STARTUP_S:
            if self.process.poll() is not None:
                raise AssertionError(f"vllm serve exited with {self.process.returncode}:\n"
                                     f"{open(log_path).read()[-3000:]}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2):
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.5)
        else:
            self.stop()
            raise AssertionError(f"vllm serve not ready after {STARTUP_S} s")
        with urllib.request.urlopen(self.base + "/v1/models") as response:
            self.model = json.loads(response.read())["data"][0]["id"]

    def complete(self, token_ids: list[int], max_tokens: int) -> dict:
        body = {"model": self.model, "prompt": token_ids, "n": SAMPLES, "max_tokens": max_tokens,
                "temperature": 1.0, "ignore_eos": True}
        request = urllib.request.Request(self.base + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as response:
            return json.loads(response.read())

    def one_pass(self, names: list[str]) -> list[str]:
        """Each prompt's request (n samples) sent in `names` order, 0.1 s apart, all before the first returns;
        the names in the order their responses completed."""
        done, errors = [], []

        def send(name):
            try:
                reply = self.complete(*PROMPTS[name])
                assert [c["finish_reason"] for c in reply["choices"]] == ["length"] * SAMPLES
                done.append(name)
            except Exception as exc:  # re-raised in the test's thread
                errors.append(exc)

        threads = [threading.Thread(target=send, args=(name,)) for name in names]
        threads[0].start()
        self.wait_running()  # the first is running before the rest are sent, however slow the host
        for thread in threads[1:]:
            thread.start()
            time.sleep(0.1)
        for thread in threads:
            thread.join(300)
        if errors:
            raise errors[0]
        return done

    def wait_running(self, timeout_s: float = 60.0) -> None:
        """Until the engine reports a request running (vLLM's Prometheus gauge)."""
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            with urllib.request.urlopen(self.base + "/metrics", timeout=5) as response:
                for line in response.read().decode().splitlines():
                    if line.startswith("vllm:num_requests_running") and float(line.split()[-1]) >= 1:
                        return
            time.sleep(0.02)
        raise AssertionError(f"no request running {timeout_s:.0f} s after the first was sent")

    def stop(self) -> int:
        """SIGINT, as a terminal's Ctrl-C: vLLM's own shutdown, which calls the scheduler's."""
        self.process.send_signal(signal.SIGINT)
        try:
            return self.process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            raise AssertionError("vllm serve did not stop within 60 s of SIGINT")
        finally:
            self.log.close()


def trace_steps(path) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if "step" in r]


def waiting_before_first_finish(steps: list[dict], pass_index: int) -> int:
    """The most requests waiting in a pass (of 4 prompts x SAMPLES) before its first finish: all but the running
    one when every request arrived while the blocker's first sample ran, which the order tests presume."""
    finished_before = pass_index * len(PROMPTS) * SAMPLES
    return max(r["waiting"] for r in steps if r["finished"] == finished_before)


def test_vllm_serve_with_our_scheduler_learns_each_prompts_length_and_keeps_it_across_a_restart(
        tiny_model, tmp_path):
    """One request at a time (b_max 1, vLLM's max_num_seqs 32). After the first pass the scheduler knows each
    prompt's length, learned from its tokens. In the next, the middle prompt's request arrives before the long
    one's, both while the blocker runs, yet the long one finishes first. Its state_dir holds them; a new server started
    with it orders its first pass the same way."""
    state = tmp_path / "state"
    settings = {"policy": {"name": "forecast", "b_max": 1}, "state_dir": str(state),
                "trace_path": str(tmp_path / "trace.jsonl")}
    server = Server(tiny_model, settings, tmp_path / "serve.log")
    try:
        server.one_pass(ORDER)
        memory = json.loads((state / "prompt_lengths.json").read_text())["mean_output_tokens"]
        assert memory == pytest.approx({prompt_key(ids): n for ids, n in PROMPTS.values()})
        second = server.one_pass(ORDER)
        # The trace is written before a pass's last output leaves.
        assert waiting_before_first_finish(trace_steps(tmp_path / "trace.jsonl"), 1) == ALL_BUT_ONE
        assert second.index("long") < second.index("middle"), second
    finally:
        assert server.stop() == 0, open(tmp_path / "serve.log").read()[-3000:]
    steps = trace_steps(tmp_path / "trace.jsonl")
    assert steps and max(r["running"] for r in steps) == 1 and {r["cap"] for r in steps} == {1}
    # Written as each pass ends: at vLLM's default --shutdown-timeout 0 a SIGINT ends the engine before the
    # scheduler's shutdown() runs.
    assert (state / "length_stats.json").is_file()

    restarted = Server(tiny_model, {**settings, "trace_path": str(tmp_path / "trace2.jsonl")},
                       tmp_path / "serve2.log")
    try:
        start = json.loads((tmp_path / "trace2.jsonl").read_text().splitlines()[0])
        assert start["event"] == "start" and start["stats_count"] == 2 * len(PROMPTS) * SAMPLES
        third = restarted.one_pass(ORDER)
        assert waiting_before_first_finish(trace_steps(tmp_path / "trace2.jsonl"), 0) == ALL_BUT_ONE
        assert third.index("long") < third.index("middle"), third
    finally:
        assert restarted.stop() == 0
