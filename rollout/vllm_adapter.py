"""The one place that touches vLLM's scheduler: a subclass that sets the admission cap every step.

vLLM builds the scheduler inside the engine-core process from `scheduler_cls="rollout.vllm_adapter.<Class>"`;
our settings reach it through `additional_config={"rollout": {...}}` (see `adapter_settings`). Since the
driver cannot reach that process, the scheduler writes a per-step trace (JSON lines) and the length statistics
to files the driver reads back.

The cap knob depends on the installed vLLM: 0.32 has `max_num_active_reqs` (admission only, safe to move
between steps); 0.26 has only `max_num_running_reqs`, which it also asserts against the running count, so the
cap is never set below that. `max_num_seqs` stays at B_max because the model runner sizes buffers from it.
"""

from __future__ import annotations

import itertools
import json
import math
import time

import numpy as np
from pathlib import Path

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from rollout.policy import FallbackPolicy, LengthStats, StepState, make_policy

SETTINGS_KEY = "rollout"


def adapter_settings(policy: dict, trace_path: str, stats_in: str | None, stats_out: str | None,
                     stats_options: dict | None = None) -> dict:
    """The additional_config entry that configures the scheduler in the engine process."""
    return {SETTINGS_KEY: {"policy": policy, "trace_path": trace_path, "stats_in": stats_in,
                           "stats_out": stats_out, "stats_options": stats_options or {}}}


