"""The one place that touches vLLM's scheduler: a subclass that sets the admission cap every step.

vLLM builds the scheduler inside the engine-core process from `scheduler_cls="rollout.vllm_adapter.<Class>"`;
our settings reach it through `additional_config={"rollout": {...}}` (see `adapter_settings`). Since the
driver cannot reach that process, the scheduler writes a per-step trace (JSON lines) and the length statistics
to files the driver reads back.

The cap knob depends on the installed vLLM: 0.32 has `max_num_active_reqs` (admission only, safe to move
between steps); 0.26 has only `max_num_running_reqs`, which it also asserts against the running count, so the
cap is never set below that. `max_num_seqs` stays at B_max because the model runner sizes buffers from it.
A policy may also set the step's token budget (`max_num_scheduled_tokens`, read fresh by every schedule()).

Step latency (the time between tokens a decoding request sees) is measured here, where the step happens: a
step's latency is the time from the later of its schedule() and the previous step's output to its own
update_from_output(). With synchronous scheduling that is schedule + forward + sampling of the step; with async
scheduling (step N+1 is scheduled while N runs) it is the interval between consecutive outputs, which is what a
streaming client sees, without idle gaps. A step's trace record is complete when its output arrives; records go
to the file together every 0.5 s and at the end of a generate() call.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import math
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections import OrderedDict, deque
from operator import attrgetter

import msgspec
import numpy as np
from pathlib import Path

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from rollout.policy import FallbackPolicy, LengthStats, StepState, make_policy, shared_prompt_blocks
from rollout.policy.probes import SiblingOrder, reorder_siblings

SETTINGS_KEY = "rollout"
_request_id = attrgetter("request_id")
# A request's output so far: the length of its private token list (vLLM 0.26 and 0.32 both keep one behind the
# num_output_tokens property) is read without a Python call per request; the property where it is missing.
_output_list = attrgetter("_output_token_ids")
# Per-request columns the adapter keeps for a pass (a row per request, `_row`): what does not change while it runs.
PROMPT, MAX_TOKENS, GROUP, SHARED, SCALE = range(5)


LENGTH_SCALE_KEY = "rollout_length_scale"
# The benchmarks impose each request's true length through max_tokens (with ignore_eos): they set this to the
# limit a trainer would have given, which is all the policy is told (the oracle reads the true one).
NOMINAL_MAX_TOKENS_KEY = "rollout_nominal_max_tokens"
PASS_PRIOR_FILE = "pass_prior.json"  # beside the trace: the driver's expected lengths for the next pass
# The samples of a prompt whose lengths the driver does not know carry its group (policy.probe_first): as they
# finish, the waiting ones are reordered (rollout/policy/probes.py).
PROBE_GROUP_KEY = "rollout_probe_group"


def _extra_arg(request, key: str, default):
    """What the driver set under `key` in the request's SamplingParams.extra_args, else `default`."""
    extra = getattr(request.sampling_params, "extra_args", None) if request.sampling_params else None
    return extra.get(key, default) if extra else default


def probe_group(request) -> int | None:
    return _extra_arg(request, PROBE_GROUP_KEY, None)


_probe_of = attrgetter("_rollout_probe")  # probe_group, kept on the request when it arrives
_computed = attrgetter("num_computed_tokens")


def length_scale(request) -> float:
    """The predicted output length of a request's prompt relative to the average, set by the driver in
    SamplingParams.extra_args from its per-prompt memory; 1.0 when none was given."""
    return float(_extra_arg(request, LENGTH_SCALE_KEY, 1.0))


def nominal_max_tokens(request) -> int:
    """The max_tokens the policy sees: the request's own, unless the driver set a nominal one (benchmarks)."""
    return int(_extra_arg(request, NOMINAL_MAX_TOKENS_KEY, request.max_tokens))


def adapter_settings(policy: dict, trace_path: str, stats_in: str | None, stats_out: str | None,
                     stats_options: dict | None = None) -> dict:
    """The additional_config entry that configures the scheduler in the engine process. Call it in the thread
    that starts the engine: only an engine started by the main thread ends with its parent (`end_with_parent`)."""
    return {SETTINGS_KEY: {"policy": policy, "trace_path": trace_path, "stats_in": stats_in,
                           "stats_out": stats_out, "stats_options": stats_options or {},
                           "end_with_parent": threading.current_thread() is threading.main_thread()}}


