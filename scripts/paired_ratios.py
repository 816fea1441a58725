"""Ratios of each scheduler to vLLM's default from runs that ran at the same time on other GPUs of one host
(`scripts/bench-gpus.sh` with chains that cross: "0 cap-bound:forecast cap-bound:vllm" "1 cap-bound:vllm
cap-bound:forecast"), where the host's speed cancels; beside them, the pairs within one process.

    python scripts/paired_ratios.py OUT [OUT ...]     # folders holding results.json files (searched below)
"""
import json
import sys
from pathlib import Path

from rollout.suite import summarize_ratios, time_paired_ratios

results = []
for folder in sys.argv[1:]:
    for path in sorted(Path(folder).rglob("results.json")):
        runs = json.loads(path.read_text())["results"]
        base = [r["tokens_per_s"] for r in runs if r["scheduler"] == "vllm"]
        results += [{**r, "in_process": r["tokens_per_s"] / base[0] if base else None} for r in runs]
if not results:
    sys.exit(f"error: no results.json under {' '.join(sys.argv[1:]) or '(no folder given)'}")
pairs = time_paired_ratios(results)
for pair in pairs:
    print(f"{pair['profile']:12s} {pair['scheduler']:14s} GPU {pair['gpu']} vs {pair['base_gpu']} "
          f"(overlap {pair['overlap']:.0%}): {pair['tokens_per_s']:.0f} / {pair['base_tokens_per_s']:.0f} "
          f"= {pair['ratio']:.3f}")
for profile, scheduler in sorted({(r["profile"], r["scheduler"]) for r in results if r["scheduler"] != "vllm"}):
    for label, ratios in (("same time, other GPU", [p["ratio"] for p in pairs
                                                     if (p["profile"], p["scheduler"]) == (profile, scheduler)]),
                          ("one process", [r["in_process"] for r in results if r["in_process"] is not None
                                           and (r["profile"], r["scheduler"]) == (profile, scheduler)])):
        if ratios:
            s = summarize_ratios(ratios)
            se = "-" if s["log_standard_error"] is None else f"{s['log_standard_error']:.1%}"
            print(f"{profile:12s} {scheduler:14s} {label:21s} n={s['n']:2d} geometric mean {s['geometric_mean']:.3f} "
                  f"(standard error {se}), {s['min']:.3f}-{s['max']:.3f}")
