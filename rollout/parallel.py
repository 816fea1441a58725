"""Data parallel rollouts on Ray: N engines, each a Ray actor holding one `RolloutEngine` on its own GPU(s).

`ray.init()` finds the cluster: the one `ray start` made (or RAY_ADDRESS names), else a new one on this host. The
engines' resources are reserved in one placement group (PACK: one host where it fits, several where not), so
none starts before all of them can.

This process keeps the prompt set, the sample store (a killed run resumes as a single-engine one does), the
scorers (closures, which do not travel) and the per-prompt length memory merged over the engines, which every
engine's samples update: it splits the prompts by it, and each engine's scheduler starts each pass from it (a
prompt an engine never ran is known to it as to the one that did).
A `Dispatcher` actor holds the prompts no engine has started yet, one queue per engine: the shares come from
`split_by_work` (a prompt's n samples together, heaviest first to the least-loaded engine), each queue heaviest
first. An engine starts with twice its KV cache's tokens of predicted work (at most `policy.b_max` requests)
and takes more from its own queue whenever fewer of its requests wait than `waiting_wanted` says, so its
scheduler has the next requests at hand, the longest first, while the rest stays where another engine can take
it: with its own queue empty and nothing waiting, an engine takes from the queue with the most work left (work
stealing, whole prompts). Finished samples come back through
the dispatcher, which keeps the first copy of each. An engine that dies has its unfinished samples put back for
the others; the pass ends when every sample is in.

Invariant: every sample of the pass not yet received is in exactly one place, a queue or one engine's hands.
"""

from __future__ import annotations

import heapq
import json
import os
import time
from collections import deque
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from rollout.batch import RolloutBatch
from rollout.config import RunConfig, SamplingConfig
from rollout.engine import (PROMPT_LENGTHS_FILE, GenerationResult, Job, PassRun, as_prompts, sampling_overrides,
                            weights_for_engine)
from rollout.policy.length_stats import PromptLengths, prompt_key, save_json

PLACEMENT_TIMEOUT_S = 600.0  # long enough for a cluster's autoscaler; then a clear error instead of a hang
# An engine keeps this share of its running batch waiting: enough for the slots that free up between two asks,
# and little held back where no other engine can take it once the queues are empty. Eight engines in the
# simulator (scripts/simulate_dp.py, docs/results.md), the worst first pass of the suite's profiles against
# total work / 8: a whole batch waiting 1.17 (long-cot), half 1.16 (long-cot), a quarter 1.15 (tail-bound).
WAITING_PER_RUNNING = 0.25
# While it probes prompts never seen (a first pass of groups), an engine keeps a whole batch waiting: its
# scheduler learns which groups are long from the probes of the prompts it holds, and starts their siblings first
# (tail-bound's first pass 1.030 against 1.146, grpo-groups' 1.081 against 1.098 with a quarter).
WAITING_PER_RUNNING_PROBING = 1.0


def waiting_wanted(cap: int, running: int, probing: bool = False) -> int:
    """Requests an engine wants waiting, running `running` under the cap `cap`: below it, it asks for more.
    `probing`: the pass probes prompts of unknown lengths (`rollout.policy.probes`)."""
    share = WAITING_PER_RUNNING_PROBING if probing else WAITING_PER_RUNNING
    return max(int(min(cap, running) * share), 1)


def probes_unknown(jobs, probes: bool) -> bool:
    """Whether a pass of these jobs probes: `probes` on and a prompt of unknown lengths with several samples."""
    return probes and any(not job.known and len(job.samples) > 1 for job in jobs)


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


def predicted_work(prompts, n: int, max_tokens: int, memory: PromptLengths | None = None) -> np.ndarray:
    """Tokens each prompt will cost: n samples of its prompt plus its predicted output. The prediction is the
    per-prompt memory's where it knows the prompt; else the mean over the prompts it knows; else half of
    max_tokens."""
    predicted = np.full(len(prompts), np.nan) if memory is None else memory.predict(
        [prompt_key(p.token_ids) for p in prompts])
    known = ~np.isnan(predicted)
    predicted[~known] = predicted[known].mean() if known.any() else max_tokens / 2.0
    return n * (np.array([len(p.token_ids) for p in prompts], dtype=float) + predicted)


def remember_lengths(memory: PromptLengths, keys: list[str], records: list[dict], path: Path) -> None:
    """Each prompt's outputs of a pass (records numbered by `group_index` into `keys`) update the merged memory,
    as the scheduler that ran them updated its own (`PromptLengths.update`); saved to `path`."""
    by_prompt: dict[str, list[int]] = {}
    for record in records:
        by_prompt.setdefault(keys[record["group_index"]], []).append(record["completion_tokens"])
    for key, lengths in by_prompt.items():
        memory.update(key, lengths)
    if by_prompt:
        memory.save(path)


