"""Static B_max cap vs the memory policies on a workload whose KV demand far exceeds the cache (tiny model, CPU).

    python scripts/tight_kv_compare.py [--reps 3] [--blocks 24] [--prompts 96]

Runs the policies interleaved, `reps` times each, and prints generated tok/s, preemptions and mean cap.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

from omegaconf import OmegaConf


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--blocks", type=int, default=24)
    parser.add_argument("--prompts", type=int, default=96)
    parser.add_argument("--b-max", type=int, default=64)
    parser.add_argument("--policies", default="static,memory,memory-clt")
    args = parser.parse_args()

    from rollout.config import RunConfig, validate
    from rollout.engine import RolloutEngine
    from rollout.models import build_tiny_llama
    from rollout.workloads import lognormal_workload

    work = tempfile.mkdtemp(prefix="tightkv-")
    model = build_tiny_llama(os.path.join(work, "tiny"))
    prompts, lengths = lognormal_workload(args.prompts, seed=1)
    results = {name: [] for name in args.policies.split(",")}
    for rep in range(args.reps):
        for name in results:
            cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), {
                "model": {"path": str(model), "dtype": "float32", "num_gpu_blocks_override": args.blocks,
                          "max_model_len": 2048, "kv_cache_memory_bytes": 64 << 20},
                "data": {"source": "synthetic"}, "sampling": {"n": 1, "ignore_eos": True, "temperature": 1.0},
                "policy": {"name": name, "b_max": args.b_max}, "output": {"stats_in": None}}))
            validate(cfg)
            with RolloutEngine(cfg, os.path.join(work, f"{name}-{rep}")) as engine:
                s = engine.generate(prompts, progress=False, max_tokens=lengths).summary
            assert s["generated_tokens"] == sum(lengths), "every request must produce its imposed length"
            results[name].append(s)
            print(json.dumps({"rep": rep, "policy": name, "tok_s": s["generated_tokens_per_s"],
                              "preemptions": s["preemptions"], "cap_mean": s["cap"]["mean"],
                              "running_mean": s["running"]["mean"], "wall_s": s["wall_time_s"]}), flush=True)
    base = statistics.median(r["generated_tokens_per_s"] for r in results["static"]) if "static" in results else None
    print(f"\n{'policy':<12} {'tok/s median':>12} {'spread':>16} {'preemptions':>12} {'vs static':>10}")
    for name, runs in results.items():
        tps = [r["generated_tokens_per_s"] for r in runs]
        med = statistics.median(tps)
        print(f"{name:<12} {med:>12.1f} {f'{min(tps):.0f}-{max(tps):.0f}':>16} "
              f"{statistics.median(r['preemptions'] for r in runs):>12.0f} "
              f"{(med / base if base else float('nan')):>10.3f}")


if __name__ == "__main__":
    main()
