"""vLLM's own scheduler, ours or its default, driven without a model in simulated time: the check on the simulator
where what matters is vLLM's code rather than ours (rollout/sim/engine.py re-implements vLLM's loop and leaves
out its KV connectors).

The scheduler (rollout.vllm's, or vLLM's `Scheduler` at a static cap) is built from a VllmConfig over a
model folder holding only a config.json, as vLLM's own scheduler tests build theirs; each step every scheduled
request whose prompt is computed samples one token, and the step takes what the fitted `StepTimeModel` says. With
`host_offload_bytes`, vLLM's OffloadingConnector runs its scheduler side: a load (a preempted request resuming)
completes once the host link has moved its tokens, the link carrying one load at a time, while the engine steps on;
a store completes at the end of the step that asked for it (write-through, a block at a time, on its own stream).
`Driver` also steps the adapter's tests, there with async scheduling's one-step overlap where a test asks for it;
`profile_run` steps without it. Not modelled: the worker's copies themselves.
"""

from __future__ import annotations

import json
import math
import zlib
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from rollout.sim.engine import StepTimeModel
from rollout.vllm.versions import OFFLOADING_CONNECTOR


def sampled_token(request_id: str) -> int:
    """What request `request_id` samples at every step: its own token, so that samples of one prompt differ as
    real samples do. Were they alike, a prompt's samples would share their generated blocks in the prefix cache,
    and a preempted one would find what it had computed among its siblings' blocks (on tail-bound's first pass
    a tenth of what preemptions threw away was then computed again, where an H200 computed two thirds again)."""
    return 1 + zlib.crc32(request_id.encode()) % 997


def config_only_model(folder: Path, vocab_size: int = 1024, max_model_len: int = 2048) -> Path:
    """A model folder vLLM's config reads: a one-layer Llama's config.json, no weights, no tokenizer."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab_size, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 1, "num_key_value_heads": 1,
        "head_dim": 64, "max_position_embeddings": max_model_len, "torch_dtype": "float32"}))
    return folder


# A token's KV bytes in the scheduler's own cache spec (one layer, one head of size 1, float32: a key and a value),
# by which vLLM's offloading divides the host memory it is given.
SPEC_KV_BYTES_PER_TOKEN = 8


def host_bytes_for(host_offload_bytes: int, kv_bytes_per_token: int | None, block_size: int) -> int:
    """The host memory to give vLLM's offloading over this scheduler's cache spec for it to hold as many blocks as
    `host_offload_bytes` holds of a model's KV of `kv_bytes_per_token` (None: the spec's own): vLLM divides it by a
    block's bytes rounded up to its alignment."""
    if kv_bytes_per_token is None:
        return host_offload_bytes
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    align = getattr(CPUOffloadingSpec, "BLOCK_SIZE_ALIGNMENT", 1)
    blocks = host_offload_bytes // (kv_bytes_per_token * block_size)
    return blocks * -(-SPEC_KV_BYTES_PER_TOKEN * block_size // align) * align


def kv_cache_tensors(num_blocks: int, page_bytes: int, layer: str) -> list:
    """The KV cache allocation a worker would make for one layer of `num_blocks` pages of `page_bytes`, as vLLM's
    KVCacheTensor describes it. The scheduler never allocates it, but vLLM's offloading sizes a host block from it
    (the tensors' bytes over num_blocks): with none, 0.24 divides by zero and 0.26-0.29 give host memory no block
    (every store refused); 0.31 on fall back to the groups' page size, which this equals. Its fields changed in
    0.29 (`shared_by` became `layers` with strides)."""
    from dataclasses import fields

    from vllm.v1.kv_cache_interface import KVCacheTensor

    size = num_blocks * page_bytes
    if "layers" in {f.name for f in fields(KVCacheTensor)}:  # 0.29 on: one layer-outermost allocation
        return [KVCacheTensor(size=size, layers=[layer], layer_stride=size, block_stride=page_bytes)]
    return [KVCacheTensor(size=size, shared_by=[layer])]  # up to 0.26: one unpacked tensor (block_stride 0)


def build_scheduler(model_dir, additional_config: dict | None, *, num_blocks: int, block_size: int = 16,
                    max_num_seqs: int = 8, max_num_batched_tokens: int = 512, max_model_len: int = 1024, cls=None,
                    async_scheduling: bool = False, prefix_caching: bool = False,
                    host_offload_bytes: int | None = None, kv_bytes_per_token: int | None = None):
    """`cls` (vLLM's `Scheduler` where None) over `num_blocks` KV blocks (one of them vLLM's null block), with
    `additional_config` (rollout's scheduler reads its settings there: rollout.vllm.settings.adapter_settings).
    `host_offload_bytes`: vLLM's native KV offloading to that much host memory (model.kv_offloading_gib), its
    scheduler side; measured in a model's KV of `kv_bytes_per_token` (None: this scheduler's own, a few bytes a
    token), so that host memory holds as many tokens as it would for that model."""
    import torch
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    model = ModelConfig(model=str(model_dir), dtype="float32", seed=0, skip_tokenizer_init=True,
                        max_model_len=max_model_len)
    config = VllmConfig(
        model_config=model,
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                         max_model_len=max_model_len, enable_chunked_prefill=True,
                                         is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=block_size, cache_dtype="auto", enable_prefix_caching=prefix_caching),
        kv_transfer_config=None if host_offload_bytes is None else KVTransferConfig(
            kv_connector=OFFLOADING_CONNECTOR, kv_role="kv_both",
            kv_connector_extra_config={"cpu_bytes_to_use": host_bytes_for(host_offload_bytes, kv_bytes_per_token,
                                                                          block_size),
                                       "offload_prompt_only": False}),
        additional_config=additional_config or {})
    config.cache_config.num_gpu_blocks = num_blocks
    # As a GPU engine's config has it (vLLM's CPU platform turns async scheduling off while building the config).
    config.scheduler_config.async_scheduling = async_scheduling
    page = SPEC_KV_BYTES_PER_TOKEN * block_size
    kv_cache = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=kv_cache_tensors(num_blocks, page, "layer"),
                             kv_cache_groups=[KVCacheGroupSpec(["layer"], FullAttentionSpec(
                                 block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32))])
    assert kv_cache.kv_cache_groups[0].kv_cache_spec.page_size_bytes == page
    return (cls or Scheduler)(vllm_config=config, kv_cache_config=kv_cache, block_size=block_size, log_stats=False,
                              structured_output_manager=StructuredOutputManager(config))


