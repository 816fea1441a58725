"""Weight updates and sleep/wake on a GPU: the RL loop's engine calls against the installed vLLM.

    python scripts/gpu_weight_push.py OUT_DIR

A small untied Llama starts from a checkpoint (random weights, saved here: vLLM 0.26 refuses to reload a model
loaded with dummy weights); a trainer's state dict (another model of the same shape) is pushed and must change
the greedy outputs; weights that force one token must make every output that
token; sleep(level=2) (weights and KV freed) then wake_up and a push must give the pushed model's outputs again.
Prints one line per check and exits non-zero on the first that fails.
"""
import json
import sys
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, LlamaConfig

from rollout.config import RunConfig, validate
from rollout.engine import RolloutEngine
from rollout.models import forced_token_weights

FORCED_TOKEN = 77


def main(out: Path) -> int:
    import vllm

    shape = out / "model"
    shape.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=4, num_attention_heads=16,
                         num_key_value_heads=8, vocab_size=32000, max_position_embeddings=2048,
                         tie_word_embeddings=False, torch_dtype="bfloat16")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(shape)
    trainer_state = AutoModelForCausalLM.from_config(config).state_dict()
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), {
        "model": {"path": str(shape), "dtype": "bfloat16", "kv_cache_memory_bytes": 2 << 30, "max_model_len": 1024,
                  "engine_kwargs": {"enable_sleep_mode": True, "skip_tokenizer_init": True,
                                    "compilation_config": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}}},
        "data": {"source": "synthetic"}, "sampling": {"n": 1, "temperature": 0.0, "max_tokens": 16, "ignore_eos": True},
        "policy": {"name": "forecast", "b_max": 64}, "output": {"stats_in": None}}))
    validate(cfg)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    checks = {"vllm": vllm.__version__}
    with RolloutEngine(cfg, out / "work") as engine:
        initial = engine.rollout(prompts).completion_ids
        start = time.perf_counter()
        engine.update_weights(trainer_state)
        checks["push_s"] = round(time.perf_counter() - start, 3)
        pushed = engine.rollout(prompts).completion_ids
        checks["pushed_changes_outputs"] = pushed != initial
        engine.update_weights(forced_token_weights(trainer_state, FORCED_TOKEN))
        checks["forced_token_everywhere"] = all(t == FORCED_TOKEN for c in engine.rollout(prompts).completion_ids
                                                for t in c)
        free_awake = torch.cuda.mem_get_info()[0]
        engine.sleep(level=2)
        checks["sleep_freed_gib"] = round((torch.cuda.mem_get_info()[0] - free_awake) / 2**30, 2)
        engine.wake_up()
        engine.update_weights(trainer_state.items())
        checks["wake_and_push_restores"] = engine.rollout(prompts).completion_ids == pushed
    print(json.dumps(checks))
    ok = all(v for k, v in checks.items() if isinstance(v, bool))
    print("all checks passed" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(Path(sys.argv[1])))
