"""The one place that touches vLLM's scheduler: a subclass that sets the admission cap every step.

vLLM builds the scheduler inside the engine-core process from `scheduler_cls="rollout.vllm_adapter.<Class>"`;
our settings reach it through `additional_config={"rollout": {...}}` (see `adapter_settings`). It learns by itself
what it needs (the length statistics, each prompt's lengths, the longest-first order, the probes), from the
requests that reach it, whoever drives the engine; it writes a per-step trace (rollout/trace.py) and what it
learned (`state_dir`) to files the driver reads back.

The cap knob depends on the installed vLLM: 0.32 has `max_num_active_reqs` (admission only, safe to move between
steps); 0.26 has only `max_num_running_reqs`, which it also asserts against the running count, so the cap is never
set below that. `max_num_seqs` stays at B_max because the model runner sizes buffers from it. A policy may also set
the step's token budget (`max_num_scheduled_tokens`, read fresh by every schedule()).

With a KV connector (KV offloading), a request whose blocks are being loaded waits outside the running set while
it holds them, and vLLM starts such loads for as many waiting requests as the free blocks allow, whatever the cap:
the adapter shows the policy those requests as running, and lets vLLM's admission loop reach only as many of the
waiting requests as the cap leaves room for (`_meter`). Under vLLM's offloading connector (model.kv_offloading_gib)
a request that has generated nothing loads nothing, computing its prompt (`fresh_requests_load_nothing`), the
policy runs under `PolicyConfig.under_kv_offloading`, and a preempted request's blocks in host memory are marked as
just used, so that host memory evicts those of finished requests first (`HostBlocks`). Where vLLM defers a
preempted request's block free (async scheduling with a connector that loads) and its preemption loop does not
stop at such a victim (0.26), a victim's blocks free at once and no KV load starts until the step that may still
write them has been processed (`_load_fence`).

Invariants: every request of a pass has a row in `PassState.table` from add_request until the pass ends; every
finish passes `_free_request` once and reaches the policy at the next schedule(), before it is asked; the policy is
asked through `rollout.policy.step.decide`, as the simulator asks it. With a KV connector and FCFS queues, the
running requests and those holding blocks outside the running set are, after a step, no more than its cap (but
where the cap stands below what already runs or holds).
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections import deque
from operator import attrgetter
from pathlib import Path

import numpy as np
from filelock import FileLock, Timeout
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from rollout.config import SCHEDULER_SETTINGS
from rollout.drafts import DraftSource
from rollout.policy import FallbackPolicy, LengthStats, PolicyConfig, StepState, make_policy
from rollout.policy.length_stats import PromptLengths, prompt_key
from rollout.policy.probes import SiblingOrder, reorder_siblings
from rollout.policy.prompt_memory import PromptMemory, arrival_order
from rollout.policy.speculation import draft_length, tokens_tested
from rollout.policy.step import (GROUP, NUM_COLUMNS, PassShape, Requests, StepGate, decide, least_progress_last,
                                 preemption_possible, promote_to_front, shared_prompt_blocks)
from rollout.trace import NoTrace, StepDone, StepRecord, StepTimer, TraceWriter, policy_trace_fields
from rollout.vllm_compat import (OFFLOADING_CONNECTOR, check_scheduler_hooks, held_queue_attribute,
                                 loading_queue_attributes, prefix_skip_attribute, preemption_stops_at_deferred_frees)

# The private names overridden or read here, checked once against the installed vLLM (a renamed hook would silently
# stop being called): an ImportError names the version. The admission cap's attribute differs between versions.
CAP_ATTR = check_scheduler_hooks()
# The queue vLLM admits from before `waiting`, where requests wait whose KV blocks a connector loads (None: none).
HELD_QUEUE = held_queue_attribute()
# Other queues of requests outside the running set that may load KV (0.34's async_kv_waiting).
LOADING_QUEUES = loading_queue_attributes()
# The request attribute that makes a KV connector's lookup find nothing: 0.24-0.33 a flag, 0.34 a token limit.
PREFIX_SKIP = prefix_skip_attribute()

SETTINGS_KEY = "rollout"
_request_id = attrgetter("request_id")
# A request's output so far: the length of its private token list (vLLM 0.26 and 0.32 both keep one behind the
# num_output_tokens property; rollout.vllm_compat checks it) is read without a Python call per request.
_output_list = attrgetter("_output_token_ids")
# What each of rollout.policy.config.PREEMPTION_ORDERS but vLLM's own puts last in the running list.
PROGRESS = {"least_output": attrgetter("num_output_tokens"), "least_computed": attrgetter("num_computed_tokens")}


# The benchmarks impose each request's true length through max_tokens (with ignore_eos): they set this to the
# limit a trainer would have given, which is all the policy is told (the oracle reads the true one).
NOMINAL_MAX_TOKENS_KEY = "rollout_nominal_max_tokens"


def _extra_arg(request, key: str, default):
    """What the driver set under `key` in the request's SamplingParams.extra_args, else `default`."""
    extra = getattr(request.sampling_params, "extra_args", None) if request.sampling_params else None
    return extra.get(key, default) if extra else default


# Kept on each request when it arrives: its probe group, predicted length scale and whether it is a probed prompt's
# held sample, from the scheduler's PromptMemory (none of them without it: `learn_prompts` false).
_probe_of = attrgetter("_rollout_probe")
_scale_of = attrgetter("_rollout_scale")
_held_of = attrgetter("_rollout_held")
_placed_of = attrgetter("_rollout_placed")  # it was in the waiting queue when the queue was last put in order
_computed = attrgetter("num_computed_tokens")



