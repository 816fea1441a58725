"""python -m rollout.online --config configs/online/<name>.yaml [key=value ...]

Online serving and its capacity under a latency bound. Requests arrive as a Poisson process at a rate (qps)
into vLLM's AsyncLLM running our scheduler; every request streams, and the client stamps each token's arrival.
Time between tokens (TBT) is taken from those stamps (a delta carrying k tokens counts k gaps of 1/k of its
interval), time to first token (TTFT) from arrival to the first token.

Capacity, as in Sarathi-Serve and the paper: the largest rate at which the TBT statistic (`criterion`: p99 or
mean) stays within D_SLA while the server keeps up (median TTFT within `max_queue_delay_s`; past capacity the
queue grows and TTFT with it). Found per scheduler by doubling the rate until a trial fails, then bisecting.
Schedulers: "vllm" (untouched, its default max_num_seqs), "static-N" (our adapter, fixed cap N), "sla" (the
paper's min(b_mem, b_sla) on the batch cap), "sla-chunk" (the same, and the SLA search also sizes the token
budget of steps that run prompt tokens).

Writes results.json, results.md and capacity.png (TBT and TTFT against rate per scheduler).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rollout.bench import GPU_ENGINE, benchmark_model
from rollout.config import ConfigError, RunConfig, validate
from rollout.workloads import ProfileConfig, profile_requests



@dataclass
class CapacityConfig:
    model: str = "tiny"  # "tiny" (built here) or a folder with a config.json (GPU: dummy weights)
    gpu: bool = False
    dtype: str = "bfloat16"
    schedulers: list = field(default_factory=lambda: ["vllm", "static-64", "sla"])
    b_max: int = 256  # max_num_seqs of our schedulers
    d_sla_ms: float = 50.0
    # The sla scheduler's own target for the mean step latency; None: d_sla_ms. Below d_sla_ms when the
    # criterion is a tail (p99) and the controller, as the paper's, steers the mean.
    controller_target_ms: Optional[float] = None
    criterion: str = "p99"  # p99 | mean: the TBT statistic held within d_sla_ms
    max_queue_delay_s: float = 2.0  # median TTFT above this: the server no longer keeps up
    workload: ProfileConfig = field(default_factory=lambda: ProfileConfig(name="online", num_prompts=200))
    trial_s: float = 10.0  # arrivals span this long at every rate (requests cycle through the workload)
    min_requests: int = 32
    start_qps: float = 1.0
    max_qps: float = 1000.0
    refine_steps: int = 4  # bisection steps once a failing rate is found
    max_num_batched_tokens: Optional[int] = None
    kv_cache_memory_bytes: Optional[int] = None
    max_model_len: Optional[int] = None
    seed: int = 0
    vocab_size: int = 1000
    out_dir: str = "runs/online"


SCHEDULERS = ("vllm", "sla", "sla-chunk")


def load_capacity_config(path: str | None, overrides: list[str]) -> CapacityConfig:
    try:
        cfg = OmegaConf.structured(CapacityConfig)
        if path:
            if not Path(path).is_file():
                raise ConfigError(f"config file {path} does not exist")
            cfg = OmegaConf.merge(cfg, OmegaConf.load(path))
        if overrides:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))
        capacity = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as exc:
        raise ConfigError(str(exc).splitlines()[0]) from exc
    for name in capacity.schedulers:
        if name not in SCHEDULERS and not (name.startswith("static-") and name[7:].isdigit()):
            raise ConfigError(f"schedulers: unknown scheduler {name!r} (vllm, static-N, sla, sla-chunk)")
    if capacity.criterion not in ("p99", "mean"):
        raise ConfigError(f"criterion must be p99 or mean, got {capacity.criterion!r}")
    if not 0 < capacity.start_qps <= capacity.max_qps:
        raise ConfigError(f"need 0 < start_qps <= max_qps, got {capacity.start_qps}, {capacity.max_qps}")
    if capacity.d_sla_ms <= 0 or capacity.max_queue_delay_s <= 0 or capacity.trial_s <= 0:
        raise ConfigError("d_sla_ms, max_queue_delay_s and trial_s must be > 0")
    return capacity


def run_config(capacity: CapacityConfig, scheduler: str, model: str) -> RunConfig:
    w = capacity.workload
    if scheduler.startswith("static-"):
        policy = {"name": "static", "b_max": int(scheduler[7:])}
    elif scheduler == "vllm":
        policy = {"name": "vllm"}
    else:
        policy = {"name": "sla", "b_max": capacity.b_max, "d_sla_ms": capacity.controller_target_ms or capacity.d_sla_ms,
                  "sla_chunk": scheduler == "sla-chunk"}
    model_cfg = {"path": model, "max_model_len": capacity.max_model_len or w.prompt_tokens + w.max_output + 16,
                 "dtype": capacity.dtype if capacity.gpu else "float32", "enforce_eager": not capacity.gpu,
                 "engine_kwargs": GPU_ENGINE if capacity.gpu else {"skip_tokenizer_init": True}}
    for key in ("kv_cache_memory_bytes", "max_num_batched_tokens"):
        if getattr(capacity, key) is not None:
            model_cfg[key] = getattr(capacity, key)
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), {
        "model": model_cfg, "data": {"source": "synthetic"}, "policy": policy, "output": {"stats_in": None},
        "sampling": {"n": 1, "ignore_eos": True, "seed": capacity.seed}}))
    validate(cfg)
    return cfg


def find_capacity(measure: Callable[[float], dict], passes: Callable[[dict], bool], start: float, limit: float,
                  refine_steps: int) -> tuple[float, list[dict]]:
    """Largest passing rate: double from `start` until a trial fails (or `limit`), then bisect the last
    passing and first failing rates. Returns the capacity (0 if even the lowest rate tried fails) and every
    trial, each the measurement plus its rate and verdict."""
    trials = []

    def trial(rate: float) -> bool:
        result = {"rate_qps": round(rate, 4), **measure(rate)}
        result["passed"] = bool(passes(result))
        trials.append(result)
        return result["passed"]

    low, high, rate = 0.0, None, start
    while high is None:
        if trial(rate):
            low = rate
            if rate >= limit:
                return low, trials
            rate = min(rate * 2, limit)
        else:
            high = rate
    for _ in range(refine_steps):
        mid = (low + high) / 2
        if trial(mid):
            low = mid
        else:
            high = mid
    return low, trials


def latency_metrics(arrivals: np.ndarray, stamps: list[list[tuple[float, int]]], wall_s: float) -> dict:
    """TBT and TTFT (ms) over all requests from per-request (time, tokens in this delta) stamps."""
    gaps, ttft, tokens = [], [], 0
    for arrival, deltas in zip(arrivals, stamps):
        if not deltas:
            continue
        ttft.append(deltas[0][0] - arrival)
        tokens += sum(k for _, k in deltas)
        for (t_prev, _), (t, k) in zip(deltas, deltas[1:]):
            gaps += [(t - t_prev) / k] * k
    gaps_ms, ttft_ms = np.array(gaps) * 1e3, np.array(ttft) * 1e3

    def q(values, p):
        return round(float(np.percentile(values, p)), 2) if len(values) else None

    return {"tbt_p50_ms": q(gaps_ms, 50), "tbt_p99_ms": q(gaps_ms, 99),
            "tbt_mean_ms": round(float(gaps_ms.mean()), 2) if len(gaps_ms) else None,
            "ttft_p50_ms": q(ttft_ms, 50), "ttft_p99_ms": q(ttft_ms, 99),
            "tokens_per_s": round(tokens / wall_s, 1), "completed": len(ttft)}


class OnlineServer:
    """AsyncLLM with our scheduler (or vLLM's), serving one Poisson trial at a time on its own event loop."""

    def __init__(self, cfg: RunConfig, workdir: Path) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from rollout.engine import TRACE_FILE, engine_kwargs
        from rollout.models import resolve_model

        self.trace_path = workdir / TRACE_FILE
        workdir.mkdir(parents=True, exist_ok=True)
        kwargs = engine_kwargs(cfg, resolve_model(cfg.model.path), self.trace_path, None, workdir / "stats.json")
        self.loop = asyncio.new_event_loop()
        self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
        self.trials = 0

    def close(self) -> None:
        self.engine.shutdown()
        # Let the engine's output task see its cancellation before the loop goes.
        pending = asyncio.all_tasks(self.loop)
        for task in pending:
            task.cancel()
        self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        del self.engine
        self.loop.close()

    def serve(self, prompts: list[list[int]], lengths: list[int], rate_qps: float, count: int, seed: int,
              deadline_s: float, nominal_max_tokens: int | None = None) -> dict:
        """`count` requests (cycling through the pool) at Poisson rate `rate_qps`. Requests not finished
        `deadline_s` after the last arrival are aborted; the trial then reports fewer completed. The lengths
        are imposed through max_tokens; the policy is told `nominal_max_tokens` instead, where given."""
        return self.loop.run_until_complete(self._serve(prompts, lengths, rate_qps, count, seed, deadline_s,
                                                        nominal_max_tokens))

    async def _serve(self, prompts, lengths, rate_qps, count, seed, deadline_s, nominal_max_tokens) -> dict:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        from rollout.engine import TraceReader
        from rollout.vllm_adapter import NOMINAL_MAX_TOKENS_KEY

        self.trials += 1
        trace = TraceReader(self.trace_path)
        rng = np.random.default_rng([seed, int(rate_qps * 1000)])
        offsets = np.cumsum(rng.exponential(1.0 / rate_qps, count))
        start = time.monotonic()
        arrivals = start + offsets
        stamps: list[list[tuple[float, int]]] = [[] for _ in range(count)]
        done = np.zeros(count, dtype=bool)

        async def one(i: int) -> None:
            await asyncio.sleep(max(0.0, arrivals[i] - time.monotonic()))
            j = i % len(prompts)
            params = SamplingParams(max_tokens=lengths[j], ignore_eos=True, temperature=1.0,
                                    output_kind=RequestOutputKind.DELTA, extra_args=None if nominal_max_tokens is None
                                    else {NOMINAL_MAX_TOKENS_KEY: nominal_max_tokens})
            async for out in self.engine.generate({"prompt_token_ids": prompts[j]}, params,
                                                  f"t{self.trials}-{i}"):
                k = len(out.outputs[0].token_ids)
                if k:
                    stamps[i].append((time.monotonic(), k))
            done[i] = True

        tasks = [asyncio.ensure_future(one(i)) for i in range(count)]
        await asyncio.wait(tasks, timeout=offsets[-1] + deadline_s)
        for task in tasks:  # an overloaded trial: cancelling the stream aborts the request in the engine
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        wall = time.monotonic() - start
        result = latency_metrics(arrivals, stamps, wall)
        result.update(requests=count, completed=int(done.sum()))
        steps = [s for s in trace.poll() if s.get("step_ms") is not None]
        if steps:  # engine-side step latency and batch, from our scheduler's trace
            step_ms = np.array([s["step_ms"] for s in steps])
            result.update(step_p99_ms=round(float(np.percentile(step_ms, 99)), 2),
                          mean_running=round(float(np.mean([s["running"] for s in steps])), 1),
                          mean_cap=round(float(np.mean([s["cap"] for s in steps])), 1))
        result["wall_s"] = round(wall, 2)
        return result


def table(results: list[dict], capacity: CapacityConfig) -> str:
    lines = [f"D_SLA {capacity.d_sla_ms} ms on TBT {capacity.criterion}, median TTFT <= "
             f"{capacity.max_queue_delay_s} s", "",
             "| scheduler | capacity qps | vs vllm | at capacity: TBT p50 / p99 / mean ms | TTFT p50 ms | tok/s | "
             "mean running |", "|---|---|---|---|---|---|---|"]
    base = next((r["capacity_qps"] for r in results if r["scheduler"] == "vllm"), None)
    for r in results:
        best = max((t for t in r["trials"] if t["passed"]), key=lambda t: t["rate_qps"], default=None)
        ratio = f"{r['capacity_qps'] / base:.2f}" if base else "-"
        at = (f"{best['tbt_p50_ms']} / {best['tbt_p99_ms']} / {best['tbt_mean_ms']} | {best['ttft_p50_ms']} | "
              f"{best['tokens_per_s']:.0f} | {best.get('mean_running', '-')}") if best else "- | - | - | -"
        lines.append(f"| {r['scheduler']} | {r['capacity_qps']:.2f} | {ratio} | {at} |")
    return "\n".join(lines) + "\n"


def plot(results: list[dict], capacity: CapacityConfig, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (tbt_ax, ttft_ax) = plt.subplots(1, 2, figsize=(11, 4))
    key = "tbt_p99_ms" if capacity.criterion == "p99" else "tbt_mean_ms"
    for r in results:
        trials = sorted(r["trials"], key=lambda t: t["rate_qps"])
        rates = [t["rate_qps"] for t in trials]
        tbt_ax.plot(rates, [t[key] for t in trials], marker="o", label=r["scheduler"])
        ttft_ax.plot(rates, [t["ttft_p50_ms"] for t in trials], marker="o", label=r["scheduler"])
    tbt_ax.axhline(capacity.d_sla_ms, color="k", ls="--", lw=1, label="D_SLA")
    ttft_ax.axhline(capacity.max_queue_delay_s * 1e3, color="k", ls="--", lw=1)
    tbt_ax.set(xlabel="arrival rate (qps)", ylabel=f"TBT {capacity.criterion} (ms)")
    ttft_ax.set(xlabel="arrival rate (qps)", ylabel="TTFT p50 (ms)", yscale="log")
    tbt_ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    os.environ.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    parser = argparse.ArgumentParser(prog="python -m rollout.online", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="a capacity YAML (configs/online/)")
    parser.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. d_sla_ms=30 schedulers=[vllm,sla]")
    args = parser.parse_args(argv)
    try:
        capacity = load_capacity_config(args.config, args.overrides)
        for scheduler in capacity.schedulers:  # fail on a bad setting before any engine starts
            run_config(capacity, scheduler, "unused")
        requests = profile_requests(capacity.workload, 0, capacity.seed, capacity.vocab_size)
    except (ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(capacity.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="online-"))
    model = benchmark_model(capacity.model, work, capacity.vocab_size)
    prompts = [r.prompt.token_ids for r in requests]
    lengths = [r.output_tokens for r in requests]
    cap = capacity.workload.max_output  # what the policy is told as max_tokens; `lengths` are imposed
    stat = "tbt_p99_ms" if capacity.criterion == "p99" else "tbt_mean_ms"
    # Past the last arrival, a request within the bound needs at most its queue delay plus its tokens at D_SLA.
    deadline = 2 * capacity.max_queue_delay_s + 2 * max(lengths) * capacity.d_sla_ms / 1e3

    def passes(m: dict) -> bool:
        return (m["completed"] == m["requests"] and m[stat] is not None and m[stat] <= capacity.d_sla_ms
                and m["ttft_p50_ms"] <= capacity.max_queue_delay_s * 1e3)

    results = []
    for scheduler in capacity.schedulers:
        server = OnlineServer(run_config(capacity, scheduler, model), work / scheduler)
        try:
            server.serve(prompts, lengths, capacity.start_qps * 4, 16, capacity.seed + 1, 60.0, cap)  # warm-up

            def measure(rate: float) -> dict:
                count = max(capacity.min_requests, round(rate * capacity.trial_s))
                m = server.serve(prompts, lengths, rate, count, capacity.seed, deadline, cap)
                line = {"scheduler": scheduler, "rate_qps": round(rate, 3), **m}
                print(json.dumps(line), flush=True)
                with (out / "trials.jsonl").open("a") as f:  # every trial survives a kill
                    f.write(json.dumps(line) + "\n")
                return m

            qps, trials = find_capacity(measure, passes, capacity.start_qps, capacity.max_qps, capacity.refine_steps)
        finally:
            server.close()
        results.append({"scheduler": scheduler, "capacity_qps": qps, "trials": trials})
        report = {"config": OmegaConf.to_container(OmegaConf.structured(capacity)), "results": results}
        (out / "results.json").write_text(json.dumps(report, indent=1))  # partial results survive a kill
    md = table(results, capacity)
    (out / "results.md").write_text(md)
    plot(results, capacity, out / "capacity.png")
    print(md)
    print(f"results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
