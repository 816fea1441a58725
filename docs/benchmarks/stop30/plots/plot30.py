"""Stop 30's plot (one H200, calls A-D back to back, code at 64e8478): each scheduler's tok/s against vLLM's
default on the profiles it ran, and on grpo-groups the KV cache in use over each run's wall time, from the runs'
per-step records (both passes; the forecast's, the grouped longest-first oracle's and the FIFO oracle's).
    python docs/benchmarks/stop30/plots/plot30.py docs/benchmarks/stop30"""
import gzip
import json
import re
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

root = Path(sys.argv[1])
tps = {}  # (profile, scheduler) -> tok/s
for results in root.glob("[A-D]-g0-*/results.md"):
    profile = re.match(r"[A-D]-g0-(grpo-groups|kv-bound|cap-bound|long-cot|real)", results.parent.name).group(1)
    for line in results.read_text().splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) > 3 and re.fullmatch(r"\d+ \(\d+-\d+\)", cells[2]):
            tps[profile, cells[1]] = float(cells[2].split()[0])
fig, (bars, kv) = plt.subplots(1, 2, figsize=(14, 4.5), gridspec_kw={"width_ratios": [1, 1.4]})
profiles = ["grpo-groups", "kv-bound", "cap-bound"]
schedulers = ["forecast", "oracle-fcfs", "oracle"]
for k, name in enumerate(schedulers):
    ratios = [tps.get((p, "forecast-lpt" if name == "forecast" and p == "grpo-groups" else name), 0.0)
              / tps[p, "vllm"] for p in profiles]
    xs = [i + 0.27 * (k - 1) for i in range(len(profiles))]
    bars.bar(xs, [r or float("nan") for r in ratios], width=0.25, color=f"C{k}", label=name)
    for x, r in zip(xs, ratios):
        if r:
            bars.text(x, r + 0.005, f"{r:.3f}", ha="center", fontsize=7)
bars.axhline(1.0, color="k", lw=0.8)
bars.set_xticks(range(len(profiles)), profiles)
bars.set_ylim(0.9, 1.4)
bars.set_ylabel("tok/s / vLLM's default (same machine)")
bars.set_title("one run each; forecast on grpo-groups is forecast-lpt (probes)", fontsize=9)
bars.legend(fontsize=8, loc="upper right")
for name, run, color in (("forecast-lpt", "A-g0-grpo-groups-forecast-lpt", "C0"),
                         ("oracle-fcfs", "B-g0-grpo-groups-oracle-fcfs", "C1"), ("oracle", "A-g0-grpo-groups-oracle", "C2")):
    with gzip.open(root / run / "steps-grpo-groups.jsonl.gz", "rt") as f:
        passes = [json.loads(line)["steps"] for line in f]
    offset, ts, use = 0.0, [], []
    for steps in passes:  # each pass's clock starts at 0: lay them end to end
        ts += [offset + s[0] for s in steps]
        use += [s[3] for s in steps]
        offset = ts[-1]
    kv.plot(ts, use, lw=0.6, color=color, label=f"{name} ({tps['grpo-groups', name]:.0f} tok/s)")
kv.set_xlabel("seconds (two passes end to end)")
kv.set_ylabel("KV cache in use")
kv.set_title("grpo-groups: KV use per step", fontsize=9)
kv.legend(fontsize=8, loc="lower right")
fig.suptitle("stop 30: one H200, vLLM 0.26, Llama-3.1-8B shape (dummy weights, CUDA graphs), code at 64e8478",
             fontsize=10)
fig.tight_layout()
out = root / "plots" / "stop30.png"
fig.savefig(out, dpi=90)
print(out)
