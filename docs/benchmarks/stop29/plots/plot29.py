"""Stop 29's plot: tok/s per run and profile (4x H200, one machine, calls A-C; read from the runs' logs, since call
A's result folders did not come back), and the grouped oracle's first 40 s of each grpo-groups pass on GPU 2
against the forecast's on the same GPU, from vLLM's 10 s log lines: the oracle held its first 4 requests alone.
    python docs/benchmarks/stop29/plots/plot29.py docs/benchmarks/stop29"""
import re
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

root = Path(sys.argv[1])
runs = []  # (call, gpu, profile, scheduler, tok/s)
# Call A: the logs' tables; calls B and C: results.md (a chain's repeated name overwrote the log of its first run,
# not that run's results.md, which the repeat stopped at the deadline never rewrote).
for log in sorted([*root.glob("A-logs/*.log"), *root.glob("[BC]-*/results.md")]):
    call, gpu, profile = re.match(r"([ABC])-g(\d)-(grpo-groups|kv-bound|cap-bound|long-cot|real)",
                                     log.parent.name if log.name == "results.md" else log.name).groups()
    for line in log.read_text().splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) > 3 and re.fullmatch(r"\d+ \(\d+-\d+\)", cells[2]):
            name = cells[1].replace(":probe_first=false", "\nno probes")
            runs.append((call, int(gpu), profile, name, float(cells[2].split()[0])))
profiles = ["grpo-groups", "kv-bound", "real", "long-cot", "cap-bound"]
fig, axes = plt.subplots(1, 6, figsize=(21, 4.5), gridspec_kw={"width_ratios": [1.4, 0.7, 0.7, 0.7, 1.0, 1.6]})
for ax, prof in zip(axes, profiles):
    names = sorted({n for _, _, p, n, _ in runs if p == prof}, key=lambda n: (n != "vllm", n))
    for call, gpu, p, name, tps in runs:
        if p == prof:
            ax.plot(names.index(name) + 0.07 * (gpu - 1.5), tps, "o", color=f"C{gpu}", ms=5)
    ax.set_xticks(range(len(names)), names, fontsize=7)
    ax.set_xlim(-0.5, len(names) - 0.5)
    ax.set_title(prof + (" (oracle before its fix)" if prof == "grpo-groups" else ""), fontsize=9)
axes[0].set_ylabel("generated tok/s")
for k in range(4):
    axes[0].plot([], [], "o", color=f"C{k}", label=f"GPU {k}")
axes[0].legend(fontsize=7, loc="lower right")
ax = axes[5]
for name, style in (("oracle", "-o"), ("forecast-lpt", "-s")):
    text = (root / "A-logs" / f"A-g2-grpo-groups-{name}.log").read_text()
    counts = [int(n) for n in re.findall(r"Running: (\d+) reqs", text)]
    ax.plot([10 * (k + 1) for k in range(len(counts))], counts, style, ms=3, lw=0.8, label=name)
ax.set_xlabel("seconds (vLLM log, every 10 s; both passes)")
ax.set_ylabel("running requests")
ax.set_title("grpo-groups, GPU 2, call A: the oracle starts each pass with 4", fontsize=9)
ax.legend(fontsize=7)
fig.suptitle("stop 29: 4x H200, vLLM 0.26, Llama-3.1-8B shape (dummy weights, CUDA graphs), code at 74ce632",
             fontsize=10)
fig.tight_layout()
out = root / "plots" / "stop29.png"
fig.savefig(out, dpi=90)
print(out)
