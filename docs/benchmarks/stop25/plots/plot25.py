"""Stop 25's plot: forecast vs vLLM's default per profile and GPU (4x H200, one machine), and long-cot's timeline."""
import json, sys
from pathlib import Path
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
root = Path(sys.argv[1])
runs = {}
for f in sorted(root.glob("*/results.json")):
    call, gpu = f.parent.name.split("-")[:2]
    results = json.load(open(f))["results"]
    paired = [r["tokens_per_s"] for r in results if r["scheduler"] == "vllm"]
    for r in results:  # a run beside vLLM in one process is compared with that vLLM run
        runs.setdefault((r["profile"], gpu), []).append((call, {**r, "paired": paired[0] if paired else None}))
profiles = ["long-cot", "kv-bound", "grpo-groups", "real", "cap-bound"]
fig, (ax, tl) = plt.subplots(1, 2, figsize=(13, 4.5))
for i, prof in enumerate(profiles):
    for gpu in ["g0", "g1", "g2", "g3"]:
        rs = runs.get((prof, gpu), [])
        base = [r["tokens_per_s"] for _, r in rs if r["scheduler"] == "vllm"]
        if not base:
            continue
        b = sum(base) / len(base)  # vLLM's default on this GPU (mean of its runs)
        for _, r in rs:
            if r["scheduler"].startswith("forecast"):
                ax.plot(i + (int(gpu[1]) - 1.5) * 0.12, r["tokens_per_s"] / (r["paired"] or b), "o", color="C0", ms=5)
            if r["scheduler"] == "oracle-fcfs":
                ax.plot(i + (int(gpu[1]) - 1.5) * 0.12, r["tokens_per_s"] / b, "^", color="C3", ms=6)
ax.axhline(1.0, color="gray", lw=0.8)
ax.axhline(0.98, color="gray", lw=0.8, ls=":")
ax.set_xticks(range(len(profiles)), profiles)
ax.set_ylabel("tok/s / vLLM's default (same process, else same GPU)")
ax.plot([], [], "o", color="C0", label="forecast (grpo-groups: forecast-lpt)")
ax.plot([], [], "^", color="C3", label="FIFO oracle (true lengths)")
ax.legend(fontsize=8, loc="upper right")
ax.set_title("stop 25: 4x H200, vLLM 0.26, 8B shape; one point per run, GPUs side by side")
for (prof, gpu), rs in runs.items():
    if prof != "long-cot" or gpu != "g0":
        continue
    for call, r in rs:
        if r["scheduler"] == "vllm":
            continue
        t = [s["t"] for s in r["timeline"]]
        line, = tl.plot(t, [s["kv_usage"] for s in r["timeline"]], lw=1, label=f"{r['scheduler']} KV use")
        tl.plot(t, [s["running"] / 512 for s in r["timeline"]], lw=1, ls="--", color=line.get_color(),
                label=f"{r['scheduler']} running / 512")
tl.set_xlabel("seconds")
tl.set_ylim(0, 1.05)
tl.legend(fontsize=8, loc="upper right")
tl.set_title("long-cot, GPU 0: KV use and running requests")
fig.tight_layout()
out = root / "plots" / "stop25.png"
out.parent.mkdir(exist_ok=True)
fig.savefig(out, dpi=100)
print(out)
