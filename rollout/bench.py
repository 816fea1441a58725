"""python -m rollout.bench --config configs/bench/<name>.yaml [key=value ...]

Every scheduler on every workload profile, interleaved (each repetition runs all schedulers before the next
one starts), in one process on one machine. Schedulers: "vllm" (vLLM untouched, its default max_num_seqs),
"static-N" (our adapter with a fixed cap N = max_num_seqs), "memory" (Algorithm 1), "memory-clt", "forecast"
(length-aware admission from censored length estimates), "forecast-lpt" (forecast with each prompt's
predicted length from earlier iterations: longest first, and scaled estimates; in a first pass, probes as
`rollout.generate` sends them: `forecast-lpt:probe_first=false` for none), and "oracle" (true lengths,
longest first, a prompt's samples together, admitted in waves as the forecast admits; a reference, not a policy
one can deploy) and "oracle-fcfs" (the same admission in submission order, which separates what admission and
what order are worth; `oracle-fcfs:forecast_min_wave=0` admits whatever fits at every step). A name may carry
policy settings: `forecast:forecast_after=8:eps_m=0.1`.

Writes results.json, steps-<profile>.jsonl.gz (what `python -m rollout.sim` fits to), results.md (a table per
profile), throughput.png (median and spread per scheduler) and timeline-<profile>.png (running batch and KV use
over time) into out_dir (default runs/bench/<config name>). The runs themselves are `rollout.suite.run_bench`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from rollout.config import ConfigError
from rollout.suite import BenchConfig, check_bench, load_bench_config, run_bench


def table(results: list[dict], profile: str, schedulers: list[str]) -> str:
    rows = [r for r in results if r["profile"] == profile]
    base = statistics.median(r["tokens_per_s"] for r in rows if r["scheduler"] == "vllm") if any(
        r["scheduler"] == "vllm" for r in rows) else None
    lines = [f"### {profile}", "",
             "| scheduler | tok/s median (min-max) | vs vllm | makespan s | preemptions | recomputed % (net of cache hits) | "
             "mean running | KV use | drain tail | policy % of step (CPU; at finishes) | adapter % of step | "
             "tok/s per iteration |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def med(runs, key, fmt, scale=1.0):
        values = [r[key] * scale for r in runs if r.get(key) is not None]  # absent or None without a trace (vllm) or a forecast
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
            f"{med(runs, 'recomputed_fraction', '{:.2f}', 100)} ({med(runs, 'recomputed_net_fraction', '{:.2f}', 100)}) | "
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
    parser.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. reps=5 out_dir=runs/bench/b2")
    args = parser.parse_args(argv)
    try:
        bench = load_bench_config(args.config, args.overrides)
        check_bench(bench)
    except (ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(bench.out_dir)
    report = run_bench(bench, out, on_result=lambda result: print(
        json.dumps({k: v for k, v in result.items() if k != "timeline"}), flush=True))
    results, ran_on = report["results"], report["machine"]
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
