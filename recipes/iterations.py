"""Several rollout iterations on one engine, as a trainer's loop would call it (no training step here: the
GRPO recipe adds that). Shows the length statistics carrying over: from the second iteration on, the first
safety buffer and cap come from what earlier iterations saw, not from a cold start.

    python recipes/iterations.py [key=value ...]       # same overrides as rollout.generate
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str]) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from rollout.config import load_config
    from rollout.data import load_prompts
    from rollout.engine import RolloutEngine

    # A small KV cache (128 MiB, ~5.8k tokens of SmolLM2) so that memory, and the statistics, decide the cap.
    cfg = load_config(["data.num_prompts=16", "sampling.max_tokens=256", "model.kv_cache_memory_bytes=134217728",
                       "output.dir=runs/iterations", "output.stats_in=null", *argv])
    with RolloutEngine(cfg, cfg.output.dir) as engine:
        prompts, _ = load_prompts(cfg.data, engine.tokenizer, max_prompt_tokens=cfg.model.max_model_len - 1)
        print("iter  tok/s   preempt  len_mean  len_p90  cap_first  cap_mean  L0_first(tokens)  reward")
        for iteration in range(3):
            s = engine.generate(prompts, progress=False).summary
            first = s["series"][0]
            buffer = (s.get("safety_buffer_tokens") or {}).get("first")
            print(f"{iteration:>4}  {s['generated_tokens_per_s']:>6.0f}  {s['preemptions']:>7}  "
                  f"{s['completion_tokens']['mean']:>8.1f}  {s['completion_tokens']['p90']:>7.0f}  "
                  f"{first['cap']:>9}  {s['cap']['mean']:>8.1f}  {buffer!s:>16}  "
                  f"{s.get('reward_mean', float('nan')):.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
