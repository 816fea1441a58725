"""The scheduler vLLM loads (`scheduler_cls="rollout.vllm.RolloutScheduler"`): a subclass of vLLM's that sets the
admission cap every step, its settings read from `additional_config={"rollout": {...}}` (rollout.vllm.settings).

It learns by itself what it needs (the length statistics, each prompt's lengths, the longest-first order, the
probes), from the requests that reach it, whoever drives the engine; it writes a per-step trace
(rollout.vllm.trace) and what it learned (`state_dir`, rollout.vllm.prompt_store) to files the driver reads back.
The neighbours hold one concern each: the vLLM release's names (versions), the pass's requests (pass_state), the
per-prompt memory and queue order (prompt_store), the rules under a KV connector (offloading), tail drafts
(drafting), preemptions' cost (recompute), the trace and the timer (trace).

The cap knob depends on the installed vLLM: 0.32 has `max_num_active_reqs` (admission only, safe to move between
steps); 0.24-0.31 have only `max_num_running_reqs`, which they also assert against the running count, so the cap
is never set below that. `max_num_seqs` stays at B_max because the model runner sizes buffers from it. A policy
may also set the step's token budget (`max_num_scheduled_tokens`, read fresh by every schedule()).

Invariants: every request of a pass has a row in `PassState.table` from add_request until the pass ends; every
finish passes `_free_request` once and reaches the policy at the next schedule(), before it is asked; the policy is
asked through `rollout.policy.step.decide`, as the simulator asks it.
"""

from __future__ import annotations

import itertools
import time
from operator import attrgetter
from pathlib import Path

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from rollout.policy import FallbackPolicy, LengthStats, PolicyConfig, StepState, make_policy
from rollout.policy.prompt_memory import PromptMemory
from rollout.policy.step import StepGate, decide, least_progress_last, preemption_possible, promote_to_front
from rollout.vllm.drafting import TailDrafts
from rollout.vllm.offloading import Offloading
from rollout.vllm.parent import end_with_parent
from rollout.vllm.pass_state import PassState
from rollout.vllm.prompt_store import (STATE_PROMPTS_FILE, STATE_STATS_FILE, PromptStore, arrive_unknown,
                                       is_reorderable, reorder_probed_siblings)
from rollout.vllm.recompute import Recomputation
from rollout.vllm.settings import graph_batch, nominal_max_tokens, read_settings
from rollout.vllm.trace import NoTrace, StepDone, StepRecord, StepTimer, TraceWriter, policy_trace_fields
from rollout.vllm.versions import resolve

# Every private name of vLLM's scheduler the adapter uses, checked once against the installed vLLM (a renamed hook
# would silently stop being called): an ImportError names the version.
HOOKS = resolve()

# What each of rollout.policy.config.PREEMPTION_ORDERS but vLLM's own puts last in the running list.
PROGRESS = {"least_output": attrgetter("num_output_tokens"), "least_computed": attrgetter("num_computed_tokens")}


