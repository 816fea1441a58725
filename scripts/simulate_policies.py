"""Schedulers on the GPU suite's workloads in the simulator, with the step-time model fitted to the H200 8B
kv-bound runs (configs/sim/kv-bound-h200-steps.jsonl.gz), no GPU needed. Prints tok/s, preemptions and
recomputed share. Those runs' contexts are too short to price reading the KV cache, so that term is fixed at
the 8B shape's 128 KiB per token over ~4 TB/s of HBM (it matters for long-cot).

    python scripts/simulate_policies.py vllm,memory,forecast,forecast-lpt,oracle "only=[kv-bound,grpo-groups]"

forecast-lpt keeps a per-prompt memory across iterations as RolloutEngine does with policy.order=longest_first.
A scheduler may carry policy settings: `forecast:forecast_after=8:eps_m=0.1`.

`--h100` (first argument): the step-time model fitted to an H100 long-cot run instead
(configs/sim/long-cot-h100-steps.jsonl.gz: long contexts, so the KV-read term is measured), with the H200 fit's
prefill terms (that run's prefill steps are all large admission waves, which cannot tell a per-token from a
per-step cost). For long-cot it is the closer model (docs/results.md).

`--kv-bytes=N` (first argument, before `--h100`): another model shape's KV bytes per token (57344 for configs/models/qwen2.5-7b),
which sets both the cache's tokens and the KV-read term.

`--seeds=0,1,2` (first argument, before the others): each profile's workload drawn with each seed (the bench's
`seed`), the schedulers run on each draw (two at a time), and per scheduler the ratio to the first one listed:
geometric mean over the seeds with its range, each pass's mean ratio, and the mean recomputed share (net: less what
resumed requests found in the prefix cache or, with `kv_offloading_gib=N`, in host memory). One seed's
draw can rank two close settings either way (docs/results.md, "tail-bound").
"""
import dataclasses
import multiprocessing
import sys
import time
from pathlib import Path

import numpy as np

from rollout.sim.fit import fit_step_time, step_rows
from rollout.sim.runs import simulate_profile
from rollout.suite import load_bench_config

ROOT = Path(__file__).resolve().parent.parent
FITS = ROOT / "configs" / "sim"
STEPS = FITS / "kv-bound-h200-steps.jsonl.gz"
H100_STEPS = FITS / "long-cot-h100-steps.jsonl.gz"
KV_BYTES_PER_TOKEN = 128 * 1024  # Llama-3.1-8B shape
if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
    sys.exit(__doc__)
SEEDS = None
if sys.argv[1].startswith("--seeds="):
    SEEDS = [int(seed) for seed in sys.argv.pop(1).split("=", 1)[1].split(",")]
if sys.argv[1].startswith("--kv-bytes="):
    KV_BYTES_PER_TOKEN = int(sys.argv.pop(1).split("=", 1)[1])
model, _ = fit_step_time(step_rows(STEPS), per_kv_token=KV_BYTES_PER_TOKEN / 4.0e12)
if sys.argv[1] == "--h100":
    sys.argv.pop(1)
    h100, _ = fit_step_time([run for run in step_rows(H100_STEPS) if run["scheduler"] == "forecast"])
    model = dataclasses.replace(h100, per_prefill_token=model.per_prefill_token, per_mixed_step=model.per_mixed_step)
print(f"step time = {model}", flush=True)
bench = load_bench_config(str(ROOT / "configs" / "bench" / "gpu.yaml"), sys.argv[2:])


def simulate_seed(job: tuple) -> tuple:
    """One scheduler on one profile's workload drawn with one seed: tok/s, per-pass tok/s, recomputed share, and
    that share net of what resumed requests found in the prefix cache or host memory."""
    profile, name, seed = job
    run = simulate_profile(dataclasses.replace(bench, seed=seed), profile, name, model,
                           kv_capacity_tokens=profile.kv_cache_memory_bytes // KV_BYTES_PER_TOKEN)
    return (run.tokens_per_s, run.per_iteration_tokens_per_s, run.recomputed_tokens / run.generated_tokens,
            (run.recomputed_tokens - run.recovered_tokens) / run.generated_tokens)


if SEEDS is not None:
    names = sys.argv[1].split(",")
    with multiprocessing.Pool(2) as pool:
        for profile in bench.profiles:
            jobs = [(profile, name, seed) for seed in SEEDS for name in names]
            runs = dict(zip([(name, seed) for _, name, seed in jobs], pool.map(simulate_seed, jobs)))
            for name in names:
                ratios = np.array([runs[name, seed][0] / runs[names[0], seed][0] for seed in SEEDS])
                passes = np.mean([np.divide(runs[name, seed][1], runs[names[0], seed][1]) for seed in SEEDS], axis=0)
                print(f"{profile.name:12s} {name:40s} vs {names[0]}: {np.exp(np.log(ratios).mean()):.3f}x "
                      f"({ratios.min():.3f}-{ratios.max():.3f}) over seeds {SEEDS}; per pass "
                      f"{' / '.join(f'{v:.3f}x' for v in passes)}; recomputed "
                      f"{np.mean([runs[name, seed][2] for seed in SEEDS]):.1%} "
                      f"(net {np.mean([runs[name, seed][3] for seed in SEEDS]):.1%})", flush=True)
    sys.exit(0)
for profile in bench.profiles:
    row = {}
    for name in sys.argv[1].split(","):
        t0 = time.time()
        run = simulate_profile(bench, profile, name, model,
                               kv_capacity_tokens=profile.kv_cache_memory_bytes // KV_BYTES_PER_TOKEN, keep_trace=True)
        row[name] = run.tokens_per_s
        print(f"{profile.name:12s} {name:12s} {run.tokens_per_s:8.0f} tok/s  preemptions {run.preemptions:5d}  "
              f"recomputed {run.recomputed_tokens / run.generated_tokens:.2%} "
              f"(net {(run.recomputed_tokens - run.recovered_tokens) / run.generated_tokens:.2%})  per iteration "
              f"{'/'.join(f'{v:.0f}' for v in run.per_iteration_tokens_per_s)}  ({time.time() - t0:.1f} s to simulate)",
              flush=True)
        for k, trace in enumerate(run.traces):  # how full the cache is kept while requests wait, and how many run
            clock, running, kv, waiting, longest = (np.array([step[i] for step in trace]) for i in (0, 1, 3, 5, 6))
            held = np.diff(clock, prepend=0.0) * (waiting > 0)
            print(f"{'':25s} pass {k}: requests waited {held.sum():.0f} of {clock[-1]:.0f} s, the cache then "
                  f"{np.sum(kv * held) / held.sum():.2f} full with {np.sum(running * held) / held.sum():.0f} running, "
                  f"{np.sum(longest * held) / held.sum():.1f} of them of the pass's longest tenth (time means); "
                  f"that tenth's most at once {longest.max()}", flush=True)
        for k, (last, longest) in enumerate(zip(run.last, run.longest)):  # the request that finished the pass
            for what, path in (("last", last), ("longest", longest)):  # and its longest
                ran = path.finished_s - path.started_s
                print(f"{'':25s} pass {k}: its {what} request ({path.output_tokens} tokens) admitted at "
                      f"{path.started_s:.1f} s, ran {ran:.1f} s ({ran / path.output_tokens * 1e3:.1f} ms a token), "
                      f"recomputed {path.recomputed_tokens} tokens in {path.preemptions} preemptions", flush=True)
    if "vllm" in row:
        print("  ratios:", {k: round(v / row["vllm"], 3) for k, v in row.items()}, flush=True)
