"""Stop 33 on one H200: cap-bound's three pairs in call order, real beside its FIFO oracle, and the adapter's time
per run split into the policy, the finishes and the rest (the trace).
    python docs/benchmarks/stop33/plots/plot33.py"""
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from rollout.bench import device_runs

HERE = Path(__file__).resolve().parent.parent
runs = device_runs(HERE)
colors = {"forecast": "tab:blue", "vllm": "tab:gray", "oracle-fcfs": "tab:green"}

fig, (pairs, real, cost) = plt.subplots(1, 3, figsize=(15, 4.5), gridspec_kw={"width_ratios": [3, 2, 3]})
cap = sorted((r for r in runs if r["profile"] == "cap-bound"), key=lambda r: r["started_at"])
for k, r in enumerate(cap):
    pairs.bar(k, r["tokens_per_s"], color=colors[r["scheduler"]],
              label=r["scheduler"] if r["scheduler"] not in [c["scheduler"] for c in cap[:k]] else None)
pairs.set_xticks(range(len(cap)), [f"call {r['call']}\n{'first' if k % 2 == 0 else 'second'}" for k, r in enumerate(cap)])
pairs.set_ylim(10000, 16000)
pairs.set_ylabel("tok/s")
pairs.set_title("cap-bound, three pairs in run order\n(the first run of each call was the faster)")
pairs.legend()
real_runs = [r for r in runs if r["profile"] == "real"]
for k, name in enumerate(("vllm", "forecast", "oracle-fcfs")):
    for r in real_runs:
        if r["scheduler"] == name:
            real.bar(k, r["tokens_per_s"], color=colors[name])
real.set_xticks(range(3), ["vLLM default", "ours", "FIFO oracle"])
real.set_ylim(7000, 10500)
real.set_title("real (one run each)")
ours = [r for r in runs if r["scheduler"] == "forecast"]
policy = [100 * r["policy_time_fraction"] for r in ours]
finish = [100 * r["finish_cpu_fraction"] for r in ours]
rest = [100 * r["adapter_time_fraction"] - p - f for r, p, f in zip(ours, policy, finish)]
x = range(len(ours))
cost.bar(x, policy, color="tab:blue", label="policy (wall)")
cost.bar(x, finish, bottom=policy, color="tab:orange", label="at finishes (CPU)")
cost.bar(x, rest, bottom=[p + f for p, f in zip(policy, finish)], color="tab:purple", label="rest: trace, counts")
cost.axhline(1.0, color="red", lw=1)
cost.set_xticks(x, [f"{r['profile']}\n{r['call']}" for r in ours], fontsize=8)
cost.set_ylabel("% of step time")
cost.set_title("the adapter's time on the engine's path (code bcf0286)")
cost.legend(fontsize=8)
fig.tight_layout()
fig.savefig(Path(__file__).with_suffix("").with_name("stop33.png"), dpi=100)
