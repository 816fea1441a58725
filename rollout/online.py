"""python -m rollout.online --config configs/online/<name>.yaml [key=value ...]

Online serving and its capacity under a latency bound. Requests arrive as a Poisson process at a rate (qps)
into vLLM's AsyncLLM running our scheduler; every request streams, and the client stamps each token's arrival.
Time between tokens (TBT) is taken from those stamps (a delta carrying k tokens counts k gaps of 1/k of its
interval), time to first token (TTFT) from arrival to the first token.

Capacity, as in Sarathi-Serve and the paper: the largest rate at which the TBT statistic (`criterion`: p99 or
mean) stays within D_SLA while the server keeps up (median TTFT within `max_queue_delay_s`; past capacity the
queue grows and TTFT with it). Found per scheduler by doubling the rate until a trial fails, then bisecting.
Schedulers: "vllm" (untouched, its default max_num_seqs), "static-N" (our adapter, fixed cap N), "sla" (the
paper's min(b_mem, b_sla) on the batch cap), "sla-chunk" (the same, and the SLA search also sizes the token
budget of steps that run prompt tokens).

Writes trials.jsonl, results.json, results.md and capacity.png (TBT and TTFT against rate per scheduler) into
out_dir (default runs/online/<config name>). The search itself is `rollout.suite.run_capacity`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from rollout.config import ConfigError
from rollout.suite import CapacityConfig, check_capacity, load_capacity_config, run_capacity


def table(results: list[dict], capacity: CapacityConfig) -> str:
    lines = [f"D_SLA {capacity.d_sla_ms} ms on TBT {capacity.criterion}, median TTFT <= "
             f"{capacity.max_queue_delay_s} s", "",
             "| scheduler | capacity qps | vs vllm | at capacity: TBT p50 / p99 / mean ms | TTFT p50 ms | tok/s | "
             "mean running |", "|---|---|---|---|---|---|---|"]
    base = next((r["capacity_qps"] for r in results if r["scheduler"] == "vllm"), None)
    for r in results:
        best = max((t for t in r["trials"] if t["passed"]), key=lambda t: t["rate_qps"], default=None)
        ratio = f"{r['capacity_qps'] / base:.2f}" if base else "-"
        at = (f"{best['tbt_p50_ms']} / {best['tbt_p99_ms']} / {best['tbt_mean_ms']} | {best['ttft_p50_ms']} | "
              f"{best['tokens_per_s']:.0f} | {best.get('mean_running', '-')}") if best else "- | - | - | -"
        lines.append(f"| {r['scheduler']} | {r['capacity_qps']:.2f} | {ratio} | {at} |")
    return "\n".join(lines) + "\n"


def plot(results: list[dict], capacity: CapacityConfig, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (tbt_ax, ttft_ax) = plt.subplots(1, 2, figsize=(11, 4))
    key = "tbt_p99_ms" if capacity.criterion == "p99" else "tbt_mean_ms"
    for r in results:
        trials = sorted(r["trials"], key=lambda t: t["rate_qps"])
        rates = [t["rate_qps"] for t in trials]
        tbt_ax.plot(rates, [t[key] for t in trials], marker="o", label=r["scheduler"])
        ttft_ax.plot(rates, [t["ttft_p50_ms"] for t in trials], marker="o", label=r["scheduler"])
    tbt_ax.axhline(capacity.d_sla_ms, color="k", ls="--", lw=1, label="D_SLA")
    ttft_ax.axhline(capacity.max_queue_delay_s * 1e3, color="k", ls="--", lw=1)
    tbt_ax.set(xlabel="arrival rate (qps)", ylabel=f"TBT {capacity.criterion} (ms)")
    ttft_ax.set(xlabel="arrival rate (qps)", ylabel="TTFT p50 (ms)", yscale="log")
    tbt_ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    os.environ.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    parser = argparse.ArgumentParser(prog="python -m rollout.online", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="a capacity YAML (configs/online/)")
    parser.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. d_sla_ms=30 schedulers=[vllm,sla]")
    args = parser.parse_args(argv)
    try:
        capacity = load_capacity_config(args.config, args.overrides)
        check_capacity(capacity)
    except (ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(capacity.out_dir)
    report = run_capacity(capacity, out, on_trial=lambda trial: print(json.dumps(trial), flush=True))
    md = table(report["results"], capacity)
    (out / "results.md").write_text(md)
    plot(report["results"], capacity, out / "capacity.png")
    print(md)
    print(f"results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
