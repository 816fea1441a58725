"""The suite's workloads through `vllm serve`: vLLM's own scheduler against ours inside the server, with nothing of
our driver (the scheduler learns each prompt's lengths itself). A client sends each iteration's requests at once
over HTTP (one sample a request, as verl and OpenRLHF send them), each with its true length imposed (max_tokens,
ignore_eos) and the profile's max_output as the nominal limit the policy is told (vllm_xargs).

    python scripts/serve_bench.py run --config configs/bench/gpu.yaml --profile kv-bound --scheduler vllm \\
        --out runs/serve-bench [--reps 1]
    python scripts/serve_bench.py report runs/serve-bench

`run` starts one server per (repetition, scheduler), the schedulers interleaved within each repetition, and
appends one JSON line per run to OUT/results.jsonl; `report` prints each repetition's ratio to vLLM's default.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rollout.suite import GPU_ENGINE, benchmark_model, load_bench_config  # noqa: E402
from rollout.vllm.settings import NOMINAL_MAX_TOKENS_KEY  # noqa: E402
from rollout.workloads import max_prompt_tokens, profile_requests  # noqa: E402

STARTUP_S = 900
SCHEDULERS = ("vllm", "ours")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(bench, profile, scheduler: str, model: str, port: int, state_dir: Path) -> list[str]:
    """The server's flags, as the suite configures its engines (rollout.suite.bench_run_config)."""
    max_len = bench.max_model_len or (max_prompt_tokens(profile) + profile.max_output + 16)
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(max_len),
               "--seed", str(bench.seed), "--shutdown-timeout", "30"]
    if bench.gpu:
        command += ["--dtype", bench.dtype, "--load-format", GPU_ENGINE["load_format"], "--skip-tokenizer-init",
                    "--compilation-config", json.dumps(GPU_ENGINE["compilation_config"])]
    else:
        command += ["--dtype", "float32", "--enforce-eager", "--skip-tokenizer-init"]
    command += ["--enable-prefix-caching" if bench.prefix_caching else "--no-enable-prefix-caching"]
    if profile.kv_cache_memory_bytes is not None:
        command += ["--kv-cache-memory-bytes", str(profile.kv_cache_memory_bytes)]
    if profile.num_gpu_blocks_override is not None:
        command += ["--num-gpu-blocks-override", str(profile.num_gpu_blocks_override)]
    if scheduler == "ours":
        settings = {"policy": {"name": "forecast", "b_max": bench.b_max, "eps_m": bench.eps_m},
                    "state_dir": str(state_dir), "trace_path": str(state_dir / "trace.jsonl")}
        command += ["--max-num-seqs", str(bench.b_max), "--scheduler-cls", "rollout.vllm.RolloutScheduler",
                    "--additional-config", json.dumps({"rollout": settings})]
    return command


def wait_ready(process, base: str, log_path: Path) -> None:
    started = time.monotonic()
    while time.monotonic() - started < STARTUP_S:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with {process.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2):
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(1.0)
    raise SystemExit(f"the server was not ready after {STARTUP_S} s")


async def one_pass(base: str, model: str, requests, nominal: int) -> dict:
    """Every request of the pass sent at once; the wall time from the first send to the last response."""
    import aiohttp

    async def send(session, request):
        body = {"model": model, "prompt": request.prompt.token_ids, "max_tokens": request.output_tokens,
                "temperature": 1.0, "ignore_eos": True, "vllm_xargs": {NOMINAL_MAX_TOKENS_KEY: nominal}}
        async with session.post(base + "/v1/completions", json=body) as response:
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:500]}")
            reply = await response.json()
        return reply["usage"]["completion_tokens"]

    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        started = time.monotonic()
        generated = await asyncio.gather(*(send(session, r) for r in requests))
        wall = time.monotonic() - started
    return {"wall_s": round(wall, 3), "generated_tokens": int(sum(generated)),
            "requested_tokens": int(sum(r.output_tokens for r in requests)),
            "tokens_per_s": round(sum(generated) / wall, 1)}


def run_one(bench, profile, scheduler: str, model: str, out: Path, rep: int) -> dict:
    state_dir = out / f"{profile.name}-{scheduler}-{rep}"
    state_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = state_dir / "server.log"
    log = open(log_path, "w")
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    started = time.monotonic()
    process = subprocess.Popen(server_command(bench, profile, scheduler, model, port, state_dir), stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        wait_ready(process, base, log_path)
        ready_s = time.monotonic() - started
        with urllib.request.urlopen(base + "/v1/models") as response:
            served = json.loads(response.read())["data"][0]["id"]
        passes = [asyncio.run(one_pass(base, served, profile_requests(profile, iteration, bench.seed,
                                                                      bench.vocab_size), profile.max_output))
                  for iteration in range(profile.iterations)]
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
        log.close()
    wall = sum(p["wall_s"] for p in passes)
    generated = sum(p["generated_tokens"] for p in passes)
    return {"profile": profile.name, "scheduler": scheduler, "rep": rep, "ready_s": round(ready_s, 1),
            "tokens_per_s": round(generated / wall, 1), "makespan_s": round(wall, 3), "generated_tokens": generated,
            "per_iteration_tokens_per_s": [p["tokens_per_s"] for p in passes], "passes": passes,
            "started_at": round(time.time() - (time.monotonic() - started), 1)}


def run(args) -> None:
    bench = load_bench_config(args.config, [f"only=[{args.profile}]"])
    profile = bench.profiles[0]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = benchmark_model(bench.model, Path(tempfile.mkdtemp(prefix="serve-bench-")), bench.vocab_size)
    schedulers = args.scheduler.split(",")
    for rep in range(args.reps):
        for scheduler in (schedulers if rep % 2 == 0 else schedulers[::-1]):
            if scheduler not in SCHEDULERS:
                raise SystemExit(f"--scheduler: {scheduler!r} is not one of {', '.join(SCHEDULERS)}")
            result = run_one(bench, profile, scheduler, model, out, rep)
            with open(out / "results.jsonl", "a") as f:
                f.write(json.dumps(result) + "\n")
            print(json.dumps({k: v for k, v in result.items() if k != "passes"}), flush=True)


def report(args) -> None:
    results = [json.loads(line) for line in Path(args.out, "results.jsonl").read_text().splitlines()]
    for profile in sorted({r["profile"] for r in results}):
        rows = [r for r in results if r["profile"] == profile]
        for rep in sorted({r["rep"] for r in rows}):
            by = {r["scheduler"]: r for r in rows if r["rep"] == rep}
            if {"vllm", "ours"} <= set(by):
                ours, base = by["ours"], by["vllm"]
                per = [round(a / b, 3) for a, b in zip(ours["per_iteration_tokens_per_s"],
                                                       base["per_iteration_tokens_per_s"])]
                print(f"{profile} rep {rep}: ours {ours['tokens_per_s']} tok/s, vLLM's default "
                      f"{base['tokens_per_s']}: {ours['tokens_per_s'] / base['tokens_per_s']:.3f}x "
                      f"(per iteration {per})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    runner = sub.add_parser("run")
    runner.add_argument("--config", default=str(ROOT / "configs" / "bench" / "gpu.yaml"))
    runner.add_argument("--profile", required=True)
    runner.add_argument("--scheduler", default="vllm,ours")
    runner.add_argument("--out", required=True)
    runner.add_argument("--reps", type=int, default=1)
    reporter = sub.add_parser("report")
    reporter.add_argument("out")
    args = parser.parse_args()
    (run if args.command == "run" else report)(args)


if __name__ == "__main__":
    main()
