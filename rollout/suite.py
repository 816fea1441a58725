"""The benchmark suite as a library: what `python -m rollout.bench`, `python -m rollout.online` and the
simulator (`rollout.sim`) share, and the runs themselves.

- The offline suite: `BenchConfig` (configs/bench/*.yaml) from `load_bench_config`; `scheduler_policy`, the
  policy settings a scheduler name stands for; `run_bench`, every scheduler on every workload profile.
- Online capacity: `CapacityConfig` (configs/online/*.yaml) from `load_capacity_config`; `run_capacity`, the
  largest Poisson arrival rate each scheduler serves within a bound on the time between tokens.
- Shared: `GPU_ENGINE`, the engine settings of every GPU run (dummy weights, no tokenizer, decode-only CUDA
  graphs); `benchmark_model`; `machine`, what ran a benchmark.

Outputs go under runs/ by default: runs/bench/<config name>, runs/online/<config name>.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rollout.config import ConfigError, PolicyConfig, RunConfig, validate
from rollout.policy.length_stats import LengthStats, PromptLengths, prompt_key
from rollout.policy.prompt_memory import PromptMemory
from rollout.workloads import ProfileConfig, longest_first, max_prompt_tokens, profile_requests

GPU_ENGINE = {"load_format": "dummy", "skip_tokenizer_init": True,
              "compilation_config": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}}

# The offline suite's scheduler names; "static-N" (N digits) besides. A name may carry policy settings after
# it, typed as on the command line: `forecast:forecast_siblings=true:eps_m=0.1`.
BENCH_SCHEDULERS = ("vllm", "memory", "memory-clt", "forecast", "forecast-lpt", "oracle", "oracle-fcfs")
CAPACITY_SCHEDULERS = ("vllm", "sla", "sla-chunk")


def default_out_dir(kind: str, config_path: str | None) -> str:
    """runs/<kind>/<the config file's name without .yaml>, or runs/<kind>/default without one."""
    return f"runs/{kind}/{Path(config_path).stem if config_path else 'default'}"


def benchmark_model(model: str, work: Path, vocab_size: int) -> str:
    """"tiny": a random tiny Llama built under `work`; anything else: a model folder, used as it is."""
    if model != "tiny":
        return model
    from rollout.models import build_tiny_llama

    return str(build_tiny_llama(work / "tiny", vocab_size=vocab_size))