def graph_batch(vllm_config) -> int:
    """The largest decode batch the engine replays as a CUDA graph; 0 when it runs none (CPU, enforce_eager)."""
    compilation = vllm_config.compilation_config
    mode = getattr(compilation, "cudagraph_mode", None)
    if vllm_config.model_config.enforce_eager or mode is None or getattr(mode, "name", str(mode)) == "NONE":
        return 0
    return int(getattr(compilation, "max_cudagraph_capture_size", None) or max(
        getattr(compilation, "cudagraph_capture_sizes", None) or [0]))


def end_with_parent() -> None:
    """Have Linux end this process (SIGTERM) when its parent dies. vLLM's engine core does not watch the driver
    that started it: after a SIGKILL of `rollout.generate` (the OOM killer, a job scheduler, a test's timeout)
    it ran the requests on with nobody to read them, holding the accelerator's memory, its worker spinning a
    CPU core. SIGTERM is vLLM's own shutdown, which also ends the worker. Linux sends it when the parent's
    *thread* that started this process ends: so only for engines a main thread started (`adapter_settings`),
    not one a trainer starts from a worker thread that then returns."""
    parent = multiprocessing.parent_process()
    if parent is None or not sys.platform.startswith("linux"):
        return  # the driver's own process (vLLM without multiprocessing), or no prctl
    pr_set_pdeathsig = 1
    if ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM) == 0 and os.getppid() != parent.pid:
        os.kill(os.getpid(), signal.SIGTERM)  # the parent died before this was set


