"""The scheduler's per-step trace (JSON lines, written in the engine process, read back by the driver) and the timer
of the adapter's own time on the engine's path. No vLLM import.

A record's values are kept raw (`StepRecord`) until the step's output arrives (`StepTimer`), and the records go to
the file together every `FLUSH_S` and at the end of a generate() call: a record's dict and JSON, built one at a time
between the model's steps with the interpreter's data out of cache, cost several times more than in a batch.
"""

from __future__ import annotations

import json
import math
import time
from collections import OrderedDict
from pathlib import Path
from typing import NamedTuple

import msgspec
import numpy as np

FLUSH_S = 0.5  # the driver's progress bar follows the file
MAX_IN_FLIGHT = 16  # outputs awaited at once (async scheduling runs one ahead); an output that never came is dropped


class StepRecord(NamedTuple):
    """What a scheduled step's trace record holds before its output arrives."""

    step: int
    start: float  # time.monotonic() at the step's schedule()
    cap: int
    running: int  # after schedule(): admitted requests included
    waiting: int
    kv_usage: float
    preempted: int  # requests preempted by this step's schedule()
    scheduled_tokens: int
    finished: int  # requests finished since the engine started
    recomputed_tokens: int  # computed tokens thrown away by those preemptions
    recovered_tokens: int  # of the tokens earlier preemptions threw away, those its resumed requests found cached
    policy_s: float  # wall time of the policy's answer (or of the check that skipped it)
    policy_cpu_s: float | None  # its CPU time (None: not timed)
    policy_skipped: bool
    describe_cpu_us: float | None  # CPU time describing the requests to the policy (None: not described or timed)
    token_budget: int | None  # the step's token budget where the policy set one
    length_scaled: bool  # some request of the pass carried a predicted length scale
    policy_fields: dict  # the policy's trace_fields() as it last answered
    kv_held: int = 0  # after schedule(): requests holding KV blocks outside the running set (loading them)


class StepDone(NamedTuple):
    """What the step's output adds to its record."""

    latency_s: float
    decode_requests: int
    prefill_tokens: int
    adapter_s: float | None  # the adapter's wall time since the previous record (None: not timed)
    finish_cpu_us: float | None  # the policy's CPU time at this step's finishes (None: not timed)
    draft_tokens: int = 0  # draft tokens vLLM verified in this step (tail speculation)
    accepted_tokens: int = 0  # of those, the ones accepted: the step emitted this many tokens beyond one a decode


def _plain(value):
    """msgspec's hook for what it does not encode itself: numpy scalars (a policy's trace fields)."""
    if isinstance(value, np.generic):
        return value.item()
    raise NotImplementedError(f"cannot write {type(value).__name__} to the trace")


def policy_trace_fields(fields: dict, block_size: int) -> dict:
    """A policy's trace fields as written: floats rounded, NaN as null, the safety buffer also in tokens."""
    out = {}
    for key, value in fields.items():
        if isinstance(value, float):
            value = None if math.isnan(value) else round(value, 3)
        out[key] = value
    if out.get("safety_buffer_blocks") is not None:
        out["safety_buffer_tokens"] = round(out["safety_buffer_blocks"] * block_size, 1)
    return out


def record_dict(record: StepRecord, done: StepDone | None, t0: float) -> dict:
    """A step's trace line. Keys absent where a value is not known, so readers test `in`."""
    out = {
        "step": record.step, "t": round(record.start - t0, 4), "cap": record.cap, "running": record.running,
        "waiting": record.waiting, "kv_usage": round(record.kv_usage, 4), "preempted": record.preempted,
        "scheduled_tokens": record.scheduled_tokens, "finished": record.finished,
        "recomputed_tokens": record.recomputed_tokens, "policy_us": round(record.policy_s * 1e6, 1),
    }
    if record.recovered_tokens:
        out["recovered_tokens"] = record.recovered_tokens
    if record.kv_held:
        out["kv_held"] = record.kv_held
    if record.policy_cpu_s is not None:
        out["policy_cpu_us"] = round(record.policy_cpu_s * 1e6, 1)
    if record.policy_skipped:
        out["policy_skipped"] = True
    if record.describe_cpu_us is not None:  # the per-request arrays were built (their share of policy_cpu_us)
        out["describe_cpu_us"] = round(record.describe_cpu_us, 1)
    if record.token_budget is not None:
        out["token_budget"] = record.token_budget
    if record.length_scaled:
        out["length_scaled"] = True
    out.update(record.policy_fields)
    if done is not None:
        out.update(step_ms=round(done.latency_s * 1e3, 3), decode_requests=done.decode_requests,
                   prefill_tokens=done.prefill_tokens)
        if done.adapter_s is not None:
            out.update(adapter_us=round(done.adapter_s * 1e6, 1), finish_cpu_us=round(done.finish_cpu_us, 1))
        if done.draft_tokens:
            out.update(draft_tokens=done.draft_tokens, accepted_tokens=done.accepted_tokens)
    return out