def _started(requests) -> list[bool]:
    """Whether each request computed or generated anything (a preempted one did): such a request keeps its
    place in the waiting queue. Attribute reads without a Python call per request: a first pass of 2,048 requests
    may reorder ~100 times."""
    return [bool(a or b) for a, b in zip(map(len, map(_output_list, requests)), map(_computed, requests))]

def nominal_max_tokens(request) -> int:
    """The max_tokens the policy sees: the request's own, unless the driver set a nominal one (benchmarks)."""
    return int(_extra_arg(request, NOMINAL_MAX_TOKENS_KEY, request.max_tokens))


def adapter_settings(policy: dict, trace_path: str, state_dir: str | None, stats_in: str | None, stats_out: str | None,
                     timing: bool = True) -> dict:
    """The additional_config entry our driver (rollout.engine) configures the scheduler in the engine process
    with: `policy`, the plain dict form of PolicyConfig; `state_dir`, where the scheduler keeps what it learns
    (the driver reads the per-prompt memory there for its submission order); `timing`, the benchmark-only
    measurements (CPU times, the adapter's own time; see rollout.trace.StepTimer). Nothing else reaches the
    scheduler from the driver, as from any other engine's owner. Call it in the thread that starts the engine:
    only an engine started by the main thread ends with its parent (`end_with_parent`)."""
    return {SETTINGS_KEY: {"policy": policy, "trace_path": trace_path, "state_dir": state_dir,
                           "stats_in": stats_in, "stats_out": stats_out, "timing": timing,
                           "end_with_parent": threading.current_thread() is threading.main_thread()}}


# Files the scheduler keeps in its `state_dir` (settings): what it learned, saved as each pass ends and at shutdown,
# read back when an engine starts. The prompts' file is read again when a pass opens if someone else rewrote it
# since (rollout.parallel merges its engines' memories so), and several engines may share it (verl gives all of its
# servers one configuration): each adds its pass's prompts to what the file holds, under its lock. The statistics'
# file is the last saver's.
STATE_STATS_FILE = "length_stats.json"
STATE_PROMPTS_FILE = "prompt_lengths.json"
MEMORY_LOCK_TIMEOUT_S = 30  # a save holds the lock for milliseconds: longer is a writer that hangs

logger = logging.getLogger("rollout")


def read_settings(additional_config: dict | None) -> dict:
    """additional_config["rollout"], checked: a missing entry, an unknown key or policy field, or a bad value
    raise ValueError with one line naming it (vLLM prints it where the engine fails to start)."""
    settings = (additional_config or {}).get(SETTINGS_KEY)
    if settings is None:
        raise ValueError(f"rollout's scheduler needs additional_config[{SETTINGS_KEY!r}], e.g. "
                         f'--additional-config \'{{"{SETTINGS_KEY}": {{"policy": {{"name": "forecast"}}}}}}\'')
    if not isinstance(settings, dict):
        raise ValueError(f"additional_config[{SETTINGS_KEY!r}] must be a mapping, not {type(settings).__name__}")
    unknown = sorted(set(settings) - set(SCHEDULER_SETTINGS))
    if unknown:
        raise ValueError(f"additional_config[{SETTINGS_KEY!r}]: unknown key {unknown[0]!r}; known: "
                         f"{', '.join(SCHEDULER_SETTINGS)}")
    policy = settings.get("policy") or {}
    if not isinstance(policy, dict):
        raise ValueError(f"additional_config[{SETTINGS_KEY!r}]['policy'] must be a mapping of PolicyConfig fields")
    return {**settings, "policy": policy}


def graph_batch(vllm_config) -> int:
    """The largest decode batch the engine replays as a CUDA graph; 0 when it runs none (CPU, enforce_eager)."""
    compilation = vllm_config.compilation_config
    mode = getattr(compilation, "cudagraph_mode", None)
    if vllm_config.model_config.enforce_eager or mode is None or getattr(mode, "name", str(mode)) == "NONE":
        return 0
    return int(getattr(compilation, "max_cudagraph_capture_size", None) or max(
        getattr(compilation, "cudagraph_capture_sizes", None) or [0]))


PARENT_GONE_GRACE_S = 10.0  # how long vLLM's own shutdown may take once the driver is gone


def end_with_parent() -> None:
    """Have Linux end this process (SIGTERM) when its parent dies. vLLM's engine core does not watch the driver
    that started it: after a SIGKILL of `rollout.generate` (the OOM killer, a job scheduler, a test's timeout)
    it ran the requests on with nobody to read them, holding the accelerator's memory, its worker spinning a
    CPU core. SIGTERM is vLLM's own shutdown, which also ends the worker; where that shutdown hangs, a watch
    thread ends the process PARENT_GONE_GRACE_S after the parent is gone. Linux sends the SIGTERM when the
    parent's *thread* that started this process ends: so only for engines a main thread started
    (`adapter_settings`), not one a trainer starts from a worker thread that then returns."""
    parent = multiprocessing.parent_process()
    if parent is None or not sys.platform.startswith("linux"):
        return  # the driver's own process (vLLM without multiprocessing), or no prctl
    pr_set_pdeathsig = 1
    if ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM) == 0 and os.getppid() != parent.pid:
        os.kill(os.getpid(), signal.SIGTERM)  # the parent died before this was set

    def watch() -> None:
        # vLLM's shutdown after the SIGTERM can wait for ever on the dead driver (its output thread sending to
        # nobody): PARENT_GONE_GRACE_S after the parent is gone the process ends at once. Its worker ends by
        # itself (vLLM's death pipe); nothing it would still send has a reader.
        while os.getppid() == parent.pid:
            time.sleep(1.0)
        time.sleep(PARENT_GONE_GRACE_S)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="rollout-parent-watch", daemon=True).start()


