"""The KV cache of an engine on the CPU where the user sets none (model.kv_cache_memory_bytes null).

vLLM's CPU default gives the cache most of the host's memory: beside a model, a tokenizer and this process, that
nears the machine's limit, and allocating it alone takes a minute. Here the cache gets what the prompt set can
use at once (every sample's prompt and max_tokens in the cache together), at most a quarter of the memory the
host has available beyond the model's weights, and at least one request of model.max_model_len tokens (vLLM
refuses to start with less).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

GIB = 2 ** 30
SHARE_OF_AVAILABLE = 0.25
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


@dataclass
class KVCacheSize:
    bytes: int
    reason: str  # one line for the user: what the size is and why


def kv_bytes_per_token(model_path: str, dtype: str) -> int:
    """Bytes of KV cache a token takes: keys and values of every layer's KV heads, in the engine's dtype (vLLM's
    cache dtype "auto"), from the model folder's config.json."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    config = config.get("text_config", config)  # a multimodal model's language part
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    element = 4 if dtype in ("float32", "float") else 2
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * element


def weights_bytes(model_path: str) -> int:
    """The model's weight files' size: what loading it takes, in the checkpoint's dtype."""
    return sum(f.stat().st_size for f in Path(model_path).iterdir() if f.suffix in WEIGHT_SUFFIXES)


def default_kv_cache(model_path: str, dtype: str, max_model_len: int, demand_tokens: int | None,
                     available_bytes: int) -> KVCacheSize:
    """The cache size for a CPU engine given none. demand_tokens: the tokens the prompt set's samples hold
    together at their longest (None: unknown, the share of memory alone decides)."""
    per_token = kv_bytes_per_token(model_path, dtype)
    # The weights twice: the checkpoint's and the engine's copy while it loads (and converts the dtype).
    spare = max(available_bytes - 2 * weights_bytes(model_path), 0)
    gib = f"{spare / GIB:.1f} GiB"
    sizes = {f"a quarter of the {gib} available beside the model": int(spare * SHARE_OF_AVAILABLE)}
    if demand_tokens is not None:
        sizes[f"what the prompt set's samples hold at once, under a quarter of the {gib} available"] = \
            demand_tokens * per_token
    why, size = min(sizes.items(), key=lambda item: item[1])
    if size < max_model_len * per_token:
        why, size = (f"one request of model.max_model_len={max_model_len} tokens, the least vLLM starts with",
                     max_model_len * per_token)
    size = -(-size // (1 << 20)) << 20  # whole MiB
    return KVCacheSize(size, f"model.kv_cache_memory_bytes is unset: the CPU engine's KV cache gets "
                             f"{size / GIB:.2f} GiB ({why}); set it to choose")


def demand_tokens(prompt_lengths: list[int], n: int, max_tokens: int, max_model_len: int) -> int:
    """The tokens every sample of the set holds at its longest, all at once."""
    return n * sum(min(length + max_tokens, max_model_len) for length in prompt_lengths)
