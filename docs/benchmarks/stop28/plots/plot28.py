"""Stop 28's plot: tok/s per run on grpo-groups (with and without first-pass probes), long-cot, real and cap-bound
(4x H200, one machine, calls A-C), and grpo-groups' first pass on GPU 1: running requests and KV use with and
without probes, preemptions marked.
    python docs/benchmarks/stop28/plots/plot28.py docs/benchmarks/stop28"""
import gzip, json, sys
from pathlib import Path
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
root = Path(sys.argv[1])
runs = []
for f in sorted(root.glob("*/results.json")):
    call, gpu = f.parent.name.split("-")[:2]
    for r in json.load(open(f))["results"]:
        runs.append((call, gpu, r["profile"], r["scheduler"].replace(":probe_first=true", "\n+probes"), r))
profiles = ["grpo-groups", "long-cot", "real", "cap-bound"]
fig, axes = plt.subplots(1, 6, figsize=(21, 4.5), gridspec_kw={"width_ratios": [1.3, 1.1, 0.9, 0.7, 1.5, 1.5]})
for ax, prof in zip(axes, profiles):
    names = sorted({n for _, _, p, n, _ in runs if p == prof}, key=lambda n: (n != "vllm", n))
    for call, gpu, p, name, r in runs:
        if p == prof:
            k = int(gpu[1])
            ax.plot(names.index(name) + 0.06 * (k - 1.5), r["tokens_per_s"], "o", color=f"C{k}", ms=5)
    ax.set_xticks(range(len(names)), names, fontsize=7)
    ax.set_title(prof, fontsize=10)
axes[0].set_ylabel("generated tok/s")
for k in range(4):
    axes[0].plot([], [], "o", color=f"C{k}", label=f"GPU {k}")
axes[0].legend(fontsize=7, loc="lower right")
for ax, column, label in ((axes[4], 1, "running requests"), (axes[5], 3, "KV cache in use")):
    for run, name in (("A-g1-grpo-groups-forecast-lpt", "forecast-lpt"),
                      ("A-g1-grpo-groups-forecast-lpt+probe", "forecast-lpt + probes")):
        steps = json.loads(gzip.open(root / run / "steps-grpo-groups.jsonl.gz").readline())["steps"]
        first = [s for s in steps if s[0] < 60]
        line, = ax.plot([s[0] for s in first], [s[column] for s in first], lw=0.7, label=name)
        hit = [s for s in first if s[4] > 0]
        ax.plot([s[0] for s in hit], [s[column] for s in hit], "x", color=line.get_color(), ms=5)
    ax.set_xlabel("seconds (first pass; x: a step that preempted)")
    ax.set_ylabel(label)
    ax.set_title(f"grpo-groups, GPU 1, call A: {label}", fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
fig.suptitle("stop 28: 4x H200, vLLM 0.26, Llama-3.1-8B shape (dummy weights, CUDA graphs), code at 3428d51",
             fontsize=10)
fig.tight_layout()
out = root / "plots" / "stop28.png"
fig.savefig(out, dpi=90)
print(out)