def machine(gpu: bool) -> dict:
    """What ran the benchmark, for its results to name: the GPUs as nvidia-smi lists them (it leaves CUDA
    uninitialised in this process, which vLLM's engine process wants), the CPU, and vLLM's and torch's versions."""
    import platform
    import subprocess

    import torch
    import vllm

    gpus = []
    if gpu:
        try:
            listed = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                                    capture_output=True, text=True, timeout=60)
            gpus = [line.strip() for line in listed.stdout.splitlines() if line.strip()]
        except (OSError, subprocess.SubprocessError):
            pass  # no nvidia-smi: the GPU goes unnamed, the runs are no less valid
    return {"gpus": gpus, "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "vllm": vllm.__version__, "torch": torch.__version__}


# The offline suite


@dataclass
class BenchConfig:
    model: str = "tiny"  # "tiny" (built here) or a folder with a config.json (GPU: dummy weights)
    gpu: bool = False
    dtype: str = "bfloat16"
    max_model_len: Optional[int] = None  # None: longest prompt + output of the profile
    schedulers: list = field(default_factory=lambda: ["vllm", "static-256", "static-1024", "memory", "memory-clt",
                                                      "oracle"])
    b_max: int = 1024  # max_num_seqs for memory, memory-clt and oracle
    eps_m: float = 0.05
    # vLLM keeps a preempted request's blocks in its prefix cache until they are reused: off, every preemption
    # recomputes in full (what the simulator assumes).
    prefix_caching: bool = True
    # GiB of host memory for vLLM's KV offloading in every scheduler's engine (model.kv_offloading_gib): a
    # preempted request loads its computed tokens back instead of recomputing them. None: off. GPU only.
    kv_offloading_gib: Optional[float] = None
    reps: int = 3
    seed: int = 0
    # The first iteration each run generates. The ones before it are not run: every scheduler starts from what it
    # would have learned in them (`learned_state`), as a trainer's next iteration starts from the files the last
    # one saved, so that a later pass (where the per-prompt memory acts) can be measured alone, at a fraction of
    # the device time. 0: every iteration.
    start_iteration: int = 0
    vocab_size: int = 1000
    profiles: list = field(default_factory=lambda: [ProfileConfig()])
    only: list = field(default_factory=list)  # names of the profiles to run; empty: all
    out_dir: Optional[str] = None  # None: runs/bench/<config name>


def load_bench_config(path: str | None, overrides: list[str]) -> BenchConfig:
    try:
        cfg = OmegaConf.structured(BenchConfig)
        if path:
            cfg = OmegaConf.merge(cfg, OmegaConf.load(path))
        cfg.profiles = [OmegaConf.merge(OmegaConf.structured(ProfileConfig), p) for p in cfg.profiles]
        for item in overrides:  # one at a time, so that list items can be reached: profiles.0.num_prompts=64
            key = item.split("=", 1)[0]
            OmegaConf.update(cfg, key, OmegaConf.select(OmegaConf.from_dotlist([item]), key), merge=True)
        bench = OmegaConf.to_object(cfg)
    except (OmegaConfBaseException, OSError) as exc:
        raise ConfigError(str(exc).splitlines()[0]) from exc
    if bench.only:
        unknown = set(bench.only) - {p.name for p in bench.profiles}
        if unknown:
            raise ConfigError(f"only: no profile named {sorted(unknown)}")
        bench.profiles = [p for p in bench.profiles if p.name in bench.only]
    for name in bench.schedulers:
        base = name.split(":")[0]
        if base not in BENCH_SCHEDULERS and not (base.startswith("static-") and base[7:].isdigit()):
            raise ConfigError(f"schedulers: unknown scheduler {name!r} (vllm, static-N, memory, memory-clt, "
                              "forecast, forecast-lpt, oracle, oracle-fcfs)")
        policy_options(name)
    fixed = [p.name for p in bench.profiles if p.new_prompts and p.kind == "recorded"]
    if fixed:
        raise ConfigError(f"profiles {fixed}: new_prompts: a recorded profile's prompts are its lengths_file's")
    short = [f"{p.name} has {p.iterations}" for p in bench.profiles if not 0 <= bench.start_iteration < p.iterations]
    if short:
        raise ConfigError(f"start_iteration={bench.start_iteration}: it must be at least 0 and below every profile's "
                          f"iterations ({', '.join(short)})")
    if bench.out_dir is None:
        bench.out_dir = default_out_dir("bench", path)
    return bench


def learned_state(profile: ProfileConfig, seed: int, vocab_size: int, iterations: int,
                  policy: PolicyConfig | dict) -> tuple[LengthStats, PromptLengths]:
    """What a scheduler has learned once the profile's first `iterations` passes have ended, every request at
    its workload length: the length statistics (with `policy`'s forgetting) and the per-prompt memory, as it saves
    them for the next run to start from (`output.stats_in`). Order within a pass moves neither: the statistics
    without forgetting are sums, and a prompt's entry is its samples' mean."""
    if isinstance(policy, dict):
        policy = PolicyConfig.from_dict(policy)
    stats = LengthStats(forgetting=policy.forgetting, window=policy.window, decay=policy.decay)
    memory = PromptMemory()
    for iteration in range(iterations):
        for r in profile_requests(profile, iteration, seed, vocab_size):
            stats.observe(len(r.prompt.token_ids), r.output_tokens)
            memory.finished(prompt_key(r.prompt.token_ids), r.output_tokens)
        memory.close_pass()
    return stats, memory.lengths


def save_learned_state(folder: Path, profile: ProfileConfig, seed: int, vocab_size: int, iterations: int,
                       policy: PolicyConfig | dict) -> Path:
    """`learned_state` written into `folder` as a scheduler saves it: its statistics file and, beside it, the
    per-prompt memory, under the names RolloutEngine and the adapter read. Returns the statistics file (what
    `output.stats_in` names; a scheduler's `state_dir` is the folder)."""
    from rollout.engine import PROMPT_LENGTHS_FILE, STATS_FILE

    stats, lengths = learned_state(profile, seed, vocab_size, iterations, policy)
    folder.mkdir(parents=True, exist_ok=True)
    stats.save(folder / STATS_FILE)
    lengths.save(folder / PROMPT_LENGTHS_FILE)
    return folder / STATS_FILE


def policy_options(scheduler: str) -> dict:
    """The policy settings after a scheduler's name (`forecast:eps_m=0.1:forecast_siblings=false`), checked
    against `PolicyConfig`: a misspelt key would otherwise run the defaults under the name of a variant."""
    options = scheduler.split(":")[1:]
    if any("=" not in option for option in options):
        raise ConfigError(f"schedulers: {scheduler!r}: settings after the name are key=value, separated by ':'")
    try:
        given = OmegaConf.from_dotlist(options)
        OmegaConf.merge(OmegaConf.structured(PolicyConfig), given)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"schedulers: {scheduler!r}: {str(exc).splitlines()[0]}") from exc
    return OmegaConf.to_container(given)


