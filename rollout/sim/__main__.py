"""python -m rollout.sim --config configs/bench/gpu.yaml --steps DIR [--out OUT] [key=value ...]

Fits the step-time model to a benchmark's recorded steps (DIR/steps-<profile>.jsonl.gz), simulates every
scheduler of the bench config on the same workloads, and compares simulated with measured tokens/s (from
DIR/results.json): the error, and whether the ranking of schedulers agrees. Writes OUT/results.json (the
numbers) and OUT/results.md (the tables it prints); OUT defaults to runs/sim/<name of DIR>.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

from rollout.config import ConfigError
from rollout.sim.fit import fit_step_time, step_rows
from rollout.sim.runs import simulate_profile
from rollout.suite import BenchConfig, load_bench_config


def compare(bench: BenchConfig, folder: Path, fit: str | None = None, per_kv_token: float | None = None,
            graph_batch: int = 0, policy_time: bool = False, block_size: int = 16,
            token_budget: int = 16384) -> list[dict]:
    """Per profile: the fitted step-time model, and per scheduler measured against simulated tok/s and
    preemptions, with both rankings (fastest first)."""
    measured = json.loads((folder / "results.json").read_text())["results"]
    profiles = []
    for profile in bench.profiles:
        runs = step_rows(folder / f"steps-{profile.name}.jsonl.gz")
        model, fit_error = fit_step_time(step_rows(fit) if fit else runs, per_kv_token, graph_batch)
        capacity_tokens = max(run["kv_capacity_tokens"] or 0 for run in runs)  # "vllm" runs record none
        rows = []
        for name in bench.schedulers:
            real = [r for r in measured if r["profile"] == profile.name and r["scheduler"] == name]
            if not real:
                continue
            step_model = model
            policy_us = [r["policy_us_mean"] for r in real if r.get("policy_us_mean") is not None]
            if policy_time and policy_us:
                step_model = dataclasses.replace(model, base=model.base + statistics.median(policy_us) * 1e-6)
            run = simulate_profile(bench, profile, name, step_model, kv_capacity_tokens=capacity_tokens,
                                   block_size=block_size, token_budget=token_budget)
            real_tps = statistics.median(r["tokens_per_s"] for r in real)
            rows.append({"scheduler": name, "measured_tokens_per_s": real_tps,
                         "simulated_tokens_per_s": run.tokens_per_s, "error": run.tokens_per_s / real_tps - 1,
                         "measured_preemptions": statistics.median(r["preemptions"] for r in real),
                         "simulated_preemptions": run.preemptions})

        def ranking(key: str) -> list[str]:
            return [row["scheduler"] for row in sorted(rows, key=lambda row: row[key], reverse=True)]

        profiles.append({"profile": profile.name, "step_time": dataclasses.asdict(model),
                         "step_time_text": str(model), "fitted_to": fit or "these runs", "fit_error": fit_error,
                         "schedulers": rows, "ranking_measured": ranking("measured_tokens_per_s"),
                         "ranking_simulated": ranking("simulated_tokens_per_s")})
    return profiles


def markdown(profiles: list[dict]) -> str:
    lines = []
    for p in profiles:
        lines += [f"### {p['profile']}: step time = {p['step_time_text']} "
                  f"(fitted to {p['fitted_to']}; total-time error of the fit {p['fit_error']:.1%})", "",
                  "| scheduler | measured tok/s | simulated tok/s | error | measured preemptions | simulated |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r['scheduler']} | {r['measured_tokens_per_s']:.0f} | {r['simulated_tokens_per_s']:.0f} | "
                  f"{r['error']:+.1%} | {r['measured_preemptions']:.0f} | {r['simulated_preemptions']} |"
                  for r in p["schedulers"]]
        lines += ["", f"ranking measured: {p['ranking_measured']}", f"ranking simulated: {p['ranking_simulated']}",
                  ""]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rollout.sim", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--steps", required=True, help="a benchmark output folder")
    parser.add_argument("--out", help="where results.json and results.md go (default runs/sim/<name of --steps>)")
    parser.add_argument("--fit", help="fit the step-time model to these recorded steps instead (a steps-*.jsonl.gz "
                                      "file): a held-out check of a profile the model was not fitted to")
    parser.add_argument("--per-kv-token-ns", type=float, help="fix the KV-read cost instead of fitting it")
    parser.add_argument("--token-budget", type=int, default=16384,
                        help="vLLM's max_num_batched_tokens (its offline default on a GPU of 70 GiB or more)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--graph-batch", type=int, default=0,
                        help="the largest decode batch run as a CUDA graph (vLLM's default: 512 with max_num_seqs "
                             "1024); the fit then prices decode-only steps above it apart")
    parser.add_argument("--policy-time", action="store_true",
                        help="add each scheduler's measured policy time per step (results.json) to its simulated "
                             "steps, as if the policy ran on the critical path (the simulator has no policy cost)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    try:
        bench = load_bench_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    folder = Path(args.steps)
    per_kv = None if args.per_kv_token_ns is None else args.per_kv_token_ns * 1e-9
    profiles = compare(bench, folder, args.fit, per_kv, args.graph_batch, args.policy_time, args.block_size,
                       args.token_budget)
    out = Path(args.out or f"runs/sim/{folder.resolve().name}")
    out.mkdir(parents=True, exist_ok=True)
    md = markdown(profiles)
    report = {"config": dataclasses.asdict(bench), "steps": str(folder), "policy_time": args.policy_time,
              "token_budget": args.token_budget, "block_size": args.block_size, "profiles": profiles}
    (out / "results.json").write_text(json.dumps(report, indent=1))
    (out / "results.md").write_text(md)
    print(md, end="")
    print(f"results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
