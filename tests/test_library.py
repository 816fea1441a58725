"""The library API a trainer uses: RolloutBatch from a pass, weight updates into the running engine."""

import pytest
import torch

from rollout.batch import RolloutBatch


def records():
    return [
        {"group_index": 1, "sample_index": 0, "prompt_token_ids": [7, 8], "completion_token_ids": [4],
         "finish_reason": "stop", "logprobs": [-0.5], "reward": 0.0},
        {"group_index": 0, "sample_index": 1, "prompt_token_ids": [5, 6, 7], "completion_token_ids": [9, 9, 2],
         "finish_reason": "length", "logprobs": [-1.0, -2.0, -3.0], "reward": 1.0},
        {"group_index": 0, "sample_index": 0, "prompt_token_ids": [5, 6, 7], "completion_token_ids": [3, 2],
         "finish_reason": "stop", "logprobs": [-0.1, -0.2], "reward": 0.0},
        {"group_index": 1, "sample_index": 1, "prompt_token_ids": [7, 8], "completion_token_ids": [4, 4],
         "finish_reason": "stop", "logprobs": [-0.3, -0.4], "reward": 1.0},
    ]


def test_batch_rows_masks_and_group_advantages():
    batch = RolloutBatch.from_records(records())
    assert list(batch.group_index) == [0, 0, 1, 1] and list(batch.sample_index) == [0, 1, 0, 1]
    assert list(batch.completion_lengths) == [2, 3, 1, 2] and list(batch.prompt_lengths) == [3, 3, 2, 2]
    t = batch.to_tensors(pad_token_id=0)
    assert t["input_ids"].shape == (4, 6)
    assert t["input_ids"][1].tolist() == [5, 6, 7, 9, 9, 2]
    assert t["attention_mask"].sum(1).tolist() == [5, 6, 3, 4]
    assert t["loss_mask"].sum(1).tolist() == [2, 3, 1, 2]
    assert t["loss_mask"][0].tolist() == [0, 0, 0, 1, 1, 0]  # completion tokens only
    assert t["old_logprobs"][1, 3:6].tolist() == pytest.approx([-1.0, -2.0, -3.0])
    assert torch.all(t["old_logprobs"][t["loss_mask"] == 0] == 0)
    advantages = batch.group_advantages()
    assert advantages[:2].sum() == pytest.approx(0) and advantages[1] > 0 > advantages[0]
    assert advantages[3] > 0 > advantages[2]


def test_a_batch_without_rewards_has_no_advantages():
    rows = [{k: v for k, v in r.items() if k != "reward"} for r in records()]
    with pytest.raises(ValueError, match="no rewards"):
        RolloutBatch.from_records(rows).group_advantages()


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    from omegaconf import OmegaConf

    from rollout.config import RunConfig, validate
    from rollout.engine import RolloutEngine

    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), {
        "model": {"path": str(tiny_model), "dtype": "float32", "kv_cache_memory_bytes": 64 << 20,
                  "max_model_len": 512},
        "data": {"source": "synthetic"}, "sampling": {"n": 1, "temperature": 0.0, "max_tokens": 8, "ignore_eos": True},
        "policy": {"name": "memory", "b_max": 16}, "output": {"stats_in": None}}))
    validate(cfg)
    with RolloutEngine(cfg, tmp_path_factory.mktemp("library")) as engine:
        yield engine


@pytest.mark.engine
def test_rollout_returns_a_training_batch(engine):
    batch = engine.rollout([[5, 6, 7, 8], [9, 10, 11]], n=3, logprobs=0, temperature=1.0)
    assert len(batch) == 6 and list(batch.group_index) == [0, 0, 0, 1, 1, 1]
    assert batch.prompt_ids[0] == [5, 6, 7, 8] and batch.prompt_ids[5] == [9, 10, 11]
    assert all(len(c) == 8 for c in batch.completion_ids) and set(batch.finish_reasons) == {"length"}
    assert all(len(lp) == 8 and all(v <= 0 for v in lp) for lp in batch.logprobs)
    assert batch.summary["num_samples"] == 6
    assert engine.cfg.sampling.n == 1  # the overrides held for that call only
    with pytest.raises(ValueError, match="unknown sampling setting"):
        engine.rollout([[5, 6]], colour="red")


@pytest.mark.engine
def test_pushed_weights_change_the_generated_tokens_and_can_be_undone(engine, tiny_model):
    from transformers import AutoModelForCausalLM

    from rollout.models import forced_token_weights

    state = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13]]
    before = engine.rollout(prompts).completion_ids
    forced_token = 77
    assert any(token != forced_token for c in before for token in c)
    engine.update_weights(forced_token_weights(state, forced_token))
    forced = engine.rollout(prompts).completion_ids
    assert all(token == forced_token for c in forced for token in c)
    engine.update_weights(state.items())  # an iterator of (name, tensor) works too
    assert engine.rollout(prompts).completion_ids == before
    with pytest.raises(ValueError, match="no tensors"):
        engine.update_weights({})
