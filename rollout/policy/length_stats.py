"""Running statistics of request lengths (prompt, output, their sum, and the sum in KV blocks).

These feed the memory policy's expected demand and its safety buffer. They are updated online as rollouts
finish, can forget old observations (a sliding window or exponential decay) so that drift in response length
across RL iterations is followed, and are saved after a run so the next iteration starts from them.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

FORGETTING_MODES = ("none", "window", "exponential")
STATS_FORMAT_VERSION = 1
HISTOGRAM_BIN_TOKENS = 16  # the length forecast's bin width (policy/forecast.py)


def add_to_bin(bins: list[float], k: int, weight: float) -> None:
    """bins[k] += weight, the list grown (doubled at least) to hold bin k. Plain Python: a finish adds to one bin
    between the model's steps, with numpy's code out of the CPU's caches, where a numpy scalar update costs
    several times as much."""
    if k >= len(bins):
        bins.extend([0.0] * (max(k + 1, 2 * len(bins)) - len(bins)))
    bins[k] += weight


@dataclass
class Moments:
    """Count, mean and variance of a stream of values.

    forgetting="none": exact Welford. "exponential": each older observation's weight is multiplied by `decay`
    on every new one. "window": only the last `window` values count.
    """

    forgetting: str = "none"
    window: int = 2048
    decay: float = 0.999
    count: int = 0
    weight: float = 0.0
    mean: float = 0.0
    m2: float = 0.0
    recent: deque = field(default_factory=deque)

    def __post_init__(self) -> None:
        if self.forgetting not in FORGETTING_MODES:
            raise ValueError(f"forgetting must be one of {FORGETTING_MODES}, got {self.forgetting!r}")
        self.recent = deque(self.recent, maxlen=self.window if self.forgetting == "window" else None)

    def add(self, value: float) -> None:
        self.count += 1
        if self.forgetting == "window":
            self.recent.append(float(value))
            values = np.asarray(self.recent)
            self.weight = float(len(values))
            self.mean = float(values.mean())
            self.m2 = float(((values - self.mean) ** 2).sum())
            return
        if self.forgetting == "exponential":
            self.weight *= self.decay
            self.m2 *= self.decay
        self.weight += 1.0
        delta = value - self.mean
        self.mean += delta / self.weight
        self.m2 += delta * (value - self.mean)

    @property
    def variance(self) -> float:
        """Population variance of the weighted observations (0 with fewer than two)."""
        return self.m2 / self.weight if self.weight > 1.0 else 0.0

    @property
    def std(self) -> float:
        return math.sqrt(max(self.variance, 0.0))

    def merge(self, other: Moments) -> None:
        """Fold another stream into this one (Chan et al.'s pairwise update on weights)."""
        if other.weight == 0:
            return
        if self.forgetting == "window":
            for value in other.recent:
                self.recent.append(value)
            self.count += other.count
            values = np.asarray(self.recent)
            self.weight, self.mean = float(len(values)), float(values.mean())
            self.m2 = float(((values - self.mean) ** 2).sum())
            return
        total = self.weight + other.weight
        delta = other.mean - self.mean
        self.mean += delta * other.weight / total
        self.m2 += other.m2 + delta * delta * self.weight * other.weight / total
        self.weight = total
        self.count += other.count

    def to_dict(self) -> dict:
        out = {"count": self.count, "weight": self.weight, "mean": self.mean, "m2": self.m2}
        if self.forgetting == "window":
            out["recent"] = list(self.recent)
        return out

    def load_dict(self, data: dict) -> None:
        if self.forgetting == "window":
            # A prior saved without its raw values is rebuilt as `weight` copies of its mean, which keeps the mean
            # and drops the spread; saved windows carry their values.
            values = data.get("recent") or [data["mean"]] * int(min(data["weight"], self.window))
            self.recent = deque(values, maxlen=self.window)
            self.count = int(data["count"])
            if values:
                arr = np.asarray(values, dtype=float)
                self.weight, self.mean = float(len(arr)), float(arr.mean())
                self.m2 = float(((arr - self.mean) ** 2).sum())
            return
        self.count = int(data["count"])
        self.weight = float(data["weight"])
        self.mean = float(data["mean"])
        self.m2 = float(data["m2"])


class LengthStats:
    """Length statistics of finished requests, in tokens and in KV blocks of `block_size` tokens."""

    def __init__(self, forgetting: str = "none", window: int = 2048, decay: float = 0.999,
                 block_size: int | None = None) -> None:
        self.forgetting, self.window, self.decay = forgetting, window, decay
        self.block_size = block_size
        self.prompt_tokens = self._moments()
        self.output_tokens = self._moments()
        self.total_tokens = self._moments()
        self.total_blocks = self._moments()
        # Output lengths per HISTOGRAM_BIN_TOKENS bin, weighted as the moments are (the forecast's prior shape);
        # a list (`add_to_bin`). Exponential forgetting scales the new weights up instead of all the old ones
        # down, renormalised before floats underflow.
        self._histogram: list[float] = []
        self._histogram_scale = 1.0  # the weight of a stored 1.0 now

    def _moments(self) -> Moments:
        return Moments(forgetting=self.forgetting, window=self.window, decay=self.decay)

    @property
    def count(self) -> int:
        return self.total_tokens.count

    def observe(self, prompt_tokens: int, output_tokens: int) -> None:
        total = prompt_tokens + output_tokens
        self.prompt_tokens.add(prompt_tokens)
        self.output_tokens.add(output_tokens)
        self.total_tokens.add(total)
        if self.block_size:
            self.total_blocks.add(math.ceil(total / self.block_size))
        if self.forgetting != "window":
            if self.forgetting == "exponential":
                self._histogram_scale *= self.decay
                if self._histogram_scale < 1e-100:
                    self._histogram = [w * self._histogram_scale for w in self._histogram]
                    self._histogram_scale = 1.0
            self._add_to_histogram(output_tokens, 1.0)

    def _add_to_histogram(self, output_tokens: float, weight: float) -> None:
        add_to_bin(self._histogram, int(output_tokens // HISTOGRAM_BIN_TOKENS), weight / self._histogram_scale)

    @property
    def output_histogram(self) -> np.ndarray:
        """Weight of finished requests per output-length bin of HISTOGRAM_BIN_TOKENS tokens."""
        if self.forgetting == "window":
            values = np.asarray(self.output_tokens.recent, dtype=float)
            return np.bincount((values // HISTOGRAM_BIN_TOKENS).astype(np.int64)).astype(float)
        return np.trim_zeros(np.array(self._histogram) * self._histogram_scale, "b")

    def set_block_size(self, block_size: int) -> None:
        """Fix the block size; block moments kept for another block size are dropped."""
        if block_size != self.block_size:
            self.block_size = block_size
            self.total_blocks = self._moments()

    def demand_blocks(self, block_size: int) -> tuple[float, float]:
        """Mean and variance of one request's KV demand (prompt + output) in whole blocks.

        Exact from per-request block counts when every observation was kept for this block size; otherwise from
        token moments, assuming the rounding remainder is uniform: mean + (bs-1)/2 tokens, variance + (bs^2-1)/12.
        """
        if self.block_size == block_size and 0 < self.total_blocks.count == self.total_tokens.count:
            return self.total_blocks.mean, self.total_blocks.variance
        mean = (self.total_tokens.mean + (block_size - 1) / 2) / block_size
        var = (self.total_tokens.variance + (block_size**2 - 1) / 12) / block_size**2
        return mean, var

    def merge(self, other: LengthStats) -> None:
        for name in ("prompt_tokens", "output_tokens", "total_tokens"):
            getattr(self, name).merge(getattr(other, name))
        if self.block_size == other.block_size:
            self.total_blocks.merge(other.total_blocks)
        if self.forgetting != "window":  # a window's histogram comes from its merged values
            for k, weight in enumerate(other.output_histogram):
                if weight:
                    self._add_to_histogram(k * HISTOGRAM_BIN_TOKENS, weight)

    def to_dict(self) -> dict:
        return {
            "format_version": STATS_FORMAT_VERSION,
            "forgetting": self.forgetting, "window": self.window, "decay": self.decay,
            "block_size": self.block_size,
            "prompt_tokens": self.prompt_tokens.to_dict(),
            "output_tokens": self.output_tokens.to_dict(),
            "total_tokens": self.total_tokens.to_dict(),
            "total_blocks": self.total_blocks.to_dict(),
            "output_histogram": {"bin_tokens": HISTOGRAM_BIN_TOKENS,
                                 "weights": [float(w) for w in self.output_histogram]},
            "summary": self.summary(),
        }

    def summary(self) -> dict:
        return {
            "count": self.count,
            "prompt_tokens_mean": self.prompt_tokens.mean, "prompt_tokens_std": self.prompt_tokens.std,
            "output_tokens_mean": self.output_tokens.mean, "output_tokens_std": self.output_tokens.std,
            "total_tokens_mean": self.total_tokens.mean, "total_tokens_std": self.total_tokens.std,
        }

    @classmethod
    def from_dict(cls, data: dict, forgetting: str | None = None, window: int | None = None,
                  decay: float | None = None) -> LengthStats:
        """Rebuild saved statistics; the forgetting settings of the new run win over the saved ones."""
        if data.get("format_version") != STATS_FORMAT_VERSION:
            raise ValueError(f"unsupported length-statistics format {data.get('format_version')!r}")
        stats = cls(forgetting=forgetting or data["forgetting"], window=window or data["window"],
                    decay=decay or data["decay"], block_size=data.get("block_size"))
        for name in ("prompt_tokens", "output_tokens", "total_tokens", "total_blocks"):
            getattr(stats, name).load_dict(data[name])
        histogram = data.get("output_histogram")  # absent in files written before it existed
        if histogram and stats.forgetting != "window":
            if histogram["bin_tokens"] != HISTOGRAM_BIN_TOKENS:
                raise ValueError(f"output_histogram bins of {histogram['bin_tokens']} tokens, "
                                 f"expected {HISTOGRAM_BIN_TOKENS}")
            stats._histogram = [float(w) for w in histogram["weights"]]
        return stats

    def save(self, path: str | os.PathLike) -> None:
        save_json(path, self.to_dict(), indent=1)

    @classmethod
    def load(cls, path: str | os.PathLike, **overrides) -> LengthStats:
        try:
            data = json.loads(Path(path).read_text())
            return cls.from_dict(data, **overrides)
        except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"cannot read length statistics from {path}: {exc}") from exc


def save_json(path: str | os.PathLike, data: dict, indent: int | None = None) -> None:
    """Write atomically: a crash mid-write leaves the previous file intact."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=path.name, suffix=".tmp", delete=False) as tmp:
        json.dump(data, tmp, indent=indent)
        tmp.flush()
        os.fsync(tmp.fileno())
    os.replace(tmp.name, path)


def prompt_key(token_ids) -> str:
    """A prompt's identity across RL iterations: a digest of its token ids."""
    import hashlib

    return hashlib.blake2b(np.asarray(token_ids, dtype=np.int64).tobytes(), digest_size=12).hexdigest()


class PromptLengths:
    """Per-prompt memory of output lengths across passes: each prompt's mean over its latest samples, blended
    with what was known before (`keep` is the weight of the earlier estimate). Prompts seen once predict their
    next pass; unseen prompts get no prediction (NaN) and fall back to the global statistics."""

    def __init__(self, keep: float = 0.3) -> None:
        self.keep = keep
        self.mean: dict[str, float] = {}
        self.last: dict[str, list[int]] = {}  # each prompt's output lengths in its latest pass

    def predict(self, keys: list[str]) -> np.ndarray:
        return np.array([self.mean.get(k, np.nan) for k in keys], dtype=float)

    def update(self, key: str, output_tokens: list[int]) -> None:
        latest = float(np.mean(output_tokens))
        self.last[key] = [int(n) for n in output_tokens]
        old = self.mean.get(key)
        self.mean[key] = latest if old is None else self.keep * old + (1.0 - self.keep) * latest

    def scales(self, keys: list[str]) -> np.ndarray:
        """Predicted length relative to the mean prediction over `keys` (1 where nothing is known)."""
        predicted = self.predict(keys)
        known = ~np.isnan(predicted)
        if not known.any():
            return np.ones(len(keys))
        predicted[~known] = predicted[known].mean()
        return np.maximum(predicted / predicted.mean(), 1e-3)

    def prior(self, keys: list[str], scales: np.ndarray) -> np.ndarray:
        """What the next pass's lengths are expected to look like in the units its scales define: each known
        prompt's latest lengths divided by its scale (each prompt once)."""
        seen: dict[str, float] = {}
        for key, scale in zip(keys, scales):
            if key in self.last:
                seen.setdefault(key, float(scale))
        if not seen:
            return np.array([])
        return np.concatenate([np.asarray(self.last[k], dtype=float) / s for k, s in seen.items()])

    def to_dict(self) -> dict:
        return {"format_version": 1, "keep": self.keep, "mean_output_tokens": self.mean,
                "last_output_tokens": self.last}

    def save(self, path: str | os.PathLike) -> None:
        save_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike, keep: float | None = None) -> PromptLengths:
        try:
            data = json.loads(Path(path).read_text())
            memory = cls(keep if keep is not None else data["keep"])
            memory.mean = {str(k): float(v) for k, v in data["mean_output_tokens"].items()}
            memory.last = {str(k): [int(n) for n in v] for k, v in data.get("last_output_tokens", {}).items()}
            return memory
        except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"cannot read prompt length memory from {path}: {exc}") from exc