class _DynamicBatchMixin:
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        settings = (self.vllm_config.additional_config or {}).get(SETTINGS_KEY)
        if settings is None:
            raise ValueError(f"{type(self).__name__} needs additional_config[{SETTINGS_KEY!r}]")
        options = settings.get("stats_options") or {}
        if settings.get("stats_in"):
            stats = LengthStats.load(settings["stats_in"], **options)
        else:
            stats = LengthStats(**options)
        self.max_cap = self.scheduler_config.max_num_seqs
        static_cap = int(settings["policy"].get("static_cap") or self.max_cap)
        self.batch_policy = FallbackPolicy(make_policy(settings["policy"], stats), min(static_cap, self.max_cap))
        self._cap_attr = "max_num_active_reqs" if hasattr(self, "max_num_active_reqs") else "max_num_running_reqs"
        self.kv_capacity_blocks = self.kv_cache_manager.block_pool.num_gpu_blocks - 1  # block 0 is the null block
        self.stats_out = settings.get("stats_out")
        trace_path = Path(settings["trace_path"])
        trace_path.parent.mkdir(parents=True, exist_ok=True)
        self._trace = trace_path.open("a", buffering=1 << 16)
        self._trace.write(json.dumps({"event": "start", "policy": self.batch_policy.name,
                                      "kv_capacity_blocks": self.kv_capacity_blocks,
                                      "block_size": self.block_size, "max_cap": self.max_cap,
                                      "cap_attr": self._cap_attr, "stats_count": self.batch_policy.stats.count}) + "\n")
        self._trace.flush()
        self._step = 0
        self._t0 = self._last_flush = time.monotonic()
        # Running sums over unfinished requests: the policy's cold-start demand estimate, kept O(1) per step.
        self._pending = 0
        self._pending_prompt_tokens = 0
        self._pending_max_tokens = 0
        self._finished = 0
        self._recomputed = 0

    def add_request(self, request) -> None:
        super().add_request(request)
        self._pending += 1
        self._pending_prompt_tokens += request.num_prompt_tokens
        self._pending_max_tokens += request.max_tokens

    def _free_request(self, request, *args, **kwargs):
        # Every finish (stop, length, abort of a stop string) passes here once.
        self._pending -= 1
        self._pending_prompt_tokens -= request.num_prompt_tokens
        self._pending_max_tokens -= request.max_tokens
        self._finished += 1
        self.batch_policy.observe_finished(request.num_prompt_tokens, request.num_output_tokens)
        return super()._free_request(request, *args, **kwargs)

    def schedule(self, *args, **kwargs):
        num_running, num_waiting = self.get_request_counts()
        started = time.perf_counter()
        state = StepState(
            num_running=num_running, num_waiting=num_waiting,
            kv_capacity_blocks=self.kv_capacity_blocks, block_size=self.block_size,
            pending_prompt_tokens_mean=self._pending_prompt_tokens / max(self._pending, 1),
            pending_max_tokens_mean=self._pending_max_tokens / max(self._pending, 1),
        )
        if self.batch_policy.needs_requests:
            self._describe_requests(state)
        cap = min(max(self.batch_policy.batch_cap(state), num_running, 1), self.max_cap)
        policy_us = (time.perf_counter() - started) * 1e6
        setattr(self, self._cap_attr, cap)
        self._recomputed = 0
        output = super().schedule(*args, **kwargs)
        self._step += 1
        preempted = len(getattr(output, "preempted_req_ids", None) or ())
        if num_running or num_waiting:
            now = time.monotonic()
            running_after, waiting_after = self.get_request_counts()
            record = {
                "step": self._step, "t": round(now - self._t0, 4), "cap": cap,
                "running": running_after, "waiting": waiting_after,
                "kv_usage": round(self.kv_cache_manager.usage, 4), "preempted": preempted,
                "scheduled_tokens": output.total_num_scheduled_tokens, "finished": self._finished,
                "recomputed_tokens": self._recomputed, "policy_us": round(policy_us, 1),
            }
            for key, value in self.batch_policy.trace_fields().items():
                if isinstance(value, float):
                    value = None if math.isnan(value) else round(value, 3)
                record[key] = value
            if record.get("safety_buffer_blocks") is not None:
                record["safety_buffer_tokens"] = round(record["safety_buffer_blocks"] * self.block_size, 1)
            self._trace.write(json.dumps(record) + "\n")
            if now - self._last_flush > 0.5:  # the driver's progress bar follows the file
                self._trace.flush()
                self._last_flush = now
        return output

    def _describe_requests(self, state: StepState) -> None:
        def tokens_and_remaining(requests):
            held = np.fromiter((r.num_tokens for r in requests), dtype=np.int64, count=len(requests))
            left = np.fromiter((r.max_tokens - r.num_output_tokens for r in requests), dtype=np.int64,
                               count=len(requests))
            return held, left

        state.running_tokens, state.running_remaining = tokens_and_remaining(self.running)
        # Preempted requests wait at the front; only as many as the cap could still admit matter.
        headroom = self.max_cap - len(self.running)
        waiting = list(itertools.islice(iter(self.waiting), headroom))
        state.waiting_tokens, state.waiting_remaining = tokens_and_remaining(waiting)

    def _preempt_request(self, request, *args, **kwargs):
        self._recomputed += request.num_computed_tokens  # this step's work thrown away, to be prefilled again
        return super()._preempt_request(request, *args, **kwargs)

    def update_from_output(self, *args, **kwargs):
        outputs = super().update_from_output(*args, **kwargs)
        if not self.has_unfinished_requests():
            # A generate() call ends here: make the trace and statistics durable before its last output leaves.
            self._flush()
        return outputs

    def get_request_counts(self) -> tuple[int, int]:
        if hasattr(super(), "get_request_counts"):
            return super().get_request_counts()
        return len(self.running), len(self.waiting)  # vLLM 0.26

    def _flush(self) -> None:
        self._trace.flush()
        if self.stats_out:
            self.batch_policy.stats.save(self.stats_out)

    def shutdown(self) -> None:
        try:
            self._flush()
            self._trace.close()
        finally:
            super().shutdown()


class DynamicBatchScheduler(_DynamicBatchMixin, Scheduler):
    """Synchronous scheduling (CPU, or GPU with async_scheduling=False)."""


class AsyncDynamicBatchScheduler(_DynamicBatchMixin, AsyncScheduler):
    """Async scheduling (vLLM's default on GPU)."""


def scheduler_class_path(async_scheduling: bool) -> str:
    cls = AsyncDynamicBatchScheduler if async_scheduling else DynamicBatchScheduler
    return f"{cls.__module__}.{cls.__qualname__}"
