"""Stop 32 on one H200: tok/s against vLLM's default per profile, and the policy's share of the step per run.
    python docs/benchmarks/stop32/plots/plot32.py"""
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from rollout.bench import device_runs

HERE = Path(__file__).resolve().parent.parent
runs = device_runs(HERE)


def tok_s(profile, scheduler):
    return [r["tokens_per_s"] for r in runs if r["profile"] == profile and r["scheduler"] == scheduler]


profiles = [("kv-bound", "forecast", "oracle-fcfs"), ("long-cot", "forecast", "oracle-fcfs"),
            ("cap-bound", "forecast", None), ("grpo-groups", "forecast-lpt", None)]
fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
for i, (profile, ours, oracle) in enumerate(profiles):
    base = tok_s(profile, "vllm")
    if not base:
        continue
    base = sum(base) / len(base)
    for k, (name, color) in enumerate(((ours, "tab:blue"), (oracle, "tab:green"))):
        if name is None:
            continue
        values = [v / base for v in tok_s(profile, name)]
        left.scatter([i + 0.15 * (2 * k - 1)] * len(values), values, color=color, zorder=3,
                     label={0: "ours", 1: "FIFO oracle"}[k] if i == 0 else None)
left.axhline(1.0, color="gray", lw=1)
left.axhline(0.98, color="gray", lw=1, ls=":")
left.set_xticks(range(len(profiles)), [p[0] for p in profiles])
left.set_ylabel("tok/s / vLLM default (mean of its runs here)")
left.set_title("one H200, stop 32 (one run per point)")
left.legend()
policy = [r for r in runs if r.get("policy_time_fraction") is not None and not r["scheduler"].startswith("oracle")]
names = [f"{r['profile']}\n{r['call']}" for r in policy]
right.bar(range(len(policy)), [100 * r["policy_time_fraction"] for r in policy], color="tab:blue", label="policy, wall")
right.bar(range(len(policy)), [100 * (r.get("finish_cpu_fraction") or 0) for r in policy],
          bottom=[100 * r["policy_time_fraction"] for r in policy], color="tab:orange", label="at finishes, CPU")
right.axhline(1.0, color="red", lw=1)
right.set_xticks(range(len(policy)), names, fontsize=8)
right.set_ylabel("% of step time")
right.set_title("the policy's time (code c299f65: asked only where something changed)")
right.legend()
fig.tight_layout()
fig.savefig(Path(__file__).with_suffix("").with_name("stop32.png"), dpi=100)