@dataclass
class LoopResult:
    """One pass through vLLM's scheduler: its clock and tokens, and what the scheduler did at each step."""

    makespan_s: float = 0.0
    generated_tokens: int = 0
    steps: int = 0
    preemptions: int = 0
    running: list = field(default_factory=list)  # requests running after each step
    loading: list = field(default_factory=list)  # requests whose blocks a load holds, after each step
    caps: list = field(default_factory=list)  # the admission cap at each step
    started_s: dict = field(default_factory=dict)  # request id -> the clock at its first scheduled step
    finished_s: dict = field(default_factory=dict)  # request id -> the clock when it finished
    preempted: dict = field(default_factory=dict)  # request id -> times it was preempted
    longest_tenth_done_s: float = 0.0  # when the pass's longest tenth (by max_tokens) had all finished

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.makespan_s if self.makespan_s else 0.0


class Driver:
    """Drives a scheduler as the engine core does: schedule(), the model's output, update_from_output(), each
    scheduled request whose prompt is computed sampling its own token (`sampled_token`). `overlap` (async
    scheduling): the next step is scheduled before the last one's output arrives. `step_time`: what each step
    takes on the clock (None: the clock stands still). With a KV connector (vLLM's OffloadingConnector), a store
    completes at the end of the step that asked for it, a load once the host link has moved its tokens
    (`load_s_per_token`; 0: within the step), the link carrying one load at a time. `cap_attr`: the scheduler's
    admission cap, recorded at each step; `observe(clock, scheduler)`: called after each step."""

    def __init__(self, scheduler, requests: list, step_time: StepTimeModel | None = None, *, overlap: bool = False,
                 load_s_per_token: float = 0.0, cap_attr: str | None = None, observe=None) -> None:
        self.scheduler = scheduler
        self.requests, self.tokens = {}, {}
        self.step_time, self.overlap, self.load_s_per_token = step_time, overlap, load_s_per_token
        self.cap_attr, self.observe = cap_attr, observe
        self.loads = [] if scheduler.connector is not None else None  # (done at, job id, request id)
        self.in_flight: deque = deque()  # (scheduler output, model output) not yet given back
        self.clock = self.link_free = 0.0
        self.result = LoopResult()
        self.add(requests)

    @property
    def finished(self) -> int:
        """Requests finished so far."""
        return len(self.result.finished_s)

    def add(self, requests: list) -> None:
        """Hand `requests` (vLLM Request objects, in submission order) to the scheduler."""
        for r in requests:
            self.requests[r.request_id], self.tokens[r.request_id] = r, sampled_token(r.request_id)
            self.scheduler.add_request(r)

    def step(self):
        """One schedule() and the outputs that arrive after it; returns the scheduler's output."""
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.request import RequestStatus

        result, by_id = self.result, self.requests
        output = self.scheduler.schedule()
        result.preemptions += len(output.preempted_req_ids or ())
        for request_id in output.preempted_req_ids or ():
            result.preempted[request_id] = result.preempted.get(request_id, 0) + 1
        ids = list(output.num_scheduled_tokens)
        sampled = [[] if by_id[i].is_prefill_chunk else [self.tokens[i]] for i in ids]
        began = self.clock
        if self.step_time is not None and ids:
            decode = sum(n == 1 and bool(s) for n, s in zip(output.num_scheduled_tokens.values(), sampled))
            prefill = output.total_num_scheduled_tokens - decode
            kv_read = sum(by_id[i].num_computed_tokens - n for i, n in output.num_scheduled_tokens.items())
            self.clock += self.step_time(decode, kv_read, prefill)
        transferred = self._transfers(output, ids)
        for request_id in ids:
            result.started_s.setdefault(request_id, began)
        # vLLM 0.24-0.33's output also maps each request to its row; 0.34's has no such field.
        indexed = ({"req_id_to_index": {i: k for k, i in enumerate(ids)}}
                   if "req_id_to_index" in ModelRunnerOutput.__dataclass_fields__ else {})
        self.in_flight.append((output, ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled,
                                                         kv_connector_output=transferred, **indexed)))
        while self.in_flight and (len(self.in_flight) > 1 or not self.overlap or not ids):
            outputs = self.scheduler.update_from_output(*self.in_flight.popleft())
            for engine in outputs.values():
                for finished in engine.outputs:
                    if finished.finish_reason is not None:
                        result.finished_s[finished.request_id] = self.clock
        result.steps += 1
        if self.observe is not None:
            self.observe(self.clock, self.scheduler)
        result.running.append(len(self.scheduler.running))
        result.loading.append(sum(r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
                                  for r in self.scheduler.requests.values()) if self.loads is not None else 0)
        result.caps.append(getattr(self.scheduler, self.cap_attr) if self.cap_attr
                           else self.scheduler.max_num_running_reqs)
        return output

    def _transfers(self, output, ids: list):
        """The connector's output for this step: its stores, and the loads the host link has finished by now."""
        if self.loads is None:
            return None
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
        from vllm.v1.outputs import KVConnectorOutput

        meta = output.kv_connector_metadata
        for job_id, job in meta.load_jobs.items():
            self.link_free = (max(self.link_free, self.clock)
                              + self.requests[job.req_id].num_computed_tokens * self.load_s_per_token)
            self.loads.append((self.link_free, job_id, job.req_id))
        if not ids and self.loads:  # nothing to run until a load completes
            self.clock = max(self.clock, min(done for done, _, _ in self.loads))
        done = [load for load in self.loads if load[0] <= self.clock]
        self.loads = [load for load in self.loads if load[0] > self.clock]
        return KVConnectorOutput(
            finished_recving={request_id for _, _, request_id in done} or None,
            kv_connector_worker_meta=OffloadingWorkerMetadata(completed_jobs={
                **dict.fromkeys(meta.store_jobs, 1), **{job_id: 1 for _, job_id, _ in done}}))

    def steps(self, limit: int = 10 ** 7):
        """Steps until every request finished; at most `limit` of them."""
        for _ in range(limit):
            if not self.scheduler.has_unfinished_requests() and not self.in_flight:
                return
            yield self.step()
        raise RuntimeError(f"requests left after {limit} steps: {self.scheduler.get_request_counts()}")

    def run(self, limit: int = 10 ** 7) -> LoopResult:
        """Steps until every request finished; the pass's result."""
        for _ in self.steps(limit):
            pass
        result, requests = self.result, list(self.requests.values())
        result.makespan_s = self.clock
        cut = np.quantile([r.max_tokens for r in requests], 0.9) if requests else 0
        result.longest_tenth_done_s = max((result.finished_s.get(r.request_id, self.clock) for r in requests
                                           if r.max_tokens >= cut), default=0.0)
        result.generated_tokens = sum(len(r.output_token_ids) for r in requests)
        return result