def scheduler_policy(bench: BenchConfig, scheduler: str) -> dict:
    """The policy settings a scheduler name stands for: "vllm" (vLLM untouched, its default max_num_seqs),
    "static-N" (a fixed cap N that is also max_num_seqs), "memory" (Algorithm 1), "memory-clt", "forecast"
    (length-aware admission from censored length estimates), "forecast-lpt" (the forecast with prompts
    longest-predicted first from earlier iterations), "oracle" (true lengths: a reference, not a policy one can
    deploy) and "oracle-fcfs" (the oracle's admission in submission order, which separates what admission and
    what order are worth). Submission is in the workload's order except for forecast-lpt (and the oracle, which
    its runs sort by true length). A name may carry policy settings, typed as on the command line:
    `forecast:forecast_siblings=true:eps_m=0.1`."""
    base = scheduler.split(":")[0]
    if base.startswith("static-"):
        settings = {"name": "static", "b_max": int(base[7:]), "order": "fifo"}
    elif base == "oracle-fcfs":  # the oracle's admission in submission order: its gain without the order
        settings = {"name": "oracle", "b_max": bench.b_max, "eps_m": bench.eps_m, "order": "fifo"}
    elif base == "forecast-lpt":  # forecast, prompts longest-predicted first from earlier iterations
        settings = {"name": "forecast", "order": "longest_first", "b_max": bench.b_max, "eps_m": bench.eps_m}
    else:
        settings = {"name": base, "b_max": bench.b_max, "eps_m": bench.eps_m, "order": "fifo"}
    settings.update(policy_options(scheduler))
    return settings


def bench_run_config(bench: BenchConfig, profile: ProfileConfig, scheduler: str, model: str) -> RunConfig:
    """The run configuration of one scheduler on one profile: synthetic prompts, one sample each, lengths
    imposed with ignore_eos."""
    max_len = bench.max_model_len or (max_prompt_tokens(profile) + profile.max_output + 16)
    model_cfg = {"path": model, "max_model_len": max_len, "dtype": bench.dtype if bench.gpu else "float32",
                 "enforce_eager": not bench.gpu, "engine_kwargs": GPU_ENGINE if bench.gpu else {},
                 "enable_prefix_caching": bench.prefix_caching, "kv_offloading_gib": bench.kv_offloading_gib}
    for key in ("kv_cache_memory_bytes", "num_gpu_blocks_override"):
        if getattr(profile, key) is not None:
            model_cfg[key] = getattr(profile, key)
    policy = scheduler_policy(bench, scheduler)
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), {
        "model": model_cfg, "data": {"source": "synthetic"}, "policy": policy,
        "output": {"stats_in": None, "trace_timing": True},
        "sampling": {"n": 1, "ignore_eos": True, "temperature": 1.0, "seed": bench.seed}}))
    validate(cfg)
    return cfg