class PassState:
    """The requests of the current pass (from requests arriving at an idle engine until none is left): running sums
    for the cold-start demand estimate, kept O(1) per step, and a table row per request (`rollout.policy.step`
    columns) of what does not change while it runs, so that describing requests to the policy reads two attributes
    per request (output so far, id) instead of five."""

    def __init__(self, share_prompts: bool, block_size: int) -> None:
        # Prefix caching shares a prompt's full blocks among the requests that carry it (GRPO's n samples).
        self.share_prompts = share_prompts
        self.block_size = block_size
        self.pending = 0  # requests arrived and not finished
        self.pending_prompt_tokens = 0
        self.pending_max_tokens = 0  # as the policy is told them (nominal)
        self.max_tokens_bound = 0  # the pass's largest max_tokens: no request outputs more
        self.scaled = False  # some request of the pass carried a predicted length scale
        self.groups: dict[int, int] = {}  # hash of a prompt's tokens -> its group id in the pass
        self.grouped_requests = 0  # requests of the pass with a group (prompt ids known, prefix caching on)
        self.rows: dict[str, int] = {}
        self.table = np.zeros((1024, NUM_COLUMNS))
        self.sibling_order = SiblingOrder()

    @property
    def shape(self) -> PassShape:
        # A prompt of one sample tells its siblings nothing: groups count only where some prompt has several.
        return PassShape(len(self.groups) < self.grouped_requests, len(self.groups), self.scaled)

    def arrive(self, request, nominal: int, scale: float) -> bool:
        """A request of the pass arrived; True if it opens the pass."""
        opens = self.pending == 0
        if opens:
            self.max_tokens_bound = 0
            self.scaled = False
        self.pending += 1
        self.pending_prompt_tokens += request.num_prompt_tokens
        self.pending_max_tokens += nominal
        self.max_tokens_bound = max(self.max_tokens_bound, nominal)
        self.scaled = self.scaled or scale != 1.0
        group, shared = -1, 0
        if self.share_prompts and request.prompt_token_ids is not None:
            group = self.groups.setdefault(hash(tuple(request.prompt_token_ids)), len(self.groups))
            shared = shared_prompt_blocks(request.num_prompt_tokens, self.block_size) * self.block_size
            self.grouped_requests += 1
        row = self.rows.setdefault(request.request_id, len(self.rows))
        if row >= len(self.table):
            self.table = np.concatenate([self.table, np.zeros_like(self.table)])
        self.table[row] = (request.num_prompt_tokens, request.max_tokens, group, shared, scale)
        return opens

    def finish(self, request, nominal: int) -> tuple[int, int]:
        """A request of the pass ended: its (row, group) as the policy is told them (-1: none)."""
        self.pending -= 1
        self.pending_prompt_tokens -= request.num_prompt_tokens
        self.pending_max_tokens -= nominal
        row = self.rows.get(request.request_id)
        grouped = len(self.groups) < self.grouped_requests
        group = int(self.table[row, GROUP]) if row is not None and grouped else -1
        if self.pending == 0:  # rows and groups are a pass's
            self.groups.clear()
            self.grouped_requests = 0
            self.rows.clear()
            self.sibling_order.forget()
        return (-1 if row is None else row), group

    def requests(self, requests: list) -> Requests:
        """`requests` (vLLM Request objects of the pass, in order) as the step description's arrays."""
        n = len(requests)
        generated = np.fromiter(map(len, map(_output_list, requests)), np.int64, n)
        rows = np.fromiter(map(self.rows.__getitem__, map(_request_id, requests)), np.int64, n)
        return Requests(generated, rows, self.table[rows])


