"""Schedulers on the GPU suite's workloads in the simulator, no GPU needed, each step priced by
`rollout.sim.fit.h200_step_model` (fitted to the H200 8B kv-bound runs; the KV-read term from the model shape).
Prints tok/s, preemptions and recomputed share.

    python scripts/simulate_policies.py vllm,memory,forecast,forecast-lpt,oracle "only=[kv-bound,grpo-groups]"

forecast-lpt keeps a per-prompt memory across iterations as RolloutEngine does with policy.order=longest_first.
A scheduler may carry policy settings: `forecast:forecast_after=8:eps_m=0.1`.

`--h100`: the step-time model fitted to an H100 long-cot run, with the H200 fit's prefill terms. For long-cot
it is the closer model (docs/results.md).

`--kv-bytes=N`: another model shape's KV bytes per token (57344 for configs/models/qwen2.5-7b), which sets both the cache's tokens and the KV-read term.

`--seeds=0,1,2`: each profile's workload drawn with each seed (the bench's `seed`), the schedulers run on each
draw (two at a time), and per scheduler the ratio to the first one listed: geometric mean over the seeds with its range, each pass's mean ratio, and the mean recomputed share (net: less what
resumed requests found in the prefix cache or, with `kv_offloading_gib=N`, in host memory). One seed's
draw can rank two close settings either way (docs/results.md, "tail-bound").
"""
import argparse
import dataclasses
import multiprocessing
import sys
import time
from pathlib import Path

import numpy as np

from rollout.sim.fit import LLAMA_8B_KV_BYTES_PER_TOKEN, h200_step_model
from rollout.sim.runs import simulate_profile
from rollout.suite import load_bench_config

GPU_BENCH = Path(__file__).resolve().parent.parent / "configs" / "bench" / "gpu.yaml"


def arguments(doc: str, argv: list[str]) -> argparse.Namespace:
    """The options scripts/simulate_policies.py and scripts/vllm_loop_policies.py share."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("schedulers", type=lambda names: names.split(","), help="comma-separated, the first the reference")
    parser.add_argument("overrides", nargs="*", help='bench overrides, e.g. "only=[kv-bound]"')
    parser.add_argument("--kv-bytes", type=int, default=LLAMA_8B_KV_BYTES_PER_TOKEN, help="KV bytes per token")
    parser.add_argument("--seeds", type=lambda seeds: [int(seed) for seed in seeds.split(",")],
                        help="draw each profile's workload with each of these seeds")
    parser.add_argument("--h100", action="store_true", help="the H100 long-cot fit")
    return parser.parse_intermixed_args(argv)


def simulate_seed(job: tuple) -> tuple:
    """One scheduler on one profile's workload drawn with one seed: tok/s, per-pass tok/s, recomputed share, and
    that share net of what resumed requests found in the prefix cache or host memory."""
    bench, profile, name, seed, model, kv_bytes = job
    run = simulate_profile(dataclasses.replace(bench, seed=seed), profile, name, model,
                           kv_capacity_tokens=profile.kv_cache_memory_bytes // kv_bytes)
    return (run.tokens_per_s, run.per_iteration_tokens_per_s, run.recomputed_tokens / run.generated_tokens,
            (run.recomputed_tokens - run.recovered_tokens) / run.generated_tokens)


def over_seeds(bench, names: list[str], seeds: list[int], model, kv_bytes: int) -> None:
    with multiprocessing.Pool(2) as pool:
        for profile in bench.profiles:
            jobs = [(bench, profile, name, seed, model, kv_bytes) for seed in seeds for name in names]
            runs = dict(zip([(name, seed) for seed in seeds for name in names], pool.map(simulate_seed, jobs)))
            for name in names:
                ratios = np.array([runs[name, seed][0] / runs[names[0], seed][0] for seed in seeds])
                passes = np.mean([np.divide(runs[name, seed][1], runs[names[0], seed][1]) for seed in seeds], axis=0)
                print(f"{profile.name:12s} {name:40s} vs {names[0]}: {np.exp(np.log(ratios).mean()):.3f}x "
                      f"({ratios.min():.3f}-{ratios.max():.3f}) over seeds {seeds}; per pass "
                      f"{' / '.join(f'{v:.3f}x' for v in passes)}; recomputed "
                      f"{np.mean([runs[name, seed][2] for seed in seeds]):.1%} "
                      f"(net {np.mean([runs[name, seed][3] for seed in seeds]):.1%})", flush=True)


def one_draw(bench, names: list[str], model, kv_bytes: int) -> None:
    for profile in bench.profiles:
        row = {}
        for name in names:
            t0 = time.time()
            run = simulate_profile(bench, profile, name, model,
                                   kv_capacity_tokens=profile.kv_cache_memory_bytes // kv_bytes, keep_trace=True)
            row[name] = run.tokens_per_s
            print(f"{profile.name:12s} {name:12s} {run.tokens_per_s:8.0f} tok/s  preemptions {run.preemptions:5d}  "
                  f"recomputed {run.recomputed_tokens / run.generated_tokens:.2%} "
                  f"(net {(run.recomputed_tokens - run.recovered_tokens) / run.generated_tokens:.2%})  per iteration "
                  f"{'/'.join(f'{v:.0f}' for v in run.per_iteration_tokens_per_s)}  "
                  f"({time.time() - t0:.1f} s to simulate)", flush=True)
            for k, trace in enumerate(run.traces):  # how full the cache is kept while requests wait, and how many run
                clock, running, kv, waiting, longest = (np.array([step[i] for step in trace]) for i in (0, 1, 3, 5, 6))
                held = np.diff(clock, prepend=0.0) * (waiting > 0)
                print(f"{'':25s} pass {k}: requests waited {held.sum():.0f} of {clock[-1]:.0f} s, the cache then "
                      f"{np.sum(kv * held) / held.sum():.2f} full with {np.sum(running * held) / held.sum():.0f} "
                      f"running, {np.sum(longest * held) / held.sum():.1f} of them of the pass's longest tenth "
                      f"(time means); that tenth's most at once {longest.max()}", flush=True)
            for k, (last, longest) in enumerate(zip(run.last, run.longest)):  # the request that finished the pass
                for what, path in (("last", last), ("longest", longest)):  # and its longest
                    ran = path.finished_s - path.started_s
                    print(f"{'':25s} pass {k}: its {what} request ({path.output_tokens} tokens) admitted at "
                          f"{path.started_s:.1f} s, ran {ran:.1f} s ({ran / path.output_tokens * 1e3:.1f} ms a "
                          f"token), recomputed {path.recomputed_tokens} tokens in {path.preemptions} preemptions",
                          flush=True)
        if "vllm" in row:
            print("  ratios:", {k: round(v / row["vllm"], 3) for k, v in row.items()}, flush=True)


def main(argv: list[str]) -> None:
    args = arguments(__doc__, argv)
    model = h200_step_model(args.kv_bytes, h100=args.h100)
    print(f"step time = {model}", flush=True)
    bench = load_bench_config(str(GPU_BENCH), args.overrides)
    if args.seeds is not None:
        over_seeds(bench, args.schedulers, args.seeds, model, args.kv_bytes)
    else:
        one_draw(bench, args.schedulers, model, args.kv_bytes)


if __name__ == "__main__":
    main(sys.argv[1:])
