"""Schedulers on a GPU suite profile's first pass with vLLM's own scheduler in simulated time
(rollout.sim.vllm_loop): our adapter or vLLM's default, vLLM's KV connectors included, the step time from the
simulator's H200 fit (as scripts/simulate_policies.py). Prints, per scheduler and seed: tok/s, preemptions, the
most requests loading KV blocks at once, and the most by which running and loading requests together exceeded
the admission cap.

    python scripts/vllm_loop_policies.py --kv-bytes=57344 --seeds=0,1,2 vllm,forecast-lpt \\
      "only=[tail-bound]" profiles.5.num_prompts=96 profiles.5.kv_cache_memory_bytes=8589934592 kv_offloading_gib=32

Its throughput is not calibrated against a GPU (docs/results.md, tail-bound): read it for what the scheduler
does, not for how fast.
"""
import sys
import tempfile
from pathlib import Path

import numpy as np

from rollout.sim.fit import fit_step_time, step_rows
from rollout.sim.vllm_loop import profile_pass
from rollout.suite import load_bench_config

ROOT = Path(__file__).resolve().parent.parent
STEPS = ROOT / "configs" / "sim" / "kv-bound-h200-steps.jsonl.gz"


def main(argv: list[str]) -> None:
    kv_bytes, seeds = 128 * 1024, [0]
    while argv and argv[0].startswith("--"):
        key, _, value = argv.pop(0).partition("=")
        if key == "--kv-bytes":
            kv_bytes = int(value)
        elif key == "--seeds":
            seeds = [int(seed) for seed in value.split(",")]
        else:
            sys.exit(f"unknown option {key}\n{__doc__}")
    if not argv:
        sys.exit(__doc__)
    model, _ = fit_step_time(step_rows(STEPS), per_kv_token=kv_bytes / 4.0e12)
    names, overrides = argv[0].split(","), argv[1:]
    for seed in seeds:
        bench = load_bench_config(str(ROOT / "configs" / "bench" / "gpu.yaml"), [*overrides, f"seed={seed}"])
        for profile in bench.profiles:
            for name in names:
                with tempfile.TemporaryDirectory() as work:
                    result, _ = profile_pass(bench, profile, name, model, Path(work), kv_bytes_per_token=kv_bytes)
                over = np.add(result.running, result.loading) - np.array(result.caps)
                print(f"{profile.name:12s} seed {seed} {name:24s} {result.tokens_per_s:7.0f} tok/s, "
                      f"{result.preemptions} preemptions, at most {max(result.loading)} loading, "
                      f"running + loading at most {int(over.max()):+d} over the cap, "
                      f"mean running {np.mean(result.running):.1f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
