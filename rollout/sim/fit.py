"""Fitting the simulator's step-time model to per-step data recorded by the benchmark on a GPU."""

from __future__ import annotations

import dataclasses
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


FITS = Path(__file__).resolve().parent.parent.parent / "configs" / "sim"
LLAMA_8B_KV_BYTES_PER_TOKEN = 128 * 1024
HBM_BYTES_PER_S = 4.0e12  # the rate the scripts assume a decode step reads the KV cache at (the H200 peaks at 4.8 TB/s)


def h200_step_model(kv_bytes_per_token: int = LLAMA_8B_KV_BYTES_PER_TOKEN, h100: bool = False) -> StepTimeModel:
    """The step-time model the simulator's scripts price GPU suite workloads with: fitted to the H200 8B
    kv-bound runs (configs/sim/kv-bound-h200-steps.jsonl.gz). Those runs' contexts are too short to price reading
    the KV cache, so that term is the model shape's `kv_bytes_per_token` over HBM_BYTES_PER_S. `h100`: fitted to
    an H100 long-cot run instead (configs/sim/long-cot-h100-steps.jsonl.gz: long contexts, so the KV-read term is
    measured), with the H200 fit's prefill terms: that run's prefill steps are all large admission waves, which
    cannot tell a per-token from a per-step cost."""
    model, _ = fit_step_time(step_rows(FITS / "kv-bound-h200-steps.jsonl.gz"),
                             per_kv_token=kv_bytes_per_token / HBM_BYTES_PER_S)
    if not h100:
        return model
    runs = [run for run in step_rows(FITS / "long-cot-h100-steps.jsonl.gz") if run["scheduler"] == "forecast"]
    fitted, _ = fit_step_time(runs)
    return dataclasses.replace(fitted, per_prefill_token=model.per_prefill_token, per_mixed_step=model.per_mixed_step)
