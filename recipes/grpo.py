"""GRPO that really trains, on CPU in minutes: SmolLM2-135M-Instruct (the embedded default model) on
reasoning-gym arithmetic, rewards from reasoning-gym's scorer, group-normalised advantages, a policy-gradient
step in torch (accelerate places it), and the new weights pushed into the running vLLM engine every iteration.

    python recipes/grpo.py [iterations=10] [lr=1e-4] [trainable_layers=12] [key=value ...]
                                                          # other keys: rollout.generate's

One run on 2 CPU cores: reward 0.06 -> 0.57 and accuracy 0.05 -> 0.52 over the 10 iterations, responses
shortening from 20.9 to 9.6 tokens as the model learns to answer with the number alone. CPU runs differ in
their samples (the batch's composition moves them), so another run's trajectory differs.

Per iteration it prints the reward, response lengths, rollout tokens/s, the batch cap and safety buffer (the
length statistics feeding back as lengths drift), and the training loss. Only groups whose samples disagree
carry a gradient (GRPO's advantage is zero for a group with one reward), so those alone are trained on.
"""

from __future__ import annotations

import os
import sys
import time

RECIPE = {"iterations": 10, "lr": 1e-4, "trainable_layers": 12, "micro_batch": 16}
ROLLOUT = [
    "model.path=smollm2-135m-instruct",
    "data.source=reasoning_gym:basic_arithmetic", "data.num_prompts=16", "data.seed=7",
    # Single-digit sums: the 135M model gets ~5% right at the start, enough signal for GRPO to climb.
    "data.dataset_config={min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1, operators: ['+']}",
    "data.system_prompt='Reply with only the final number.'",
    "sampling.n=8", "sampling.max_tokens=24", "sampling.temperature=1.0",
    "model.kv_cache_memory_bytes=134217728", "output.dir=runs/grpo", "output.stats_in=null",
]


def policy_gradient_step(model, optimizer, accelerator, batch, advantages, pad_id, micro_batch) -> float:
    """One step of the GRPO objective without clipping or KL (a single update per rollout, so the sampling
    policy is the current one): minimise -mean over completion tokens of advantage * log pi(token)."""
    import torch

    rows = [i for i in range(len(batch)) if advantages[i] != 0]
    if not rows:
        return 0.0
    tensors = batch.to_tensors(pad_token_id=pad_id)
    tokens = float(tensors["loss_mask"][rows].sum())
    model.train()
    optimizer.zero_grad()
    total = 0.0
    for start in range(0, len(rows), micro_batch):
        pick = rows[start:start + micro_batch]
        ids = tensors["input_ids"][pick].to(accelerator.device)
        mask = tensors["attention_mask"][pick].to(accelerator.device)
        loss_mask = tensors["loss_mask"][pick][:, 1:].to(accelerator.device)
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        adv = torch.tensor(advantages[pick], dtype=torch.float32, device=accelerator.device)[:, None]
        loss = -(adv * logp * loss_mask).sum() / tokens
        accelerator.backward(loss)
        total += float(loss)
    optimizer.step()
    model.eval()
    return total


def main(argv: list[str]) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import numpy as np
    import torch
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from rollout.config import load_config
    from rollout.data import load_prompts
    from rollout.engine import RolloutEngine

    recipe = dict(RECIPE)
    overrides = []
    for item in argv:
        key, _, value = item.partition("=")
        if key in recipe:
            recipe[key] = type(RECIPE[key])(value)
        else:
            overrides.append(item)
    cfg = load_config([*ROLLOUT, *overrides])
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    with RolloutEngine(cfg, cfg.output.dir) as engine:
        prompts, _ = load_prompts(cfg.data, engine.tokenizer, max_prompt_tokens=cfg.model.max_model_len - 1)
        model = AutoModelForCausalLM.from_pretrained(engine.model_path, torch_dtype=torch.float32)
        # Only the top layers and the final norm learn: a CPU step stays in seconds.
        for param in model.parameters():
            param.requires_grad = False
        layers = model.model.layers
        for module in [*layers[len(layers) - recipe["trainable_layers"]:], model.model.norm]:
            for param in module.parameters():
                param.requires_grad = True
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=recipe["lr"])
        model, optimizer = accelerator.prepare(model, optimizer)
        pad_id = engine.tokenizer.pad_token_id or 0
        print("iter  reward  accuracy  len_mean  len_p90  tok/s  cap_mean  L0_mean  groups_trained  "
              "loss     train_s  push_s")
        for iteration in range(recipe["iterations"]):
            batch = engine.rollout(prompts)
            s = batch.summary
            advantages = batch.group_advantages()
            started = time.monotonic()
            loss = policy_gradient_step(model, optimizer, accelerator, batch, advantages, pad_id,
                                        recipe["micro_batch"])
            trained = time.monotonic() - started
            started = time.monotonic()
            engine.update_weights(accelerator.unwrap_model(model).state_dict())
            pushed = time.monotonic() - started
            groups = len(np.unique(batch.group_index[advantages != 0]))
            buffer = (s.get("safety_buffer_tokens") or {}).get("mean")
            buffer = "-" if buffer is None else f"{buffer:.0f}"  # tokens kept free against length uncertainty
            print(f"{iteration:>4}  {s['reward_mean']:>6.3f}  {s['accuracy']:>8.3f}  "
                  f"{s['completion_tokens']['mean']:>8.1f}  {s['completion_tokens']['p90']:>7.0f}  "
                  f"{s['generated_tokens_per_s']:>5.0f}  {s['cap']['mean']:>8.1f}  "
                  f"{buffer!s:>7}  {groups:>14}  {loss:>+.4f}  {trained:>7.1f}  {pushed:>6.1f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