class TraceWriter:
    """Appends the trace's lines: a start event, then the steps' records in batches."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = path.open("ab", buffering=1 << 16)
        self._encoder = msgspec.json.Encoder(enc_hook=_plain)  # ~1 us a record against json's ~7
        self._pending: list[tuple[StepRecord, StepDone | None]] = []
        self.t0 = self.last_flush = time.monotonic()

    def event(self, fields: dict) -> None:
        self._file.write(json.dumps(fields).encode() + b"\n")
        self._file.flush()

    def add(self, record: StepRecord, done: StepDone | None) -> None:
        self._pending.append((record, done))

    def due(self, now: float) -> bool:
        return now - self.last_flush > FLUSH_S

    def flush(self) -> None:
        t0 = self.t0
        self._file.write(self._encoder.encode_lines([record_dict(r, d, t0) for r, d in self._pending]))
        self._pending.clear()
        self._file.flush()
        self.last_flush = time.monotonic()

    def close(self) -> None:
        self._file.close()


class NoTrace:
    """A TraceWriter that keeps nothing: a scheduler configured without a trace_path (a server's engine would
    otherwise write a record per step for as long as it runs)."""

    path = None

    def event(self, fields: dict) -> None:
        pass

    def add(self, record: StepRecord, done: StepDone | None) -> None:
        pass

    def due(self, now: float) -> bool:
        return False

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class StepTimer:
    """Times each step where it happens and the adapter's own time on the engine's path.

    A step's latency (what the policy's `observe_step` and the trace's `step_ms` get) is the time from the later of
    its schedule() and the previous step's output to its own output: schedule + forward + sampling when synchronous,
    the interval between outputs under async scheduling (step N+1 is scheduled while N runs), which is what a
    streaming client sees, without idle gaps. With `detail` (benchmarks) it also takes the policy's CPU time, the
    description's and the finishes' (a system call each) and the adapter's wall time per step (`adapter_us`);
    without, only wall clocks run."""

    def __init__(self, detail: bool = True) -> None:
        self.detail = detail
        self.cpu = time.thread_time if detail else None
        self.adapter_s = 0.0  # the adapter's wall time since the last record
        self.finish_cpu_us = 0.0  # the policy's CPU time at finishes since the last record
        self._in_flight: OrderedDict[int, tuple[float, StepRecord | None]] = OrderedDict()
        self._last_output_t = 0.0

    def add_adapter(self, seconds: float) -> None:
        self.adapter_s += seconds

    def scheduled(self, output, start: float, record: StepRecord | None) -> list[StepRecord]:
        """A step left schedule(); returns the records of outputs that never came back (kept without timing)."""
        self._in_flight[id(output)] = (start, record)
        lost = []
        while len(self._in_flight) > MAX_IN_FLIGHT:
            _, (_, record) = self._in_flight.popitem(last=False)
            if record is not None:
                lost.append(record)
        return lost

    def done(self, output, now: float) -> tuple[StepRecord | None, float] | None:
        """The step's output arrived: its record (if any) and its latency; None for an output not scheduled here."""
        start, record = self._in_flight.pop(id(output), (None, None))
        if start is None:
            return None
        latency = now - max(start, self._last_output_t)
        self._last_output_t = now
        return record, latency

    def take(self) -> tuple[float | None, float | None]:
        """The adapter's time and the finishes' CPU time since the last record, for the next record; restarts both."""
        adapter_s, finish_cpu_us = self.adapter_s, self.finish_cpu_us
        self.adapter_s = self.finish_cpu_us = 0.0
        return (adapter_s, finish_cpu_us) if self.detail else (None, None)

    def unfinished(self) -> list[StepRecord]:
        """Records of steps whose output has not come (at shutdown)."""
        records = [record for _, record in self._in_flight.values() if record is not None]
        self._in_flight.clear()
        return records
