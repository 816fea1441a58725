"""The KV cache a CPU engine gets where the user sets none: from the model's shape, the prompt set and the memory
available, each bound named in the line the user reads."""

import json

import pytest

from rollout.cpu_memory import GIB, default_kv_cache, demand_tokens, kv_bytes_per_token

MIB = 2 ** 20


@pytest.fixture
def model(tmp_path):
    """SmolLM2-135M's shape: 30 layers, 3 KV heads of 64; 256 MiB of weights."""
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 30, "num_attention_heads": 9,
                                                      "num_key_value_heads": 3, "hidden_size": 576}))
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.truncate(256 * MIB)
    return str(tmp_path)


def test_bytes_per_token_follow_the_shape_and_dtype(model):
    assert kv_bytes_per_token(model, "bfloat16") == 2 * 30 * 3 * 64 * 2
    assert kv_bytes_per_token(model, "float32") == 2 * 30 * 3 * 64 * 4


def test_the_prompt_set_bounds_the_cache_where_it_needs_less(model):
    tokens = demand_tokens([100, 300], n=4, max_tokens=512, max_model_len=2048)
    assert tokens == 4 * (612 + 812)
    size = default_kv_cache(model, "float32", 2048, tokens, available_bytes=20 * GIB)
    per_token = 2 * 30 * 3 * 64 * 4
    assert tokens * per_token <= size.bytes < tokens * per_token + MIB
    assert "what the prompt set's samples hold at once" in size.reason and "19.5 GiB available" in size.reason


def test_a_quarter_of_the_memory_beside_the_model_bounds_a_large_set(model):
    size = default_kv_cache(model, "float32", 2048, demand_tokens([500] * 10_000, 8, 2048, 2048),
                            available_bytes=20 * GIB)
    assert size.bytes == (20 * GIB - 512 * MIB) // 4
    assert size.reason.startswith("model.kv_cache_memory_bytes is unset: the CPU engine's KV cache gets 4.88 GiB "
                                  "(a quarter of the 19.5 GiB available beside the model)")
    assert default_kv_cache(model, "float32", 2048, None, available_bytes=20 * GIB).bytes == size.bytes


def test_one_request_of_the_full_context_is_the_least(model):
    size = default_kv_cache(model, "bfloat16", 8192, demand_tokens([10], 1, 16, 8192), available_bytes=40 * GIB)
    assert size.bytes == 8192 * 2 * 30 * 3 * 64 * 2
    assert "one request of model.max_model_len=8192 tokens" in size.reason
