"""Data parallel rollouts: one engine per GPU, each in its own process, prompts split by predicted work.

The parent keeps the prompt set and the sample store (so a killed run resumes as a single-engine one does); each
worker is handed its share of the prompts (token ids; scorers stay in the parent, which scores what comes
back), runs `RolloutEngine.generate` on it and streams finished samples back, renumbered to the whole set's
order. Tensor parallelism inside an engine is vLLM's (`model.tensor_parallel_size`).
"""

from __future__ import annotations

import heapq
import multiprocessing as mp
import os
import queue
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from rollout.config import RunConfig


def split_by_work(work, parts: int) -> list[list[int]]:
    """Indices into `work` in `parts` shares of near-equal total work: heaviest first, each to the lightest
    share so far (longest processing time first). Each share keeps the original order."""
    shares: list[list[int]] = [[] for _ in range(parts)]
    loads = [(0.0, k) for k in range(parts)]
    for index in sorted(range(len(work)), key=lambda i: -work[i]):
        load, k = heapq.heappop(loads)
        shares[k].append(index)
        heapq.heappush(loads, (load + float(work[index]), k))
    return [sorted(share) for share in shares]


def predicted_work(prompts, n: int, max_tokens: int) -> np.ndarray:
    """Tokens each prompt will cost: n samples of its prompt plus an output of half of max_tokens (the prompt
    memory of earlier passes lives in each engine's folder and is not consulted for the split yet)."""
    return n * (np.array([len(p.token_ids) for p in prompts]) + max_tokens / 2.0)


def _worker(rank: int, cfg: RunConfig, share: list, indices: list[int], mine: dict, workdir: str,
            messages) -> None:
    # Before torch or vLLM is imported in this fresh process: engine k sees only its own GPU (harmless on CPU).
    devices = cfg.model.device_ids or list(range(cfg.model.data_parallel_size))
    os.environ["CUDA_VISIBLE_DEVICES"] = str(devices[rank])
    try:
        from rollout.engine import RolloutEngine

        def send(records):  # copies: the engine keeps its own (share-relative) records
            messages.put(("records", rank, [{**r, "group_index": indices[r["group_index"]]} for r in records]))

        with RolloutEngine(cfg, workdir) as engine:
            result = engine.generate(share, progress=False, done=mine, sink=send)
        summary = {k: v for k, v in result.summary.items() if k != "series"}
        messages.put(("done", rank, summary))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which stops the run
        import traceback

        where = traceback.extract_tb(exc.__traceback__)[-1]
        messages.put(("error", rank, f"{type(exc).__name__}: {exc} ({Path(where.filename).name}:{where.lineno})"))


def generate_parallel(cfg: RunConfig, prompts, out_dir: Path, done: dict, sink, engines: int) -> dict:
    """Every prompt's samples over `engines` engine processes; finished samples go to `sink` as they come.
    Returns the merged summary (tokens/s over the whole run and per engine)."""
    from rollout.engine import RolloutEngine  # noqa: F401 - fail here, not in every worker, if vLLM is missing

    shares = split_by_work(predicted_work(prompts, cfg.sampling.n, cfg.sampling.max_tokens), engines)
    context = mp.get_context("spawn")  # vLLM and torch state must not be forked
    messages = context.Queue()
    workers = []
    for rank, share in enumerate(shares):
        share_ids = {prompts[i].prompt_id for i in share}
        mine = {key: record for key, record in done.items() if key[0] in share_ids}  # its resumed samples only
        unscored = [replace(prompts[i], score=None) for i in share]  # scorers are closures: they do not pickle
        workers.append(context.Process(target=_worker, daemon=False, args=(
            rank, cfg, unscored, share, mine, str(out_dir / f"engine-{rank}"), messages)))
    rewards = [r["reward"] for r in done.values() if "reward" in r]

    def score(records):
        for record in records:
            scorer = prompts[record["group_index"]].score
            if scorer is not None:
                record["reward"] = scorer(record["completion"])
                rewards.append(record["reward"])
        sink(records)

    started = time.monotonic()
    for worker in workers:
        worker.start()
    summaries: dict[int, dict] = {}
    try:
        while len(summaries) < len(workers):
            try:
                kind, rank, payload = messages.get(timeout=1.0)
            except queue.Empty:
                dead = [w for r, w in enumerate(workers) if r not in summaries and not w.is_alive()]
                if dead and messages.empty():
                    raise RuntimeError(f"engine process {workers.index(dead[0])} exited ({dead[0].exitcode}) "
                                       "without a result")
                continue
            if kind == "records":
                score(payload)
            elif kind == "done":
                summaries[rank] = payload
            else:
                raise RuntimeError(f"engine {rank}: {payload}")
    finally:
        for worker in workers:
            if worker.is_alive() and len(summaries) < len(workers):
                worker.terminate()
            worker.join(timeout=30)
    wall = time.monotonic() - started
    per_engine = [summaries[r] for r in range(len(workers))]
    generated = sum(s["generated_tokens"] for s in per_engine)
    slowest = max(s["wall_time_s"] for s in per_engine)
    return {
        "policy": cfg.policy.name, "engines": len(workers), "wall_time_s": round(wall, 3),
        "num_samples": sum(s["num_samples"] for s in per_engine),
        "samples_generated": sum(s["samples_generated"] for s in per_engine),
        "generated_tokens": generated, "generated_tokens_per_s": round(generated / wall, 2) if wall > 0 else None,
        # Without the engines' start (spawn, model load, CUDA graphs): what a trainer that keeps them sees.
        "generated_tokens_per_s_started": round(generated / slowest, 2) if slowest > 0 else None,
        "generated_tokens_per_s_per_engine": [s["generated_tokens_per_s"] for s in per_engine],
        "preemptions": sum(s["preemptions"] for s in per_engine),
        **({"reward_mean": float(np.mean(rewards)), "accuracy": float(np.mean([r >= 1.0 for r in rewards]))}
           if rewards else {}),
        "prompts_per_engine": [len(share) for share in shares],
        "per_engine": per_engine,
    }
