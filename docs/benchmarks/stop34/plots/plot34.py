"""Stop 34 on one H200: long-cot's two triples (vLLM, ours, the FIFO oracle) in run order, where ours and the
oracle differ over the pass, and the adapter's time on kv-bound before (stop 33) and after the trace's batching.
    python docs/benchmarks/stop34/plots/plot34.py"""
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from rollout.bench import device_runs
from rollout.sim.fit import step_rows

STOP34 = Path(__file__).resolve().parents[1]
runs = device_runs(STOP34)
SCHEDULERS = {"vllm": ("vLLM default", "tab:gray"), "forecast": ("ours", "tab:blue"),
              "oracle-fcfs": ("FIFO oracle", "tab:green")}

fig, (order, timeline, cost) = plt.subplots(1, 3, figsize=(16, 4.5), gridspec_kw={"width_ratios": [3, 3, 2]})

long_cot = sorted((r for r in runs if r["profile"] == "long-cot"), key=lambda r: r["started_at"])
seen = set()
for k, r in enumerate(long_cot):
    label, color = SCHEDULERS[r["scheduler"]]
    order.bar(k, r["tokens_per_s"], color=color, label=None if label in seen else label)
    seen.add(label)
order.set_xticks(range(len(long_cot)), [f"call {r['call']}" for r in long_cot])
order.set_ylim(6500, 7600)
order.set_ylabel("generated tok/s")
order.set_title("long-cot, six runs in run order\n(ours 76-81% of the oracle's gain over all 8 triples)")
order.legend(fontsize=8)

for name in ("forecast", "oracle-fcfs"):
    label, color = SCHEDULERS[name]
    # per step: t, running, scheduled tokens, KV use, ...
    trace = step_rows(STOP34 / f"A-g0-long-cot-{name}" / "steps-long-cot.jsonl.gz")[0]["steps"]
    t = [s[0] for s in trace]
    timeline.plot(t, [s[1] for s in trace], color=color, lw=1, label=f"{label}: running")
    timeline.plot([], [], color=color, lw=1, ls=":", label=f"{label}: KV use")
    kv_axis = timeline.twinx() if name == "forecast" else kv_axis
    kv_axis.plot(t, [s[3] for s in trace], color=color, lw=0.8, ls=":")
kv_axis.set_ylim(0, 1.05)
kv_axis.set_ylabel("KV use")
timeline.set_xlabel("seconds")
timeline.set_ylabel("running requests")
timeline.set_title("long-cot, call A: the gap is the first 30 s\n(a smaller first wave, then a margin)")
timeline.legend(fontsize=8, loc="upper right")

kv_runs = [(f"stop {stop} {r['call']}\n({commit})", r)
           for stop, commit, folder in ((33, "bcf0286", STOP34.parent / "stop33"), (34, "b4d01fe", STOP34))
           for r in device_runs(folder) if r["profile"] == "kv-bound" and r["scheduler"] == "forecast"]
bottom = [0.0] * len(kv_runs)
for key, label, color in (("policy_time_fraction", "policy (wall)", "tab:blue"),
                          ("finish_cpu_fraction", "at finishes (CPU)", "tab:orange"),
                          (None, "rest: trace, counts", "tab:purple")):
    heights = [100 * (r[key] if key else r["adapter_time_fraction"] - r["policy_time_fraction"]
                      - r["finish_cpu_fraction"]) for _, r in kv_runs]
    cost.bar(range(len(kv_runs)), heights, bottom=bottom, color=color, label=label)
    bottom = [b + h for b, h in zip(bottom, heights)]
cost.axhline(1.0, color="red", lw=1)
cost.set_xticks(range(len(kv_runs)), [name for name, _ in kv_runs], fontsize=8)
cost.set_ylabel("% of step time")
cost.set_title("kv-bound: the adapter's time")
cost.legend(fontsize=8)
fig.tight_layout()
fig.savefig(Path(__file__).with_name("stop34.png"), dpi=100)
