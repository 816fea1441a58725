"""Fitting the simulator's step-time model to per-step data recorded by the benchmark on a GPU."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np

from rollout.sim.engine import StepTimeModel


def step_rows(path: str | Path) -> list[dict]:
    """The benchmark's steps-<profile>.jsonl.gz: one run per line."""
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def fit_step_time(runs: list[dict], per_kv_token: float | None = None,
                  graph_batch: int = 0) -> tuple[StepTimeModel, float]:
    """Non-negative least squares of step duration on (1, decode seqs, KV tokens, prefill tokens, any prefill
    under the graph, and with `graph_batch` a step decoding more requests than that: see `StepTimeModel`);
    returns the model and the relative error of predicted total time over the runs used. `per_kv_token` fixes
    that coefficient (seconds per KV token read): short contexts cannot tell it from the per-sequence cost."""
    from scipy.optimize import nnls

    features, durations = [], []
    for run in runs:
        steps = np.asarray([row[:5] for row in run["steps"]], dtype=float)  # t, running, scheduled, KV, preempted
        if len(steps) < 3:
            continue
        dt = np.diff(steps[:, 0])
        running, scheduled, kv = steps[:-1, 1], steps[:-1, 2], steps[:-1, 3] * run["kv_capacity_tokens"]
        prefill = np.maximum(scheduled - running, 0)
        decode = np.minimum(running, scheduled)
        eager = decode > graph_batch if graph_batch else np.zeros_like(dt, dtype=bool)
        features.append(np.column_stack([np.ones_like(dt), decode, kv, prefill, (prefill > 0) & ~eager, eager]))
        durations.append(dt)
    x, y = np.vstack(features), np.concatenate(durations)
    # A slow step without prefill is a hiccup of the machine, not a step; slow steps with prefill are what
    # prices prefill and recomputation (dropping them too prices recomputation at about a sixth of its cost).
    keep = ~((y > 10 * np.median(y)) & (x[:, 3] == 0))
    fitted = [k for k in range(6) if not (k == 2 and per_kv_token is not None or k == 5 and not graph_batch)]
    coef = np.zeros(x.shape[1])
    if per_kv_token is not None:
        coef[2] = per_kv_token
    coef[fitted], _ = nnls(x[keep][:, fitted], y[keep] - x[keep] @ coef)
    error = abs(float((x @ coef).sum() - y.sum())) / float(y.sum())
    return StepTimeModel(*map(float, coef[:5]), graph_batch=graph_batch, per_eager_step=float(coef[5])), error
