"""The scheduler's settings: what an engine's owner writes under additional_config["rollout"] (our driver through
`adapter_settings`, `vllm serve` through --additional-config, the plugin's switch from its variable), checked in
the engine process (`read_settings`), and what a request's SamplingParams may add. No vLLM import."""

from __future__ import annotations

import threading

from rollout.config import SCHEDULER_SETTINGS

SETTINGS_KEY = "rollout"

# The benchmarks impose each request's true length through max_tokens (with ignore_eos): they set this to the
# limit a trainer would have given, which is all the policy is told (the oracle reads the true one).
NOMINAL_MAX_TOKENS_KEY = "rollout_nominal_max_tokens"


def adapter_settings(policy: dict, trace_path: str, state_dir: str | None, stats_in: str | None, stats_out: str | None,
                     timing: bool = True) -> dict:
    """The additional_config entry our driver (rollout.engine) configures the scheduler in the engine process
    with: `policy`, the plain dict form of PolicyConfig; `state_dir`, where the scheduler keeps what it learns
    (the driver reads the per-prompt memory there for its submission order); `timing`, the benchmark-only
    measurements (CPU times, the adapter's own time; see rollout.vllm.trace.StepTimer). Nothing else reaches the
    scheduler from the driver, as from any other engine's owner. Call it in the thread that starts the engine:
    only an engine started by the main thread ends with its parent (rollout.vllm.parent)."""
    return {SETTINGS_KEY: {"policy": policy, "trace_path": trace_path, "state_dir": state_dir,
                           "stats_in": stats_in, "stats_out": stats_out, "timing": timing,
                           "end_with_parent": threading.current_thread() is threading.main_thread()}}


def read_settings(additional_config: dict | None) -> dict:
    """additional_config["rollout"], checked: a missing entry, an unknown key or policy field, or a bad value
    raise ValueError with one line naming it (vLLM prints it where the engine fails to start)."""
    settings = (additional_config or {}).get(SETTINGS_KEY)
    if settings is None:
        raise ValueError(f"rollout's scheduler needs additional_config[{SETTINGS_KEY!r}], e.g. "
                         f'--additional-config \'{{"{SETTINGS_KEY}": {{"policy": {{"name": "forecast"}}}}}}\'')
    if not isinstance(settings, dict):
        raise ValueError(f"additional_config[{SETTINGS_KEY!r}] must be a mapping, not {type(settings).__name__}")
    unknown = sorted(set(settings) - set(SCHEDULER_SETTINGS))
    if unknown:
        raise ValueError(f"additional_config[{SETTINGS_KEY!r}]: unknown key {unknown[0]!r}; known: "
                         f"{', '.join(SCHEDULER_SETTINGS)}")
    policy = settings.get("policy") or {}
    if not isinstance(policy, dict):
        raise ValueError(f"additional_config[{SETTINGS_KEY!r}]['policy'] must be a mapping of PolicyConfig fields")
    return {**settings, "policy": policy}


def nominal_max_tokens(request) -> int:
    """The max_tokens the policy sees: the request's own, unless the driver set a nominal one (benchmarks) in its
    SamplingParams.extra_args."""
    extra = getattr(request.sampling_params, "extra_args", None) if request.sampling_params else None
    return int(extra.get(NOMINAL_MAX_TOKENS_KEY, request.max_tokens) if extra else request.max_tokens)


def graph_batch(vllm_config) -> int:
    """The largest decode batch the engine replays as a CUDA graph; 0 when it runs none (CPU, enforce_eager)."""
    compilation = vllm_config.compilation_config
    mode = getattr(compilation, "cudagraph_mode", None)
    if vllm_config.model_config.enforce_eager or mode is None or getattr(mode, "name", str(mode)) == "NONE":
        return 0
    return int(getattr(compilation, "max_cudagraph_capture_size", None) or max(
        getattr(compilation, "cudagraph_capture_sizes", None) or [0]))
