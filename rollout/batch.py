"""What a trainer takes from a rollout pass: one row per sample, token ids, masks, logprobs, rewards, groups."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class RolloutBatch:
    """Samples in (prompt, sample) order; `group_index[i]` is the prompt sample i came from (GRPO groups)."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    group_index: np.ndarray
    sample_index: np.ndarray
    finish_reasons: list[str]
    logprobs: list[list[float]] | None = None  # per completion token, when sampling.logprobs was set
    rewards: np.ndarray | None = None  # where the prompt set has a scorer
    summary: dict = field(default_factory=dict)  # the pass's throughput summary

    @classmethod
    def from_records(cls, records: list[dict], summary: dict | None = None) -> RolloutBatch:
        records = sorted(records, key=lambda r: (r["group_index"], r["sample_index"]))
        has_logprobs = bool(records) and all("logprobs" in r for r in records)
        has_rewards = bool(records) and all("reward" in r for r in records)
        return cls(
            prompt_ids=[list(r["prompt_token_ids"]) for r in records],
            completion_ids=[list(r["completion_token_ids"]) for r in records],
            group_index=np.array([r["group_index"] for r in records], dtype=np.int64),
            sample_index=np.array([r["sample_index"] for r in records], dtype=np.int64),
            finish_reasons=[str(r["finish_reason"]) for r in records],
            logprobs=[list(r["logprobs"]) for r in records] if has_logprobs else None,
            rewards=np.array([r["reward"] for r in records], dtype=float) if has_rewards else None,
            summary=summary or {})

    def __len__(self) -> int:
        return len(self.completion_ids)

    @property
    def prompt_lengths(self) -> np.ndarray:
        return np.array([len(p) for p in self.prompt_ids], dtype=np.int64)

    @property
    def completion_lengths(self) -> np.ndarray:
        return np.array([len(c) for c in self.completion_ids], dtype=np.int64)

    def group_advantages(self, eps: float = 1e-6) -> np.ndarray:
        """GRPO's advantage: each reward minus its group's mean, over the group's standard deviation."""
        if self.rewards is None:
            raise ValueError("no rewards: the prompt set has no scorer")
        advantages = np.zeros(len(self))
        for group in np.unique(self.group_index):
            members = self.group_index == group
            r = self.rewards[members]
            advantages[members] = (r - r.mean()) / (r.std() + eps)
        return advantages

    def to_tensors(self, pad_token_id: int = 0, device=None) -> dict:
        """Right-padded torch tensors: input_ids (prompt + completion), attention_mask, loss_mask (1 on
        completion tokens), and old_logprobs aligned with input_ids (0 outside the completion) when present."""
        import torch

        width = max((len(p) + len(c) for p, c in zip(self.prompt_ids, self.completion_ids)), default=0)
        rows = len(self)
        input_ids = torch.full((rows, width), pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((rows, width), dtype=torch.long)
        loss_mask = torch.zeros((rows, width), dtype=torch.float32)
        old_logprobs = torch.zeros((rows, width), dtype=torch.float32) if self.logprobs is not None else None
        for i, (prompt, completion) in enumerate(zip(self.prompt_ids, self.completion_ids)):
            p, c = len(prompt), len(completion)
            input_ids[i, :p + c] = torch.tensor(prompt + completion, dtype=torch.long)
            attention_mask[i, :p + c] = 1
            loss_mask[i, p:p + c] = 1.0
            if old_logprobs is not None:
                old_logprobs[i, p:p + c] = torch.tensor(self.logprobs[i], dtype=torch.float32)
        out = {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}
        if old_logprobs is not None:
            out["old_logprobs"] = old_logprobs
        return {k: v.to(device) for k, v in out.items()} if device is not None else out
