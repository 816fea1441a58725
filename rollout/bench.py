"""python -m rollout.bench --config configs/bench/<name>.yaml [key=value ...]

Every scheduler on every workload profile, interleaved (each repetition runs all schedulers before the next
one starts), in one process on one machine. Schedulers: "vllm" (vLLM untouched, its default max_num_seqs),
"static-N" (our adapter with a fixed cap N = max_num_seqs), "memory" (Algorithm 1), "memory-clt", "forecast"
(length-aware admission from censored length estimates), "forecast-lpt" (forecast with each prompt's
predicted length from earlier iterations: longest first, and scaled estimates; in a first pass, probes as
`rollout.generate` sends them: `forecast-lpt:probe_first=false` for none), and "oracle" (true lengths,
longest first, a prompt's samples together, admitted in waves as the forecast admits; a reference, not a policy
one can deploy) and "oracle-fcfs" (the same admission in submission order, which separates what admission and
what order are worth; `oracle-fcfs:forecast_min_wave=0` admits whatever fits at every step, as before stop 27).

Writes results.json, results.md (a table per profile), throughput.png (median and spread per scheduler) and
timeline-<profile>.png (running batch and KV use over time) into the output folder.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rollout.config import ConfigError, PolicyConfig, RunConfig, validate
from rollout.workloads import ProfileConfig, longest_first, profile_requests

GPU_ENGINE = {"load_format": "dummy", "skip_tokenizer_init": True,
              "compilation_config": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}}


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
    reps: int = 3
    seed: int = 0
    vocab_size: int = 1000
    profiles: list = field(default_factory=lambda: [ProfileConfig()])
    only: list = field(default_factory=list)  # names of the profiles to run; empty: all
    out_dir: str = "runs/bench"


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
        if base not in ("vllm", "memory", "memory-clt", "forecast", "forecast-lpt", "oracle", "oracle-fcfs") and not (
                base.startswith("static-") and base[7:].isdigit()):
            raise ConfigError(f"schedulers: unknown scheduler {name!r} (vllm, static-N, memory, memory-clt, forecast, forecast-lpt, oracle, oracle-fcfs)")
        policy_options(name)
    return bench


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


def benchmark_model(model: str, work: Path, vocab_size: int) -> str:
    """"tiny": a random tiny Llama built under `work`; anything else: a model folder, used as it is."""
    if model != "tiny":
        return model
    from rollout.models import build_tiny_llama

    return str(build_tiny_llama(work / "tiny", vocab_size=vocab_size))


def scheduler_policy(bench: BenchConfig, scheduler: str) -> dict:
    """The policy settings a scheduler name stands for ("static-N": a fixed cap N that is also max_num_seqs).
    Submission is in the workload's order except for forecast-lpt. A name may carry policy settings,
    typed as on the command line: `forecast:forecast_siblings=true:eps_m=0.1`."""
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


def run_config(bench: BenchConfig, profile: ProfileConfig, scheduler: str, model: str) -> RunConfig:
    max_len = bench.max_model_len or (int(profile.prompt_tokens * max(profile.scale, 1)) + profile.max_output + 16)
    model_cfg = {"path": model, "max_model_len": max_len, "dtype": bench.dtype if bench.gpu else "float32",
                 "enforce_eager": not bench.gpu, "engine_kwargs": GPU_ENGINE if bench.gpu else {},
                 "enable_prefix_caching": bench.prefix_caching}
    for key in ("kv_cache_memory_bytes", "num_gpu_blocks_override"):
        if getattr(profile, key) is not None:
            model_cfg[key] = getattr(profile, key)
    policy = scheduler_policy(bench, scheduler)
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), {
        "model": model_cfg, "data": {"source": "synthetic"}, "policy": policy, "output": {"stats_in": None},
        "sampling": {"n": 1, "ignore_eos": True, "temperature": 1.0, "seed": bench.seed}}))
    validate(cfg)
    return cfg


def drain_tail_fraction(trace: list[dict]) -> float | None:
    """Share of the wall time spent with the running batch under half of its peak."""
    if len(trace) < 2:
        return None
    peak = max(s["running"] for s in trace)
    total = trace[-1]["t"] - trace[0]["t"]
    tail = sum(b["t"] - a["t"] for a, b in zip(trace, trace[1:]) if a["running"] < 0.5 * peak)
    return tail / total if total > 0 else None


def run_once(bench: BenchConfig, profile: ProfileConfig, scheduler: str, model: str, workdir: Path) -> dict:
    from rollout.engine import RolloutEngine

    cfg = run_config(bench, profile, scheduler, model)
    requested = generated = 0
    wall = preemptions = recomputed = 0.0
    per_pass = []  # tok/s of each iteration: later passes start from the lengths the earlier ones carried
    kv_capacity_tokens = None
    trace: list[dict] = []
    with RolloutEngine(cfg, workdir) as engine:
        started_at = time.time()
        for iteration in range(profile.iterations):
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


def time_paired_ratios(results: list[dict], base: str = "vllm") -> list[dict]:
    """Each run's tok/s against the `base` run of its profile that ran at the same time on another GPU (the one
    overlapping it most, by at least half the shorter run; each base run pairs once). A host's speed moves the
    runs on all its GPUs alike: on cap-bound (stop 27, 2x H200) both GPUs ran 12.9-13.6k tok/s in one slot and
    14.3-15.1k in the next, whichever scheduler ran, and such pairs halved the ratios' standard error against
    pairs within one process. Needs `started_at`, `ended_at` and `gpu` (results from stop 27 on)."""
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


def device_runs(folder: str | Path) -> list[dict]:
    """Every run's results under a folder of `scripts/device-bench.sh` output (a TAG-gN-PROFILE-SCHEDULER folder
    per run, its log beside it), each with the TAG of the call that ran it as "call"."""
    return [{**result, "call": path.parent.name.split("-")[0]}
            for path in sorted(Path(folder).glob("*-g*-*/results.json"))
            for result in json.loads(path.read_text())["results"]]


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


def table(results: list[dict], profile: str, schedulers: list[str]) -> str:
    rows = [r for r in results if r["profile"] == profile]
    base = statistics.median(r["tokens_per_s"] for r in rows if r["scheduler"] == "vllm") if any(
        r["scheduler"] == "vllm" for r in rows) else None
    lines = [f"### {profile}", "",
             "| scheduler | tok/s median (min-max) | vs vllm | makespan s | preemptions | recomputed % | "
             "mean running | KV use | drain tail | policy % of step (CPU; at finishes) | adapter % of step | "
             "tok/s per iteration |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def med(runs, key, fmt, scale=1.0):
        values = [r[key] * scale for r in runs if r.get(key) is not None]  # older results lack newer keys
        return fmt.format(statistics.median(values)) if values else "-"

    for name in schedulers:
        runs = [r for r in rows if r["scheduler"] == name]
        if not runs:
            continue
        tps = [r["tokens_per_s"] for r in runs]
        passes = [r["per_iteration_tokens_per_s"] for r in runs if r.get("per_iteration_tokens_per_s")]
        per_pass = " / ".join(f"{statistics.median(v):.0f}" for v in zip(*passes)) if passes else "-"
        ratio = f"{statistics.median(tps) / base:.3f}" if base else "-"
        lines.append(
            f"| {name} | {statistics.median(tps):.0f} ({min(tps):.0f}-{max(tps):.0f}) | {ratio} | "
            f"{med(runs, 'makespan_s', '{:.1f}')} | {med(runs, 'preemptions', '{:.0f}')} | "
            f"{med(runs, 'recomputed_fraction', '{:.2f}', 100)} | "
            f"{med(runs, 'mean_running', '{:.1f}')} | {med(runs, 'kv_usage_mean', '{:.2f}')} | "
            f"{med(runs, 'drain_tail_fraction', '{:.2f}')} | "
            f"{med(runs, 'policy_time_fraction', '{:.3f}', 100)} ({med(runs, 'policy_cpu_fraction', '{:.3f}', 100)}; "
            f"{med(runs, 'finish_cpu_fraction', '{:.3f}', 100)}) | {med(runs, 'adapter_time_fraction', '{:.3f}', 100)} | "
            f"{per_pass} |")
    return "\n".join(lines) + "\n"


def plots(results: list[dict], bench: BenchConfig, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    profiles = [p.name for p in bench.profiles]
    fig, axes = plt.subplots(1, len(profiles), figsize=(5 * len(profiles), 4), squeeze=False)
    for ax, profile in zip(axes[0], profiles):
        names = [s for s in bench.schedulers if any(r["scheduler"] == s and r["profile"] == profile for r in results)]
        tps = [[r["tokens_per_s"] for r in results if r["scheduler"] == s and r["profile"] == profile] for s in names]
        meds = [statistics.median(t) for t in tps]
        err = [[m - min(t) for m, t in zip(meds, tps)], [max(t) - m for m, t in zip(meds, tps)]]
        ax.bar(range(len(names)), meds, yerr=err, capsize=4, color="tab:blue")
        ax.set_xticks(range(len(names)), names, rotation=40, ha="right", fontsize=8)
        ax.set_title(profile)
        ax.set_ylabel("generated tok/s (median, min-max)")
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=100)
    plt.close(fig)
    paths.append(str(out / "throughput.png"))
    for profile in profiles:
        fig, (run_ax, kv_ax) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
        for name in bench.schedulers:
            first = next((r for r in results if r["profile"] == profile and r["scheduler"] == name
                          and r["timeline"]), None)
            if first:
                t = [p["t"] for p in first["timeline"]]
                run_ax.plot(t, [p["running"] for p in first["timeline"]], lw=1, label=name)
                kv_ax.plot(t, [p["kv_usage"] for p in first["timeline"]], lw=1, label=name)
        run_ax.set_ylabel("running requests")
        kv_ax.set_ylabel("KV use")
        kv_ax.set_xlabel("seconds")
        run_ax.legend(fontsize=8)
        run_ax.set_title(f"{profile}: first repetition (vllm has no trace)")
        fig.tight_layout()
        path = out / f"timeline-{profile}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(str(path))
    return paths


def main(argv: list[str] | None = None) -> int:
    os.environ.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    parser = argparse.ArgumentParser(prog="python -m rollout.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="a bench YAML (configs/bench/)")
    parser.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. reps=5 out_dir=runs/b2")
    args = parser.parse_args(argv)
    try:
        bench = load_bench_config(args.config, args.overrides)
        for profile in bench.profiles:  # fail on a bad profile before any engine starts
            for scheduler in bench.schedulers:
                run_config(bench, profile, scheduler, "unused")
            profile_requests(profile, 0, bench.seed, bench.vocab_size)
    except (ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(bench.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-"))
    model = benchmark_model(bench.model, work, bench.vocab_size)
    results, started, ran_on = [], time.time(), machine(bench.gpu)
    for profile in bench.profiles:
        for rep in range(bench.reps):
            for scheduler in bench.schedulers:
                result = run_once(bench, profile, scheduler, model, work / f"{profile.name}-{scheduler}-{rep}")
                result["rep"] = rep
                steps = {"scheduler": scheduler, "rep": rep, "kv_capacity_tokens": result.pop("kv_capacity_tokens"),
                         "steps": result.pop("steps")}  # per step: t, running, scheduled, KV use, preempted, cap, ms
                with gzip.open(out / f"steps-{profile.name}.jsonl.gz", "at") as f:  # what the simulator is fit to
                    f.write(json.dumps(steps) + "\n")
                results.append(result)
                print(json.dumps({k: v for k, v in result.items() if k != "timeline"}), flush=True)
                report = {"config": OmegaConf.to_container(OmegaConf.structured(bench)), "started": started,
                          "machine": ran_on, "results": results}
                (out / "results.json").write_text(json.dumps(report, indent=1))  # partial results survive a kill
    where = ", ".join(ran_on["gpus"]) or f"CPU only ({ran_on['cpu_count']} cores)"
    md = f"Machine: {where}; vLLM {ran_on['vllm']}, torch {ran_on['torch']}\n\n" + "".join(
        table(results, p.name, bench.schedulers) + "\n" for p in bench.profiles)
    (out / "results.md").write_text(md)
    plots(results, bench, out)
    print(md)
    print(f"results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
