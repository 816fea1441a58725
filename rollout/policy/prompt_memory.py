"""What a scheduler learns of prompts across passes by itself, from the requests that reach it: each prompt's
output lengths (keyed by its token ids, `prompt_key`), the predicted length scales and longest-first order they
give, and first-pass probes for prompts never seen, computed here as requests stream in, whoever drives the
engine (our driver, vllm serve, an RL stack). The driver only reads the saved memory back for its submission
order (`rollout.engine.submission_plan`); the simulator runs these same objects.

Invariants: a pass opens when a request reaches an idle engine and closes when its last request ends; the scales
of one pass are relative to one reference, fixed when it opens (the mean over the remembered prompts), so rows of
a pass compare; the memory changes only when a pass closes.
"""

from __future__ import annotations

import os
from typing import NamedTuple, Sequence

import numpy as np

from rollout.policy.length_stats import PromptLengths


class Arrival(NamedTuple):
    scale: float  # predicted output length relative to the pass's reference (1: nothing known)
    probe_group: int | None  # a probed prompt's number in the pass (None: known, or a prompt of one request)
    held: bool  # a probed prompt's sample after its probe: it waits behind every other request
    # This arrival made its prompt a probed group: the prompt's first request (already waiting, or running) is its
    # probe, and `first` is what was handed in with it (`PromptMemory.arrive`).
    probes_first: bool = False
    first: object = None


class PromptMemory:
    """Per-prompt output lengths across passes, with the order and probes of a pass (see the module's text).
    `order`: "longest_first" or "fifo" (policy.order); `probe_first`: policy.probe_first."""

    def __init__(self, lengths: PromptLengths | None = None, order: str = "longest_first",
                 probe_first: bool = True) -> None:
        self.lengths = lengths if lengths is not None else PromptLengths()
        self.order = order
        self.probe_first = probe_first and order == "longest_first"
        self.passes = 0  # passes closed
        self._reference = np.nan
        self._pass: dict[str, list[int]] = {}  # this pass's finished output lengths per prompt
        self._probes: dict[str, int] = {}  # this pass's probed prompts -> their probe group
        self._counts: dict[str, int] = {}  # this pass's requests per prompt
        self._first: dict[str, object] = {}  # this pass's prompts never seen, of one request so far -> its handle

    def open_pass(self) -> np.ndarray | None:
        """A pass begins. Returns the policy's prior for it (`Policy.start_pass`): the latest lengths of every
        remembered prompt in this pass's units (None where nothing is remembered)."""
        self._pass.clear()
        self._probes.clear()
        self._counts.clear()
        self._first.clear()
        known = self.lengths.mean
        self._reference = float(np.mean(list(known.values()))) if known else np.nan
        if self.order != "longest_first" or not self.lengths.last:
            return None
        keys = list(self.lengths.last)
        return self.lengths.prior(keys, np.array([self.scale(k) for k in keys]))

    def scale(self, key: str) -> float:
        """A prompt's predicted output length relative to this pass's reference (1: nothing known)."""
        mean = self.lengths.mean.get(key)
        if mean is None or not self._reference > 0:
            return 1.0
        return max(mean / self._reference, 1e-3)

    def arrive(self, key: str, handle: object = None) -> Arrival:
        """A request of prompt `key` arrived (`handle`: the caller's for it). vLLM hands a prompt's n samples over
        as requests of one sample each, one after another: a prompt never seen becomes a probed group when its
        second request arrives, and its first is the probe (`Arrival.probes_first`, its handle `Arrival.first`)."""
        count = self._counts[key] = self._counts.get(key, 0) + 1
        if self.order != "longest_first":
            return Arrival(1.0, None, False)
        if key in self.lengths.mean or not self.probe_first:
            return Arrival(self.scale(key), None, False)
        if count == 1:
            self._first[key] = handle
            return Arrival(1.0, None, False)
        probe = self._probes.get(key)
        if probe is None:
            probe = self._probes[key] = len(self._probes)
            return Arrival(1.0, probe, True, probes_first=True, first=self._first.pop(key, None))
        return Arrival(1.0, probe, True)

    def finished(self, key: str, output_tokens: int) -> None:
        """A request of this pass ended with `output_tokens` (not aborted)."""
        self._pass.setdefault(key, []).append(int(output_tokens))

    def close_pass(self) -> dict[str, list[int]]:
        """The pass ended: each of its prompts' lengths update the memory. Returns those lengths (prompt key ->
        the pass's output lengths), for `update` on another copy of the memory."""
        updates = dict(self._pass)
        self.update(updates)
        self._pass.clear()
        self.passes += 1
        return updates

    def update(self, updates: dict[str, list[int]]) -> None:
        for key, lengths in updates.items():
            self.lengths.update(key, lengths)

    def save(self, path: str | os.PathLike) -> None:
        self.lengths.save(path)

    @classmethod
    def load(cls, path: str | os.PathLike, order: str = "longest_first", probe_first: bool = True) -> PromptMemory:
        """The memory saved at `path`; an empty one where no file is there yet. A file that is there but cannot
        be read raises ValueError (it names the path)."""
        lengths = PromptLengths.load(path) if os.path.exists(path) else PromptLengths()
        return cls(lengths, order, probe_first)


def pass_arrivals(memory: PromptMemory, keys: Sequence[str]) -> list[Arrival]:
    """What the scheduler (rollout.vllm.prompt_store) ends up knowing of each request where requests of these prompts
    arrive in this order: a probed prompt's first request gets its probe group when its second arrives. The
    simulator's view of a pass, which must match the adapter's."""
    arrivals = []
    for k, key in enumerate(keys):
        arrival = memory.arrive(key, k)
        arrivals.append(arrival)
        if arrival.probes_first:
            arrivals[arrival.first] = arrivals[arrival.first]._replace(probe_group=arrival.probe_group)
    return arrivals


def arrival_order(fixed: Sequence[bool], held: Sequence[bool], scales: Sequence[float]) -> list[int]:
    """The waiting queue's new order (positions into it) once requests arrived: the `fixed` ones keep their
    places; the others fill the remaining places longest predicted first, a probed prompt's held samples after
    every other, ties in queue order. Fixed are the requests that already ran (preempted) and the held samples
    that were waiting before: a held sample waits for its own probe, not for the probes of prompts that arrive
    after it (as a data-parallel engine's queue is refilled), so the later arrivals queue behind it."""
    places = [k for k, keep in enumerate(fixed) if not keep]
    ordered = sorted(places, key=lambda k: (held[k], -scales[k]))
    result = list(range(len(fixed)))
    for place, k in zip(places, ordered):
        result[place] = k
    return result
