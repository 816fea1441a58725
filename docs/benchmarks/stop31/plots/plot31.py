"""Stop 31's plot (2x H200 of one host, calls A-C back to back, code at 0c87233): grpo-groups' runs of vLLM's
default, the forecast (forecast-lpt) and the grouped longest-first oracle, tok/s of each run against the time it
started (both GPUs, so the host's drift shows), and the share of the oracle's gain for every triple of runs.
    python docs/benchmarks/stop31/plots/plot31.py docs/benchmarks/stop31"""
import itertools
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import Patch

root = Path(sys.argv[1])
runs = {}  # scheduler -> [(started_at, tok/s, gpu, folder)]
for path in sorted(root.glob("*-grpo-groups-*/results.json")):
    for r in json.loads(path.read_text())["results"]:
        runs.setdefault(r["scheduler"], []).append((r["started_at"], r["tokens_per_s"], r["gpu"], path.parent.name))
t0 = min(started for rows in runs.values() for started, *_ in rows)
fig, (timeline, shares) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [1.5, 1]})
for k, name in enumerate(["vllm", "forecast-lpt", "oracle"]):
    for started, tps, gpu, folder in runs[name]:
        timeline.scatter((started - t0) / 60, tps, color=f"C{k}", marker="o" if gpu == "0" else "s")
        timeline.annotate(folder[0], ((started - t0) / 60, tps), xytext=(4, 4), textcoords="offset points", fontsize=7)
timeline.set_xlabel("minutes from the first run's start (circle: GPU 0, square: GPU 1; letter: the call)")
timeline.set_ylabel("grpo-groups tok/s (two passes)")
timeline.legend(handles=[Patch(color=f"C{k}", label=name) for k, name in enumerate(["vllm", "forecast-lpt", "oracle"])],
                fontsize=8, loc="center right")
timeline.set_title("each run (one process each)", fontsize=9)
triples = [(f - v) / (o - v) for (_, v, *_), (_, f, *_), (_, o, *_)
           in itertools.product(runs["vllm"], runs["forecast-lpt"], runs["oracle"])]
shares.hist(triples, bins=12, color="C1")
shares.axvline(0.70, color="k", lw=1, ls="--", label="the issue's 70%")
shares.set_xlabel("(forecast - vLLM) / (oracle - vLLM), every triple of runs")
shares.set_ylabel("triples")
shares.set_title(f"share of the grouped oracle's gain: {min(triples):.0%}-{max(triples):.0%} over {len(triples)} triples",
                 fontsize=9)
shares.legend(fontsize=8)
fig.suptitle("stop 31: 2x H200 (one host), vLLM 0.26, Llama-3.1-8B shape (dummy weights, CUDA graphs), grpo-groups "
             "(256 prompts x 8, 2 passes), code at 0c87233", fontsize=9)
fig.tight_layout()
out = root / "plots" / "stop31.png"
fig.savefig(out, dpi=90)
print(out)
