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


def fit_step_time(runs: list[dict]) -> tuple[StepTimeModel, float]:
    """Least squares of step duration on (1, decode seqs, KV tokens, prefill tokens); returns the model and the
    relative error of predicted total time over the runs used."""
    features, durations = [], []
    for run in runs:
        steps = np.asarray(run["steps"], dtype=float)  # t, running, scheduled tokens, KV use, preempted
        if len(steps) < 3:
            continue
        dt = np.diff(steps[:, 0])
        running, scheduled, kv = steps[:-1, 1], steps[:-1, 2], steps[:-1, 3] * run["kv_capacity_tokens"]
        prefill = np.maximum(scheduled - running, 0)
        decode = np.minimum(running, scheduled)
        features.append(np.column_stack([np.ones_like(dt), decode, kv, prefill]))
        durations.append(dt)
    x, y = np.vstack(features), np.concatenate(durations)
    keep = y < 10 * np.median(y)  # engine restarts and host hiccups are not steps
    coef, *_ = np.linalg.lstsq(x[keep], y[keep], rcond=None)
    coef = np.maximum(coef, 0.0)
    error = abs(float((x @ coef).sum() - y.sum())) / float(y.sum())
    return StepTimeModel(*map(float, coef)), error