class _DynamicBatchMixin:
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        settings = (self.vllm_config.additional_config or {}).get(SETTINGS_KEY)
        if settings is None:
            raise ValueError(f"{type(self).__name__} needs additional_config[{SETTINGS_KEY!r}]")
        if settings.get("end_with_parent"):
            end_with_parent()
        options = settings.get("stats_options") or {}
        if settings.get("stats_in"):
            stats = LengthStats.load(settings["stats_in"], **options)
        else:
            stats = LengthStats(**options)
        self.max_cap = self.scheduler_config.max_num_seqs
        static_cap = int(settings["policy"].get("static_cap") or self.max_cap)
        policy_settings = {**settings["policy"], "graph_batch": graph_batch(self.vllm_config)}
        self.batch_policy = FallbackPolicy(make_policy(policy_settings, stats), min(static_cap, self.max_cap))
        self._cap_attr = "max_num_active_reqs" if hasattr(self, "max_num_active_reqs") else "max_num_running_reqs"
        self.kv_capacity_blocks = self.kv_cache_manager.block_pool.num_gpu_blocks - 1  # block 0 is the null block
        self.stats_out = settings.get("stats_out")
        trace_path = Path(settings["trace_path"])
        trace_path.parent.mkdir(parents=True, exist_ok=True)
        self._prior_path = trace_path.with_name(PASS_PRIOR_FILE)
        self._trace = trace_path.open("ab", buffering=1 << 16)  # records go in as msgspec's bytes
        self._trace.write(json.dumps({"event": "start", "policy": self.batch_policy.name,
                                      "kv_capacity_blocks": self.kv_capacity_blocks,
                                      "block_size": self.block_size, "max_cap": self.max_cap,
                                      "graph_batch": policy_settings["graph_batch"],
                                      "cap_attr": self._cap_attr,
                                      "stats_count": self.batch_policy.stats.count}).encode() + b"\n")
        self._trace.flush()
        self._step = 0
        self._t0 = self._last_flush = time.monotonic()
        # Running sums over unfinished requests: the policy's cold-start demand estimate, kept O(1) per step.
        self._pending = 0
        self._pending_prompt_tokens = 0
        self._pending_max_tokens = 0
        self._max_tokens_bound = 0  # the pass's largest max_tokens: no request outputs more
        self._scaled = False  # some request carried a predicted length scale
        # Prefix caching shares a prompt's full blocks among the requests that carry it (GRPO's n samples):
        # each request's group (its prompt) and prompt tokens in full blocks, for the policy to count them once.
        # Requests of a pass get a row of `_columns` (PROMPT, MAX_TOKENS, GROUP, SHARED, SCALE): describing
        # them to the policy then reads two attributes per request (output so far, id), not five tuples'
        # worth (that cost ~0.5 ms a forecasting step on an H100 host with ~300 requests).
        self._share_prompts = bool(getattr(self.cache_config, "enable_prefix_caching", False))
        self._groups: dict[int, int] = {}
        self._grouped_requests = 0  # requests of this pass with a group (prompt ids known, prefix caching on)
        self._row: dict[str, int] = {}
        self._columns = np.zeros((1024, 5))
        self._output_lists = True  # every request keeps its output in a list (see _output_list)
        self._finished = 0
        self._preempted = 0
        # What the policy last answered at (running, waiting, finished, preempted), its cap, the step until which
        # that answer stands unless they change (`steady_until`) and its trace fields.
        self._events: tuple | None = None
        self._cap = self.max_cap
        self._steady_until = 0.0
        self._policy_fields: dict = {}
        self._sibling_order = SiblingOrder()
        self._recomputed = 0
        self._finish_cpu_us = 0.0  # observe_finished since the last record (its share of adapter_us)
        # Finishes the policy has not been told of yet: (prompt tokens, output tokens, scale, group, row).
        self._finishes: list[tuple] = []
        # Wall time in this class's own code (policy, finishes, trace) since the last step recorded: what the adapter
        # adds to vLLM's scheduler on the engine's path.
        self._adapter_s = 0.0
        # vLLM's own dependency: a record in ~1 us against json's ~7. Infinity and NaN are written as null.
        self._encoder = msgspec.json.Encoder(enc_hook=_plain)
        # Steps whose records are not written yet, as raw values: a record's dict and JSON, built between the
        # model's steps with the interpreter's data out of cache, cost ~30 us a step on this project's CPU; in
        # a batch every 0.5 s, a few us each.
        self._records: list[tuple] = []
        self._max_step_tokens = getattr(self, "max_num_scheduled_tokens", None)
        self._in_flight: OrderedDict[int, tuple[float, tuple | None]] = OrderedDict()  # id(output) -> start, values
        self._last_output_t = 0.0

    def add_request(self, request) -> None:
        if self._pending == 0:  # requests arrive at an idle engine: a new pass (RL iteration)
            started = time.perf_counter()
            self._tell_finishes()  # any the last pass left, before the new one starts
            self.batch_policy.start_pass(self._read_prior())
            self._max_tokens_bound = 0
            self._adapter_s += time.perf_counter() - started  # in the pass's first record
        super().add_request(request)
        self._output_lists = self._output_lists and isinstance(getattr(request, "_output_token_ids", None), list)
        self._pending += 1
        self._scaled = self._scaled or length_scale(request) != 1.0
        self._pending_prompt_tokens += request.num_prompt_tokens
        max_tokens = nominal_max_tokens(request)
        self._pending_max_tokens += max_tokens
        self._max_tokens_bound = max(self._max_tokens_bound, max_tokens)
        group, shared = -1, 0
        if self._share_prompts and request.prompt_token_ids is not None:
            group = self._groups.setdefault(hash(tuple(request.prompt_token_ids)), len(self._groups))
            shared = shared_prompt_blocks(request.num_prompt_tokens, self.block_size) * self.block_size
            self._grouped_requests += 1
        request._rollout_probe = probe_group(request)
        row = self._row.setdefault(request.request_id, len(self._row))
        if row >= len(self._columns):
            self._columns = np.concatenate([self._columns, np.zeros_like(self._columns)])
        self._columns[row] = (request.num_prompt_tokens, request.max_tokens, group, shared, length_scale(request))

    @property
    def _grouped(self) -> bool:
        """Some prompt of the pass has several samples (prefix caching on)."""
        return len(self._groups) < self._grouped_requests

    def _read_prior(self) -> np.ndarray | None:
        # The driver writes it before submitting a pass, so it is in place when the first request arrives.
        try:
            return np.asarray(json.loads(self._prior_path.read_text())["lengths"], dtype=float)
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _free_request(self, request, *args, **kwargs):
        # Every finish (stop, length, abort of a stop string) passes here once.
        started = time.perf_counter()
        self._pending -= 1
        self._pending_prompt_tokens -= request.num_prompt_tokens
        self._pending_max_tokens -= nominal_max_tokens(request)
        self._finished += 1
        row = self._row.get(request.request_id)
        # A prompt of one sample tells its siblings nothing: groups count only where some prompt has several (as
        # the StepState's group columns), which on kv-bound spared each finish the sibling bookkeeping.
        group = int(self._columns[row, GROUP]) if row is not None and self._grouped else -1
        probed = getattr(request, "_rollout_probe", None)
        if probed is not None:
            self._sibling_order.observe(probed, request.num_output_tokens)
        if self._pending == 0:  # rows and groups are a pass's
            self._groups.clear()
            self._grouped_requests = 0
            self._row.clear()
            self._sibling_order.forget()
        # Told at the next schedule(), with the step's other finishes and just before the policy is asked: one
        # at a time between vLLM's own work, each cost ~38 us of CPU on an H200 host (kv-bound, stop 32) against
        # ~2 us in a loop, its data out of cache.
        self._finishes.append((request.num_prompt_tokens, request.num_output_tokens, length_scale(request), group,
                               -1 if row is None else row))
        self._adapter_s += time.perf_counter() - started
        return super()._free_request(request, *args, **kwargs)

    def _tell_finishes(self) -> None:
        """The policy learns of the finishes since it last did (the length statistics, the siblings)."""
        if not self._finishes:
            return
        started_cpu = time.thread_time()
        observe = self.batch_policy.observe_finished
        for finish in self._finishes:
            observe(*finish)
        self._finishes.clear()
        # The policy's share of the finishes: counted apart from its answer (policy_us).
        self._finish_cpu_us += (time.thread_time() - started_cpu) * 1e6

    def schedule(self, *args, **kwargs):
        started = time.perf_counter()
        self._tell_finishes()
        asked = time.perf_counter()
        num_running, num_waiting = self.get_request_counts()
        events = (num_running, num_waiting, self._finished, self._preempted)
        # Where nothing the policy reads changed since it answered (`steady_until`; most decode steps), its cap
        # stands and it is not asked.
        skipped = events == self._events and self._step < self._steady_until
        describe_cpu_us = budget = None
        if skipped:  # the check alone: its wall time stands for its CPU time (thread_time is a system call)
            policy_s = policy_cpu_s = time.perf_counter() - asked
        else:
            started_cpu = time.thread_time()
            describe_cpu_us, budget = self._ask_policy(num_running, num_waiting)
            self._events, self._steady_until = events, self.batch_policy.steady_until()
            policy_s = time.perf_counter() - asked
            # Wall time includes waits for the GIL, which the engine core's I/O threads hold at times; CPU time
            # is what the policy itself costs.
            policy_cpu_s = time.thread_time() - started_cpu
        setattr(self, self._cap_attr, self._cap)
        self._recomputed = 0
        step_start = time.monotonic()
        base_started = time.perf_counter()
        self._adapter_s += base_started - started
        output = super().schedule(*args, **kwargs)
        base_ended = time.perf_counter()
        self._step += 1
        self._recorded(output, step_start, num_running, num_waiting, policy_s, policy_cpu_s, describe_cpu_us, budget,
                       skipped)
        self._adapter_s += time.perf_counter() - base_ended
        return output

    def _ask_policy(self, num_running: int, num_waiting: int) -> tuple[float | None, int | None]:
        """This step's cap (`_cap`) and token budget from the policy; the CPU time spent describing requests to
        it (None: not described) and the budget it set (None: vLLM's)."""
        state = StepState(
            num_running=num_running, num_waiting=num_waiting, step=self._step,
            kv_capacity_blocks=self.kv_capacity_blocks, block_size=self.block_size,
            kv_free_blocks=round((1.0 - self.kv_cache_manager.usage) * self.kv_capacity_blocks),
            pending_prompt_tokens_mean=self._pending_prompt_tokens / max(self._pending, 1),
            pending_max_tokens_mean=self._pending_max_tokens / max(self._pending, 1),
            max_tokens_bound=self._max_tokens_bound,
        )
        describe_cpu_us = None
        wants_requests = self.batch_policy.wants_requests(state)
        # The waiting order matters only where the policy reads the queue's head or vLLM admits from it: a
        # first pass's probes finish ~100 times between admission waves, and each reordering walks the queue.
        if self._sibling_order.dirty and wants_requests:
            self._reorder_waiting()
        if wants_requests:
            describe_started = time.thread_time()
            self._describe_requests(state)
            describe_cpu_us = (time.thread_time() - describe_started) * 1e6
        self._cap = min(max(self.batch_policy.batch_cap(state), num_running, 1), self.max_cap)
        if self._sibling_order.dirty and self._cap > num_running:
            self._reorder_waiting()
        budget = None
        if self._max_step_tokens is not None:
            budget = self.batch_policy.token_budget(self._max_step_tokens, num_running)
            self.max_num_scheduled_tokens = self._max_step_tokens if budget is None else max(budget, 1)
        return describe_cpu_us, budget

    def _recorded(self, output, step_start: float, num_running: int, num_waiting: int, policy_s: float,
                  policy_cpu_s: float, describe_cpu_us: float | None, budget: int | None, skipped: bool) -> None:
        """The step's values for its trace record, kept until its output arrives (`_step_done`)."""
        record = None
        if num_running or num_waiting:
            running_after, waiting_after = self.get_request_counts()
            if not skipped:  # where the policy was not asked, its fields are as it last gave them
                self._policy_fields = self._trace_fields()
            record = (self._step, step_start, self._cap, running_after, waiting_after, self.kv_cache_manager.usage,
                      len(getattr(output, "preempted_req_ids", None) or ()), output.total_num_scheduled_tokens,
                      self._finished, self._recomputed, policy_s, policy_cpu_s, skipped, describe_cpu_us,
                      None if budget is None else self.max_num_scheduled_tokens, self._scaled, self._policy_fields)
        self._in_flight[id(output)] = (step_start, record)
        while len(self._in_flight) > 16:  # an output that never came back (should not happen) is not kept
            _, (_, lost) = self._in_flight.popitem(last=False)
            if lost is not None:
                self._records.append((lost, None))

    def _trace_fields(self) -> dict:
        fields = {}
        for key, value in self.batch_policy.trace_fields().items():
            if isinstance(value, float):
                value = None if math.isnan(value) else round(value, 3)
            fields[key] = value
        if fields.get("safety_buffer_blocks") is not None:
            fields["safety_buffer_tokens"] = round(fields["safety_buffer_blocks"] * self.block_size, 1)
        return fields

    def _write_records(self) -> None:
        """The kept steps' records, as JSON lines, to the trace file."""
        records, t0 = [], self._t0
        for values, done in self._records:
            (step, start, cap, running, waiting, kv_usage, preempted, scheduled, finished, recomputed, policy_s,
             policy_cpu_s, skipped, describe_cpu_us, token_budget, scaled, policy_fields) = values
            record = {
                "step": step, "t": round(start - t0, 4), "cap": cap, "running": running, "waiting": waiting,
                "kv_usage": round(kv_usage, 4), "preempted": preempted, "scheduled_tokens": scheduled,
                "finished": finished, "recomputed_tokens": recomputed, "policy_us": round(policy_s * 1e6, 1),
                "policy_cpu_us": round(policy_cpu_s * 1e6, 1),
            }
            if skipped:
                record["policy_skipped"] = True
            if describe_cpu_us is not None:  # the per-request arrays were built (their share of policy_cpu_us)
                record["describe_cpu_us"] = round(describe_cpu_us, 1)
            if token_budget is not None:
                record["token_budget"] = token_budget
            if scaled:
                record["length_scaled"] = True
            record.update(policy_fields)
            if done is not None:
                latency, decode_requests, prefill_tokens, adapter_s, finish_cpu_us = done
                record.update(step_ms=round(latency * 1e3, 3), decode_requests=decode_requests,
                              prefill_tokens=prefill_tokens, adapter_us=round(adapter_s * 1e6, 1),
                              finish_cpu_us=round(finish_cpu_us, 1))
            records.append(record)
        self._trace.write(self._encoder.encode_lines(records))
        self._records.clear()
        self._trace.flush()
        self._last_flush = time.monotonic()

    def _step_done(self, scheduler_output) -> None:
        now = time.monotonic()
        start, record = self._in_flight.pop(id(scheduler_output), (None, None))
        if start is None:
            return
        latency = now - max(start, self._last_output_t)
        self._last_output_t = now
        per_request = scheduler_output.num_scheduled_tokens
        decode_requests = list(per_request.values()).count(1)  # in C: a generator took ~30 us at 1,024 requests
        prefill_tokens = scheduler_output.total_num_scheduled_tokens - decode_requests
        if scheduler_output.total_num_scheduled_tokens:
            self.batch_policy.observe_step(latency, decode_requests, prefill_tokens)
        if record is not None:
            # This step's adapter time: its schedule() and what came since the last record (the finishes, the
            # records' writing); the writing that follows counts in the next.
            self._records.append((record, (latency, decode_requests, prefill_tokens, self._adapter_s,
                                           self._finish_cpu_us)))
            self._adapter_s = self._finish_cpu_us = 0.0
            if now - self._last_flush > 0.5:  # the driver's progress bar follows the file
                self._write_records()

    def _reorder_waiting(self) -> None:
        """A probed group's first sample finished: its waiting siblings move to their place (longest first)."""
        queue = self.waiting
        if not isinstance(queue, deque):  # priority scheduling: vLLM's heap keeps its own order
            self._sibling_order.dirty = False
            return
        # Attribute reads without a Python call per request: a first pass of 2,048 requests may reorder ~100 times.
        items = list(queue)
        outputs = map(len, map(_output_list, items)) if self._output_lists else (r.num_output_tokens for r in items)
        started = [bool(a or b) for a, b in zip(outputs, map(_computed, items))]
        reordered = reorder_siblings(items, self._sibling_order, list(map(_probe_of, items)), started)
        queue.clear()
        queue.extend(reordered)

    def _describe(self, requests) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Output tokens so far, rows in the pass and the pass's columns of `requests`."""
        n = len(requests)
        if self._output_lists:
            generated = np.fromiter(map(len, map(_output_list, requests)), np.int64, n)
        else:
            generated = np.fromiter((r.num_output_tokens for r in requests), np.int64, n)
        rows = np.fromiter(map(self._row.__getitem__, map(_request_id, requests)), np.int64, n)
        return generated, rows, self._columns[rows]

    def _describe_requests(self, state: StepState) -> None:
        running = list(self.running)
        run_generated, run_rows, run_columns = self._describe(running)
        # Preempted requests wait at the front; only as many as the cap could still admit (and the policy
        # asks for), and whose tokens would fit in the free blocks (plus one), matter. A group's prompt
        # blocks are held once: counted per sample, the cut showed the policy one waiting request a step while
        # groups ran, and it admitted one sample a step, each step a prefill (33 against 13 ms on an H100).
        headroom = self.max_cap - len(running)
        limit = self.batch_policy.waiting_limit()
        free_tokens = state.kv_free_blocks * state.block_size
        grouped = self._grouped
        if grouped:
            held = np.zeros(len(self._groups), dtype=bool)  # groups whose prompt blocks are in the cache
            group = run_columns[:, GROUP].astype(np.int64)
            held[group[group >= 0]] = True
        queue = iter(self.waiting)
        wait_generated, wait_rows, wait_columns = [], [], []
        remaining = headroom if limit is None else min(headroom, limit)
        chunk_size = 16  # growing chunks: the cut usually comes early
        while remaining > 0 and free_tokens >= 0:
            chunk = list(itertools.islice(queue, min(remaining, chunk_size)))
            if not chunk:
                break
            remaining -= len(chunk)
            chunk_size *= 4
            generated, rows, columns = self._describe(chunk)
            need = columns[:, PROMPT] + generated
            if grouped:
                group = columns[:, GROUP].astype(np.int64)
                first = np.zeros(len(chunk), dtype=bool)
                first[np.unique(group, return_index=True)[1]] = True
                cached = (group >= 0) & (~first | held[np.maximum(group, 0)])
                need -= np.where(cached, columns[:, SHARED], 0)
            need = np.cumsum(need)
            keep = min(int(np.searchsorted(need, free_tokens, side="right")) + 1, len(chunk))
            wait_generated.append(generated[:keep])
            wait_rows.append(rows[:keep])
            wait_columns.append(columns[:keep])
            if grouped:
                held[group[:keep][group[:keep] >= 0]] = True
            free_tokens -= need[keep - 1]
        wait_generated = np.concatenate(wait_generated) if wait_generated else np.zeros(0, np.int64)
        wait_rows = np.concatenate(wait_rows) if wait_rows else np.zeros(0, np.int64)
        wait_columns = np.concatenate(wait_columns) if wait_columns else np.zeros((0, 5))
        for side, generated, rows, columns in (("running", run_generated, run_rows, run_columns),
                                               ("waiting", wait_generated, wait_rows, wait_columns)):
            prompt = columns[:, PROMPT].astype(np.int64)
            setattr(state, f"{side}_tokens", prompt + generated)
            setattr(state, f"{side}_generated", generated)
            setattr(state, f"{side}_rows", rows)
            setattr(state, f"{side}_remaining", columns[:, MAX_TOKENS].astype(np.int64) - generated)
            if grouped:
                setattr(state, f"{side}_group", columns[:, GROUP].astype(np.int64))
                setattr(state, f"{side}_shared", columns[:, SHARED].astype(np.int64))
            if self._scaled:
                setattr(state, f"{side}_scale", columns[:, SCALE])

    def _preempt_request(self, request, *args, **kwargs):
        self._recomputed += request.num_computed_tokens  # this step's work thrown away, to be prefilled again
        self._preempted += 1
        self.batch_policy.observe_preempted(request.num_computed_tokens)
        return super()._preempt_request(request, *args, **kwargs)

    def update_from_output(self, scheduler_output, *args, **kwargs):
        outputs = super().update_from_output(scheduler_output, *args, **kwargs)
        started = time.perf_counter()
        done = not self.has_unfinished_requests()
        if done:  # a generate() call ends here: the statistics, whole and saved, before its last output leaves
            self._save_stats()
            self._adapter_s += time.perf_counter() - started  # in this, the pass's last record
            started = time.perf_counter()
        self._step_done(scheduler_output)
        self._adapter_s += time.perf_counter() - started
        if done:
            self._write_records()
        return outputs

    if not hasattr(Scheduler, "get_request_counts"):  # vLLM 0.26; where vLLM has it, its own calls go direct
        def get_request_counts(self) -> tuple[int, int]:
            return len(self.running), len(self.waiting)

    def _save_stats(self) -> None:
        self._tell_finishes()  # the saved statistics hold every finish
        if self.stats_out:
            self.batch_policy.stats.save(self.stats_out)

    def shutdown(self) -> None:
        try:
            self._records.extend((record, None) for _, record in self._in_flight.values() if record is not None)
            self._in_flight.clear()
            self._write_records()
            self._save_stats()
            self._trace.close()
        finally:
            super().shutdown()


class DynamicBatchScheduler(_DynamicBatchMixin, Scheduler):
    """Synchronous scheduling (CPU, or GPU with async_scheduling=False)."""


class AsyncDynamicBatchScheduler(_DynamicBatchMixin, AsyncScheduler):
    """Async scheduling (vLLM's default on GPU)."""


def _plain(value):
    """msgspec's hook for what it does not encode itself: numpy scalars (a policy's trace fields)."""
    if isinstance(value, np.generic):
        return value.item()
    raise NotImplementedError(f"cannot write {type(value).__name__} to the trace")


def scheduler_class_path(async_scheduling: bool) -> str:
    cls = AsyncDynamicBatchScheduler if async_scheduling else DynamicBatchScheduler
    return f"{cls.__module__}.{cls.__qualname__}"
