"""Synthetic workloads with imposed lengths (token-id prompts, max_tokens + ignore_eos), for tests and benchmarks."""

from __future__ import annotations

import numpy as np

from rollout.data import Prompt


def lognormal_workload(num_prompts: int, *, prompt_tokens: int = 32, median_output: int = 160, sigma: float = 0.7,
                       max_output: int = 1024, vocab_size: int = 1000, seed: int = 0) -> tuple[list[Prompt], list[int]]:
    """Prompts of random token ids and a lognormal output length per prompt (clipped to [1, max_output])."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(median_output), sigma, num_prompts).astype(int), 1, max_output)
    prompts = [Prompt(prompt_id=f"w{i}", text="", token_ids=rng.integers(10, vocab_size, prompt_tokens).tolist())
               for i in range(num_prompts)]
    return prompts, lengths.tolist()
