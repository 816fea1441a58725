"""Our scheduler inside `vllm serve`, with nothing of our driver: a real OpenAI-compatible server process started
by the test (in vLLM's dev mode, for /pause and /resume), passes of prompts with n samples sent over HTTP while
it is paused, and what the scheduler learned kept in its state_dir across a restart."""

import json
import os
import re
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
PROMPTS = {"short": ([11, 12, 13, 14, 15, 16], 6), "middle": ([21, 22, 23, 24, 25], 20), "long": ([31, 32, 33, 34], 60)}
ORDER = ["short", "middle", "long"]  # the order each pass sends them in
SAMPLES = 3
ADDED = re.compile(r"Added request (?:\d+_)?cmpl-([a-z]+)-(\d+)")  # vLLM's log (--enable-log-requests) of a sample sent


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
                   "--seed", "0", "--enable-log-requests", "--scheduler-cls", "rollout.vllm.RolloutScheduler",
                   "--additional-config", json.dumps({"rollout": settings})]
        self.log = open(log_path, "w")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                        env=dict(os.environ, HF_HUB_OFFLINE="1", VLLM_SERVER_DEV_MODE="1",
                                                 VLLM_LOGGING_LEVEL="INFO"))  # the request log is INFO
        self.log_path = log_path
        self.passes = 0
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

    def post(self, path: str, body: dict | None = None, headers: dict | None = None) -> dict:
        request = urllib.request.Request(self.base + path, data=json.dumps(body or {}).encode(),
                                         headers={"Content-Type": "application/json", **(headers or {})})
        with urllib.request.urlopen(request, timeout=300) as response:
            return json.loads(response.read())

    def one_pass(self, names: list[str]) -> list[str]:
        """Each prompt's request (n samples) sent in `names` order while the engine is paused (vLLM's /pause,
        as an RL trainer pauses it), each once the last one's samples reached the engine (its log), then /resume:
        the scheduler chooses among all of them at once. Returns the names in the order vLLM's log shows their
        samples sent to the engine."""
        self.passes += 1
        errors = []

        def send(name):
            token_ids, max_tokens = PROMPTS[name]
            try:
                self.post("/v1/completions", {"model": self.model, "prompt": token_ids, "n": SAMPLES,
                                              "max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True},
                          {"X-Request-Id": f"{name}-{self.passes}"})
            except Exception as exc:  # noqa: BLE001 - re-raised in the test's thread
                errors.append(exc)

        self.post("/pause?mode=keep")
        threads = [threading.Thread(target=send, args=(name,)) for name in names]
        try:
            for k, thread in enumerate(threads):
                thread.start()
                self.wait_added((k + 1) * SAMPLES)
        finally:
            self.post("/resume")  # also where the wait failed: the server stops only once its requests ended
        for thread in threads:
            thread.join(300)
        if errors:
            raise errors[0]
        return list(dict.fromkeys(self.added()))

    def added(self) -> list[str]:
        """The prompts whose samples vLLM's log shows sent to the engine in this pass, a name per sample."""
        return [m[1] for m in ADDED.finditer(open(self.log_path).read()) if int(m[2]) == self.passes]

    def wait_added(self, count: int, timeout_s: float = 120.0) -> None:
        started = time.monotonic()
        while len(self.added()) < count:
            if time.monotonic() - started > timeout_s:
                raise AssertionError(f"{len(self.added())} samples, not {count}, reached the engine in "
                                     f"{timeout_s:.0f} s")
            time.sleep(0.02)

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


def started(path) -> list[str]:
    """The prompts in the order the engine started their samples, a name per sample: one request runs at a time,
    so each step that prefills prefills one sample, whose prompt its token count names (they differ)."""
    name_of = {len(ids): name for name, (ids, _) in PROMPTS.items()}
    return [name_of[r["prefill_tokens"]] for r in trace_steps(path) if r["prefill_tokens"]]


# Nothing known: a probe of each prompt in arrival order, then the siblings of the prompt whose probe is running
# or longest; known: longest first.
PROBED = ["short", "middle", "long"] + ["long", "long", "middle", "middle", "short", "short"]
LONGEST_FIRST = ["long"] * SAMPLES + ["middle"] * SAMPLES + ["short"] * SAMPLES


def test_vllm_serve_with_our_scheduler_learns_each_prompts_length_and_keeps_it_across_a_restart(
        tiny_model, tmp_path):
    """One request at a time (b_max 1, vLLM's max_num_seqs 32). In the first pass the scheduler probes each prompt,
    then knows its length, learned from its tokens. In the next, the prompts' samples reach it shortest first, and
    it starts them longest first. Its state_dir holds the lengths; a new server started with it orders its first
    pass the same way."""
    state = tmp_path / "state"
    settings = {"policy": {"name": "forecast", "b_max": 1}, "state_dir": str(state),
                "trace_path": str(tmp_path / "trace.jsonl")}
    server = Server(tiny_model, settings, tmp_path / "serve.log")
    try:
        assert server.one_pass(ORDER) == ORDER
        memory = json.loads((state / "prompt_lengths.json").read_text())["mean_output_tokens"]
        assert memory == pytest.approx({prompt_key(ids): n for ids, n in PROMPTS.values()})
        assert server.one_pass(ORDER) == ORDER
    finally:
        assert server.stop() == 0, open(tmp_path / "serve.log").read()[-3000:]
    steps = trace_steps(tmp_path / "trace.jsonl")
    assert steps and max(r["running"] for r in steps) == 1 and {r["cap"] for r in steps} == {1}
    assert started(tmp_path / "trace.jsonl") == PROBED + LONGEST_FIRST
    # Written as each pass ends: at vLLM's default --shutdown-timeout 0 a SIGINT ends the engine before the
    # scheduler's shutdown() runs.
    assert (state / "length_stats.json").is_file()

    restarted = Server(tiny_model, {**settings, "trace_path": str(tmp_path / "trace2.jsonl")},
                       tmp_path / "serve2.log")
    try:
        start = json.loads((tmp_path / "trace2.jsonl").read_text().splitlines()[0])
        assert start["event"] == "start" and start["stats_count"] == 2 * len(PROMPTS) * SAMPLES
        assert restarted.one_pass(ORDER) == ORDER
    finally:
        assert restarted.stop() == 0
    assert started(tmp_path / "trace2.jsonl") == LONGEST_FIRST
