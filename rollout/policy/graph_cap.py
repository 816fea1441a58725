"""Whether running more requests than the engine's largest CUDA-graph batch makes more tokens per second.

vLLM replays decode steps as CUDA graphs up to a batch size (512 unless configured); a larger decode batch runs
eagerly, every kernel launched from the host. Whether that pays differs by machine: in tokens a second an eager
step of twice the graph's batch runs from as fast as the graph to markedly slower (docs/results.md). So it is
measured: decode-only steps near the graph's batch and above it, one small probe above it when none ran there.
Off by default (`policy.graph_cap`): it ties on the GPUs measured.

A step's time is taken as a line in its batch, fitted (least squares) to the recent steps below the graph's batch
and, apart, above it once they span enough batch sizes; the eager line is read at `max_cap`. From the probe
alone, an eager step of `max_cap` requests is taken as the longer of the probe's step (the host launching
kernels one by one, which the GPU's work overlaps: an eager step just past the graph takes about as long as
one of twice its batch) and the graph's line read at `max_cap`, all of the graph's step counted per request
while its steps span too few batch sizes for a line. The cap is held at the graph's batch, for good, when it
makes `GRAPH_GAIN` times the tokens a second of `max_cap` requests.
"""

from __future__ import annotations

import statistics
from collections import deque

# How many times the larger batch's tokens a second the graph's must make to hold the cap there. A larger batch
# also starts the queue's requests sooner, which shortens the drain tail (a graph a few percent faster gains
# far less over a pass), and the probe's estimate of a large eager step runs high (docs/results.md).
GRAPH_GAIN = 1.15


class GraphCap:
    """The largest cap worth running: `graph_batch`, one probe above it, or `max_cap`."""

    def __init__(self, graph_batch: int, max_cap: int, samples: int = 8) -> None:
        if not 0 < graph_batch < max_cap:
            raise ValueError(f"need 0 < graph_batch < max_cap, got {graph_batch}, {max_cap}")
        self.graph_batch = graph_batch
        self.max_cap = max_cap
        self.samples = samples
        # Small: every step above the graph's batch costs its eager time, until finishes bring the batch back.
        self.probe = max(1, graph_batch // 64)
        # Recent decode-only steps, (batch, latency): from half the graph's batch up to it, and above it.
        self.graph_steps: deque[tuple[int, float]] = deque(maxlen=4 * samples)
        self.eager_steps: deque[tuple[int, float]] = deque(maxlen=4 * samples)
        self.near_graph: deque[float] = deque(maxlen=4 * samples)  # latencies in the top eighth below it
        self.limit = graph_batch
        self.held = False  # decided: the graph's batch it is
        self.eager_since_decision = 0  # eager steps since the lines were last fitted

    def observe(self, latency_s: float, decode_requests: int, prefill_tokens: int) -> int:
        """One finished step; returns the cap limit from now on."""
        if prefill_tokens or not decode_requests:  # prompt tokens make a step's time another matter
            return self.limit
        if decode_requests > self.graph_batch:
            self.eager_steps.append((decode_requests, latency_s))
            self.eager_since_decision += 1
        elif 2 * decode_requests >= self.graph_batch:
            self.graph_steps.append((decode_requests, latency_s))
            if 8 * decode_requests >= 7 * self.graph_batch:
                self.near_graph.append(latency_s)
        else:
            return self.limit
        if self.held:
            return self.limit
        if len(self.near_graph) < self.samples:  # the graph's best is not known: stay there
            self.limit = self.graph_batch
        elif len(self.eager_steps) < self.samples:
            self.limit = self.graph_batch + self.probe
        elif self.limit == self.max_cap and self.eager_since_decision < self.samples:
            pass  # decided for max_cap: fitted again once `samples` more eager steps came, not at each one
        else:
            self.eager_since_decision = 0
            slope, intercept = self.graph_line()
            graph_step = intercept + slope * self.graph_batch
            gain = (self.graph_batch / graph_step) / (self.max_cap / self.eager_step_s(slope, intercept))
            # Held for good: the steps grow slower as contexts lengthen, so graph steps read later against the
            # eager steps of before would turn the answer back and forth (each turn a wait for the batch to come
            # down).
            self.held = gain > GRAPH_GAIN
            self.limit = self.graph_batch if self.held else self.max_cap
        return self.limit

    def graph_line(self) -> tuple[float, float]:
        """Slope and intercept of the graph's step time in its batch; all of it per request (the most the
        GPU's own work at a larger batch could be) while the steps span too few batch sizes to tell."""
        line = _line(self.graph_steps, self.graph_batch / 4)
        if line is not None:
            return line
        return statistics.median(self.near_graph) / self.graph_batch, 0.0

    def eager_step_s(self, graph_slope: float, graph_intercept: float) -> float:
        """A decode step of `max_cap` requests, from the eager steps seen. While they span too few batch sizes
        for a line (the probe alone): the longer of the probe's step (the host launching kernels one by one,
        which the GPU's work overlaps) and the graph's line read at `max_cap` (the GPU's work)."""
        line = _line(self.eager_steps, self.graph_batch / 8)
        if line is not None:
            slope, intercept = line
            return intercept + slope * self.max_cap
        return max(statistics.median(t for _, t in self.eager_steps), graph_intercept + graph_slope * self.max_cap)


def _line(steps, spread: float) -> tuple[float, float] | None:
    """Least-squares slope (at least 0) and intercept of latency on batch; None when the batches span < spread."""
    batches, latencies = zip(*steps)
    if max(batches) - min(batches) < spread:
        return None
    slope, _ = statistics.linear_regression(batches, latencies)
    slope = max(slope, 0.0)
    return slope, statistics.fmean(latencies) - slope * statistics.fmean(batches)
