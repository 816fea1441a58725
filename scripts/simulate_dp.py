"""Data parallel balance in the simulator: N engines (one GPU each, the profile's KV cache each) over N times a
profile's prompts, each engine running the default policy on its share and learning only from it. A pass lasts
as long as its slowest engine; against total work / N (the engines' mean pass time) that is the balance.

    python scripts/simulate_dp.py 8 count,predicted,memory,stealing ["only=[kv-bound,grpo-groups]"]

Splits, a prompt's samples always together: `count`, contiguous shares of equal prompt counts (verl's and TRL's
split); `predicted`, longest processing time first by rollout.parallel.predicted_work (prompt tokens and half of
max_tokens, what the data parallel driver uses); `memory`, the same by each prompt's total tokens in the previous
iteration (what a per-prompt memory shared by the engines would know; the first iteration as `predicted`);
`stealing`, rollout.parallel.ParallelEngines: the split by the shared memory's predicted work, each engine fed from
its queue as it runs and taking from the fullest other queue when it has nothing waiting
(rollout.sim.runs.simulate_parallel).
Step-time model and KV capacity as scripts/simulate_policies.py.
"""
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from rollout.parallel import split_by_work
from rollout.sim.fit import LLAMA_8B_KV_BYTES_PER_TOKEN, h200_step_model
from rollout.sim.runs import simulate_parallel, simulate_profile
from rollout.suite import load_bench_config
from rollout.workloads import profile_requests

ROOT = Path(__file__).resolve().parent.parent
KV_BYTES_PER_TOKEN = LLAMA_8B_KV_BYTES_PER_TOKEN
if len(sys.argv) < 3 or sys.argv[1] in ("-h", "--help"):
    sys.exit(__doc__)
engines, splits = int(sys.argv[1]), sys.argv[2].split(",")
model = h200_step_model(KV_BYTES_PER_TOKEN)
bench = load_bench_config(str(ROOT / "configs" / "bench" / "gpu.yaml"), sys.argv[3:])


def groups_of(requests) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = {}
    for k, r in enumerate(requests):
        groups.setdefault(r.group, []).append(k)
    return groups


def splitter(profile, how: str, engine: int):
    def share(iteration: int, requests) -> list[int]:
        groups = groups_of(requests)
        ids = list(groups)
        if how == "count":
            parts = np.array_split(np.arange(len(ids)), engines)
            chosen = [ids[i] for i in parts[engine]]
        else:
            if how == "memory" and iteration > 0:
                before = groups_of(previous := profile_requests(profile, iteration - 1, bench.seed, bench.vocab_size))
                work = [sum(len(previous[k].prompt.token_ids) + previous[k].output_tokens for k in before[g])
                        for g in ids]
            else:
                work = [len(groups[g]) * (len(requests[groups[g][0]].prompt.token_ids) + profile.max_output / 2)
                        for g in ids]
            chosen = [ids[i] for i in split_by_work(work, engines)[engine]]
        return sorted(k for g in chosen for k in groups[g])
    return share


for profile in bench.profiles:
    scaled = replace(profile, num_prompts=profile.num_prompts * engines)
    for how in splits:
        started = time.time()
        kv_capacity_tokens = profile.kv_cache_memory_bytes // KV_BYTES_PER_TOKEN
        bound = ""
        if how == "stealing":
            times, paths = simulate_parallel(bench, scaled, "forecast-lpt", model, engines=engines,
                                             kv_capacity_tokens=kv_capacity_tokens)
            times = times.T
            bound = "; the longest request alone: " + " ".join(
                f"{b:.3f}" for b in paths.max(axis=1) / times.mean(axis=0))
        else:
            times = np.array([simulate_profile(bench, scaled, "forecast-lpt", model, share=splitter(scaled, how, e),
                                               kv_capacity_tokens=kv_capacity_tokens).per_iteration_makespan_s
                              for e in range(engines)])  # engine x iteration
        balance = times.max(axis=0) / times.mean(axis=0)
        print(f"{profile.name:12s} {how:9s} pass time / (total work / {engines}) per iteration: "
              f"{' '.join(f'{b:.3f}' for b in balance)}{bound}  "
              f"(slowest engine {' '.join(f'{t:.0f}' for t in times.max(0))} s; "
              f"{time.time() - started:.0f} s to simulate)", flush=True)