class _DynamicBatchMixin:
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        settings = read_settings(self.vllm_config.additional_config)
        if settings.get("end_with_parent"):
            end_with_parent()
        config = PolicyConfig.from_dict(settings["policy"])
        transfer = self.vllm_config.kv_transfer_config
        self._host_blocks = None
        if transfer is not None and transfer.kv_connector == OFFLOADING_CONNECTOR:
            # A preempted request loads its blocks back from host memory; a fresh one computes its prompt; a
            # preempted request's blocks there are marked as just used (`HostBlocks`).
            config = config.under_kv_offloading()
            self.connector.get_num_new_matched_tokens = fresh_requests_load_nothing(
                self.connector.get_num_new_matched_tokens)
            self._host_blocks = host_block_keys(self.connector)
        # Under async scheduling with a connector that loads, vLLM defers a preempted request's block free until the
        # step in flight ends; where its preemption loop does not stop at such a victim (vLLM 0.26), one request
        # short of a block would preempt every request behind it. The adapter frees a victim's blocks at once
        # instead, and holds back every KV load until the step that may still write them has ended
        # (`_load_fence`): a load runs on its own stream, unordered against that step, and is the one writer that
        # could land in those blocks before it; a step's own writes follow the step in flight on the same stream.
        self._free_at_preemption = (getattr(self, "defer_block_free", False)
                                    and not preemption_stops_at_deferred_frees())
        self._load_fence = 0  # no KV load starts before the step of this sequence number has been processed
        if self._free_at_preemption:
            self.connector.get_num_new_matched_tokens = self._loads_after_fence(
                self.connector.get_num_new_matched_tokens)
        state_dir = settings.get("state_dir")
        self.state_dir = Path(state_dir) if state_dir else None
        if self.state_dir is not None:
            self.state_dir.mkdir(parents=True, exist_ok=True)
        saved_stats = self.state_dir / STATE_STATS_FILE if self.state_dir is not None else None
        # The statistics' forgetting is the policy's setting, wherever the settings came from.
        options = {"forgetting": config.forgetting, "window": config.window, "decay": config.decay}
        stats_in = settings.get("stats_in") or (saved_stats if saved_stats is not None and saved_stats.is_file()
                                                else None)
        stats = LengthStats.load(stats_in, **options) if stats_in else LengthStats(**options)
        self.max_cap = self.scheduler_config.max_num_seqs
        self.graph_batch = graph_batch(self.vllm_config)
        self.batch_policy = FallbackPolicy(make_policy(config, stats, self.graph_batch),
                                           min(config.static_cap or self.max_cap, self.max_cap))
        self.kv_capacity_blocks = self.kv_cache_manager.block_pool.num_gpu_blocks - 1  # block 0 is the null block
        self.stats_out = settings.get("stats_out") or saved_stats
        # What the scheduler learns of prompts by itself (where no driver sends it): kept in state_dir if given.
        self.memory: PromptMemory | None = None
        self._memory_path = self.state_dir / STATE_PROMPTS_FILE if self.state_dir is not None else None
        self._memory_stamp = None  # the memory file as this scheduler last read or wrote it
        if settings.get("learn_prompts", True):
            self.memory = PromptMemory(None, config.order, config.probe_first)
            self._reload_memory()
        self._arrived = False  # requests arrived since the queue was last put in order
        self.trace = TraceWriter(settings["trace_path"]) if settings.get("trace_path") else NoTrace()
        self.trace.event({"event": "start", "policy": self.batch_policy.name,
                          "kv_capacity_blocks": self.kv_capacity_blocks, "block_size": self.block_size,
                          "max_cap": self.max_cap, "graph_batch": self.graph_batch, "cap_attr": CAP_ATTR,
                          "stats_count": self.batch_policy.stats.count})
        self.timer = StepTimer(detail=settings.get("timing", True))
        self.pass_state = PassState(bool(getattr(self.cache_config, "enable_prefix_caching", False)),
                                    self.block_size)
        self.gate = StepGate()
        self._step = 0
        self._finished = 0
        self._preempted = 0
        self._recomputed = 0  # computed tokens thrown away by this step's preemptions
        # Preempted requests not resumed yet -> the tokens thrown away: vLLM keeps their blocks in its prefix cache
        # until they are reused (and with KV offloading in host memory), and a resumed request computes again only
        # what its prefix hit lacks.
        self._thrown: dict[str, int] = {}
        self._cap = self.max_cap
        self._policy_fields: dict = {}  # the policy's trace fields as it last answered
        # Finishes the policy has not been told of yet, (prompt tokens, output tokens, scale, group, row): told at
        # the next schedule(), together and just before the policy is asked; one at a time between vLLM's own
        # work, each cost several times more, its data out of cache.
        self._finishes: list[tuple] = []
        self._max_step_tokens = getattr(self, "max_num_scheduled_tokens", None)
        # Tail speculation: drafts this scheduler chooses for the requests it lets speculate (the worker's
        # proposer, NoWorkerDrafts, proposes none); vLLM verifies what `spec_token_ids` holds at schedule().
        self.draft_tokens = config.spec_draft_tokens if self.vllm_config.speculative_config is not None else 0
        self.spec_max_batch = config.spec_max_batch
        self.spec_min_gain = config.spec_min_gain
        self.drafts = DraftSource() if self.draft_tokens else None
        self._prompt_keys: dict[str, str] = {}  # request id -> its prompt's key (rollout.policy.length_stats)
        self._drafted = False  # whether the last step set drafts
        self._verified = [0, 0]  # draft and accepted tokens of the step whose output is being read

    def add_request(self, request) -> None:
        started = time.perf_counter()
        if self.pass_state.pending == 0:  # requests arrive at an idle engine: a new pass (RL iteration)
            self._tell_finishes()  # any the last pass left, before the new one starts
            if self.memory is not None:
                self._reload_memory()
            self.batch_policy.start_pass(self.memory.open_pass() if self.memory is not None else None)
            if self.drafts is not None:
                self.drafts.new_pass()
        request._rollout_placed = False
        if self.memory is None:
            request._rollout_probe, request._rollout_scale, request._rollout_held = None, 1.0, False
        else:
            self._learned_arrival(request)
        base_started = time.perf_counter()
        super().add_request(request)
        base_ended = time.perf_counter()
        self.pass_state.arrive(request, nominal_max_tokens(request), request._rollout_scale)
        self.timer.add_adapter(base_started - started + time.perf_counter() - base_ended)

    def _learned_arrival(self, request) -> None:
        """A request's scale and probe group from the scheduler's own memory of its prompt."""
        key = self._prompt_keys[request.request_id] = prompt_key(request.prompt_token_ids)
        arrival = self.memory.arrive(key, request)
        request._rollout_scale, request._rollout_probe, request._rollout_held = (
            arrival.scale, arrival.probe_group, arrival.held)
        if arrival.probes_first:  # the prompt's first request, waiting or running, is its probe
            arrival.first._rollout_probe = arrival.probe_group
        self._arrived = True

    def _put_arrivals_in_order(self) -> None:
        """The waiting queue in the memory's order (`arrival_order`: longest predicted first, probed prompts' held
        samples last), once requests arrived since it last was; preempted requests and the held samples that were
        already waiting keep their places."""
        self._arrived = False
        queue = self.waiting
        if not isinstance(queue, deque) or self.memory.order != "longest_first":
            return  # priority scheduling: vLLM's heap keeps its own order
        items = list(queue)
        held = list(map(_held_of, items))
        fixed = [began or (h and placed) for began, h, placed in zip(_started(items), held, map(_placed_of, items))]
        order = arrival_order(fixed, held, list(map(_scale_of, items)))
        for request in items:
            request._rollout_placed = True
        if order != list(range(len(items))):
            queue.clear()
            queue.extend(items[k] for k in order)

    def _file_stamp(self):
        try:
            stat = os.stat(self._memory_path)
        except (OSError, TypeError):
            return None
        return stat.st_ino, stat.st_mtime_ns, stat.st_size

    def _reload_memory(self) -> None:
        """The memory file read in, where it changed since this scheduler last read or wrote it (at the start: a
        restart; between passes: another's merge). A file that cannot be read raises ValueError naming it."""
        stamp = self._file_stamp()
        if stamp is not None and stamp != self._memory_stamp:
            self.memory.lengths = PromptLengths.load(self._memory_path)
            self._memory_stamp = stamp

    def _save_memory(self, updates: dict[str, list[int]] | None = None) -> None:
        """The memory written to its file, under the file's lock. With a closed pass's `updates`: where another
        engine wrote the file since this one last read or wrote it, the updates go onto what the file holds, so
        that engines sharing a state_dir lose none of each other's prompts. Without: written only where nobody
        else wrote since (theirs is the newer)."""
        if self._memory_path is None:
            return
        try:
            with FileLock(f"{self._memory_path}.lock", timeout=MEMORY_LOCK_TIMEOUT_S):
                stamp = self._file_stamp()
                if stamp is not None and stamp != self._memory_stamp:
                    if updates is None:
                        return
                    self.memory.lengths = PromptLengths.load(self._memory_path)
                    self.memory.update(updates)
                self.memory.save(self._memory_path)
                self._memory_stamp = self._file_stamp()
        except Timeout:
            logger.warning("%s stayed locked for %d s: this pass's prompt lengths are kept in this engine and "
                           "saved with its next pass", self._memory_path, MEMORY_LOCK_TIMEOUT_S)

    def _free_request(self, request, *args, **kwargs):
        # Every finish (stop, length, abort of a stop string) passes here once.
        started = time.perf_counter()
        self._finished += 1
        probed = getattr(request, "_rollout_probe", None)
        aborted = request.status == RequestStatus.FINISHED_ABORTED  # its length so far is no output's length
        if probed is not None and not aborted:
            self.pass_state.sibling_order.observe(probed, request.num_output_tokens)
        row, group = self.pass_state.finish(request, nominal_max_tokens(request))
        key = self._prompt_keys.pop(request.request_id, None)
        self._thrown.pop(request.request_id, None)  # aborted while preempted: it never resumes
        if self.drafts is not None:
            key = key or prompt_key(request.prompt_token_ids)
            if request.num_output_tokens:
                self.drafts.remember(key, list(request.output_token_ids))
            self.drafts.forget(request.request_id)
        if self.memory is not None:
            if key is not None and not aborted:
                self.memory.finished(key, request.num_output_tokens)
            if self.pass_state.pending == 0:  # the pass's last request: what it taught is kept
                self._save_memory(self.memory.close_pass())
        self._finishes.append((request.num_prompt_tokens, request.num_output_tokens, request._rollout_scale, group,
                               row, aborted))
        self.timer.add_adapter(time.perf_counter() - started)
        return super()._free_request(request, *args, **kwargs)

    def _tell_finishes(self) -> None:
        """The policy learns of the finishes since it last did (the length statistics, the siblings)."""
        if not self._finishes:
            return
        cpu = self.timer.cpu
        started_cpu = cpu() if cpu else 0.0
        observe = self.batch_policy.observe_finished
        for finish in self._finishes:
            observe(*finish)
        self._finishes.clear()
        if cpu:  # the policy's share of the finishes: counted apart from its answer (policy_us)
            self.timer.finish_cpu_us += (cpu() - started_cpu) * 1e6

    def schedule(self, *args, **kwargs):
        started = time.perf_counter()
        self._tell_finishes()
        if self._arrived:
            self._put_arrivals_in_order()
        asked = time.perf_counter()
        num_running, num_waiting = self.get_request_counts()
        held, front = self._outside_running() if self.connector is not None else ((), ())
        if held or front:  # counted as the policy sees them: the held ones run, the rest wait
            num_running, num_waiting = len(self.running) + len(held), len(self.waiting) + len(front)
        events = (num_running, num_waiting, self._finished, self._preempted)
        skipped = self.gate.steady(events, self._step)
        describe_cpu_us = budget = None
        if skipped:  # the check alone: its wall time stands for its CPU time (thread_time is a system call)
            policy_s = time.perf_counter() - asked
            policy_cpu_s = policy_s if self.timer.detail else None
        else:
            cpu = self.timer.cpu
            started_cpu = cpu() if cpu else 0.0
            decision = self._decide(num_running, num_waiting, held, front)
            self.gate.answered(events, decision)
            self._cap = decision.cap
            if self._max_step_tokens is not None:
                budget = decision.token_budget
                self.max_num_scheduled_tokens = self._max_step_tokens if budget is None else max(budget, 1)
            if decision.describe_s is not None:
                describe_cpu_us = decision.describe_s * 1e6
            policy_s = time.perf_counter() - asked
            # Wall time includes waits for the GIL, which the engine core's I/O threads hold at times; CPU time
            # is what the policy itself costs.
            policy_cpu_s = cpu() - started_cpu if cpu else None
        setattr(self, CAP_ATTR, self._cap)
        if self.drafts is not None:
            self._set_drafts()
        order = self.batch_policy.preemption_order
        if order != "vllm" and preemption_possible(
                self._kv_free_blocks(), len(self.running), self.max_num_scheduled_tokens, self.block_size):
            least_progress_last(self.running, PROGRESS[order])
        self._recomputed = 0
        step_start = time.monotonic()
        hidden = self._meter(self._cap - len(self.running) - len(held), front) if self.connector is not None else ()
        base_started = time.perf_counter()
        self.timer.add_adapter(base_started - started)
        try:
            output = super().schedule(*args, **kwargs)
        finally:
            for queue, requests in hidden:  # behind whatever the step left there, in their order
                queue.extend(requests)
        base_ended = time.perf_counter()
        recovered = self._recovered(output.num_scheduled_tokens) if self._thrown else 0
        self._step += 1
        record = None
        if num_running or num_waiting:
            if not skipped:  # where the policy was not asked, its fields are as it last gave them
                self._policy_fields = policy_trace_fields(self.batch_policy.trace_fields(), self.block_size)
            running_after, waiting_after = self.get_request_counts()
            record = StepRecord(
                self._step, step_start, self._cap, running_after, waiting_after, self.kv_cache_manager.usage,
                len(getattr(output, "preempted_req_ids", None) or ()), output.total_num_scheduled_tokens,
                self._finished, self._recomputed, recovered, policy_s, policy_cpu_s, skipped, describe_cpu_us,
                None if budget is None else self.max_num_scheduled_tokens, self.pass_state.scaled,
                self._policy_fields, len(self._outside_running()[0]) if self.connector is not None else 0)
        for lost in self.timer.scheduled(output, step_start, record):
            self.trace.add(lost, None)
        self.timer.add_adapter(time.perf_counter() - base_ended)
        return output

    def _outside_running(self) -> tuple[list, list]:
        """The requests vLLM admits before the waiting queue (its held queue, HELD_QUEUE), in its order: those that
        hold KV blocks (a connector loads them, or loaded them and they wait for a place), and the others (0.26
        sets aside there, for a step, a request whose blocks are still being stored)."""
        queues = [getattr(self, name, None) or () for name in ((HELD_QUEUE,) if HELD_QUEUE else ()) + LOADING_QUEUES]
        held, front = [], []
        for request in (request for queue in queues for request in queue):
            holds = request.status == RequestStatus.WAITING_FOR_REMOTE_KVS or request.num_computed_tokens > 0
            (held if holds else front).append(request)
        return held, front

    def _meter(self, room: int, front: list) -> list[tuple]:
        """Under a KV connector vLLM starts a load for every waiting request whose blocks it finds, as long as blocks
        are free, and counts none of them against the cap (a loading request is not running): the preempted
        requests' loads would take the blocks the forecast leaves for the running ones' growth, and those would be
        preempted in turn. So only `room` requests that hold no blocks (`front` first, then the waiting queue's
        head) are left where vLLM's admission loop reaches them; the others are taken out for this step. Returns
        (queue, requests taken out of it, in order), for schedule() to put back behind what the step leaves there.
        Priority queues (heaps) keep their order themselves and are left whole."""
        hidden = []
        held_queue = getattr(self, HELD_QUEUE, None) if HELD_QUEUE else None
        room = max(room, 0)
        if len(front) > room and isinstance(held_queue, deque):
            out = set(map(id, front[room:]))
            kept = [r for r in held_queue if id(r) not in out]
            hidden.append((held_queue, [r for r in held_queue if id(r) in out]))
            held_queue.clear()
            held_queue.extend(kept)
        room = max(room - len(front), 0)
        waiting = self.waiting
        if len(waiting) > room and isinstance(waiting, deque):
            taken = [waiting.pop() for _ in range(len(waiting) - room)]
            taken.reverse()
            hidden.append((waiting, taken))
        return hidden

    def _kv_free_blocks(self) -> int:
        return round((1.0 - self.kv_cache_manager.usage) * self.kv_capacity_blocks)

    def _set_drafts(self) -> None:
        """Each decoding request's drafts for this step where at most spec_max_batch run, none elsewhere: from its
        running siblings (the same prompt), its prompt's earlier rollouts and its own text."""
        if len(self.running) > self.spec_max_batch:
            if self._drafted:  # drafts set for a request vLLM did not schedule stay until cleared
                for request in self.running:
                    request.spec_token_ids = []
                self._drafted = False
            return  # otherwise the worker's proposer (none) left every request without drafts
        self._drafted = True
        groups: dict[str, list[str]] = {}
        for request in self.running:
            key = self._prompt_keys.get(request.request_id)
            if key is None:
                key = self._prompt_keys[request.request_id] = prompt_key(request.prompt_token_ids)
            groups.setdefault(key, []).append(request.request_id)
            self.drafts.track(request.request_id, request.all_token_ids)
        for request in self.running:
            if request.is_prefill_chunk or not request.num_output_tokens:
                request.spec_token_ids = []
                continue
            key = self._prompt_keys[request.request_id]
            room = request.max_tokens - request.num_output_tokens - 1  # drafts past max_tokens are never used
            k = draft_length(*self.drafts.measured(key), self.draft_tokens, self.spec_min_gain)
            request.spec_token_ids = self.drafts.propose(request.request_id, request.all_token_ids, key,
                                                         groups[key], min(k, max(room, 0)))

    def _decide(self, num_running: int, num_waiting: int, held=(), front=()):
        """The policy's decision. `held`: requests holding KV blocks outside the running set, shown as running;
        `front`: others vLLM admits before the waiting queue, shown at its head (see `_outside_running`)."""
        passing = self.pass_state
        state = StepState(
            num_running=num_running, num_waiting=num_waiting, step=self._step,
            kv_capacity_blocks=self.kv_capacity_blocks, block_size=self.block_size,
            kv_free_blocks=self._kv_free_blocks(),
            pending_prompt_tokens_mean=passing.pending_prompt_tokens / max(passing.pending, 1),
            pending_max_tokens_mean=passing.pending_max_tokens / max(passing.pending, 1),
            max_tokens_bound=passing.max_tokens_bound,
        )

        def waiting_reader():
            queue = itertools.chain(front, self.waiting)
            return lambda n: passing.requests(list(itertools.islice(queue, n)))

        def tail_reader(n: int):
            # The waiting count may hold requests outside this queue (vLLM's KV-transfer holds): the tail must not
            # reach back into the head that count was cut by.
            n -= num_waiting - len(self.waiting)
            return passing.requests(list(itertools.islice(reversed(self.waiting), max(n, 0))))

        reorderable = isinstance(self.waiting, deque)  # priority scheduling: vLLM's heap keeps its own order
        return decide(self.batch_policy, state, lambda: passing.requests([*self.running, *held]), waiting_reader,
                      max_num_seqs=self.max_cap, shape=passing.shape, max_step_tokens=self._max_step_tokens,
                      sibling_order=passing.sibling_order, reorder=self._reorder_waiting, clock=self.timer.cpu,
                      tail=tail_reader if reorderable else None,
                      promote=(lambda picks: promote_to_front(self.waiting, picks)) if reorderable else None)

    def _reorder_waiting(self) -> None:
        """A probed group's first sample finished: its waiting siblings move to their place (longest first)."""
        queue = self.waiting
        order = self.pass_state.sibling_order
        if not isinstance(queue, deque):  # priority scheduling: vLLM's heap keeps its own order
            order.dirty = False
            return
        items = list(queue)
        started = _started(items)
        reordered = reorder_siblings(items, order, list(map(_probe_of, items)), started)
        queue.clear()
        queue.extend(reordered)

    def _recovered(self, scheduled: dict) -> int:
        """Of the tokens that preemptions threw away, those the requests resumed by this step found in the prefix
        cache or loaded from host memory (KV offloading): after schedule() a resumed request's computed tokens are
        its prefix hit plus what it was scheduled."""
        recovered = 0
        for request_id in self._thrown.keys() & scheduled.keys():
            hit = self.requests[request_id].num_computed_tokens - scheduled[request_id]
            recovered += min(max(hit, 0), self._thrown.pop(request_id))
        return recovered

    def _preempt_request(self, request, *args, **kwargs):
        self._recomputed += request.num_computed_tokens  # this step's work thrown away, to be prefilled again
        self._thrown[request.request_id] = request.num_computed_tokens
        self._preempted += 1
        self.batch_policy.observe_preempted(request.num_computed_tokens)
        if self._host_blocks is not None:
            self._host_blocks.refresh(request.request_id)
        if not (self._free_at_preemption and request.last_sched_seq > self.processed_step_seq):
            return super()._preempt_request(request, *args, **kwargs)
        self._load_fence = max(self._load_fence, request.last_sched_seq)
        self.defer_block_free = False  # vLLM's _free_request_blocks then returns the blocks to the pool at once
        try:
            return super()._preempt_request(request, *args, **kwargs)
        finally:
            self.defer_block_free = True

    def _loads_after_fence(self, lookup):
        """The KV connector's lookup, answering "not yet" (None: vLLM asks again next step, the request waiting)
        for a request it would load while a step that may still write blocks freed at a preemption is in
        flight."""

        def lookup_after_fence(request, *args, **kwargs):
            hit, load_async = lookup(request, *args, **kwargs)
            if hit and self.processed_step_seq < self._load_fence:
                return None, False
            return hit, load_async

        return lookup_after_fence

    def make_spec_decoding_stats(self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens, *args,
                                 **kwargs):
        # vLLM calls this once for each request whose drafts the step verified, inside update_from_output.
        self._verified[0] += num_draft_tokens
        self._verified[1] += num_accepted_tokens
        key = self._prompt_keys.get(kwargs.get("request_id"))
        if key is not None:
            self.drafts.verified(key, num_accepted_tokens, tokens_tested(num_draft_tokens, num_accepted_tokens))
        return super().make_spec_decoding_stats(spec_decoding_stats, num_draft_tokens, num_accepted_tokens, *args,
                                                **kwargs)

    def update_from_output(self, scheduler_output, *args, **kwargs):
        self._verified = [0, 0]
        outputs = super().update_from_output(scheduler_output, *args, **kwargs)
        started = time.perf_counter()
        done = not self.has_unfinished_requests()
        if done:  # a generate() call ends here: the statistics, whole and saved, before its last output leaves
            self._save_stats()
            self.timer.add_adapter(time.perf_counter() - started)  # in this, the pass's last record
            started = time.perf_counter()
        self._step_done(scheduler_output)
        self.timer.add_adapter(time.perf_counter() - started)
        if done:
            self.trace.flush()
        return outputs

    def _step_done(self, scheduler_output) -> None:
        now = time.monotonic()
        timed = self.timer.done(scheduler_output, now)
        if timed is None:
            return
        record, latency = timed
        per_request = scheduler_output.num_scheduled_tokens
        decode_requests = list(per_request.values()).count(1)  # in C: a generator took ~30 us at 1,024 requests
        decode_tokens = decode_requests
        drafted = scheduler_output.scheduled_spec_decode_tokens
        if drafted:  # a decode with k drafts schedules 1 + k tokens
            decode_requests += len(drafted)
            decode_tokens += sum(map(per_request.__getitem__, drafted))
        prefill_tokens = scheduler_output.total_num_scheduled_tokens - decode_tokens
        if scheduler_output.total_num_scheduled_tokens:
            self.batch_policy.observe_step(latency, decode_requests, prefill_tokens)
        if record is not None:
            # This step's adapter time: its schedule() and what came since the last record (the finishes, the
            # records' writing); the writing that follows counts in the next.
            self.trace.add(record, StepDone(latency, decode_requests, prefill_tokens, *self.timer.take(),
                                            *self._verified))
            if self.trace.due(now):
                self.trace.flush()

    if not hasattr(Scheduler, "get_request_counts"):  # vLLM 0.26; where vLLM has it, its own calls go direct
        def get_request_counts(self) -> tuple[int, int]:
            return len(self.running), len(self.waiting)

    def _save_stats(self) -> None:
        self._tell_finishes()  # the saved statistics hold every finish
        if self.stats_out:
            self.batch_policy.stats.save(self.stats_out)

    def shutdown(self) -> None:
        try:
            for record in self.timer.unfinished():
                self.trace.add(record, None)
            self.trace.flush()
            self._save_stats()
            if self.memory is not None:
                self._save_memory()
            self.trace.close()
        finally:
            super().shutdown()


