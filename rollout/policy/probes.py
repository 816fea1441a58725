"""First-pass probes: where nothing is known of a prompt's lengths (an RL run's first iteration), one sample of
each such prompt is submitted first and its siblings after everything else; as the probes finish, the waiting
siblings are ordered: a group whose probe still runs first (it is long), then by the length its finished samples
ran, longest first. Longest-first order needs lengths before requests run; the probe is what can be had.

With the forecast, a first pass of GRPO groups finishes sooner this way than in submission order; probes without
the reordering finish later (a group's prompt is computed twice). docs/results.md has the numbers.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Sequence


def probe_first_order(groups: Sequence, unknown: Sequence[bool]) -> tuple[list[int], list[int | None]]:
    """Submission order with probes, for requests in the order they would go (`groups`: each one's prompt;
    `unknown`: nothing is known of its prompt's lengths). A prompt of unknown lengths with several requests is
    probed: its first request stays in place, the others go to the end. Returns the new order (positions into
    `groups`) and, in the new order, each request's probe group (a number per probed prompt) or None."""
    size = Counter(groups)
    probed: dict = {}
    first, held = [], []
    for k, (group, is_unknown) in enumerate(zip(groups, unknown)):
        if not is_unknown or size[group] < 2:
            first.append(k)
        elif group in probed:
            held.append(k)
        else:
            probed[group] = len(probed)
            first.append(k)
    order = first + held
    return order, [probed.get(groups[k]) for k in order]


class SiblingOrder:
    """Where a probed group's waiting samples belong: its finished samples' mean length (longest first), and
    ahead of every finished group while none has finished."""

    def __init__(self) -> None:
        self._total: dict[int, float] = {}
        self._count: dict[int, int] = {}
        self.dirty = False  # a group finished its first sample since the last `order`

    def observe(self, group: int, output_tokens: int) -> None:
        if group not in self._count:
            self.dirty = True  # later samples refine a group's place; its first one moves it
        self._total[group] = self._total.get(group, 0.0) + output_tokens
        self._count[group] = self._count.get(group, 0) + 1

    def sort_key(self, group: int) -> float:
        count = self._count.get(group)
        return -math.inf if count is None else -self._total[group] / count

    def order(self, groups: Sequence[int]) -> list[int]:
        """Positions of `groups` (waiting requests' groups, in queue order) in their new order; stable, so a
        group's samples stay together and a probe stays ahead of its group's siblings."""
        self.dirty = False
        key_of = {group: self.sort_key(group) for group in set(groups)}
        return sorted(range(len(groups)), key=list(map(key_of.__getitem__, groups)).__getitem__)

    def forget(self) -> None:
        """A pass ended."""
        self._total.clear()
        self._count.clear()
        self.dirty = False


def reorder_siblings(queue: list, sibling_order: SiblingOrder, groups: list, started: list) -> list:
    """`queue` with its probed (`groups[k]` not None), not yet `started` requests in `sibling_order`'s order, each
    of the others in its place (a preempted request keeps its place at the front)."""
    places = [k for k, (group, began) in enumerate(zip(groups, started)) if group is not None and not began]
    result = list(queue)
    for k, j in zip(places, sibling_order.order([groups[k] for k in places])):
        result[k] = queue[places[j]]
    return result