class Dispatcher:
    """The prompts no engine has started, per engine, and the samples received (a Ray actor; its methods run one
    at a time). `queues[k]`: engine k's share, heaviest first, as (work, job). `orphans`: samples of engines that
    died, taken before anything else."""

    def __init__(self, queues: list[list[tuple[float, Job]]], expected: int) -> None:
        self.queues = [deque(q) for q in queues]
        self.orphans: deque[tuple[float, Job]] = deque()
        self.held: list[dict[tuple[int, int], Job]] = [{} for _ in queues]  # what each engine was given, unfinished
        self.received: set[tuple[int, int]] = set()
        self.outbox: list[dict] = []
        self.expected = expected
        self.dead: set[int] = set()
        self.stolen = [0] * len(queues)  # prompts each engine took from another's queue

    def take(self, rank: int, want: int, steal: bool, tokens: float | None = None) -> list[Job] | None:
        """Jobs for engine `rank`, whole prompts, until `want` requests (and `tokens` of predicted work, where
        given) are reached; None: every sample is in (the pass is over). Orphans first, then its own queue, then,
        if `steal`, the fullest other queue."""
        if len(self.received) >= self.expected:
            return None
        if rank in self.dead:
            return []
        jobs, count, work = [], 0, 0.0

        def enough() -> bool:
            return count >= max(want, 1) or (tokens is not None and work >= tokens)

        def give(source: deque, at_most: int | None = None) -> int:
            nonlocal count, work
            given = 0
            while source and not enough() and (at_most is None or given < at_most):
                weight, job = source.popleft()
                jobs.append(job)
                count += len(job.samples)
                work += weight
                given += 1
            return given

        give(self.orphans)
        give(self.queues[rank])
        if steal and not jobs:
            loads = [(sum(w for w, _ in q), k) for k, q in enumerate(self.queues) if k != rank and q]
            if loads:
                _, victim = max(loads)
                # Half of what the victim has left at most, a prompt at least: it keeps working on its own.
                source = self.queues[victim]
                self.stolen[rank] += give(source, at_most=max(1, len(source) // 2))
        for job in jobs:
            for sample in job.samples:
                self.held[rank][(job.index, sample)] = job
        return jobs

    def put(self, rank: int, records: list[dict]) -> None:
        for record in records:
            key = (record["group_index"], record["sample_index"])
            self.held[rank].pop(key, None)
            if key not in self.received:  # a dead engine's late copy of a sample already rerun is dropped
                self.received.add(key)
                self.outbox.append(record)

    def collect(self) -> list[dict]:
        out, self.outbox = self.outbox, []
        return out

    def lost(self, rank: int) -> int:
        """Engine `rank` died: its unfinished samples and its queue go to the orphans. Returns the samples rerun."""
        self.dead.add(rank)
        by_prompt: dict[int, tuple[Job, list[int]]] = {}
        for (index, sample), job in self.held[rank].items():
            if (index, sample) not in self.received:
                by_prompt.setdefault(index, (job, []))[1].append(sample)
        self.held[rank] = {}
        rerun = [(0.0, replace(job, samples=sorted(samples))) for job, samples in by_prompt.values()]
        self.orphans.extend(rerun)
        self.orphans.extend(self.queues[rank])
        self.queues[rank] = deque()
        return sum(len(job.samples) for _, job in rerun)

    def progress(self) -> dict:
        return {"received": len(self.received), "expected": self.expected, "stolen": list(self.stolen),
                "held": [len(h) for h in self.held], "dead": sorted(self.dead)}


class EngineWorker:
    """One engine in a Ray actor; it lives as long as its `ParallelEngines`, across passes."""

    def __init__(self, cfg: RunConfig, workdir: str) -> None:
        from rollout.engine import RolloutEngine

        self.engine = RolloutEngine(cfg, workdir)

    def run(self, rank: int, dispatcher, num_prompts: int, memory: dict, sampling: SamplingConfig,
            probing: bool = False) -> dict:
        """One pass: jobs from the dispatcher until it says every sample is in; finished samples go back to it.
        `memory`: the per-prompt memory merged over the engines (a saved PromptLengths' content), which the
        scheduler reads in as the pass opens. `sampling`: the driver's sampling settings for this pass (a
        trainer's `rollout()` overrides them)."""
        # Written before the pass's first request: the scheduler reads it in when that one arrives.
        save_json(self.engine.prompt_lengths_path, memory)
        with sampling_overrides(self.engine.cfg, asdict(sampling)):
            return self._run(rank, dispatcher, num_prompts, probing)

    def _run(self, rank: int, dispatcher, num_prompts: int, probing: bool) -> dict:
        import ray

        engine = self.engine
        llm_engine = engine.llm.llm_engine
        b_max = max(engine.cfg.policy.b_max, 1)
        run = PassRun(engine, num_prompts)
        last_ask = [0.0]

        def refill() -> bool:
            """Submits more jobs where its waiting requests run low; False once the pass is over."""
            idle = not llm_engine.has_unfinished_requests()
            now = time.monotonic()
            if not idle and now - last_ask[0] < 0.2:
                return True
            last_ask[0] = now
            step = None if idle else run.latest_step()
            if idle:
                waiting, wanted = 0, b_max
            elif step is None:  # no trace (vLLM's own scheduler, or before the first step): up to b_max run
                waiting, wanted = max(llm_engine.get_num_unfinished_requests() - b_max, 0), b_max
            else:
                waiting, wanted = step["waiting"], waiting_wanted(step["cap"], step["running"], probing)
            if waiting >= wanted:
                return True
            jobs = ray.get(dispatcher.take.remote(rank, wanted - waiting, steal=waiting == 0))
            if jobs is None:
                return False
            if jobs:
                run.submit(jobs)
            elif idle:
                time.sleep(0.2)  # others still run: one of them may die and leave samples to rerun
            return True

        header = engine.header  # the cache's size, where our scheduler runs: twice its tokens to start with
        kv_tokens = (header.get("kv_capacity_blocks") or 0) * (header.get("block_size") or 0)
        run.submit(ray.get(dispatcher.take.remote(rank, b_max, steal=False, tokens=2 * kv_tokens or None)) or [])
        new = run.drive(progress=False, sink=lambda records: ray.get(dispatcher.put.remote(rank, records)),
                        refill=refill)
        summary = {k: v for k, v in run.summary(new, new).items() if k != "series"} if new else {
            "generated_tokens": 0, "num_samples": 0, "samples_generated": 0, "preemptions": 0}
        summary["wall_time_s"] = round(run.wall, 3)  # until every engine's samples were in
        summary["busy_s"] = round(run.last_step - run.start, 3)  # until its own last step
        summary["prompts"] = len({r["group_index"] for r in new})
        return summary

    def ready(self) -> bool:
        """Once the engine is up: whether it has a tokenizer (it does not with skip_tokenizer_init)."""
        return self.engine.tokenizer is not None

    def encode(self, texts: list[str]) -> list[list[int]]:
        return [self.engine.tokenizer.encode(t) for t in texts]

    def update_weights(self, weights: dict) -> None:
        self.engine.update_weights(weights)

    def sleep(self, level: int) -> None:
        self.engine.sleep(level)

    def wake_up(self) -> None:
        self.engine.wake_up()

    def shutdown(self) -> None:
        self.engine.close()


class ParallelEngines:
    """`model.data_parallel_size` engines as Ray actors, kept across passes like one `RolloutEngine`: each
    `generate` call is one pass over the prompts, split between them, with the per-prompt memory of all passes."""

    def __init__(self, cfg: RunConfig, workdir: str | os.PathLike) -> None:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.cfg = cfg
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        engines = cfg.model.data_parallel_size
        self.started_ray = not ray.is_initialized()
        if self.started_ray:
            if cfg.model.device_ids is not None:  # what a new local cluster may use; an existing one decides itself
                os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in cfg.model.device_ids)
            ray.init()
        resources = ray.cluster_resources()
        per_engine = {"GPU": cfg.model.tensor_parallel_size, "CPU": 1} if resources.get("GPU") else {"CPU": 1}
        short = {k: f"{engines * v} {k} needed, {resources.get(k, 0):g} in the cluster" for k, v in
                 per_engine.items() if resources.get(k, 0) < engines * v}
        if short:
            self._shutdown()
            raise RuntimeError(f"model.data_parallel_size={engines} (model.tensor_parallel_size="
                               f"{cfg.model.tensor_parallel_size}): {'; '.join(short.values())}")
        self.group = placement_group([per_engine] * engines, strategy="PACK")
        ready, _ = ray.wait([self.group.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            remove_placement_group(self.group)
            self._shutdown()
            raise RuntimeError(f"the Ray cluster cannot place {engines} engines of {per_engine} each "
                               f"({ray.cluster_resources()})")
        # The engines inherit this process's settings of vLLM, Hugging Face and rollout (log level, offline mode,
        # caches), also on a cluster started elsewhere; each keeps its length statistics in its own folder.
        env = {k: v for k, v in os.environ.items() if k.startswith(("VLLM_", "HF_", "TRANSFORMERS_", "ROLLOUT_"))}
        engine_cfg = replace(cfg, output=replace(cfg.output, stats_out=None, stats_in=cfg.output.stats_in or None))
        worker = ray.remote(EngineWorker)
        self.actors = []
        for rank in range(engines):
            self.actors.append(worker.options(
                num_cpus=per_engine["CPU"], num_gpus=per_engine.get("GPU", 0), runtime_env={"env_vars": env},
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=rank),
            ).remote(engine_cfg, str(self.workdir / f"engine-{rank}")))
        start = time.monotonic()
        try:
            self.tokenizes = all(ray.get([actor.ready.remote() for actor in self.actors]))
        except Exception:
            self.close()
            raise
        self.engine_start_s = time.monotonic() - start
        self.memory_path = self.workdir / PROMPT_LENGTHS_FILE
        stats_in = cfg.output.stats_in
        prior = self.memory_path if stats_in == "auto" else Path(stats_in).with_name(PROMPT_LENGTHS_FILE) \
            if stats_in else None
        self.memory = PromptLengths.load(prior) if prior is not None and prior.is_file() else PromptLengths()
        self.alive = list(range(engines))

    def generate(self, prompts, done: dict | None = None, sink=None) -> GenerationResult:
        """Every prompt's samples over the engines; finished samples go to `sink` as they come, scored here.
        `done`: samples already durable, keyed by (prompt id, sample index), not generated again."""
        import ray

        cfg, n = self.cfg, self.cfg.sampling.n
        done = done or {}
        keys = [prompt_key(p.token_ids) for p in prompts]
        known = ~np.isnan(self.memory.predict(keys))
        work = predicted_work(prompts, n, cfg.sampling.max_tokens, self.memory)
        shares = [[] for _ in self.actors]  # an engine that died in an earlier pass gets none
        for rank, share in zip(self.alive, split_by_work(work, len(self.alive))):
            shares[rank] = share
        jobs = {i: Job(i, replace(p, score=None), [s for s in range(n) if (p.prompt_id, s) not in done],
                       bool(known[i])) for i, p in enumerate(prompts)}  # scorers stay here
        queues = [sorted([(float(work[i]), jobs[i]) for i in share if jobs[i].samples], key=lambda item: -item[0])
                  for share in shares]
        expected = sum(len(job.samples) for job in jobs.values())
        self.dispatcher = dispatcher = ray.remote(Dispatcher).options(num_cpus=0).remote(queues, expected)
        rewards = [r["reward"] for r in done.values() if "reward" in r]
        new: list[dict] = []

        def receive(records: list[dict]) -> None:
            for record in records:
                scorer = prompts[record["group_index"]].score
                if scorer is not None:
                    record["reward"] = scorer(record["completion"])
                    rewards.append(record["reward"])
            new.extend(records)
            if sink:
                sink(records)

        started = time.monotonic()
        probing = probes_unknown(jobs.values(), cfg.policy.probe_first and cfg.policy.order == "longest_first")
        memory = self.memory.to_dict()
        runs = {self.actors[rank].run.remote(rank, dispatcher, len(prompts), memory, cfg.sampling, probing):
                rank for rank in self.alive}
        summaries: dict[int, dict] = {}
        rerun = 0
        try:
            while runs:
                ready, _ = ray.wait(list(runs), num_returns=1, timeout=0.5)
                receive(ray.get(dispatcher.collect.remote()))
                for ref in ready:
                    rank = runs.pop(ref)
                    try:
                        summaries[rank] = ray.get(ref)
                    except ray.exceptions.RayActorError:
                        self.alive.remove(rank)
                        rerun += ray.get(dispatcher.lost.remote(rank))
                        if not self.alive:
                            raise RuntimeError("every data-parallel engine died; the samples received are kept")
            receive(ray.get(dispatcher.collect.remote()))
            progress = ray.get(dispatcher.progress.remote())
        finally:
            ray.kill(dispatcher)
        wall = time.monotonic() - started
        if progress["received"] < expected:
            raise RuntimeError(f"{expected - progress['received']} samples were not generated")
        remember_lengths(self.memory, keys, new, self.memory_path)
        records = sorted([*done.values(), *new], key=lambda r: (r["group_index"], r["sample_index"]))
        per_engine = [summaries.get(rank, {"died": True}) for rank in range(len(self.actors))]
        for rank, summary in enumerate(per_engine):
            summary["prompts_stolen"] = progress["stolen"][rank]
        generated = sum(r["completion_tokens"] for r in new)
        busy = [s["busy_s"] for s in per_engine if "busy_s" in s]
        summary = {
            "policy": cfg.policy.name, "engines": len(self.actors), "engines_alive": len(self.alive),
            "ray_address": ray.get_runtime_context().gcs_address,  # the cluster's (one `ray start` made, or new)
            "engine_start_s": round(self.engine_start_s, 2), "wall_time_s": round(wall, 3),
            "num_prompts": len(prompts), "samples_per_prompt": n, "num_samples": len(records),
            "samples_generated": len(new), "samples_resumed": len(records) - len(new),
            "samples_rerun": rerun, "prompt_tokens": sum(r["prompt_tokens"] for r in new),
            "generated_tokens": generated, "completion_tokens_total": sum(r["completion_tokens"] for r in records),
            "generated_tokens_per_s": round(generated / wall, 2) if wall > 0 else None,
            # Each engine's time until its last step, and the slowest against their mean (1: balanced).
            "busy_s_per_engine": busy,
            "balance": round(max(busy) / float(np.mean(busy)), 4) if busy and min(busy) > 0 else None,
            "generated_tokens_per_s_per_engine": [s.get("generated_tokens_per_s") for s in per_engine],
            "preemptions": sum(s.get("preemptions", 0) for s in per_engine),
            "prompts_per_engine": [s.get("prompts", 0) for s in per_engine],
            "predicted_work_per_engine": [round(float(work[share].sum()), 1) for share in
                                          (np.array(s, dtype=int) for s in shares)],
            "prompt_lengths": {"prompts_predicted": int(known.sum()), "path": str(self.memory_path)},
            **({"reward_mean": float(np.mean(rewards)), "accuracy": float(np.mean([r >= 1.0 for r in rewards]))}
               if rewards else {}),
            "per_engine": per_engine,
        }
        return GenerationResult(records=records, summary=summary)

    def rollout(self, prompts: list, *, progress: bool = False, **sampling) -> RolloutBatch:
        """`RolloutEngine.rollout` over the engines: one pass as a `RolloutBatch`, `sampling` overriding
        `cfg.sampling` for this call. Text prompts are tokenized by an engine. `progress` is accepted for the
        same signature; the engines report through the summary."""
        import ray

        first = self.actors[self.alive[0]]
        prompts = as_prompts(prompts, (lambda texts: ray.get(first.encode.remote(texts))) if self.tokenizes else None)
        with sampling_overrides(self.cfg, sampling):
            result = self.generate(prompts)
        return RolloutBatch.from_records(result.records, result.summary)

    def update_weights(self, weights) -> None:
        """New weights into every engine (see `RolloutEngine.update_weights`): converted here once, sent through
        Ray's object store, loaded by all engines at once."""
        import ray

        self._on_every_engine("update_weights", ray.put(weights_for_engine(weights, self.cfg.model.dtype)))

    def sleep(self, level: int = 1) -> None:
        """Every engine's `sleep` (GPU only; `model.engine_kwargs.enable_sleep_mode=true`)."""
        self._on_every_engine("sleep", level)

    def wake_up(self) -> None:
        self._on_every_engine("wake_up")

    def _on_every_engine(self, method: str, *args) -> None:
        import ray

        ray.get([getattr(self.actors[rank], method).remote(*args) for rank in self.alive])

    def _shutdown(self) -> None:
        import ray

        if self.started_ray and ray.is_initialized():
            ray.shutdown()

    def close(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in getattr(self, "actors", []):
            try:
                ray.get(actor.shutdown.remote(), timeout=60)  # the engine stops its own processes
            except Exception:  # noqa: BLE001 - a dead or stuck actor is killed as it is
                pass
            ray.kill(actor)
        self.actors = []
        if getattr(self, "group", None) is not None:
            remove_placement_group(self.group)
            self.group = None
        self._shutdown()

    def __enter__(self) -> ParallelEngines:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def generate_parallel(cfg: RunConfig, prompts, out_dir: Path, done: dict, sink) -> dict:
    """The CLI's one pass over `model.data_parallel_size` engines: the merged summary."""
    with ParallelEngines(cfg, out_dir) as engines:
        result = engines.generate(prompts, done=done, sink=sink)
    (out_dir / "engines.json").write_text(json.dumps(result.summary["per_engine"], indent=1))
    return result.summary
