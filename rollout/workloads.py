"""Rollout workloads with imposed lengths (token-id prompts, max_tokens + ignore_eos).

Each profile gives, per RL iteration, a list of requests: the prompt's token ids, the true output length and
the group (prompt) it belongs to. Everything is seeded. Kind `recorded` takes the lengths from a user's own earlier
`rollout.generate` run, so that a benchmark runs their distribution.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Optional

import numpy as np

from rollout.data import DataError, Prompt

REAL_LENGTHS = Path(__file__).resolve().parent.parent / "configs" / "bench" / "real_lengths.json"


@dataclass
class ProfileConfig:
    name: str = "kv-bound"
    kind: str = "lognormal"  # lognormal | grpo | real | mixture | recorded
    num_prompts: int = 512
    samples_per_prompt: int = 1
    prompt_tokens: int = 128
    median_output: int = 200
    sigma: float = 0.8  # lognormal spread of output lengths (grpo: across prompts)
    sample_sigma: float = 0.35  # grpo: spread of a prompt's samples around its latent length
    max_output: int = 1024
    iterations: int = 1
    drift: float = 1.25  # grpo, mixture, recorded: output lengths grow by this factor per iteration
    # mixture: a share of the prompts (their class fixed per prompt) elicits outputs `long_ratio` times longer,
    # and grows by `long_drift` more per iteration; prompt lengths spread lognormally by `prompt_sigma`.
    long_share: float = 0.15
    long_ratio: float = 10.0
    long_drift: float = 1.0
    # mixture: a third class between the two, `mid_share` of the prompts with outputs `mid_ratio` times longer (0:
    # none).
    mid_share: float = 0.0
    mid_ratio: float = 1.0
    prompt_sigma: float = 0.0
    scale: float = 1.0  # real: multiply measured lengths
    # recorded: a rollout.generate run's samples.jsonl (or its output folder). Its first `num_prompts` prompts, each
    # at its recorded prompt length; each iteration draws `samples_per_prompt` of the prompt's recorded output
    # lengths (the first iteration takes them as recorded where as many were recorded), times drift per iteration.
    lengths_file: Optional[str] = None
    # grpo, mixture: each iteration after the first draws new prompts (their class, latent length and prompt
    # length), as an RL run whose dataset holds more prompts than its iterations take; false, the same prompts every
    # iteration (epochs over a small dataset). lognormal and real draw new prompts every iteration either way.
    new_prompts: bool = False
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None


@dataclass
class Request:
    prompt: Prompt
    output_tokens: int
    group: int


RECORD_FIELDS = ("prompt_id", "prompt_tokens", "completion_tokens")


def recorded_lengths(path: str | None) -> list[tuple[int, list[int]]]:
    """Per prompt of an earlier `rollout.generate` run, in the order its samples first appear: its prompt's length
    in tokens and its samples' output lengths. `path`: the run's samples.jsonl or its output folder."""
    if not path:
        raise DataError("a profile of kind recorded needs lengths_file: a rollout.generate run's samples.jsonl "
                        "or its output folder")
    source = Path(path)
    if source.is_dir():
        source = source / "samples.jsonl"
    try:
        return _read_recorded(str(source.resolve()), source.stat().st_mtime_ns)
    except FileNotFoundError:
        raise DataError(f"{source}: no such file (lengths_file: a rollout.generate run's samples.jsonl or its "
                        "output folder)") from None


@lru_cache(maxsize=4)
def _read_recorded(source: str, mtime_ns: int) -> list[tuple[int, list[int]]]:
    """The file read once per version (a run's samples also hold their texts and tokens: large)."""
    prompts: dict[str, tuple[int, list[int]]] = {}
    with open(source, "rb") as lines:
        for number, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw)
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise DataError(f"{source} line {number}: not a JSON object ({exc})") from None
            if not isinstance(row, dict) or any(key not in row for key in RECORD_FIELDS):
                raise DataError(f"{source} line {number}: a sample needs {', '.join(RECORD_FIELDS)} (the lines "
                                "rollout.generate writes)")
            prompt, output = row["prompt_tokens"], row["completion_tokens"]
            if not (isinstance(prompt, int) and prompt >= 1 and isinstance(output, int) and output >= 0):
                raise DataError(f"{source} line {number}: prompt_tokens must be a positive integer and "
                                f"completion_tokens a non-negative one, got {prompt!r} and {output!r}")
            prompts.setdefault(str(row["prompt_id"]), (prompt, []))[1].append(output)
    if not prompts:
        raise DataError(f"{source}: no samples")
    return list(prompts.values())


def max_prompt_tokens(profile: ProfileConfig) -> int:
    """The longest prompt the profile gives (what the engine's context must hold besides max_output): a mixture's
    spread prompt lengths are cut at 4x their median; a recorded run's longest prompt."""
    if profile.kind == "mixture":
        return 4 * profile.prompt_tokens
    if profile.kind == "recorded":
        return max(prompt for prompt, _ in recorded_lengths(profile.lengths_file)[:profile.num_prompts])
    return int(profile.prompt_tokens * max(profile.scale, 1))