class NoWorkerDrafts:
    """vLLM's `custom_class` proposer for the worker when this scheduler drafts (policy.spec_draft_tokens): it
    proposes nothing, so the drafts verified are the ones the scheduler puts in each request's `spec_token_ids`."""

    def __init__(self, vllm_config) -> None:
        pass

    def load_model(self, model) -> None:
        pass

    def propose(self, sampled_token_ids, *args, **kwargs) -> list[list[int]]:
        return [[] for _ in sampled_token_ids]


def fresh_requests_load_nothing(lookup):
    """The KV connector's lookup (`get_num_new_matched_tokens`: what host memory holds of a request past the GPU's
    prefix cache), asked for nothing on behalf of a request that has generated no token. Such a request has
    nothing of its own in host memory, only its prompt's blocks that a sibling wrote there and the GPU's cache no
    longer holds in full; vLLM would load them asynchronously, the request waiting a step or more outside the
    running set while it holds its blocks, and a group's samples, admitted together where nothing is loaded,
    would come in one at a time, the last of them preempted first (the least output). Its prompt's prefill is
    cheap beside the decode it starts (a token's prefill about a tenth of a decode step's share); a preempted
    request, which has generated tokens, still loads them back. The connector's own path for a request that
    reads no cache (PREFIX_SKIP: 0.24-0.33's `skip_reading_prefix_cache`, 0.34's `prefix_cache_hit_limit`, which
    the connector's lookup reads while it is not None) answers: it finds no hit and counts none."""
    skip = True if PREFIX_SKIP == "skip_reading_prefix_cache" else 0

    def lookup_past_the_prompt(request, *args, **kwargs):
        before = getattr(request, PREFIX_SKIP)
        if request.num_output_tokens or before not in (False, None):  # it reads no cache already
            return lookup(request, *args, **kwargs)
        setattr(request, PREFIX_SKIP, skip)  # read only by the connector's lookup within this call
        try:
            return lookup(request, *args, **kwargs)
        finally:
            setattr(request, PREFIX_SKIP, before)

    return lookup_past_the_prompt


