"""Writing a run's results: samples (JSONL, parquet) through `datasets`, the summary, and a trace plot."""

from __future__ import annotations

import json
import os
from pathlib import Path

OUTPUT_NAMES = {"jsonl": "samples.jsonl", "parquet": "samples.parquet"}
SUMMARY_FILE = "summary.json"


def _atomic(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def write_samples(records: list[dict], out_dir: Path, formats: list[str]) -> dict[str, str]:
    import datasets

    datasets.disable_progress_bars()
    table = datasets.Dataset.from_list(records)
    paths = {}
    for fmt in formats:
        path = out_dir / OUTPUT_NAMES[fmt]
        if fmt == "jsonl":
            _atomic(path, lambda p: table.to_json(str(p), lines=True, force_ascii=False,
                                                       double_precision=15))
        else:
            _atomic(path, lambda p: table.to_parquet(str(p)))
        paths[fmt] = str(path)
    return paths


def write_summary(summary: dict, out_dir: Path) -> Path:
    path = out_dir / SUMMARY_FILE
    _atomic(path, lambda p: p.write_text(json.dumps(summary, indent=1, default=str)))
    return path


def plot_trace(trace: list[dict], path: Path, title: str) -> Path | None:
    """Cap, running batch and KV use over the run's steps."""
    if not trace:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t"] for s in trace]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(t, [s["cap"] for s in trace], label="cap", lw=1)
    ax.plot(t, [s["running"] for s in trace], label="running", lw=1)
    ax.plot(t, [s["waiting"] for s in trace], label="waiting", lw=1, alpha=0.6)
    ax.set_xlabel("seconds")
    ax.set_ylabel("requests")
    kv = ax.twinx()
    kv.plot(t, [s["kv_usage"] for s in trace], color="black", lw=0.8, alpha=0.5, label="KV use")
    kv.set_ylim(0, 1.05)
    kv.set_ylabel("KV use")
    lines = ax.get_legend_handles_labels()
    kv_lines = kv.get_legend_handles_labels()
    ax.legend(lines[0] + kv_lines[0], lines[1] + kv_lines[1], loc="upper right", fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    _atomic(path, lambda p: fig.savefig(p, dpi=100, format="png"))
    plt.close(fig)
    return path
