"""One pass of the suite's tail-bound profile in the simulator (H200 step model, as scripts/simulate_policies.py),
with the forecast told per prompt what no real pass knows: its class (long or not) or its latent mean length,
as each request's length scale, longest first, no probes and no prior. What knowing more of each prompt is worth
to the forecast's admission, against the pass it runs (`forecast-lpt`) and the oracle.

    python scripts/tail_knowledge.py class,latent [ITERATION]
"""
import sys
from pathlib import Path

import numpy as np

from rollout.policy import make_policy
from rollout.sim.engine import simulate
from rollout.sim.fit import LLAMA_8B_KV_BYTES_PER_TOKEN, h200_step_model
from rollout.sim.runs import REQUESTS_AT_FIRST_STEP, scheduler_settings
from rollout.suite import load_bench_config
from rollout.workloads import profile_requests

ROOT = Path(__file__).resolve().parent.parent
KV_BYTES_PER_TOKEN = LLAMA_8B_KV_BYTES_PER_TOKEN
if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
    sys.exit(__doc__)
model = h200_step_model(KV_BYTES_PER_TOKEN)
bench = load_bench_config(str(ROOT / "configs" / "bench" / "gpu.yaml"), ["only=[tail-bound]"])
profile = bench.profiles[0]
iteration = int(sys.argv[2]) if len(sys.argv) > 2 else 0
requests = profile_requests(profile, iteration, bench.seed, bench.vocab_size)
# The workload's per-prompt traits, drawn as rollout.workloads draws them.
traits = np.random.default_rng([bench.seed, 10_000])
long = traits.random(profile.num_prompts) < profile.long_share
latent = traits.lognormal(np.log(profile.median_output), profile.sigma, profile.num_prompts)
latent *= np.where(long, profile.long_ratio * profile.long_drift ** iteration, 1.0) * profile.drift ** iteration
for told in sys.argv[1].split(","):
    per_prompt = {"class": np.where(long, profile.long_ratio, 1.0), "latent": latent}[told]
    per_prompt = per_prompt / np.mean(per_prompt[[r.group for r in requests]])
    scales = np.array([per_prompt[r.group] for r in requests])
    order = sorted(range(len(requests)), key=lambda i: -scales[i])
    settings = scheduler_settings(bench, "forecast-lpt")
    result = simulate([(len(requests[i].prompt.token_ids), requests[i].output_tokens, float(scales[i]),
                        requests[i].group, None) for i in order], make_policy(settings, graph_batch=model.graph_batch),
                      kv_capacity_blocks=profile.kv_cache_memory_bytes // KV_BYTES_PER_TOKEN // 16, block_size=16,
                      max_num_seqs=int(settings["b_max"]), token_budget=16384, step_time=model,
                      nominal_max_tokens=profile.max_output, requests_at_first_step=REQUESTS_AT_FIRST_STEP)
    print(f"iteration {iteration}, told each prompt's {told}: {result.tokens_per_s:.0f} tok/s, "
          f"{result.preemptions} preemptions, {result.recomputed_tokens / result.generated_tokens:.1%} recomputed")