class _DynamicBatchMixin:
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        settings = read_settings(self.vllm_config.additional_config)
        if settings.get("end_with_parent"):
            end_with_parent()
        config = PolicyConfig.from_dict(settings["policy"])
        self.offloading = Offloading(self, HOOKS) if self.connector is not None else None
        if self.offloading is not None and self.offloading.native:
            config = config.under_kv_offloading()
        state_dir = Path(settings["state_dir"]) if settings.get("state_dir") else None
        if state_dir is not None:
            state_dir.mkdir(parents=True, exist_ok=True)
        saved_stats = state_dir / STATE_STATS_FILE if state_dir is not None else None
        # The statistics' forgetting is the policy's setting, wherever the settings came from.
        options = {"forgetting": config.forgetting, "window": config.window, "decay": config.decay}
        stats_in = settings.get("stats_in") or (saved_stats if saved_stats is not None and saved_stats.is_file()
                                                else None)
        stats = LengthStats.load(stats_in, **options) if stats_in else LengthStats(**options)
        self.stats_out = settings.get("stats_out") or saved_stats
        self.max_cap = self.scheduler_config.max_num_seqs
        self.graph_batch = graph_batch(self.vllm_config)
        self.batch_policy = FallbackPolicy(make_policy(config, stats, self.graph_batch),
                                           min(config.static_cap or self.max_cap, self.max_cap))
        self.kv_capacity_blocks = self.kv_cache_manager.block_pool.num_gpu_blocks - 1  # block 0 is the null block
        # What the scheduler learns of prompts by itself (where no driver sends it): kept in state_dir if given.
        self.prompts = None
        if settings.get("learn_prompts", True):
            self.prompts = PromptStore(PromptMemory(None, config.order, config.probe_first),
                                       state_dir / STATE_PROMPTS_FILE if state_dir is not None else None)
        self._prompt_keys: dict[str, str] = {}  # request id -> its prompt's key (rollout.policy.length_stats)
        self.trace = TraceWriter(settings["trace_path"]) if settings.get("trace_path") else NoTrace()
        self.trace.event({"event": "start", "policy": self.batch_policy.name,
                          "kv_capacity_blocks": self.kv_capacity_blocks, "block_size": self.block_size,
                          "max_cap": self.max_cap, "graph_batch": self.graph_batch, "cap_attr": HOOKS.cap,
                          "stats_count": self.batch_policy.stats.count})
        self.timer = StepTimer(detail=settings.get("timing", True))
        self.pass_state = PassState(bool(getattr(self.cache_config, "enable_prefix_caching", False)),
                                    self.block_size)
        self.recomputation = Recomputation()
        self.gate = StepGate()
        self._step = 0
        self._finished = 0
        self._cap = self.max_cap
        self._policy_fields: dict = {}  # the policy's trace fields as it last answered
        # Finishes the policy has not been told of yet, (prompt tokens, output tokens, scale, group, row, aborted):
        # told at the next schedule(), together and just before the policy is asked; one at a time between vLLM's
        # own work, each cost several times more, its data out of cache.
        self._finishes: list[tuple] = []
        self._max_step_tokens = getattr(self, "max_num_scheduled_tokens", None)
        drafting = config.spec_draft_tokens if self.vllm_config.speculative_config is not None else 0
        self.drafts = TailDrafts(drafting, config.spec_max_batch, config.spec_min_gain) if drafting else None
        # Draft and accepted tokens of the step whose output is being read (whoever drafted them), for its record.
        self._verified = [0, 0]

    @property
    def memory(self) -> PromptMemory | None:
        """The per-prompt memory (None: `learn_prompts` false)."""
        return self.prompts.memory if self.prompts is not None else None

    def add_request(self, request) -> None:
        started = time.perf_counter()
        if self.pass_state.pending == 0:  # requests arrive at an idle engine: a new pass (RL iteration)
            self._tell_finishes()  # any the last pass left, before the new one starts
            if self.prompts is not None:
                self.prompts.reload()
            self.batch_policy.start_pass(self.memory.open_pass() if self.memory is not None else None)
            if self.drafts is not None:
                self.drafts.new_pass()
        if self.prompts is None:
            arrive_unknown(request)
        else:
            self._prompt_keys[request.request_id] = self.prompts.arrive(request)
        base_started = time.perf_counter()
        super().add_request(request)
        base_ended = time.perf_counter()
        self.pass_state.arrive(request, nominal_max_tokens(request), request._rollout_scale)
        self.timer.add_adapter(base_started - started + time.perf_counter() - base_ended)

    def _free_request(self, request, *args, **kwargs):
        # Every finish (stop, length, abort of a stop string) passes here once.
        started = time.perf_counter()
        self._finished += 1
        probed = request._rollout_probe
        aborted = request.status == RequestStatus.FINISHED_ABORTED  # its length so far is no output's length
        if probed is not None and not aborted:
            self.pass_state.sibling_order.observe(probed, request.num_output_tokens)
        row, group = self.pass_state.finish(request, nominal_max_tokens(request))
        key = self._prompt_keys.pop(request.request_id, None)
        self.recomputation.forget(request.request_id)
        if self.drafts is not None:
            self.drafts.finished(request, key)
        if self.prompts is not None:
            if key is not None and not aborted:
                self.memory.finished(key, request.num_output_tokens)
            if self.pass_state.pending == 0:  # the pass's last request: what it taught is kept
                self.prompts.save(self.memory.close_pass())
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
        if self.prompts is not None and self.prompts.arrived:
            self.prompts.put_arrivals_in_order(self.waiting)
        asked = time.perf_counter()
        num_running, num_waiting = self.get_request_counts()
        held, front = self.offloading.outside_running() if self.offloading is not None else ((), ())
        if held or front:  # counted as the policy sees them: the held ones run, the rest wait
            num_running, num_waiting = len(self.running) + len(held), len(self.waiting) + len(front)
        events = (num_running, num_waiting, self._finished, self.recomputation.preempted)
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
        setattr(self, HOOKS.cap, self._cap)
        if self.drafts is not None:
            self.drafts.set(self.running, self._prompt_keys)
        order = self.batch_policy.preemption_order
        if order != "vllm" and preemption_possible(
                self._kv_free_blocks(), len(self.running), self.max_num_scheduled_tokens, self.block_size):
            least_progress_last(self.running, PROGRESS[order])
        self.recomputation.new_step()
        step_start = time.monotonic()
        hidden = (self.offloading.meter(self._cap - len(self.running) - len(held), front)
                  if self.offloading is not None else ())
        base_started = time.perf_counter()
        self.timer.add_adapter(base_started - started)
        try:
            output = super().schedule(*args, **kwargs)
        finally:
            for queue, requests in hidden:  # behind whatever the step left there, in their order
                queue.extend(requests)
        base_ended = time.perf_counter()
        recovered = self.recomputation.recovered(output.num_scheduled_tokens, self.requests)
        self._step += 1
        record = None
        if num_running or num_waiting:
            if not skipped:  # where the policy was not asked, its fields are as it last gave them
                self._policy_fields = policy_trace_fields(self.batch_policy.trace_fields(), self.block_size)
            running_after, waiting_after = self.get_request_counts()
            record = StepRecord(
                step=self._step, start=step_start, cap=self._cap, running=running_after, waiting=waiting_after,
                kv_usage=self.kv_cache_manager.usage,
                preempted=len(getattr(output, "preempted_req_ids", None) or ()),
                scheduled_tokens=output.total_num_scheduled_tokens, finished=self._finished,
                recomputed_tokens=self.recomputation.step_recomputed, recovered_tokens=recovered,
                policy_s=policy_s, policy_cpu_s=policy_cpu_s, policy_skipped=skipped,
                describe_cpu_us=describe_cpu_us,
                token_budget=None if budget is None else self.max_num_scheduled_tokens,
                length_scaled=self.pass_state.scaled, policy_fields=self._policy_fields,
                kv_held=len(self.offloading.outside_running()[0]) if self.offloading is not None else 0)
        for lost in self.timer.scheduled(output, step_start, record):
            self.trace.add(lost, None)
        self.timer.add_adapter(time.perf_counter() - base_ended)
        return output

    def _decide(self, num_running: int, num_waiting: int, held=(), front=()):
        """The policy's decision. `held`: requests holding KV blocks outside the running set, shown as running;
        `front`: others vLLM admits before the waiting queue, shown at its head (see Offloading.outside_running)."""
        passing = self.pass_state
        prompt_tokens_mean, max_tokens_mean = passing.mean_pending()
        state = StepState(
            num_running=num_running, num_waiting=num_waiting, step=self._step,
            kv_capacity_blocks=self.kv_capacity_blocks, block_size=self.block_size,
            kv_free_blocks=self._kv_free_blocks(), pending_prompt_tokens_mean=prompt_tokens_mean,
            pending_max_tokens_mean=max_tokens_mean, max_tokens_bound=passing.max_tokens_bound,
        )

        def waiting_reader():
            queue = itertools.chain(front, self.waiting)
            return lambda n: passing.requests(list(itertools.islice(queue, n)))

        def tail_reader(n: int):
            # The waiting count may hold requests outside this queue (vLLM's KV-transfer holds): the tail must not
            # reach back into the head that count was cut by.
            n -= num_waiting - len(self.waiting)
            return passing.requests(list(itertools.islice(reversed(self.waiting), max(n, 0))))

        reorderable = is_reorderable(self.waiting)
        return decide(self.batch_policy, state, lambda: passing.requests([*self.running, *held]), waiting_reader,
                      max_num_seqs=self.max_cap, shape=passing.shape, max_step_tokens=self._max_step_tokens,
                      sibling_order=passing.sibling_order,
                      reorder=lambda: reorder_probed_siblings(self.waiting, passing.sibling_order),
                      clock=self.timer.cpu, tail=tail_reader if reorderable else None,
                      promote=(lambda picks: promote_to_front(self.waiting, picks)) if reorderable else None)

    def _preempt_request(self, request, *args, **kwargs):
        self.recomputation.preempting(request)
        self.batch_policy.observe_preempted(request.num_computed_tokens)
        base_preempt = super()._preempt_request
        if self.offloading is None:
            return base_preempt(request, *args, **kwargs)
        return self.offloading.preempt(request, lambda: base_preempt(request, *args, **kwargs))

    def make_spec_decoding_stats(self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens, *args,
                                 **kwargs):
        # vLLM calls this once for each request whose drafts the step verified, inside update_from_output.
        self._verified[0] += num_draft_tokens
        self._verified[1] += num_accepted_tokens
        if self.drafts is not None:
            self.drafts.step_verified(self._prompt_keys.get(kwargs.get("request_id")), num_draft_tokens,
                                      num_accepted_tokens)
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
            adapter_s, finish_cpu_us = self.timer.take()
            draft_tokens, accepted_tokens = self._verified
            self.trace.add(record, StepDone(latency_s=latency, decode_requests=decode_requests,
                                            prefill_tokens=prefill_tokens, adapter_s=adapter_s,
                                            finish_cpu_us=finish_cpu_us, draft_tokens=draft_tokens,
                                            accepted_tokens=accepted_tokens))
            if self.trace.due(now):
                self.trace.flush()

    if not HOOKS.request_counts:  # where vLLM has it, its own calls go direct
        def get_request_counts(self) -> tuple[int, int]:
            return len(self.running), len(self.waiting)

    def _kv_free_blocks(self) -> int:
        return round((1.0 - self.kv_cache_manager.usage) * self.kv_capacity_blocks)

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
            if self.prompts is not None:
                self.prompts.save()
            self.trace.close()
        finally:
            super().shutdown()


class DynamicBatchScheduler(_DynamicBatchMixin, Scheduler):
    """Synchronous scheduling (CPU, or GPU with async_scheduling=False)."""


class AsyncDynamicBatchScheduler(_DynamicBatchMixin, AsyncScheduler):
    """Async scheduling (vLLM's default on GPU)."""


class RolloutScheduler:
    """The one name to give an engine someone else builds (`--scheduler-cls rollout.vllm.RolloutScheduler`): vLLM
    calls it as it calls a scheduler class, and it builds the one that matches the engine's async scheduling (vLLM
    takes a custom class in place of its own choice between Scheduler and AsyncScheduler, and a synchronous one
    under async scheduling costs every step)."""

    def __new__(cls, *args, vllm_config, **kwargs):
        chosen = AsyncDynamicBatchScheduler if vllm_config.scheduler_config.async_scheduling else DynamicBatchScheduler
        return chosen(*args, vllm_config=vllm_config, **kwargs)


def scheduler_class_path(async_scheduling: bool) -> str:
    cls = AsyncDynamicBatchScheduler if async_scheduling else DynamicBatchScheduler
    return f"{cls.__module__}.{cls.__qualname__}"
