"""The adapter's rules under a KV connector (KV offloading: model.kv_offloading_gib), on the parts of the scheduler
that vLLM builds.

With a KV connector, a request whose blocks are being loaded waits outside the running set while it holds them,
and vLLM starts such loads for as many waiting requests as the free blocks allow, whatever the cap: the adapter
shows the policy those requests as running (`outside_running`), and lets vLLM's admission loop reach only as many
of the waiting requests as the cap leaves room for (`meter`). Under vLLM's offloading connector a request that has
generated nothing loads nothing, computing its prompt (`fresh_requests_load_nothing`), the policy runs under
`PolicyConfig.under_kv_offloading`, and a preempted request's blocks in host memory are marked as just used, so
that host memory evicts those of finished requests first (`HostBlocks`). Where vLLM defers a preempted request's
block free (async scheduling with a connector that loads) and its preemption loop does not stop at such a victim
(0.24-0.26), a victim's blocks free at once and no KV load starts until the step that may still write them has
been processed (the load fence).

Invariant (FCFS queues): the running requests and those holding blocks outside the running set are, after a step,
no more than its cap (but where the cap stands below what already runs or holds).
"""

from __future__ import annotations

from collections import deque

from vllm.v1.request import RequestStatus

from rollout.vllm.versions import OFFLOADING_CONNECTOR, Hooks


class Offloading:
    """The rules above for one scheduler (`scheduler`, which has a KV connector)."""

    def __init__(self, scheduler, hooks: Hooks) -> None:
        self.scheduler = scheduler
        connector = scheduler.connector
        transfer = scheduler.vllm_config.kv_transfer_config
        # The offloading rules apply under vLLM's own offloading connector alone, not under connectors that load KV
        # a request has never computed here (disaggregated prefill).
        self.native = transfer is not None and transfer.kv_connector == OFFLOADING_CONNECTOR
        self.host_blocks = None
        if self.native:
            connector.get_num_new_matched_tokens = fresh_requests_load_nothing(
                connector.get_num_new_matched_tokens, hooks.prefix_skip, hooks.prefix_skip_value)
            self.host_blocks = host_block_keys(connector)
        # Under async scheduling with a connector that loads, vLLM defers a preempted request's block free until the
        # step in flight ends; where its preemption loop does not stop at such a victim, one request short of a
        # block would preempt every request behind it. The adapter frees a victim's blocks at once instead, and
        # holds back every KV load until the step that may still write them has ended: a load runs on its own
        # stream, unordered against that step, and is the one writer that could land in those blocks before it; a
        # step's own writes follow the step in flight on the same stream.
        self.free_at_preemption = (getattr(scheduler, "defer_block_free", False)
                                   and not hooks.preemption_stops_at_deferred_frees)
        self.load_fence = 0  # no KV load starts before the step of this sequence number has been processed
        if self.free_at_preemption:
            connector.get_num_new_matched_tokens = self._loads_after_fence(connector.get_num_new_matched_tokens)
        # The queues vLLM admits from before `waiting`, in its order.
        self.queues = ((hooks.held_queue,) if hooks.held_queue else ()) + hooks.loading_queues
        self.held_queue = hooks.held_queue

    def preempt(self, request, base_preempt):
        """`base_preempt()` (vLLM's preemption of `request`) under the rules: the victim's host blocks marked as
        used, and its blocks freed at once where the free would be deferred past a step that may write them."""
        if self.host_blocks is not None:
            self.host_blocks.refresh(request.request_id)
        scheduler = self.scheduler
        if not (self.free_at_preemption and request.last_sched_seq > scheduler.processed_step_seq):
            return base_preempt()
        self.load_fence = max(self.load_fence, request.last_sched_seq)
        scheduler.defer_block_free = False  # vLLM's _free_request_blocks then returns the blocks to the pool at once
        try:
            return base_preempt()
        finally:
            scheduler.defer_block_free = True

    def _loads_after_fence(self, lookup):
        """The KV connector's lookup, answering "not yet" (None: vLLM asks again next step, the request waiting)
        for a request it would load while a step that may still write blocks freed at a preemption is in
        flight."""

        def lookup_after_fence(request, *args, **kwargs):
            hit, load_async = lookup(request, *args, **kwargs)
            if hit and self.scheduler.processed_step_seq < self.load_fence:
                return None, False
            return hit, load_async

        return lookup_after_fence

    def outside_running(self) -> tuple[list, list]:
        """The requests vLLM admits before the waiting queue, in its order: those that hold KV blocks (a connector
        loads them, or loaded them and they wait for a place), and the others (0.24-0.26 set aside there, for a
        step, a request whose blocks are still being stored)."""
        held, front = [], []
        for name in self.queues:
            for request in getattr(self.scheduler, name, None) or ():
                holds = request.status == RequestStatus.WAITING_FOR_REMOTE_KVS or request.num_computed_tokens > 0
                (held if holds else front).append(request)
        return held, front

    def meter(self, room: int, front: list) -> list[tuple]:
        """vLLM starts a load for every waiting request whose blocks it finds, as long as blocks are free, and
        counts none of them against the cap (a loading request is not running): the preempted requests' loads would
        take the blocks the forecast leaves for the running ones' growth, and those would be preempted in turn. So
        only `room` requests that hold no blocks (`front` first, then the waiting queue's head) are left where
        vLLM's admission loop reaches them; the others are taken out for this step. Returns (queue, requests taken
        out of it, in order), for the scheduler to put back behind what the step leaves there. Priority queues
        (heaps) keep their order themselves and are left whole."""
        hidden = []
        held_queue = getattr(self.scheduler, self.held_queue, None) if self.held_queue else None
        room = max(room, 0)
        if len(front) > room and isinstance(held_queue, deque):
            out = set(map(id, front[room:]))
            kept = [r for r in held_queue if id(r) not in out]
            hidden.append((held_queue, [r for r in held_queue if id(r) in out]))
            held_queue.clear()
            held_queue.extend(kept)
        room = max(room - len(front), 0)
        waiting = self.scheduler.waiting
        if len(waiting) > room and isinstance(waiting, deque):
            taken = [waiting.pop() for _ in range(len(waiting) - room)]
            taken.reverse()
            hidden.append((waiting, taken))
        return hidden


