"""Whether running more requests than the engine's largest CUDA-graph batch makes more tokens per second.

vLLM replays decode steps as CUDA graphs up to a batch size (512 unless configured); a larger decode batch runs
eagerly, every kernel launched from the host. On an H100 host with the 8B shape such a step took 34-65 ms at
513-1024 requests against 25 ms at 512 (docs/benchmarks.md, stop 16), so 1024 requests made fewer tokens per
second than 512, by an amount that differed between two sessions on the same kind of machine. So it is
measured: decode-only steps near the graph's batch and above it, one small probe above it when none ran there.

A step's time is taken as a line in its batch, the same slope (each request's own work) above the graph's batch
and below, a higher intercept above. Each line is fitted to the recent steps (least squares) once they span
enough batch sizes; the eager one is read at `max_cap`. Until then the slope is taken as half the graph step's
time per request (the H100's fits put it at ~60%): read flat, a probe just above the graph's batch made
1024 requests look worth it in the simulator when they were not, and the wait for the running batch to come
back down cost more than the graph gains; read at the whole time per request, a model whose step is mostly
fixed cost stayed at the graph's batch, 30% below what a full one made. The cap is held at the graph's batch
when `max_cap` requests would make fewer tokens a second than `graph_batch` requests in the graph's step.
"""

from __future__ import annotations

import statistics
from collections import deque


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

    def observe(self, latency_s: float, decode_requests: int, prefill_tokens: int) -> int:
        """One finished step; returns the cap limit from now on."""
        if prefill_tokens or not decode_requests:  # prompt tokens make a step's time another matter
            return self.limit
        if decode_requests > self.graph_batch:
            self.eager_steps.append((decode_requests, latency_s))
        elif 2 * decode_requests >= self.graph_batch:
            self.graph_steps.append((decode_requests, latency_s))
            if 8 * decode_requests >= 7 * self.graph_batch:
                self.near_graph.append(latency_s)
        else:
            return self.limit
        if len(self.near_graph) < self.samples:  # the graph's best is not known: stay there
            self.limit = self.graph_batch
        elif len(self.eager_steps) < self.samples:
            self.limit = self.graph_batch + self.probe
        else:
            per_request, graph_step = self.graph_step_s()
            eager_step = self.eager_step_s(per_request)
            self.limit = self.graph_batch if self.max_cap / eager_step < self.graph_batch / graph_step else self.max_cap
        return self.limit

    def graph_step_s(self) -> tuple[float, float]:
        """The time a request adds to a step, and a decode step of `graph_batch` requests in the graph."""
        line = _line(self.graph_steps, self.graph_batch / 4)
        if line is not None:
            slope, intercept = line
            return slope, intercept + slope * self.graph_batch
        step = statistics.median(self.near_graph)
        return step / self.graph_batch / 2, step

    def eager_step_s(self, per_request_s: float) -> float:
        """A decode step of `max_cap` requests, from the eager steps seen (`per_request_s`: the slope to take
        when they span too few batch sizes to tell one)."""
        line = _line(self.eager_steps, self.graph_batch / 8)
        if line is not None:
            slope, intercept = line
            return intercept + slope * self.max_cap
        batches, latencies = zip(*self.eager_steps)
        return statistics.median(latencies) + per_request_s * (self.max_cap - statistics.median(batches))


def _line(steps, spread: float) -> tuple[float, float] | None:
    """Least-squares slope (at least 0) and intercept of latency on batch; None when the batches span < spread."""
    batches, latencies = zip(*steps)
    if max(batches) - min(batches) < spread:
        return None
    slope, _ = statistics.linear_regression(batches, latencies)
    slope = max(slope, 0.0)
    return slope, statistics.fmean(latencies) - slope * statistics.fmean(batches)