def check_bench(bench: BenchConfig) -> None:
    """Every run's configuration and workload, built once without an engine: a bad setting fails here, before
    any engine starts (ConfigError or ValueError)."""
    from rollout.engine import check_platform

    for profile in bench.profiles:
        for scheduler in bench.schedulers:
            check_platform(bench_run_config(bench, profile, scheduler, "unused"), offloading_key="kv_offloading_gib")
        profile_requests(profile, 0, bench.seed, bench.vocab_size)


def drain_tail_fraction(trace: list[dict]) -> float | None:
    """Share of the wall time spent with the running batch under half of its peak."""
    if len(trace) < 2:
        return None
    peak = max(s["running"] for s in trace)
    total = trace[-1]["t"] - trace[0]["t"]
    tail = sum(b["t"] - a["t"] for a, b in zip(trace, trace[1:]) if a["running"] < 0.5 * peak)
    return tail / total if total > 0 else None


def policy_cost(trace: list[dict]) -> dict:
    """Where the policy's CPU time goes: steps that built the per-request arrays (and forecast) against the
    rest, and the arrays' own cost; how many steps did not ask the policy (its answer stood)."""
    described = [s for s in trace if "describe_cpu_us" in s]
    other = [s["policy_cpu_us"] for s in trace if "policy_cpu_us" in s and "describe_cpu_us" not in s]
    if not described:
        return {}
    return {"described_steps": len(described),
            "policy_cpu_us_described_mean": round(statistics.mean(s["policy_cpu_us"] for s in described), 1),
            "describe_cpu_us_mean": round(statistics.mean(s["describe_cpu_us"] for s in described), 1),
            "policy_cpu_us_other_mean": round(statistics.mean(other), 1) if other else None,
            "skipped_steps": sum(1 for s in trace if s.get("policy_skipped"))}


