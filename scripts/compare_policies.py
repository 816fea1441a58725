"""Policies side by side on one synthetic workload with imposed lengths, interleaved and repeated, in one
process: the quick form of `python -m rollout.bench`.

CPU, tiny random Llama, a KV cache far smaller than the demand (the default):
    python scripts/compare_policies.py --reps 3
GPU, a real architecture with dummy weights and CUDA graphs:
    python scripts/compare_policies.py --model configs/models/llama-3.2-1b --gpu --kv-bytes 2147483648 \
        --prompts 1024 --prompt-tokens 128 --median 250 --max-output 2048 --b-max 1024

Prints one JSON line per run, then a table: generated tok/s median (min-max), preemptions, mean cap and
running batch, and the ratio to the static cap's median. --json writes all summaries to a file.
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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="'tiny' (built here) or a model folder")
    parser.add_argument("--gpu", action="store_true", help="dummy weights, no tokenizer, CUDA graphs")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--blocks", type=int, help="KV blocks (num_gpu_blocks_override); default 24 on CPU")
    parser.add_argument("--kv-bytes", type=int, default=64 << 20)
    parser.add_argument("--prompts", type=int, default=96)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--median", type=int, default=160)
    parser.add_argument("--sigma", type=float, default=0.7)
    parser.add_argument("--max-output", type=int, default=1024)
    parser.add_argument("--b-max", type=int, default=64)
    parser.add_argument("--eps-m", type=float, default=0.05)
    parser.add_argument("--policies", default="static,memory,memory-clt")
    parser.add_argument("--json", help="write every run's summary (without series) here")
    args = parser.parse_args()

    from rollout.suite import GPU_ENGINE
    from rollout.config import RunConfig, validate
    from rollout.engine import RolloutEngine
    from rollout.models import build_tiny_llama
    from rollout.workloads import lognormal_workload

    work = tempfile.mkdtemp(prefix="compare-")
    model = build_tiny_llama(os.path.join(work, "tiny")) if args.model == "tiny" else args.model
    blocks = args.blocks if args.blocks or args.gpu else 24
    prompts, lengths = lognormal_workload(args.prompts, prompt_tokens=args.prompt_tokens, median_output=args.median,
                                          sigma=args.sigma, max_output=args.max_output, seed=1)
    model_cfg = {"path": str(model), "kv_cache_memory_bytes": args.kv_bytes,
                 "max_model_len": args.prompt_tokens + args.max_output + 16}
    if args.gpu:
        model_cfg.update(dtype="bfloat16", enforce_eager=False, engine_kwargs=GPU_ENGINE)
    else:
        model_cfg.update(dtype="float32")
    if blocks:
        model_cfg["num_gpu_blocks_override"] = blocks
    results = {name: [] for name in args.policies.split(",")}
    for rep in range(args.reps):
        for name in results:
            cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), {
                "model": model_cfg, "data": {"source": "synthetic"},
                "sampling": {"n": 1, "ignore_eos": True, "temperature": 1.0},
                "policy": {"name": name, "b_max": args.b_max, "eps_m": args.eps_m}, "output": {"stats_in": None}}))
            validate(cfg)
            with RolloutEngine(cfg, os.path.join(work, f"{name}-{rep}")) as engine:
                s = engine.generate(prompts, progress=False, max_tokens=lengths).summary
            assert s["generated_tokens"] == sum(lengths), "every request must produce its imposed length"
            s.pop("series", None)
            s["rep"] = rep
            results[name].append(s)
            print(json.dumps({"rep": rep, "policy": name, "tok_s": s["generated_tokens_per_s"],
                              "preemptions": s["preemptions"], "cap_mean": round(s["cap"]["mean"], 1),
                              "running_mean": round(s["running"]["mean"], 1), "kv_usage_mean":
                              round(s["kv_usage_mean"], 3), "wall_s": s["wall_time_s"],
                              "engine_start_s": s["engine_start_s"]}), flush=True)
    print(f"\nworkload: {args.prompts} requests, {sum(lengths)} output tokens, KV "
          f"{results[next(iter(results))][0]['kv_capacity_tokens']} tokens, b_max {args.b_max}")
    base = statistics.median(r["generated_tokens_per_s"] for r in results["static"]) if "static" in results else None
    print("| policy | tok/s median (min-max) | preemptions (median) | mean cap | mean running | vs static |")
    print("|---|---|---|---|---|---|")
    for name, runs in results.items():
        tps = [r["generated_tokens_per_s"] for r in runs]
        med = statistics.median(tps)
        print(f"| {name} | {med:.0f} ({min(tps):.0f}-{max(tps):.0f}) | "
              f"{statistics.median(r['preemptions'] for r in runs):.0f} | "
              f"{statistics.mean(r['cap']['mean'] for r in runs):.1f} | "
              f"{statistics.mean(r['running']['mean'] for r in runs):.1f} | "
              f"{(med / base if base else float('nan')):.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
