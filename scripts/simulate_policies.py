"""Schedulers on the GPU suite's workloads in the simulator, with the step-time model fitted to the H200 8B
kv-bound runs (docs/benchmarks/kv-bound-h200-steps.jsonl.gz), no GPU needed. Prints tok/s, preemptions and
recomputed share. Those runs' contexts are too short to price reading the KV cache, so that term is fixed at
the 8B shape's 128 KiB per token over ~4 TB/s of HBM (it matters for long-cot).

    python scripts/simulate_policies.py vllm,memory,forecast,forecast-lpt,oracle "only=[kv-bound,grpo-groups]"

forecast-lpt keeps a per-prompt memory across iterations as RolloutEngine does with policy.order=longest_first.
"""
import sys
import time
from pathlib import Path

import numpy as np

from rollout.bench import load_bench_config, scheduler_policy
from rollout.policy import make_policy
from rollout.policy.length_stats import PromptLengths, prompt_key
from rollout.sim.engine import simulate
from rollout.sim.fit import fit_step_time, step_rows
from rollout.workloads import profile_requests

STEPS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks" / "kv-bound-h200-steps.jsonl.gz"
model, _ = fit_step_time(step_rows(STEPS), per_kv_token=128 * 1024 / 4.0e12)
print(f"step time = {model.base * 1e3:.2f} ms + {model.per_seq * 1e6:.2f} us/seq + {model.per_kv_token * 1e9:.1f} "
      f"ns/KV token + {model.per_prefill_token * 1e6:.2f} us/prefill token + {model.per_mixed_step * 1e3:.2f} ms "
      f"per step with prefill", flush=True)
bench = load_bench_config("configs/bench/gpu.yaml", sys.argv[2:])
names = sys.argv[1].split(",")
for profile in bench.profiles:
    cap_tokens = profile.kv_cache_memory_bytes // (128 * 1024)  # Llama-3.1-8B shape: 128 KiB of KV per token
    row = {}
    for name in names:
        settings = scheduler_policy(bench, "static-1024" if name == "vllm" else name)
        policy = make_policy(settings)
        memory = PromptLengths()  # what RolloutEngine keeps for policy.order=longest_first
        clock = gen = pre = rec = 0
        t0 = time.time()
        per_iteration = []
        for it in range(profile.iterations):
            reqs = profile_requests(profile, it, bench.seed, bench.vocab_size)
            keys = [prompt_key(r.prompt.token_ids) for r in reqs]
            scales, prior = np.ones(len(reqs)), None
            if name == "oracle":
                reqs = sorted(reqs, key=lambda r: -r.output_tokens)
            elif settings.get("order") == "longest_first":
                scales = memory.scales(keys)
                prior = memory.prior(keys, scales) if memory.last else None
                order = sorted(range(len(reqs)), key=lambda i: -scales[i])
                reqs, keys, scales = [reqs[i] for i in order], [keys[i] for i in order], scales[order]
            res = simulate([(len(r.prompt.token_ids), r.output_tokens, s) for r, s in zip(reqs, scales)], policy,
                           kv_capacity_blocks=cap_tokens // 16, block_size=16, max_num_seqs=settings["b_max"],
                           token_budget=16384, step_time=model, prior_lengths=prior)
            by_prompt = {}
            for key, r in zip(keys, reqs):
                by_prompt.setdefault(key, []).append(r.output_tokens)
            for key, lengths in by_prompt.items():
                memory.update(key, lengths)
            clock += res.makespan_s
            gen += res.generated_tokens
            pre += res.preemptions
            rec += res.recomputed_tokens
            per_iteration.append(f"{res.tokens_per_s:.0f}")
        row[name] = gen / clock
        print(f"{profile.name:12s} {name:12s} {gen / clock:8.0f} tok/s  preemptions {pre:5d}  "
              f"recomputed {rec / gen:.2%}  per iteration {'/'.join(per_iteration)}  "
              f"({time.time() - t0:.1f} s to simulate)", flush=True)
    base = row.get("vllm")
    if base:
        print("  ratios:", {k: round(v / base, 3) for k, v in row.items()}, flush=True)
