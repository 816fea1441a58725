"""python -m rollout.sim --config configs/bench/gpu.yaml --steps DIR [key=value ...]

Fits the step-time model to a benchmark's recorded steps (DIR/steps-<profile>.jsonl.gz), simulates every
scheduler of the bench config on the same workloads, and prints simulated against measured tokens/s (from
DIR/results.json) with the error and whether the ranking of schedulers agrees.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

from rollout.suite import load_bench_config
from rollout.sim.fit import fit_step_time, step_rows
from rollout.sim.runs import simulate_profile


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rollout.sim", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--steps", required=True, help="a benchmark output folder")
    parser.add_argument("--fit", help="fit the step-time model to these recorded steps instead (a steps-*.jsonl.gz "
                                      "file): a held-out check of a profile the model was not fitted to")
    parser.add_argument("--per-kv-token-ns", type=float, help="fix the KV-read cost instead of fitting it")
    parser.add_argument("--token-budget", type=int, default=16384,
                        help="vLLM's max_num_batched_tokens (its offline default on H100/H200-class GPUs)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--graph-batch", type=int, default=0,
                        help="the largest decode batch run as a CUDA graph (vLLM's default: 512 with max_num_seqs "
                             "1024); the fit then prices decode-only steps above it apart")
    parser.add_argument("--policy-time", action="store_true",
                        help="add each scheduler's measured policy time per step (results.json) to its simulated "
                             "steps, as if the policy ran on the critical path (the simulator has no policy cost)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    bench = load_bench_config(args.config, args.overrides)
    folder = Path(args.steps)
    measured = json.loads((folder / "results.json").read_text())["results"]
    per_kv = None if args.per_kv_token_ns is None else args.per_kv_token_ns * 1e-9
    for profile in bench.profiles:
        runs = step_rows(folder / f"steps-{profile.name}.jsonl.gz")
        model, fit_error = fit_step_time(step_rows(args.fit) if args.fit else runs, per_kv, args.graph_batch)
        capacity_tokens = max(run["kv_capacity_tokens"] or 0 for run in runs)  # "vllm" runs record none
        print(f"### {profile.name}: step time = {model} "
              f"(fitted to {args.fit or 'these runs'}; total-time error of the fit {fit_error:.1%})\n")
        print("| scheduler | measured tok/s | simulated tok/s | error | measured preemptions | simulated |")
        print("|---|---|---|---|---|---|")
        real_rank, sim_rank = {}, {}
        for name in bench.schedulers:
            real = [r for r in measured if r["profile"] == profile.name and r["scheduler"] == name]
            if not real:
                continue
            step_model = model
            policy_us = [r["policy_us_mean"] for r in real if r.get("policy_us_mean") is not None]
            if args.policy_time and policy_us:
                step_model = dataclasses.replace(model, base=model.base + statistics.median(policy_us) * 1e-6)
            run = simulate_profile(bench, profile, name, step_model, kv_capacity_tokens=capacity_tokens,
                                   block_size=args.block_size, token_budget=args.token_budget)
            real_tps = statistics.median(r["tokens_per_s"] for r in real)
            real_rank[name], sim_rank[name] = real_tps, run.tokens_per_s
            print(f"| {name} | {real_tps:.0f} | {run.tokens_per_s:.0f} | {run.tokens_per_s / real_tps - 1:+.1%} | "
                  f"{statistics.median(r['preemptions'] for r in real):.0f} | {run.preemptions} |")
        order = lambda d: sorted(d, key=d.get, reverse=True)  # noqa: E731
        print(f"\nranking measured: {order(real_rank)}\nranking simulated: {order(sim_rank)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