def _prompt(rng: np.random.Generator, name: str, length: int, vocab: int) -> Prompt:
    return Prompt(prompt_id=name, text="", token_ids=rng.integers(10, vocab, max(length, 1)).tolist())


def profile_requests(profile: ProfileConfig, iteration: int, seed: int = 0,
                     vocab_size: int = 1000) -> list[Request]:
    """The requests of one iteration. grpo prompts keep their latent length across iterations, which drifts
    (unless `new_prompts`)."""
    rng = np.random.default_rng([seed, iteration])
    # Per-prompt traits: shared by all iterations, or with new_prompts each iteration's own (the first iteration's
    # the same either way, so that a run with new prompts starts as the one without).
    base = np.random.default_rng([seed, 10_000, iteration] if profile.new_prompts and iteration else [seed, 10_000])
    n, cap = profile.samples_per_prompt, profile.max_output
    requests = []
    if profile.kind == "lognormal":
        lengths = rng.lognormal(np.log(profile.median_output), profile.sigma, profile.num_prompts)
        for i, length in enumerate(lengths):
            prompt = _prompt(rng, f"p{i}", profile.prompt_tokens, vocab_size)
            requests.append(Request(prompt, int(np.clip(length, 1, cap)), i))
    elif profile.kind == "grpo":
        latent = base.lognormal(np.log(profile.median_output), profile.sigma, profile.num_prompts)
        prompts = [_prompt(base, f"p{i}", profile.prompt_tokens, vocab_size) for i in range(profile.num_prompts)]
        growth = profile.drift ** iteration
        for i, prompt in enumerate(prompts):
            samples = rng.lognormal(np.log(latent[i] * growth), profile.sample_sigma, n)
            requests += [Request(prompt, int(np.clip(s, 1, cap)), i) for s in samples]
    elif profile.kind == "real":
        pairs = json.loads(REAL_LENGTHS.read_text())["prompt_and_output_tokens"]
        picks = rng.integers(0, len(pairs), profile.num_prompts)
        for i, pick in enumerate(picks):
            prompt_len, out_len = pairs[pick]
            prompt = _prompt(rng, f"p{i}", int(prompt_len * profile.scale), vocab_size)
            requests.append(Request(prompt, int(np.clip(out_len * profile.scale, 1, cap)), i))
    elif profile.kind == "mixture":
        draw = base.random(profile.num_prompts)
        long = draw < profile.long_share
        mid = ~long & (draw < profile.long_share + profile.mid_share)
        latent = base.lognormal(np.log(profile.median_output), profile.sigma, profile.num_prompts)
        latent *= np.where(long, profile.long_ratio * profile.long_drift ** iteration, 1.0) * profile.drift ** iteration
        latent *= np.where(mid, profile.mid_ratio, 1.0)
        spread = base.lognormal(np.log(profile.prompt_tokens), profile.prompt_sigma, profile.num_prompts)
        prompt_lengths = np.clip(spread, 1, max_prompt_tokens(profile))
        prompts = [_prompt(base, f"p{i}", int(prompt_lengths[i]), vocab_size) for i in range(profile.num_prompts)]
        for i, prompt in enumerate(prompts):
            samples = rng.lognormal(np.log(latent[i]), profile.sample_sigma, n)
            requests += [Request(prompt, int(np.clip(s, 1, cap)), i) for s in samples]
    elif profile.kind == "recorded":
        growth = profile.drift ** iteration
        for i, (prompt_length, outputs) in enumerate(recorded_lengths(profile.lengths_file)[:profile.num_prompts]):
            prompt = _prompt(base, f"p{i}", prompt_length, vocab_size)
            if iteration == 0 and len(outputs) == n:
                samples = np.asarray(outputs, dtype=float)
            else:
                samples = rng.choice(np.asarray(outputs, dtype=float), n) * growth
            requests += [Request(prompt, int(np.clip(round(s), 1, cap)), i) for s in samples]
    else:
        raise ValueError(f"unknown workload kind {profile.kind!r} (lognormal, grpo, real, mixture, recorded)")
    return requests


def lognormal_workload(num_prompts: int, *, prompt_tokens: int = 32, median_output: int = 160, sigma: float = 0.7,
                       max_output: int = 1024, vocab_size: int = 1000, seed: int = 0) -> tuple[list[Prompt], list[int]]:
    """Prompts of random token ids and a lognormal output length per prompt (clipped to [1, max_output])."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(median_output), sigma, num_prompts).astype(int), 1, max_output)
    prompts = [Prompt(prompt_id=f"w{i}", text="", token_ids=rng.integers(10, vocab_size, prompt_tokens).tolist())
               for i in range(num_prompts)]
    return prompts, lengths.tolist()


def longest_first(requests: list[Request]) -> list[Request]:
    """The oracle's submission order: longest true output first, a group's samples together, groups ordered by
    their longest sample (sorting samples alone splits a prompt's samples apart, and each then holds the
    prompt's blocks of its own instead of sharing them, which loses most of the order's gain on grpo-groups:
    docs/results.md)."""
    longest: dict[int, int] = {}
    for r in requests:
        longest[r.group] = max(longest.get(r.group, 0), r.output_tokens)
    return sorted(requests, key=lambda r: (-longest[r.group], r.group, -r.output_tokens))
