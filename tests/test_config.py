import dataclasses
from pathlib import Path

import pytest

from rollout.config import (ConfigError, DataConfig, ModelConfig, OutputConfig, PolicyConfig, RunConfig,
                            SamplingConfig, configuration_markdown, describe_options, load_config)

DEMO_SYSTEM_PROMPT = "Solve the problem step by step. End with the final answer as a number after '####'."


def test_defaults_and_dotlist_overrides():
    cfg = load_config(["policy.eps_m=0.01", "sampling.n=8", "policy.name=memory-clt"])
    assert cfg.policy.eps_m == 0.01
    assert cfg.sampling.n == 8
    assert cfg.policy.name == "memory-clt"
    assert cfg.model.path == "smollm2-135m-instruct"  # the demo preset: neither data.source nor model.path set


def test_the_demo_preset_is_the_no_argument_job():
    cfg = load_config([])
    assert (cfg.model.path, cfg.data.source, cfg.data.num_prompts) == (
        "smollm2-135m-instruct", "reasoning_gym:gsm_symbolic", 64)
    assert cfg.data.system_prompt == DEMO_SYSTEM_PROMPT
    assert (cfg.sampling.max_tokens, cfg.model.kv_cache_memory_bytes) == (384, 1 << 30)


@pytest.mark.parametrize("given", [["data.source=my.jsonl", "model.path=/models/mine"],
                                   ["data.source=reasoning_gym:basic_arithmetic", "model.path=/models/mine"]])
def test_a_users_own_data_gets_none_of_the_demos_settings(given):
    cfg = load_config(given)
    schema = RunConfig(model=ModelConfig(path="/models/mine"), data=DataConfig(source=given[0][12:]))
    assert cfg == schema  # exactly the schema's defaults: no system prompt, max_tokens, KV size from the demo
    assert cfg.data.system_prompt is None