def run_once(bench: BenchConfig, profile: ProfileConfig, scheduler: str, model: str, workdir: Path) -> dict:
    """One scheduler over a profile's iterations in one engine; the result row of results.json, with the run's
    KV capacity and its steps (what the simulator is fit to) besides."""
    from rollout.engine import RolloutEngine

    cfg = bench_run_config(bench, profile, scheduler, model)
    if bench.start_iteration:  # the engine copies the memory beside the statistics for its scheduler
        cfg.output.stats_in = str(save_learned_state(workdir / "learned", profile, bench.seed, bench.vocab_size,
                                                     bench.start_iteration, cfg.policy))
    requested = generated = 0
    wall = preemptions = recomputed = recovered = 0.0
    per_pass = []  # tok/s of each iteration: later passes start from the lengths the earlier ones carried
    kv_capacity_tokens = None
    trace: list[dict] = []
    with RolloutEngine(cfg, workdir) as engine:
        started_at = time.time()
        for iteration in range(bench.start_iteration, profile.iterations):
            requests = profile_requests(profile, iteration, bench.seed, bench.vocab_size)
            if scheduler.split(":")[0] == "oracle":  # longest first keeps the cache full while the long ones run
                requests = longest_first(requests)
            lengths = [r.output_tokens for r in requests]
            # The policy is told the profile's cap, as a trainer's max_tokens; the lengths are the workload's.
            result = engine.generate([r.prompt for r in requests], progress=False, max_tokens=lengths,
                                     nominal_max_tokens=profile.max_output)
            s = result.summary
            kv_capacity_tokens = s.get("kv_capacity_tokens")
            requested += sum(lengths)
            generated += s["generated_tokens"]
            wall += s["wall_time_s"]
            per_pass.append(round(s["generated_tokens"] / s["wall_time_s"], 1))
            preemptions += s["preemptions"]
            recomputed += s.get("recomputed_tokens") or 0
            recovered += s.get("recovered_tokens") or 0
            if result.trace:  # iterations laid end to end on one time axis
                offset = trace[-1]["t"] if trace else 0.0
                trace += [{**step, "t": step["t"] - result.trace[0]["t"] + offset} for step in result.trace]
        ended_at = time.time()
    policy_us = [s["policy_us"] for s in trace if "policy_us" in s]
    policy_cpu_us = [s["policy_cpu_us"] for s in trace if "policy_cpu_us" in s]
    finish_cpu_us = [s["finish_cpu_us"] for s in trace if "finish_cpu_us" in s]
    adapter_us = [s["adapter_us"] for s in trace if "adapter_us" in s]
    step_s = wall / len(trace) if trace else None
    return {
        "profile": profile.name, "scheduler": scheduler, "requested_tokens": requested,
        "generated_tokens": generated, "makespan_s": round(wall, 3), "tokens_per_s": round(generated / wall, 1),
        "per_iteration_tokens_per_s": per_pass,
        # When and where it ran, to pair it with a run that ran at the same time on another GPU (time_paired_ratios).
        "started_at": round(started_at, 1), "ended_at": round(ended_at, 1), "gpu": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "preemptions": int(preemptions), "recomputed_tokens": int(recomputed) if trace else None,
        "recomputed_fraction": round(recomputed / generated, 4) if trace else None,
        # Net of the prefix cache and host memory: what the preempted requests computed again once resumed.
        "recovered_tokens": int(recovered) if trace else None,
        "recomputed_net_fraction": round((recomputed - recovered) / generated, 4) if trace else None,
        "mean_running": round(statistics.mean(s["running"] for s in trace), 1) if trace else None,
        "kv_usage_mean": round(statistics.mean(s["kv_usage"] for s in trace), 3) if trace else None,
        "drain_tail_fraction": drain_tail_fraction(trace),
        "policy_us_mean": round(statistics.mean(policy_us), 1) if policy_us else None,
        "policy_time_fraction": round(statistics.mean(policy_us) * 1e-6 / step_s, 5) if policy_us else None,
        "policy_cpu_fraction": round(statistics.mean(policy_cpu_us) * 1e-6 / step_s, 5) if policy_cpu_us else None,
        # What the policy does at each finish (the length statistics), outside the step's own policy time.
        "finish_cpu_fraction": round(sum(finish_cpu_us) * 1e-6 / wall, 5) if finish_cpu_us else None,
        # All the adapter adds to vLLM's scheduler on the engine's path, in wall time: the policy, the finishes'
        # statistics, the trace.
        "adapter_time_fraction": round(sum(adapter_us) * 1e-6 / wall, 5) if adapter_us else None,
        **policy_cost(trace),
        "timeline": [{k: s[k] for k in ("t", "running", "kv_usage", "cap")} for s in trace[::max(1, len(trace) // 300)]],
        "kv_capacity_tokens": kv_capacity_tokens,
        # The simulator's fit reads the first five; the cap and the step's latency as the policy measured it follow.
        "steps": [[s["t"], s["running"], s["scheduled_tokens"], s["kv_usage"], s["preempted"], s["cap"],
                   s.get("step_ms")] for s in trace],
    }


def run_bench(bench: BenchConfig, out: Path, on_result: Callable[[dict], None] = lambda result: None) -> dict:
    """Every scheduler on every profile, `bench.reps` times, interleaved (each repetition runs all schedulers
    before the next one starts), in this process. Writes out/results.json after every run (partial results
    survive a kill) and each run's steps to out/steps-<profile>.jsonl.gz (one line per run: t, running,
    scheduled, KV use, preempted, cap, ms per step; what the simulator is fit to). Returns the report:
    the config, when it started, the machine and the results."""
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-"))
    model = benchmark_model(bench.model, work, bench.vocab_size)
    results, started, ran_on = [], time.time(), machine(bench.gpu)
    report = {"config": OmegaConf.to_container(OmegaConf.structured(bench)), "started": started,
              "machine": ran_on, "results": results}
    for profile in bench.profiles:
        for rep in range(bench.reps):
            for scheduler in bench.schedulers:
                result = run_once(bench, profile, scheduler, model, work / f"{profile.name}-{scheduler}-{rep}")
                result["rep"] = rep
                steps = {"scheduler": scheduler, "rep": rep, "kv_capacity_tokens": result.pop("kv_capacity_tokens"),
                         "steps": result.pop("steps")}
                with gzip.open(out / f"steps-{profile.name}.jsonl.gz", "at") as f:
                    f.write(json.dumps(steps) + "\n")
                results.append(result)
                on_result(result)
                (out / "results.json").write_text(json.dumps(report, indent=1))
    return report


def time_paired_ratios(results: list[dict], base: str = "vllm") -> list[dict]:
    """Each run's tok/s against the `base` run of its profile that ran at the same time on another GPU (the one
    overlapping it most, by at least half the shorter run; each base run pairs once). A host's speed moves the
    runs on all its GPUs alike, so such pairs cancel it, which pairs within one process do not (on two GPUs of
    one host they halve the ratios' standard error: docs/results.md). Needs `started_at`, `ended_at` and `gpu`."""
    timed = [r for r in results if r.get("started_at") is not None and r.get("gpu") is not None]
    candidates = []
    for run in timed:
        if run["scheduler"] == base:
            continue
        for other in timed:
            if other["scheduler"] != base or other["profile"] != run["profile"] or other["gpu"] == run["gpu"]:
                continue
            overlap = min(run["ended_at"], other["ended_at"]) - max(run["started_at"], other["started_at"])
            shorter = min(run["ended_at"] - run["started_at"], other["ended_at"] - other["started_at"])
            if shorter > 0 and overlap >= 0.5 * shorter:
                candidates.append((overlap / shorter, id(run), id(other), run, other))
    pairs, used = [], set()
    for share, run_id, other_id, run, other in sorted(candidates, key=lambda c: -c[0]):
        if run_id in used or other_id in used:
            continue
        used.update((run_id, other_id))
        pairs.append({"profile": run["profile"], "scheduler": run["scheduler"], "gpu": run["gpu"],
                      "base_gpu": other["gpu"], "overlap": round(share, 3), "tokens_per_s": run["tokens_per_s"],
                      "base_tokens_per_s": other["tokens_per_s"], "ratio": run["tokens_per_s"] / other["tokens_per_s"]})
    return pairs


def summarize_ratios(ratios: list[float]) -> dict:
    """Geometric mean of ratios with the standard error of their logs, and their range."""
    logs = np.log(np.asarray(ratios, dtype=float))
    se = float(np.std(logs, ddof=1) / np.sqrt(len(logs))) if len(logs) > 1 else None
    return {"n": len(logs), "geometric_mean": float(np.exp(logs.mean())), "log_standard_error": se,
            "min": float(np.exp(logs.min())), "max": float(np.exp(logs.max()))}


# Online capacity


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
    out_dir: Optional[str] = None  # None: runs/online/<config name>


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
        if name not in CAPACITY_SCHEDULERS and not (name.startswith("static-") and name[7:].isdigit()):
            raise ConfigError(f"schedulers: unknown scheduler {name!r} (vllm, static-N, sla, sla-chunk)")
    if capacity.criterion not in ("p99", "mean"):
        raise ConfigError(f"criterion must be p99 or mean, got {capacity.criterion!r}")
    if not 0 < capacity.start_qps <= capacity.max_qps:
        raise ConfigError(f"need 0 < start_qps <= max_qps, got {capacity.start_qps}, {capacity.max_qps}")
    if capacity.d_sla_ms <= 0 or capacity.max_queue_delay_s <= 0 or capacity.trial_s <= 0:
        raise ConfigError("d_sla_ms, max_queue_delay_s and trial_s must be > 0")
    if capacity.out_dir is None:
        capacity.out_dir = default_out_dir("online", path)
    return capacity


def capacity_run_config(capacity: CapacityConfig, scheduler: str, model: str) -> RunConfig:
    """The run configuration of one online scheduler: "vllm" (untouched, its default max_num_seqs), "static-N"
    (our adapter, fixed cap N), "sla" (the paper's min(b_mem, b_sla) on the batch cap), "sla-chunk" (the same,
    and the SLA search also sizes the token budget of steps that run prompt tokens)."""
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
        "model": model_cfg, "data": {"source": "synthetic"}, "policy": policy,
        "output": {"stats_in": None, "trace_timing": True},
        "sampling": {"n": 1, "ignore_eos": True, "seed": capacity.seed}}))
    validate(cfg)
    return cfg