def fresh_requests_load_nothing(lookup, skip_attribute: str, skip_value):
    """The KV connector's lookup (`get_num_new_matched_tokens`: what host memory holds of a request past the GPU's
    prefix cache), asked for nothing on behalf of a request that has generated no token. Such a request has
    nothing of its own in host memory, only its prompt's blocks that a sibling wrote there and the GPU's cache no
    longer holds in full; vLLM would load them asynchronously, the request waiting a step or more outside the
    running set while it holds its blocks, and a group's samples, admitted together where nothing is loaded,
    would come in one at a time, the last of them preempted first (the least output). Its prompt's prefill is
    cheap beside the decode it starts (a token's prefill about a tenth of a decode step's share); a preempted
    request, which has generated tokens, still loads them back. The connector's own path for a request that
    reads no cache (`skip_attribute` set to `skip_value`: 0.24-0.33's `skip_reading_prefix_cache` flag, 0.34's
    `prefix_cache_hit_limit` of 0, which the connector's lookup reads while it is not None) answers: it finds no
    hit and counts none."""

    def lookup_past_the_prompt(request, *args, **kwargs):
        before = getattr(request, skip_attribute)
        if request.num_output_tokens or before not in (False, None):  # it reads no cache already
            return lookup(request, *args, **kwargs)
        setattr(request, skip_attribute, skip_value)  # read only by the connector's lookup within this call
        try:
            return lookup(request, *args, **kwargs)
        finally:
            setattr(request, skip_attribute, before)

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