class HostBlocks:
    """What vLLM's offloading connector holds in host memory for each request (its scheduler side: the manager
    and, per request, the keys of its blocks and how many of them it has stored), for marking a preempted
    request's blocks as just used. Host memory evicts the least recently used blocks first; vLLM 0.32 marks a
    request's blocks used when the request finishes, so the blocks of the many requests that finish after a
    preemption come to stand before the victim's, and host memory evicts the blocks that a resume needs before
    those that no request reads again (0.26 marks them at each store and lookup instead). Marked at its
    preemption, a victim's blocks outlast every block written before it: host memory keeps them as long as less
    than its size is written before the victim resumes, what the simulator's `HostOffload` assumes. The
    connector's request states (`_req_status`) are private; where a vLLM lacks them, `host_block_keys` finds
    none and nothing is marked."""

    def __init__(self, connector_scheduler) -> None:
        self.manager = connector_scheduler.manager
        self.states = connector_scheduler._req_status

    def refresh(self, request_id: str) -> None:
        state = self.states.get(request_id)
        for group in getattr(state, "group_states", ()):  # the manager marks the first block the most recent
            stored = getattr(group, "offload_keys", [])[:getattr(  # 0.24 counts blocks, 0.26 on chunks
                group, "next_stored_chunk_idx", getattr(group, "next_stored_block_idx", 0))]
            self.manager.touch(stored, state.req_context)


