"""Our scheduler in the engine TRL's GRPOTrainer builds (colocate mode), a few GRPO steps on the tiny model
(rollout.integrations.trl)."""

import json

import pytest



def test_each_training_process_keeps_its_own_scheduler_state():
    from rollout.integrations.trl import rank_settings

    settings = {"policy": {}, "state_dir": "/ckpt/rollout", "trace_path": "/runs/trace.jsonl"}
    assert rank_settings(settings, {}) == settings == rank_settings(settings, {"WORLD_SIZE": "1", "RANK": "0"})
    ranks = [rank_settings(settings, {"WORLD_SIZE": "2", "RANK": str(r)}) for r in (0, 1)]
    assert [s["state_dir"] for s in ranks] == ["/ckpt/rollout/rank-0", "/ckpt/rollout/rank-1"]
    assert [s["trace_path"] for s in ranks] == ["/runs/trace.rank-0.jsonl", "/runs/trace.rank-1.jsonl"]
    assert settings["state_dir"] == "/ckpt/rollout"  # the caller's settings stay as given


def length_reward(completions, **kwargs):
    return [min(len(c if isinstance(c, str) else str(c)) / 64.0, 1.0) for c in completions]


@pytest.mark.engine
def test_grpo_trainer_runs_our_scheduler_which_learns_each_prompt_across_steps(tiny_model, tmp_path):
    """Two prompts, one a step, four steps: each prompt is generated for twice. The engine TRL builds runs our
    scheduler (its trace), which keeps each prompt's lengths in state_dir; vLLM's weights follow the trainer's
    (TRL's own measure of the difference between its log-probabilities and vLLM's stays at rounding)."""
    import datasets
    from trl import GRPOConfig, GRPOTrainer

    from rollout.integrations.trl import use_rollout_scheduler
    from rollout.policy.length_stats import PromptLengths

    state, trace = tmp_path / "state", tmp_path / "trace.jsonl"
    use_rollout_scheduler(state_dir=state, trace_path=trace, policy={"name": "forecast"},
                          kv_cache_memory_bytes=64 << 20, dtype="float32")
    prompts = ["Tell me about the river.", "Tell me about the mountain."]
    config = GRPOConfig(output_dir=str(tmp_path / "out"), use_vllm=True, vllm_mode="colocate",
                        vllm_max_model_length=256, num_generations=4, per_device_train_batch_size=4,
                        max_completion_length=16, max_steps=4, learning_rate=1e-2, report_to=[], bf16=False,
                        use_cpu=True, logging_steps=1, save_strategy="no", seed=0,
                        model_init_kwargs={"dtype": "float32"})
    trainer = GRPOTrainer(model=str(tiny_model), reward_funcs=length_reward, args=config,
                          train_dataset=datasets.Dataset.from_dict({"prompt": prompts}))
    trainer.train()

    records = [json.loads(line) for line in trace.read_text().splitlines()]
    assert records[0]["event"] == "start" and records[0]["policy"] == "forecast"
    assert sum("step" in r for r in records) >= 4 * 16  # four passes of 16 tokens at least
    memory = PromptLengths.load(state / "prompt_lengths.json")
    assert len(memory.mean) == len(prompts)  # each prompt's four samples, seen twice, under one key
    assert all(len(lengths) == 4 for lengths in memory.last.values())
    steps = [r for r in trainer.state.log_history if "sampling/sampling_logp_difference/max" in r]
    assert len(steps) == 4
    # At lr 1e-2 stale weights in vLLM differ by ~1 (measured); synced ones by rounding.
    assert max(r["sampling/sampling_logp_difference/max"] for r in steps) < 1e-3
