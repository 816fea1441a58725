"""A run's trace as a plot: the cap, running batch and KV use over time."""

from __future__ import annotations

from pathlib import Path

from rollout.store import atomic_write

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
    atomic_write(path, lambda p: fig.savefig(p, dpi=100, format="png"))
    plt.close(fig)
    return path