def profile_run(bench, profile, name: str, step_time: StepTimeModel, work: Path, *, kv_bytes_per_token: int,
                iterations: int | None = None, block_size: int = 16, token_budget: int = 16384,
                observe=None) -> list[tuple[LoopResult, list]]:
    """A bench profile's passes (from the bench's `start_iteration`, ours starting from the files it would have
    saved in the earlier ones; up to `iterations`, the profile's where None) under scheduler `name`
    (rollout.suite's names; `vllm`: vLLM's own Scheduler at its default cap) on one scheduler, submitted as
    RolloutEngine submits them: for a policy that orders longest first, by what the scheduler's per-prompt memory
    learned, a probe of each prompt it never saw first. Returns each pass's result and the adapter's trace
    records of its steps."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from rollout.policy.length_stats import prompt_key
    from rollout.sim.engine import HOST_LINK_BYTES_PER_S
    from rollout.sim.runs import VLLM_DEFAULT_MAX_NUM_SEQS, engine_submission, probes_first, scheduler_settings
    from rollout.suite import save_learned_state
    from rollout.vllm.scheduler import HOOKS, DynamicBatchScheduler
    from rollout.vllm.settings import NOMINAL_MAX_TOKENS_KEY, adapter_settings
    from rollout.workloads import longest_first, profile_requests

    ours = name.split(":")[0] != "vllm"
    settings = scheduler_settings(bench, name) if ours else {}
    learns = settings.get("order") == "longest_first"
    probes = probes_first(settings)
    passes = [profile_requests(profile, k, bench.seed, bench.vocab_size)
              for k in range(bench.start_iteration, profile.iterations if iterations is None else iterations)]
    longest = max(len(r.prompt.token_ids) + r.output_tokens for requests in passes for r in requests)
    max_model_len = 1 << math.ceil(math.log2(longest + 1))
    model_dir = config_only_model(work / "model", bench.vocab_size, max_model_len)
    trace = work / f"{name.replace(':', '_')}.jsonl"
    host = int(bench.kv_offloading_gib * 2 ** 30) if bench.kv_offloading_gib else None
    state_dir = stats_in = None
    if ours and bench.start_iteration:  # what the bench's engine starts from
        state_dir = work / "state"
        stats_in = str(save_learned_state(state_dir, profile, bench.seed, bench.vocab_size, bench.start_iteration,
                                          settings))
    scheduler = build_scheduler(
        model_dir, adapter_settings(settings, str(trace), state_dir and str(state_dir), stats_in, None)
        if ours else None,
        num_blocks=profile.kv_cache_memory_bytes // kv_bytes_per_token // block_size + 1, block_size=block_size,
        max_num_seqs=int(settings["b_max"]) if ours else VLLM_DEFAULT_MAX_NUM_SEQS,
        max_num_batched_tokens=token_budget, max_model_len=max_model_len,
        cls=DynamicBatchScheduler if ours else None, prefix_caching=bench.prefix_caching, host_offload_bytes=host,
        kv_bytes_per_token=kv_bytes_per_token)
    init_none_hash(sha256)
    hasher = get_request_block_hasher(block_size, sha256) if bench.prefix_caching else None
    results = []
    try:
        for iteration, requests in enumerate(passes):
            if name.split(":")[0] == "oracle":
                requests = longest_first(requests)
            elif learns:
                keys = [prompt_key(r.prompt.token_ids) for r in requests]
                requests = [requests[i] for i in engine_submission(scheduler.memory.lengths, requests, keys, probes)]
            vllm_requests = [
                Request(request_id=f"{iteration}-{k}", prompt_token_ids=list(r.prompt.token_ids), pooling_params=None,
                        sampling_params=SamplingParams(max_tokens=r.output_tokens, ignore_eos=True, extra_args={
                            NOMINAL_MAX_TOKENS_KEY: profile.max_output}), block_hasher=hasher)
                for k, r in enumerate(requests)]
            results.append(Driver(scheduler, vllm_requests, step_time,
                                  load_s_per_token=kv_bytes_per_token / HOST_LINK_BYTES_PER_S,
                                  cap_attr=HOOKS.cap if ours else None, observe=observe).run())
    finally:
        scheduler.shutdown()
    records = [json.loads(line) for line in trace.read_bytes().split(b"\n") if line] if trace.is_file() else []
    records = [r for r in records if "step" in r]
    split, first = [], 0
    for result in results:  # the adapter numbers its steps from the engine's start
        split.append([r for r in records if first < r["step"] <= first + result.steps])
        first += result.steps
    return list(zip(results, split)) if records else [(result, []) for result in results]
