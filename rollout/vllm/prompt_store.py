"""What the scheduler learns of prompts by itself, from the requests that reach it, whoever drives the engine
(rollout.policy.prompt_memory), kept in its `state_dir` and used to put arriving requests in order. Reads vLLM
Request objects and queues, imports nothing of vLLM.

Files in the `state_dir` (settings): what the scheduler learned, saved as each pass ends and at shutdown, read back
when an engine starts. The prompts' file is read again when a pass opens if someone else rewrote it since
(rollout.parallel merges its engines' memories so), and several engines may share it (verl gives all of its
servers one configuration): each adds its pass's prompts to what the file holds, under its lock. The statistics'
file is the last saver's.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from operator import attrgetter
from pathlib import Path

from filelock import FileLock, Timeout

from rollout.policy.length_stats import PromptLengths, prompt_key
from rollout.policy.probes import SiblingOrder, reorder_siblings
from rollout.policy.prompt_memory import PromptMemory, arrival_order
from rollout.vllm.pass_state import started

STATE_STATS_FILE = "length_stats.json"
STATE_PROMPTS_FILE = "prompt_lengths.json"
MEMORY_LOCK_TIMEOUT_S = 30  # a save holds the lock for milliseconds: longer is a writer that hangs

logger = logging.getLogger("rollout")

# Kept on each request when it arrives: its probe group, predicted length scale, whether it is a probed prompt's
# held sample, and whether it was in the waiting queue when the queue was last put in order.
probe_of = attrgetter("_rollout_probe")
scale_of = attrgetter("_rollout_scale")
held_of = attrgetter("_rollout_held")
placed_of = attrgetter("_rollout_placed")


def arrive_unknown(request) -> None:
    """A request's marks where the scheduler keeps no memory of prompts (`learn_prompts` false)."""
    request._rollout_placed = False
    request._rollout_probe, request._rollout_scale, request._rollout_held = None, 1.0, False


def is_reorderable(queue) -> bool:
    """Whether the adapter may put `queue` in its own order: FCFS deques; vLLM's priority heap keeps its own."""
    return isinstance(queue, deque)


def reorder_probed_siblings(queue, order: SiblingOrder) -> None:
    """A probed group's first sample finished: its waiting siblings move to their place (longest first)."""
    if not is_reorderable(queue):
        order.dirty = False
        return
    items = list(queue)
    reordered = reorder_siblings(items, order, list(map(probe_of, items)), started(items))
    queue.clear()
    queue.extend(reordered)


class PromptStore:
    """The scheduler's PromptMemory, its file (`path`, None: kept in this engine only), and the order it gives the
    waiting queue."""

    def __init__(self, memory: PromptMemory, path: Path | None) -> None:
        self.memory = memory
        self.path = path
        self._stamp = None  # the file as this scheduler last read or wrote it
        self.arrived = False  # requests arrived since the queue was last put in order
        self.reload()

    def arrive(self, request) -> str:
        """A request's scale and probe group from the memory of its prompt, kept on it; returns its prompt's key."""
        key = prompt_key(request.prompt_token_ids)
        arrival = self.memory.arrive(key, request)
        request._rollout_placed = False
        request._rollout_scale, request._rollout_probe, request._rollout_held = (
            arrival.scale, arrival.probe_group, arrival.held)
        if arrival.probes_first:  # the prompt's first request, waiting or running, is its probe
            arrival.first._rollout_probe = arrival.probe_group
        self.arrived = True
        return key

    def put_arrivals_in_order(self, queue) -> None:
        """`queue` (vLLM's waiting queue) in the memory's order (`arrival_order`: longest predicted first, probed
        prompts' held samples last), once requests arrived since it last was; preempted requests and the held
        samples that were already waiting keep their places."""
        self.arrived = False
        if not is_reorderable(queue) or self.memory.order != "longest_first":
            return
        items = list(queue)
        held = list(map(held_of, items))
        fixed = [began or (h and placed) for began, h, placed in zip(started(items), held, map(placed_of, items))]
        order = arrival_order(fixed, held, list(map(scale_of, items)))
        for request in items:
            request._rollout_placed = True
        if order != list(range(len(items))):
            queue.clear()
            queue.extend(items[k] for k in order)

    def _file_stamp(self):
        try:
            stat = os.stat(self.path)
        except (OSError, TypeError):
            return None
        return stat.st_ino, stat.st_mtime_ns, stat.st_size

    def reload(self) -> None:
        """The file read in, where it changed since this scheduler last read or wrote it (at the start: a restart;
        between passes: another's merge). A file that cannot be read raises ValueError naming it."""
        stamp = self._file_stamp()
        if stamp is not None and stamp != self._stamp:
            self.memory.lengths = PromptLengths.load(self.path)
            self._stamp = stamp

    def save(self, updates: dict[str, list[int]] | None = None) -> None:
        """The memory written to its file, under the file's lock. With a closed pass's `updates`: where another
        engine wrote the file since this one last read or wrote it, the updates go onto what the file holds, so
        that engines sharing a state_dir lose none of each other's prompts. Without: written only where nobody
        else wrote since (theirs is the newer)."""
        if self.path is None:
            return
        try:
            with FileLock(f"{self.path}.lock", timeout=MEMORY_LOCK_TIMEOUT_S):
                stamp = self._file_stamp()
                if stamp is not None and stamp != self._stamp:
                    if updates is None:
                        return
                    self.memory.lengths = PromptLengths.load(self.path)
                    self.memory.update(updates)
                self.memory.save(self.path)
                self._stamp = self._file_stamp()
        except Timeout:
            logger.warning("%s stayed locked for %d s: this pass's prompt lengths are kept in this engine and "
                           "saved with its next pass", self.path, MEMORY_LOCK_TIMEOUT_S)
