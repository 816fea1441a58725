import pytest

from rollout.config import ConfigError, load_config


def test_defaults_and_dotlist_overrides():
    cfg = load_config(["policy.eps_m=0.01", "sampling.n=8", "policy.name=memory-clt"])
    assert cfg.policy.eps_m == 0.01
    assert cfg.sampling.n == 8
    assert cfg.policy.name == "memory-clt"
    assert cfg.model.path == "smollm2-135m-instruct"  # the embedded default


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
    (["model.data_parallel_size=2", "model.device_ids=[0]"], "model.device_ids must list a device for every"),
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