def test_a_users_config_file_counts_as_their_own_run(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  path: /models/mine\ndata:\n  source: my.jsonl\n")
    assert load_config([], str(path)).data.system_prompt is None


def test_the_demo_preset_by_name():
    cfg = load_config(["preset=demo", "model.path=/models/mine"])
    assert (cfg.model.path, cfg.data.source, cfg.data.system_prompt) == (
        "/models/mine", "reasoning_gym:gsm_symbolic", DEMO_SYSTEM_PROMPT)


@pytest.mark.parametrize("given, message", [
    (["data.source=my.jsonl"], "model.path is not set: give a local model folder, or smollm2-135m-instruct"),
    (["model.path=/models/mine"], "data.source is not set: give reasoning_gym:<dataset>"),
    (["preset=nope"], "preset: unknown preset 'nope'; choose one of demo"),
])
def test_a_run_without_model_or_data_says_what_to_give(given, message):
    with pytest.raises(ConfigError) as info:
        load_config(given)
    assert message in str(info.value)


def test_policy_shorthand_and_sla_settings():
    cfg = load_config(["policy=sla", "policy.d_sla_ms=50", "policy.sla_window=4"])
    assert (cfg.policy.name, cfg.policy.d_sla_ms, cfg.policy.sla_window) == ("sla", 50.0, 4)


def test_config_file_is_merged(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("policy:\n  b_max: 64\nsampling:\n  max_tokens: 99\n")
    cfg = load_config(["sampling.max_tokens=7"], str(path))
    assert cfg.policy.b_max == 64
    assert cfg.sampling.max_tokens == 7  # the command line wins over the file


@pytest.mark.parametrize("overrides, message", [
    (["policy.eps_m=0"], "policy.eps_m must be in (0, 1), got 0"),
    (["policy.eps_m=1.2"], "policy.eps_m must be in (0, 1), got 1.2"),
    (["policy.b_min=9", "policy.b_max=8"], "policy.b_min (9) must not exceed policy.b_max (8)"),
    (["policy.name=fastest"], "policy.name: unknown policy 'fastest'"),
    (["policy.forgetting=sometimes"], "policy.forgetting must be one of"),
    (["policy.static_cap=1000"], "policy.static_cap must be in [1, b_max=256], got 1000"),
    (["sampling.n=0"], "sampling.n must be >= 1, got 0"),
    (["sampling.max_tokens=-5"], "sampling.max_tokens must be >= 1, got -5"),
    (["sampling.top_p=0"], "sampling.top_p must be in (0, 1]"),
    (["policy.colour=red"], "Key 'colour' not in 'PolicyConfig'"),
    (["sampling.n=many"], "Value 'many' of type 'str' could not be converted to Integer"),
    (["output.formats=[csv]"], "output.formats must be a non-empty subset"),
    (["policy=sla"], "policy.name=sla needs policy.d_sla_ms > 0"),
    (["policy=sla", "policy.d_sla_ms=-3"], "policy.name=sla needs policy.d_sla_ms > 0"),
    (["policy.sla_window=0"], "policy.sla_window must be >= 1, got 0"),
    (["policy.sla_relax=-1"], "must be >= 0"),
    (["policy.order=random"], "policy.order: 'random' is not fifo or longest_first"),
    (["policy.forecast_carry_over=2"], "policy.forecast_carry_over must be in [0, 1], got 2"),
    (["policy.forecast_cold_start=guess"], "policy.forecast_cold_start must be gamma or memory, got 'guess'"),
    (["policy.forecast_cold_start_shape=0"], "policy.forecast_cold_start_shape must be > 0, got 0"),
    (["policy.forecast_cold_start_horizon=-1"], "policy.forecast_cold_start_horizon must be >= 0, got -1"),
    (["policy.forecast_after_share=2"], "policy.forecast_after_share must be in [0, 1], got 2"),
    (["policy.forecast_min_wave=1"], "policy.forecast_min_wave must be in [0, 1), got 1"),
    (["model.dtype=fp8"], "model.dtype must be one of auto, bfloat16, float16, float32, half, float, got 'fp8'"),
    (["model.data_parallel_size=0"], "model.data_parallel_size must be >= 1, got 0"),
    (["model.data_parallel_size=2", "model.device_ids=[0]"], "model.device_ids must list model.data_parallel_size x"),
    (["output.vllm_log_level=loud"], "output.vllm_log_level must be one of CRITICAL, ERROR, WARNING, INFO, DEBUG"),
])
def test_bad_values_fail_with_one_clear_message(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(overrides)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_missing_config_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config([], "/nonexistent/run.yaml")


def test_dtype_auto_is_float32_only_where_the_cpu_has_no_bfloat16_kernels(monkeypatch):
    import rollout.engine
    from rollout.engine import engine_dtype

    assert load_config([]).model.dtype == "auto"
    assert engine_dtype("float16") == "float16"  # an explicit dtype is passed on as it is
    monkeypatch.setattr(rollout.engine, "cpu_has_bfloat16_kernels", lambda: True)
    assert engine_dtype("auto") == "bfloat16"
    monkeypatch.setattr(rollout.engine, "cpu_has_bfloat16_kernels", lambda: False)  # AVX2 only
    assert engine_dtype("auto") == "float32"


SECTIONS = (ModelConfig, DataConfig, SamplingConfig, PolicyConfig, OutputConfig)


@pytest.mark.parametrize("section", SECTIONS, ids=lambda c: c.__name__)
def test_every_field_has_a_help_text(section):
    assert not section.__doc__.startswith(f"{section.__name__}("), "the section needs a docstring (its description)"
    for f in dataclasses.fields(section):
        assert len(f.metadata.get("help", "")) > 10, f"{section.__name__}.{f.name} has no help text"


def test_help_lists_every_option_with_its_help_text():
    text = describe_options()
    for section, cls in zip(("model", "data", "sampling", "policy", "output"), SECTIONS):
        for f in dataclasses.fields(cls):
            assert f"  {section}.{f.name}" in text
            assert " ".join(f.metadata["help"].split()[:4]) in " ".join(text.split())
    assert "  policy.eps_m=0.05\n" in text and "  model.path (required)\n" in text
    assert f"  data.system_prompt={DEMO_SYSTEM_PROMPT}" in text  # in the demo preset's block


def test_configuration_docs_are_current():
    committed = Path(__file__).parents[1] / "docs" / "configuration.md"
    assert committed.read_text() == configuration_markdown(), (
        "docs/configuration.md is not the schema's: run `python -m rollout.config --docs docs/configuration.md`")


def test_policy_config_travels_as_a_dict_and_comes_back_whole():
    policy = load_config(["policy=sla", "policy.d_sla_ms=40", "policy.forecast_siblings=false"]).policy
    assert PolicyConfig.from_dict(dataclasses.asdict(policy)) == policy
    assert PolicyConfig.from_dict({"name": "memory", "eps_m": 0.1}) == PolicyConfig(name="memory", eps_m=0.1)


@pytest.mark.parametrize("settings, message", [
    ({"name": "forecast", "graph_batch": 512}, "policy: unknown setting graph_batch (PolicyConfig's fields"),
    ({"colour": "red", "size": 3}, "policy: unknown settings colour, size"),
    ({"name": "sla"}, "policy.name=sla needs policy.d_sla_ms > 0"),
    ({"eps_m": 1.5}, "policy.eps_m must be in (0, 1), got 1.5"),
    ({"forecast_min_wave": 1.0}, "policy.forecast_min_wave must be in [0, 1), got 1.0"),
])
def test_policy_config_from_dict_checks_what_it_rebuilds(settings, message):
    with pytest.raises(ConfigError) as info:
        PolicyConfig.from_dict(settings)
    assert message in str(info.value)


def test_vllm_log_level_yields_to_the_users_environment(monkeypatch):
    import logging

    import rollout.engine
    from rollout.engine import set_vllm_log_level

    monkeypatch.setattr(rollout.engine, "_written_log_level", None)
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    vllm_logger = logging.getLogger("vllm")
    before = vllm_logger.level
    try:
        assert set_vllm_log_level("warning") == "WARNING"
        assert vllm_logger.level == logging.WARNING
        assert set_vllm_log_level("INFO") == "INFO"  # a later engine's own setting replaces the one written here
        monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")  # the user's
        assert set_vllm_log_level("WARNING") == "DEBUG"
        assert vllm_logger.level == logging.DEBUG
    finally:
        vllm_logger.setLevel(before)


def test_kv_offloading_stores_generated_tokens_and_is_refused_on_the_cpu(tiny_model, tmp_path, monkeypatch):
    """model.kv_offloading_gib sets up vLLM's OffloadingConnector storing outputs as well as prompts (its default
    stores prompts only, and a preempted request would compute its output again); vLLM's CPU platform has no
    offloading, so there the run stops before anything is written, as it does on a GPU machine asked to pin more
    host memory than it has."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    from rollout.engine import engine_kwargs
    from rollout.generate import main

    with pytest.raises(ConfigError, match="model.kv_offloading_gib must be > 0"):
        load_config(["model.path=/models/mine", "data.source=my.jsonl", "model.kv_offloading_gib=0"])
    assert main([f"model.path={tiny_model}", "data.source=my.jsonl", "model.kv_offloading_gib=1.5",
                 f"output.dir={tmp_path / 'out'}"]) == 2
    assert not (tmp_path / "out").exists()
    cfg = load_config([f"model.path={tiny_model}", "data.source=my.jsonl", "model.kv_offloading_gib=1.5"])
    with pytest.raises(ConfigError, match="this engine runs on the CPU"):
        engine_kwargs(cfg, str(tiny_model), tmp_path / "t", None, tmp_path / "s")
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)  # what a GPU engine is given
    more_than_any_host = load_config([f"model.path={tiny_model}", "data.source=my.jsonl",
                                      "model.kv_offloading_gib=1000000"])
    with pytest.raises(ConfigError, match=r"kv_offloading_gib=1000000.0: vLLM pins that many GiB of host memory .* "
                                          r"this machine has [0-9.]+ GiB available"):
        engine_kwargs(more_than_any_host, str(tiny_model), tmp_path / "t", None, tmp_path / "s")
    kwargs = engine_kwargs(cfg, str(tiny_model), tmp_path / "t", None, tmp_path / "s")
    transfer = EngineArgs(**kwargs).kv_transfer_config
    assert (transfer.kv_connector, transfer.kv_role) == ("OffloadingConnector", "kv_both")
    assert transfer.kv_connector_extra_config == {"cpu_bytes_to_use": 3 << 29, "offload_prompt_only": False}
