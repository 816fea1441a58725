"""The judge: on every workload of the family (rollout.sim.family), vLLM's default, the default policy and the
length oracle in the simulator; each pass's ratio to vLLM's default, the distribution over the draws, the worst
draws with their parameters, and where the default loses in each.

    python -m rollout.sim.judge --seeds 100-299 [--out runs/family/report-100-299]

writes report.md (the distribution, the ten worst draws) and draws.jsonl (every draw's numbers) under --out.
Runs on two processes; 200 draws take ~30 minutes on two cores.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
from pathlib import Path

import numpy as np

from rollout.sim.family import REPORT_SEEDS, draw
from rollout.sim.runs import simulate_profile
from rollout.suite import BenchConfig

REFERENCE, DEFAULT, ORACLE = "vllm", "forecast-lpt", "oracle"  # vLLM's default; the product's default policy


def pass_view(run, iteration: int) -> dict:
    """What a pass of `run` (a ProfileRun kept with its trace) shows of where time went: the KV cache's mean fill
    over the steps where requests waited, the longest request's wait for its first admission and what its
    preemptions threw away, and the pass's preemptions."""
    trace = np.array(run.traces[iteration]) if run.traces[iteration] else np.zeros((0, 7))
    waiting = trace[:, 5] > 0 if len(trace) else np.zeros(0, bool)
    longest = run.longest[iteration]
    return {"kv_fill_waiting": float(trace[waiting, 3].mean()) if waiting.any() else None,
            "longest_wait_s": round(longest.started_s, 3) if longest else None,
            "longest_recomputed": longest.recomputed_tokens if longest else 0,
            "preemptions": int(trace[-1, 4]) if len(trace) else 0}


def judge(seed: int) -> dict:
    """One draw: each scheduler's tok/s over the passes and per pass, the default's and the oracle's ratios to
    vLLM's default, and each pass's view of the default and vLLM's default."""
    workload = draw(seed)
    bench = BenchConfig(profiles=[workload.profile], seed=seed)
    model = workload.shape.step_model()
    runs = {name: simulate_profile(bench, workload.profile, name, model,
                                   kv_capacity_tokens=workload.kv_capacity_tokens, keep_trace=True)
            for name in (REFERENCE, DEFAULT, ORACLE)}
    reference = runs[REFERENCE]
    out = {"seed": seed, "workload": workload.describe(),
           "requests": workload.profile.num_prompts * workload.profile.samples_per_prompt,
           "kv_share": round(workload.kv_share, 3)}
    for name, run in runs.items():
        out[name] = {"tokens_per_s": round(run.tokens_per_s, 1),
                     "ratio": round(run.tokens_per_s / reference.tokens_per_s, 4),
                     "pass_ratios": [round(a / b, 4) for a, b in zip(run.per_iteration_tokens_per_s,
                                                                        reference.per_iteration_tokens_per_s)]}
    out["passes"] = [{"default": pass_view(runs[DEFAULT], k), "vllm": pass_view(reference, k)}
                     for k in range(len(reference.per_iteration_tokens_per_s))]
    return out


def distribution(ratios: np.ndarray) -> str:
    q = np.quantile(ratios, [0.01, 0.05, 0.5])
    return (f"worst {ratios.min():.3f}x, 1st pct {q[0]:.3f}x, 5th pct {q[1]:.3f}x, median {q[2]:.3f}x, geometric "
            f"mean {np.exp(np.log(ratios).mean()):.3f}x; >= 0.99x on {np.mean(ratios >= 0.99):.1%}, >= 0.97x on "
            f"{np.mean(ratios >= 0.97):.1%}")


def report(results: list[dict], seeds: str) -> str:
    default = np.array([r[DEFAULT]["ratio"] for r in results])
    oracle = np.array([r[ORACLE]["ratio"] for r in results])
    passes = np.array([p for r in results for p in r[DEFAULT]["pass_ratios"]])
    lines = [f"# The family, seeds {seeds} ({len(results)} draws), in the simulator", "",
             f"- default ({DEFAULT}) / vLLM's default, per draw: {distribution(default)}",
             f"- per pass ({len(passes)} passes): {distribution(passes)}",
             f"- length oracle / vLLM's default, per draw: {distribution(oracle)}", "",
             "## The ten worst draws for the default", ""]
    for r in sorted(results, key=lambda r: r[DEFAULT]["ratio"])[:10]:
        ratios = " / ".join(f"{x:.3f}" for x in r[DEFAULT]["pass_ratios"])
        lines.append(f"- **{r[DEFAULT]['ratio']:.3f}x** (passes {ratios}; "
                     f"oracle {r[ORACLE]['ratio']:.3f}x) {r['workload']}")
        for k, view in enumerate(r["passes"]):
            d, v = view["default"], view["vllm"]
            fill = ("-" if d["kv_fill_waiting"] is None else f"{d['kv_fill_waiting']:.0%}") + " vs " + (
                "-" if v["kv_fill_waiting"] is None else f"{v['kv_fill_waiting']:.0%}")
            lines.append(f"  - pass {k + 1}: KV fill while requests wait {fill}; longest request waits "
                         f"{d['longest_wait_s']} s vs {v['longest_wait_s']} s, recomputes {d['longest_recomputed']} "
                         f"vs {v['longest_recomputed']} tokens; preemptions {d['preemptions']} vs {v['preemptions']}")
    return "\n".join(lines) + "\n"


def seed_range(text: str) -> list[int]:
    """"100-299" or "3,5,8"."""
    if "-" in text:
        first, last = map(int, text.split("-"))
        return list(range(first, last + 1))
    return [int(s) for s in text.split(",")]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default=f"{REPORT_SEEDS.start}-{REPORT_SEEDS.stop - 1}",
                        help="the draws: a range (100-299, the report's) or a list (3,5,8)")
    parser.add_argument("--out", help="the report's folder (default runs/family/report-<seeds>)")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args(argv)
    seeds = seed_range(args.seeds)
    out = Path(args.out or f"runs/family/report-{args.seeds.replace(',', '_')}")
    out.mkdir(parents=True, exist_ok=True)
    results = []
    with multiprocessing.Pool(args.jobs) as pool, (out / "draws.jsonl").open("w") as lines:
        # Largest first, so that the two processes end together.
        for result in pool.imap_unordered(judge, sorted(seeds, key=lambda s: -draw(s).profile.num_prompts)):
            results.append(result)
            lines.write(json.dumps(result) + "\n")
            lines.flush()
            print(f"{len(results)}/{len(seeds)} seed {result['seed']}: default {result[DEFAULT]['ratio']:.3f}x, "
                  f"oracle {result[ORACLE]['ratio']:.3f}x", flush=True)
    results.sort(key=lambda r: r["seed"])
    text = report(results, args.seeds)
    (out / "report.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main(sys.argv[1:])
