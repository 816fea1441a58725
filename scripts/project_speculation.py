"""Projected gain of tail speculation for the 8B shape on one H200 (the simulator; acceptance is an input, not a
measurement: dummy weights cannot show it). Each row: ours (`forecast-lpt`) with speculative decoding where at most
`max_batch` requests decode, `k` drafts a step accepted each with probability `acceptance` until the first
rejection, against vLLM's default without speculation. `whole pass`: one engine configured for speculation, so
every step runs synchronously (1.33-1.71x the default step, measured); `switched`: only the speculating steps pay
that (an ideal switch to a speculating engine for the drain tail). Verify-step costs and sync factors:
rollout.sim.engine.Speculation, from the measurements in docs/results.md.

    python scripts/project_speculation.py "only=[long-cot,tail-bound]" [--k 2,4] [--acceptance 0.5,0.7,0.8]
"""
import argparse
import itertools
from pathlib import Path

from rollout.sim import Speculation
from rollout.sim.fit import LLAMA_8B_KV_BYTES_PER_TOKEN, h200_step_model
from rollout.sim.runs import simulate_profile
from rollout.suite import load_bench_config

ROOT = Path(__file__).resolve().parent.parent
KV_BYTES_PER_TOKEN = LLAMA_8B_KV_BYTES_PER_TOKEN


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help='bench overrides, e.g. "only=[long-cot]"')
    parser.add_argument("--k", default="4", help="draft tokens per step, comma-separated")
    parser.add_argument("--acceptance", default="0.5,0.7,0.8", help="per-token acceptance, comma-separated")
    parser.add_argument("--max-batch", default="16,64", help="speculate where at most this many decode")
    args = parser.parse_args()
    model = h200_step_model(KV_BYTES_PER_TOKEN)
    bench = load_bench_config(str(ROOT / "configs" / "bench" / "gpu.yaml"), args.overrides)
    for profile in bench.profiles:
        def run(name, speculation=None):
            return simulate_profile(bench, profile, name, model, speculation=speculation,
                                    kv_capacity_tokens=profile.kv_cache_memory_bytes // KV_BYTES_PER_TOKEN)
        vllm, ours = run("vllm").tokens_per_s, run("forecast-lpt").tokens_per_s
        print(f"{profile.name}: vLLM's default {vllm:.0f} tok/s, ours without speculation {ours:.0f} "
              f"({ours / vllm:.3f}x)", flush=True)
        for k, acceptance, max_batch, whole in itertools.product(
                [int(x) for x in args.k.split(",")], [float(x) for x in args.acceptance.split(",")],
                [int(x) for x in args.max_batch.split(",")], (True, False)):
            result = run("forecast-lpt", Speculation(k, acceptance, max_batch, whole_pass=whole))
            print(f"  k={k} acceptance={acceptance} max_batch={max_batch} {'whole pass' if whole else 'switched  '}: "
                  f"{result.tokens_per_s:.0f} tok/s, {result.tokens_per_s / vllm:.3f}x vLLM's default, "
                  f"{result.tokens_per_s / ours:.3f}x ours without", flush=True)


if __name__ == "__main__":
    main()