def check_capacity(capacity: CapacityConfig) -> None:
    """Every scheduler's configuration and the workload, built once without an engine: a bad setting fails here,
    before any engine starts (ConfigError or ValueError)."""
    for scheduler in capacity.schedulers:
        capacity_run_config(capacity, scheduler, "unused")
    profile_requests(capacity.workload, 0, capacity.seed, capacity.vocab_size)


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
    """TBT and TTFT (ms) over all requests from per-request (time, tokens in this delta) stamps. A delta
    carrying k tokens counts k gaps of 1/k of its interval; TTFT runs from arrival to the first token."""
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
        from rollout.vllm.settings import NOMINAL_MAX_TOKENS_KEY

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


def run_capacity(capacity: CapacityConfig, out: Path, on_trial: Callable[[dict], None] = lambda trial: None) -> dict:
    """Each scheduler's capacity, one engine each: the largest rate at which the TBT statistic (`criterion`)
    stays within D_SLA while the server keeps up (median TTFT within `max_queue_delay_s`), found by doubling
    the rate until a trial fails, then bisecting. Appends every trial to out/trials.jsonl and rewrites
    out/results.json after every scheduler (both survive a kill). Returns the report: the config and the
    results."""
    out.mkdir(parents=True, exist_ok=True)
    requests = profile_requests(capacity.workload, 0, capacity.seed, capacity.vocab_size)
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
    report = {"config": OmegaConf.to_container(OmegaConf.structured(capacity)), "results": results}
    for scheduler in capacity.schedulers:
        server = OnlineServer(capacity_run_config(capacity, scheduler, model), work / scheduler)
        try:
            server.serve(prompts, lengths, capacity.start_qps * 4, 16, capacity.seed + 1, 60.0, cap)  # warm-up

            def measure(rate: float) -> dict:
                count = max(capacity.min_requests, round(rate * capacity.trial_s))
                m = server.serve(prompts, lengths, rate, count, capacity.seed, deadline, cap)
                line = {"scheduler": scheduler, "rate_qps": round(rate, 3), **m}
                on_trial(line)
                with (out / "trials.jsonl").open("a") as f:
                    f.write(json.dumps(line) + "\n")
                return m

            qps, trials = find_capacity(measure, passes, capacity.start_qps, capacity.max_qps, capacity.refine_steps)
        finally:
            server.close()
        results.append({"scheduler": scheduler, "capacity_qps": qps, "trials": trials})
        (out / "results.json").write_text(json.dumps(report, indent=1))
    return report
