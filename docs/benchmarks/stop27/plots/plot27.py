"""Stop 27's plot: tok/s per run on kv-bound, grpo-groups and cap-bound (2x H200; calls A-C on one machine, D on
a second), and kv-bound's running requests: the forecast and the FIFO oracle admitting at every step or in waves."""
import json, sys
from pathlib import Path
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
root = Path(sys.argv[1])
runs = []
for f in sorted(root.glob("*/results.json")):
    call, gpu = f.parent.name.split("-")[:2]
    for r in json.load(open(f))["results"]:
        name = r["scheduler"]
        if name.startswith("oracle"):
            name += " (waves)" if call == "D" else " (every step)"
        runs.append((call, gpu, r["profile"], name, r))
fig, axes = plt.subplots(1, 4, figsize=(17, 4.5), gridspec_kw={"width_ratios": [1.2, 1.2, 0.8, 1.6]})
for ax, prof in zip(axes, ["kv-bound", "grpo-groups", "cap-bound"]):
    names = sorted({n for _, _, p, n, _ in runs if p == prof}, key=lambda n: (n != "vllm", n))
    for call, gpu, p, name, r in runs:
        if p != prof:
            continue
        ax.plot(names.index(name) + (0.08 if gpu == "g1" else -0.08), r["tokens_per_s"],
                "s" if call == "D" else "o", color="C1" if call == "D" else ("C0" if gpu == "g0" else "C2"), ms=5)
    ax.set_xticks(range(len(names)), [n.replace(" (", "\n(") for n in names], fontsize=7)
    ax.set_title(prof, fontsize=10)
axes[0].set_ylabel("generated tok/s")
axes[0].plot([], [], "o", color="C0", label="machine 1, GPU 0")
axes[0].plot([], [], "o", color="C2", label="machine 1, GPU 1")
axes[0].plot([], [], "s", color="C1", label="machine 2 (call D)")
axes[0].legend(fontsize=7, loc="lower right")
tl = axes[3]
for call, gpu, p, name, r in runs:
    if p == "kv-bound" and gpu == "g0" and (call == "D" or (call == "A" and name.startswith("oracle"))):
        t = [s["t"] for s in r["timeline"]]
        tl.plot(t, [s["running"] for s in r["timeline"]], lw=0.8, label=f"{name}, call {call}")
tl.set_xlabel("seconds")
tl.set_ylabel("running requests")
tl.legend(fontsize=7, loc="upper right")
tl.set_title("kv-bound, GPU 0: running requests", fontsize=10)
fig.suptitle("stop 27: 2x H200, vLLM 0.26, Llama-3.1-8B shape (dummy weights, CUDA graphs)", fontsize=10)
fig.tight_layout()
out = root / "plots" / "stop27.png"
fig.savefig(out, dpi=90)
print(out)