def host_block_keys(connector) -> HostBlocks | None:
    """`HostBlocks` for vLLM's offloading connector (`connector`, the scheduler's KV connector), or None where
    there is none or its scheduler side keeps no per-request block keys and stored counts."""
    scheduler_side = getattr(connector, "connector_scheduler", None)
    states = getattr(scheduler_side, "_req_status", None)
    if not isinstance(states, dict) or not callable(getattr(getattr(scheduler_side, "manager", None), "touch", None)):
        return None
    return HostBlocks(scheduler_side)


class DynamicBatchScheduler(_DynamicBatchMixin, Scheduler):
    """Synchronous scheduling (CPU, or GPU with async_scheduling=False)."""


class AsyncDynamicBatchScheduler(_DynamicBatchMixin, AsyncScheduler):
    """Async scheduling (vLLM's default on GPU)."""


class RolloutScheduler:
    """The one name to give an engine someone else builds (`--scheduler-cls rollout.vllm_adapter.RolloutScheduler`):
    vLLM calls it as it calls a scheduler class, and it builds the one that matches the engine's async scheduling
    (vLLM takes a custom class in place of its own choice between Scheduler and AsyncScheduler, and a synchronous
    one under async scheduling costs every step)."""

    def __new__(cls, *args, vllm_config, **kwargs):
        chosen = AsyncDynamicBatchScheduler if vllm_config.scheduler_config.async_scheduling else DynamicBatchScheduler
        return chosen(*args, vllm_config=vllm_config, **kwargs)


def scheduler_class_path(async_scheduling: bool) -> str:
    cls = AsyncDynamicBatchScheduler if async_scheduling else DynamicBatchScheduler
    return f"{cls.__module__}.{cls.__qualname__}"
