"""Schedulers on GPU suite profiles with vLLM's own scheduler in simulated time (rollout.sim.vllm_loop): our
adapter or vLLM's default, vLLM's KV connectors included, the step time from the simulator's H200 fit (as
scripts/simulate_policies.py). Prints, per profile, seed and scheduler: tok/s over the passes and its ratio to
the first scheduler listed, each pass's ratio, preemptions, the recomputed share (net of what resumed requests
found cached; ours only: it reads the adapter's trace), the most requests loading KV blocks at once, the most
by which running and loading requests together exceeded the admission cap, and when each pass's longest tenth
had finished against the pass's end.

    python scripts/vllm_loop_policies.py --kv-bytes=57344 --seeds=0,1,2 vllm,forecast-lpt \\
      "only=[tail-bound]" profiles.5.num_prompts=96 profiles.5.kv_cache_memory_bytes=8589934592 [kv_offloading_gib=32]

`--kv-bytes` and `--seeds` as in scripts/simulate_policies.py.
"""
import sys
import tempfile
from pathlib import Path

import numpy as np

from rollout.sim.fit import h200_step_model
from rollout.sim.vllm_loop import profile_run
from rollout.suite import load_bench_config
from simulate_policies import GPU_BENCH, arguments


def main(argv: list[str]) -> None:
    args = arguments(__doc__, argv)
    model = h200_step_model(args.kv_bytes, h100=args.h100)
    names = args.schedulers
    for seed in args.seeds or [0]:
        bench = load_bench_config(str(GPU_BENCH), [*args.overrides, f"seed={seed}"])
        for profile in bench.profiles:
            first = None
            for name in names:
                with tempfile.TemporaryDirectory() as work:
                    passes = profile_run(bench, profile, name, model, Path(work), kv_bytes_per_token=args.kv_bytes)
                results = [result for result, _ in passes]
                records = [record for _, pass_records in passes for record in pass_records]
                tokens = sum(r.generated_tokens for r in results)
                per_pass = [r.tokens_per_s for r in results]
                tokens_per_s = tokens / sum(r.makespan_s for r in results)
                first = first or (tokens_per_s, per_pass)
                recomputed = sum(r["recomputed_tokens"] for r in records)
                net = recomputed - sum(r.get("recovered_tokens", 0) for r in records)
                over = max(int(np.max(np.add(r.running, r.loading) - np.array(r.caps))) for r in results)
                over_cap = f"{over:+d}" if name.split(":")[0] != "vllm" else "-"  # vLLM's default: no cap of ours
                print(f"{profile.name:12s} seed {seed} {name:24s} {tokens_per_s:7.0f} tok/s "
                      f"{tokens_per_s / first[0]:.3f}x (passes "
                      f"{' / '.join(f'{a / b:.3f}x' for a, b in zip(per_pass, first[1]))}), "
                      f"{sum(r.preemptions for r in results)} preemptions, recomputed "
                      f"{recomputed / tokens:.1%} ({net / tokens:.1%} net), "
                      f"at most {max(max(r.loading) for r in results)} loading, running + loading at most "
                      f"{over_cap} over the cap; the longest tenth done at "
                      f"{' / '.join(f'{r.longest_tenth_done_s:.0f} of {r.makespan_s:.0f} s' for r in results)}",
                      flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
