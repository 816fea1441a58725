"""The adapter's decisions without a model, as vLLM's own scheduler tests do it: our scheduler built from a
VllmConfig over a KV cache of a few blocks, and driven by synthetic model outputs (one token for every scheduled
request whose prompt is computed). A test runs a few dozen steps in milliseconds; it starts no engine.

What the tests read is public: the cap attribute vLLM admits by, the order of `scheduler.waiting`, the trace
file, and what the policy was asked with (a spy put in the policy's place after the scheduler is built)."""

import json
import math
import re
import threading
import zlib

import pytest
import vllm
from vllm.config import ModelConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from rollout.sim.engine import StepTimeModel
from rollout.sim.vllm_loop import Driver, build_scheduler, config_only_model
from rollout.vllm.scheduler import AsyncDynamicBatchScheduler, DynamicBatchScheduler, RolloutScheduler
from rollout.vllm.settings import SETTINGS_KEY, adapter_settings, read_settings
from rollout.vllm.versions import (CAP_ATTRIBUTES, check_scheduler_hooks, preemption_stops_at_deferred_frees,
                                   vllm_release)

BLOCK = 16  # tokens per KV block
RELEASE = vllm_release(vllm.__version__)  # the installed vLLM's (major, minor): scripts/test-vllm-versions.sh runs several
CAP = check_scheduler_hooks()  # the attribute vLLM admits by


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A model folder vLLM's config can read: a tiny Llama's config.json, no weights, no tokenizer."""
    path = config_only_model(tmp_path_factory.mktemp("config-only-llama"))
    # Built once here: vLLM's first VllmConfig imports its platform's modules (seconds).
    make_scheduler(path, tmp_path_factory.mktemp("warm-up") / "trace", {"name": "static", "b_max": 4}).shutdown()
    return path


@pytest.fixture
def build(model_dir, tmp_path):
    """make_scheduler with this test's model folder and trace path (tmp_path / "trace.jsonl"); shut down after."""
    built = []

    def build(policy: dict, **options):
        built.append(make_scheduler(model_dir, tmp_path / "trace.jsonl", policy, **options))
        return built[-1]

    yield build
    for scheduler in built:
        scheduler.shutdown()


def make_scheduler(model_dir, trace_path, policy: dict, *, max_num_seqs: int = 8, num_blocks: int = 64,
                   cls=DynamicBatchScheduler, settings: dict | None = None, **options):
    """`cls` over `num_blocks` KV blocks of BLOCK tokens (rollout.sim.vllm_loop.build_scheduler, which takes
    `options`), configured as our driver configures it, or with `settings` as additional_config["rollout"] (as a
    user of vllm serve or an RL stack writes it)."""
    scheduler = build_scheduler(
        model_dir, {SETTINGS_KEY: settings} if settings is not None else adapter_settings(
            policy, str(trace_path), None, None, None),
        num_blocks=num_blocks, block_size=BLOCK, max_num_seqs=max_num_seqs, cls=cls, **options)
    assert scheduler.scheduler_config.max_num_seqs == max_num_seqs
    return scheduler


def request(name: str, prompt_tokens: int, max_tokens: int, block_hasher=None, **extra_args) -> Request:
    """A request whose prompt is its own (no two names share one, so the scheduler probes none). `block_hasher`:
    vLLM's, for the prefix cache to find its blocks."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra_args or None)
    return Request(request_id=name, prompt_token_ids=[1 + zlib.crc32(name.encode()) % 1000] * prompt_tokens,
                   sampling_params=params, pooling_params=None, block_hasher=block_hasher)


def block_hasher():
    """vLLM's block hasher for BLOCK-token blocks (what the prefix cache and host memory find blocks by)."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    return get_request_block_hasher(BLOCK, sha256)


class Spy:
    """Stands in for the adapter's policy: passes every call to `inner`, records what `batch_cap` was asked with
    and answered. `answer(state)` replaces the inner policy's answer; `steady` (steps) replaces its
    steady_until (the step before which the answer stands unless something changes); `describe` asks for the
    per-request arrays."""

    def __init__(self, inner, answer=None, steady=None, describe=False) -> None:
        self.inner, self.answer, self.steady, self.describe = inner, answer, steady, describe
        self.asks: list[tuple] = []  # (state, answer)
        self.preempted_tokens: list[int] = []  # what observe_preempted was told

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def wants_requests(self, state) -> bool:
        return self.describe or self.inner.wants_requests(state)

    def batch_cap(self, state) -> int:
        cap = self.inner.batch_cap(state) if self.answer is None else self.answer(state)
        self.asks.append((state, cap))
        return cap

    def observe_preempted(self, computed_tokens: int) -> None:
        self.preempted_tokens.append(computed_tokens)
        self.inner.observe_preempted(computed_tokens)

    def steady_until(self) -> float:
        if self.steady is None:
            return self.inner.steady_until()
        return self.asks[-1][0].step + self.steady if self.asks else 0


def spy_on(scheduler, **options) -> Spy:
    spy = Spy(scheduler.batch_policy.policy, **options)
    scheduler.batch_policy.policy = spy
    return spy


class Run(Driver):
    """vLLM's scheduler stepped as the engine core steps it (rollout.sim.vllm_loop.Driver), on no clock."""

    def events(self) -> tuple:
        """What the skip compares: (running, waiting, finished, preempted) before a step."""
        return (*self.scheduler.get_request_counts(), self.finished, self.result.preemptions)

    def steps(self, limit: int = 500):
        return super().steps(limit)


def trace_steps(path) -> list[dict]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert not any("policy_error" in r for r in records), records  # the policy (or the spy) never failed
    return [r for r in records if "step" in r]


# vLLM's private hooks


def test_the_installed_vllm_has_every_hook_the_adapter_uses(build):
    cap = check_scheduler_hooks()
    assert cap == CAP and cap in CAP_ATTRIBUTES
    scheduler = build({"name": "static", "b_max": 8}, num_blocks=20)
    # What the check found in the source is what a built scheduler and request have.
    assert getattr(scheduler, cap) == 8 and scheduler.kv_cache_manager.block_pool.num_gpu_blocks == 20
    assert isinstance(request("r", 4, 2)._output_token_ids, list)
    assert check_scheduler_hooks(DynamicBatchScheduler) == cap


def test_the_installed_vllms_preemption_stops_at_a_deferred_free_and_the_adapter_leaves_it_so(build):
    """vLLM 0.30 and later stop their preemption loop at a victim whose block free they defer (under async
    scheduling with a KV connector that loads); the adapter then frees nothing at once itself. A loop that preempts
    on (0.24-0.29's: the guard's call absent from `schedule`) is told apart, and the adapter frees at once there."""
    stops = preemption_stops_at_deferred_frees()
    assert stops == (RELEASE >= (0, 30))

    class PreemptsOn(Scheduler):
        def schedule(self):  # 0.26's loop: allocate, else preempt the last running request, until it fits
            return None

    assert not preemption_stops_at_deferred_frees(PreemptsOn)
    scheduler = build({"name": "static", "b_max": 8}, host_offload_bytes=1 << 24, cls=AsyncDynamicBatchScheduler,
                      async_scheduling=True)
    assert scheduler.defer_block_free and scheduler.offloading.free_at_preemption == (not stops)


def test_a_missing_hook_is_named_with_the_vllm_version():
    version = re.escape(vllm.__version__)
    # A vLLM whose Scheduler renamed a hook the adapter overrides: the override would never be called.
    renamed = type("Scheduler", Scheduler.__bases__,
                   {k: v for k, v in vars(Scheduler).items() if k != "_preempt_request"})
    with pytest.raises(ImportError, match=rf"vLLM {version}: it lacks Scheduler\._preempt_request\(\) \(it supports "
                                          r"vLLM 0\.24 through 0\.34\)"):
        check_scheduler_hooks(renamed)

    class Removed(Scheduler):
        _free_request = None

    with pytest.raises(ImportError, match=r"it lacks Scheduler\._free_request\(\) \("):
        check_scheduler_hooks(Removed)

    def bare_init(self):
        self.kv_cache_manager = None

    no_cap = type("Scheduler", Scheduler.__bases__, {**vars(Scheduler), "__init__": bare_init})
    with pytest.raises(ImportError, match="Scheduler.max_num_active_reqs or Scheduler.max_num_running_reqs"):
        check_scheduler_hooks(no_cap)

    def renamed_init(self):
        self.output_tokens = []

    fields = ("request_id", "sampling_params", "prompt_token_ids", "max_tokens", "num_prompt_tokens",
              "num_computed_tokens", "num_output_tokens")
    bare_request = type("Request", (), {"__init__": renamed_init, **{
        name: None for name in (*fields, "skip_reading_prefix_cache")}})
    with pytest.raises(ImportError, match=r"it lacks Request\._output_token_ids \("):
        check_scheduler_hooks(request_cls=bare_request)
    # vLLM 0.34 turned the flag into a limit: either does; neither is named.
    limited = type("Request", (), {**{name: None for name in (*fields, "_output_token_ids")},
                                   "prefix_cache_hit_limit": None})
    check_scheduler_hooks(request_cls=limited)
    neither = type("Request", (), {"__init__": renamed_init, **{name: None for name in (*fields, "_output_token_ids")}})
    with pytest.raises(ImportError, match=r"it lacks Request\.skip_reading_prefix_cache or "
                                          r"Request\.prefix_cache_hit_limit \("):
        check_scheduler_hooks(request_cls=neither)


@pytest.mark.parametrize("version, supported", [
    ("0.23.1", False), ("0.24.0", True), ("0.26.0+cpu", True), ("0.32.0", True), ("0.34.0", True),
    ("0.34.2.dev12", True), ("0.35.0", False), ("1.0.0", False), ("unknown", False)])
def test_a_vllm_outside_the_supported_range_is_refused_in_one_line(version, supported):
    from rollout.vllm.versions import check_release

    if supported:
        check_release(version)
    else:
        with pytest.raises(ImportError, match=rf"^rollout's scheduler adapter does not support vLLM {re.escape(version)}: "
                                              r"it supports vLLM 0\.24 through 0\.34 \(pyproject\.toml's gpu extra\)$"):
            check_release(version)


def test_the_scheduler_is_found_under_its_name_and_its_earlier_path_and_the_plugin_loads_no_scheduler():
    """vLLM resolves `scheduler_cls` by module and attribute: `rollout.vllm.RolloutScheduler` and the path that
    configurations written for earlier versions name are the same class. The plugin, which vLLM loads in each of
    its processes before it builds anything, imports no scheduler."""
    import subprocess
    import sys

    from vllm.utils.import_utils import resolve_obj_by_qualname

    assert resolve_obj_by_qualname("rollout.vllm.RolloutScheduler") is RolloutScheduler
    assert resolve_obj_by_qualname("rollout.vllm_adapter.RolloutScheduler") is RolloutScheduler
    with pytest.raises(AttributeError, match="RolloutSchedular"):
        resolve_obj_by_qualname("rollout.vllm.RolloutSchedular")
    loaded = subprocess.run([sys.executable, "-c", "import sys, rollout.vllm.plugin; print(sorted(m for m in "
                             "sys.modules if m.startswith(('vllm', 'rollout.vllm.'))))"],
                            capture_output=True, text=True, check=True).stdout
    assert "rollout.vllm.plugin" in loaded and "scheduler" not in loaded, loaded

def test_only_an_engine_a_main_thread_starts_ends_with_its_parent():
    # Linux signals a process when the parent's *thread* that started it ends: an engine that a trainer starts
    # from a worker thread must not be ended when that thread returns.
    assert adapter_settings({}, "trace", None, None, None)[SETTINGS_KEY]["end_with_parent"] is True
    seen = []
    worker = threading.Thread(target=lambda: seen.append(adapter_settings({}, "trace", None, None, None)))
    worker.start()
    worker.join()
    assert seen[0][SETTINGS_KEY]["end_with_parent"] is False


# The cap


def mixed_requests(count: int = 16) -> list[Request]:
    return [request(f"r{i}", 20 + i, 3 + i % 7) for i in range(count)]


def clamped(answer, running: int, max_num_seqs: int) -> int:
    return min(max(answer, running, 1), max_num_seqs)


def test_the_cap_is_the_policys_answer_clamped_to_the_running_count_and_max_num_seqs(build, tmp_path):
    scheduler = build({"name": "static", "b_max": 64},
                               num_blocks=40, max_num_seqs=6)
    answers = iter([0, 1000, -5, 3, 1, 64, 2, 6, 7] * 20)
    spy = spy_on(scheduler, answer=lambda state: next(answers))
    run = Run(scheduler, mixed_requests())
    for _ in run.steps():
        state, answer = spy.asks[-1]
        cap = getattr(scheduler, CAP)
        assert cap == clamped(answer, state.num_running, 6), (answer, state.num_running, cap)
        assert len(scheduler.running) <= cap  # vLLM admitted no more than the cap
    assert len(spy.asks) == len(trace_steps(tmp_path / "trace.jsonl"))  # a static policy is asked every step
    assert {answer for _, answer in spy.asks} >= {0, -5, 1000}  # answers below 1 and above max_num_seqs came


@pytest.mark.parametrize("policy", [
    {"name": "static", "b_max": 128, "static_cap": 100},  # the policy's own limit is above vLLM's max_num_seqs
    {"name": "static", "b_max": 64, "static_cap": 2},
    {"name": "memory", "b_max": 64, "eps_m": 0.05, "min_observations": 2, "update_every": 2},
], ids=["static-above", "static-below", "memory"])
def test_the_cap_stays_within_the_running_count_and_max_num_seqs(build, tmp_path, policy):
    trace_path = tmp_path / "trace.jsonl"
    scheduler = build(policy, num_blocks=16, max_num_seqs=6)
    spy = spy_on(scheduler)
    run = Run(scheduler, mixed_requests())
    caps = []
    for _ in run.steps():
        state, answer = spy.asks[-1]
        caps.append(getattr(scheduler, CAP))
        assert caps[-1] == clamped(answer, state.num_running, 6)
    assert [s["cap"] for s in trace_steps(trace_path)] == caps
    answers = [answer for _, answer in spy.asks]
    if policy.get("static_cap") == 100:
        assert set(answers) == {100} and set(caps) == {6}
    elif policy.get("static_cap") == 2:
        assert set(caps) == {2}
    else:  # 15 blocks for requests of 2-3 blocks each: the memory policy answers on both sides of 6
        assert min(answers) < 6 and max(answers) > 6, answers
    assert run.finished == 16


# The skip


@pytest.mark.parametrize("steady", [0, 3, math.inf])
def test_the_policy_is_asked_only_where_something_changed_or_its_answer_expired(build, tmp_path, steady):
    trace_path = tmp_path / "trace.jsonl"
    scheduler = build({"name": "static", "b_max": 4}, max_num_seqs=4)
    spy = spy_on(scheduler, steady=steady)
    run = Run(scheduler, [request(f"r{i}", 20, n) for i, n in enumerate([3, 9, 9, 12, 14, 20])])
    asked_events, asked_step, expected = None, None, []
    k, events, asks = 0, run.events(), 0
    for _ in run.steps():
        ask = events != asked_events or k >= asked_step + steady
        if ask:
            asked_events, asked_step = events, k
        assert len(spy.asks) - asks == ask, (k, events)
        expected.append(not ask)
        k, events, asks = k + 1, run.events(), len(spy.asks)
    skipped = [bool(s.get("policy_skipped")) for s in trace_steps(trace_path)]
    assert skipped == expected
    if steady == 0:
        assert not any(skipped)
    else:  # decode steps between admissions and finishes, where nothing changes
        assert sum(skipped) > len(skipped) / 3, skipped


# The waiting queue the policy sees


def test_the_policy_sees_the_queues_head_that_fits_the_free_kv_plus_one_request(build):
    scheduler = build({"name": "static", "b_max": 16},
                               num_blocks=12, max_num_seqs=16)
    spy = spy_on(scheduler, describe=True, answer=lambda state: state.num_running + 1)  # one admission a step
    run = Run(scheduler, [request(f"r{i}", 30 + i, 4) for i in range(10)])  # prompts of 30..39 tokens
    cut_by_kv = 0

    def before():
        queue = [r.num_prompt_tokens + r.num_output_tokens for r in scheduler.waiting]
        return queue, scheduler.kv_cache_manager.block_pool.get_num_free_blocks(), 16 - len(scheduler.running)

    queue, free_blocks, headroom = before()
    for _ in run.steps():
        state, _ = spy.asks[-1]
        assert state.kv_free_blocks == free_blocks
        free = free_blocks * BLOCK
        seen = 0
        for need in queue[:headroom]:  # the head whose tokens fit the free blocks, and the first that does not
            seen += 1
            free -= need
            if free < 0:
                break
        assert list(state.waiting_tokens) == queue[:seen], (queue, free_blocks)
        assert len(state.running_tokens) == state.num_running
        cut_by_kv += seen < min(len(queue), headroom)
        queue, free_blocks, headroom = before()
    assert cut_by_kv >= 3  # the cut was at the free KV, not at the queue's end
    assert run.finished == 10


# Probe groups


@pytest.mark.parametrize("learns", [True, False])
def test_a_finished_probe_moves_its_groups_waiting_siblings(model_dir, learns):
    """One request at a time, a first pass: prompts a and b of three samples each, c of one, arriving as the driver
    submits them (a probe of each prompt first, its siblings last). The scheduler makes a0 and b0 the probes and
    holds their siblings behind c. When a0 finishes short, the samples of b, whose probe has not finished, go ahead
    of a's. Without its memory (`learn_prompts` false) it keeps the arrival order."""
    scheduler = make_scheduler(model_dir, None, {}, max_num_seqs=1,
                               settings={"policy": {"name": "static", "b_max": 1}, "learn_prompts": learns})
    lengths = {"a": 2, "b": 6, "c": 3}
    names = ["a0", "b0", "a1", "a2", "c", "b1", "b2"]
    try:
        run = Run(scheduler, [prompt_request(name, "abc".index(name[0]), lengths[name[0]]) for name in names])
        admitted = []
        for _ in run.steps():
            admitted += [r.request_id for r in scheduler.running if r.request_id not in admitted]
            if admitted == ["a0"]:  # nothing has finished yet: the arrival order, the held siblings last
                assert [r.request_id for r in scheduler.waiting] == (
                    ["b0", "c", "a1", "a2", "b1", "b2"] if learns else names[1:])
        assert admitted == (["a0", "b0", "c", "b1", "b2", "a1", "a2"] if learns else names)
    finally:
        scheduler.shutdown()


# Backfill


def test_short_requests_behind_a_blocked_long_one_run_beside_the_running_long_one(build):
    """The oracle (true lengths from max_tokens): L1 is admitted; L2, as long, cannot join it before L1 ends
    (their peaks would overflow the cache). The short requests behind L2 can: they move to the queue's front and
    run beside L1 while L2 keeps its place; nothing is preempted."""
    scheduler = build({"name": "oracle", "b_max": 8, "forecast_min_wave": 0.0}, num_blocks=17, max_num_seqs=8)
    names = ["L1", "L2", "s1", "s2"]
    lengths = {"L1": 150, "L2": 150, "s1": 8, "s2": 8}
    run = Run(scheduler, [request(name, 20, lengths[name]) for name in names])
    started: list[str] = []
    for _ in run.steps():
        started += [r.request_id for r in scheduler.running if r.request_id not in started]
    assert started == ["s1", "s2", "L1", "L2"]  # the first step: the short ones moved ahead of L1's admission
    assert run.finished == 4 and run.result.preemptions == 0


def test_nothing_is_backfilled_past_a_preempted_request(build):
    """The oracle looking 8 tokens ahead admits L1 and L2 together; they outgrow the cache and vLLM preempts L2
    (as far along as L1, admitted last), which goes back to the queue's head and does not fit beside L1. A short
    request that arrived meanwhile would fit there: it is not admitted past L2, which resumes first (once L1 ends),
    and the short one starts with it, not before."""
    scheduler = build({"name": "oracle", "b_max": 8, "forecast_min_wave": 0.0, "forecast_horizon_tokens": 8},
                      num_blocks=11, max_num_seqs=8)
    run = Run(scheduler, [request("L1", 20, 100), request("L2", 20, 100)])
    events, running = [], set()
    for k, output in enumerate(run.steps()):
        if k == 30:  # L1 and L2 fill the cache: it waits
            run.add([request("s1", 20, 4)])
        now = {r.request_id for r in scheduler.running}
        events += [(k, "preempted", r) for r in sorted(output.preempted_req_ids or ())]
        events += [(k, "start", r) for r in sorted(now - running)]
        running = now
    assert run.finished == 3
    preempted = events.index(next(e for e in events if e[1:] == ("preempted", "L2")))
    resumed = next(k for k, kind, r in events[preempted:] if (kind, r) == ("start", "L2"))
    short = next(k for k, kind, r in events if (kind, r) == ("start", "s1"))
    assert events[preempted][0] < resumed <= short


# Preemption


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])
def test_a_preempted_requests_computed_tokens_are_counted_as_recomputed(build, tmp_path, overlap):
    """7 usable blocks of 16 tokens for three requests that each grow to 70 tokens (5 blocks): vLLM admits all
    three and preempts as their outputs grow."""
    trace_path = tmp_path / "trace.jsonl"
    scheduler = build({"name": "static", "b_max": 8}, num_blocks=8,
                               cls=AsyncDynamicBatchScheduler if overlap else DynamicBatchScheduler)
    spy = spy_on(scheduler)
    requests = [request(f"r{i}", 30, 40) for i in range(3)]
    run = Run(scheduler, requests, overlap=overlap)
    lost = []  # per step: the computed tokens of each request it preempted
    computed = {r.request_id: r.num_computed_tokens for r in requests}
    for output in run.steps():
        lost.append(sorted(computed[i] for i in output.preempted_req_ids or ()))
        computed = {r.request_id: r.num_computed_tokens for r in requests}
    steps = trace_steps(trace_path)
    assert [(s["preempted"], s["recomputed_tokens"]) for s in steps] == [(len(x), sum(x)) for x in lost]
    assert sum(map(len, lost)) == sum(r.num_preemptions for r in requests) >= 1
    assert min(tokens for x in lost for tokens in x) >= 30  # a preempted request had its prompt computed
    assert sorted(spy.preempted_tokens) == sorted(tokens for x in lost for tokens in x)  # the policy was told
    assert all(len(r.output_token_ids) == 40 for r in requests)


def test_a_resumed_request_computes_again_only_what_the_prefix_cache_lacks(build, tmp_path):
    """As above with vLLM's prefix caching on: a preempted request's blocks stay in the cache until they are
    reused, and once resumed it is scheduled only the tokens its prefix hit lacks. The trace counts what it found
    there as recovered, out of what the preemptions threw away."""
    hasher = block_hasher()
    scheduler = build({"name": "static", "b_max": 8}, num_blocks=8, prefix_caching=True)
    requests = [request(f"r{i}", 30, 40, block_hasher=hasher) for i in range(3)]
    run = Run(scheduler, requests)
    preempted, hits = set(), []
    tokens = {r.request_id: r.num_tokens for r in requests}
    for output in run.steps():
        for request_id in preempted & output.num_scheduled_tokens.keys():  # resumed: all it lacks, in one step
            hits.append(tokens[request_id] - output.num_scheduled_tokens[request_id])
            preempted.discard(request_id)
        preempted |= set(output.preempted_req_ids or ())
        tokens = {r.request_id: r.num_tokens for r in requests}
    steps = trace_steps(tmp_path / "trace.jsonl")
    recomputed = sum(s["recomputed_tokens"] for s in steps)
    recovered = sum(s.get("recovered_tokens", 0) for s in steps)
    assert sum(r.num_preemptions for r in requests) >= 1 and all(len(r.output_token_ids) == 40 for r in requests)
    assert recovered == sum(hits) > 0
    assert recovered < recomputed


@pytest.mark.parametrize("policy, overlap", [("static", False), ("forecast", False), ("forecast", True)])
def test_a_resumed_request_loads_its_blocks_from_host_memory_with_kv_offloading(build, tmp_path, policy, overlap):
    """With vLLM's KV offloading (model.kv_offloading_gib) every full block is also written to host memory, and a
    preempted request, once resumed, loads its full blocks from there: it computes again only its last, partial
    block (under async scheduling at most one more), and the trace counts the rest as recovered. Three requests,
    admitted at once (the cap forced; the forecast orders preemptions by output), outgrow 7 usable blocks; the
    prefix cache is on (the offload finds blocks by their hashes) but keeps too little to matter."""
    hasher = block_hasher()
    scheduler = build({"name": policy, "b_max": 8}, num_blocks=8, prefix_caching=True, host_offload_bytes=1 << 24,
                      cls=AsyncDynamicBatchScheduler if overlap else DynamicBatchScheduler)
    spy_on(scheduler, answer=lambda state: 8)  # all admitted at once, to outgrow the cache
    requests = [request(f"r{i}", 30, 40, block_hasher=hasher) for i in range(3)]
    run = Run(scheduler, requests, overlap=overlap)
    preempted, computed_again, thrown = set(), [], {}
    for output in run.steps():
        for request_id in preempted & output.num_scheduled_tokens.keys():  # resumed, its blocks loaded
            computed_again.append(output.num_scheduled_tokens[request_id])
            preempted.discard(request_id)
        for request_id in output.preempted_req_ids or ():
            preempted.add(request_id)
            thrown[request_id] = thrown.get(request_id, 0) + 1
    steps = trace_steps(tmp_path / "trace.jsonl")
    recomputed = sum(s["recomputed_tokens"] for s in steps)
    recovered = sum(s.get("recovered_tokens", 0) for s in steps)
    assert all(len(r.output_token_ids) == 40 for r in requests)
    assert sum(thrown.values()) >= 2 and len(computed_again) == sum(thrown.values())
    # The partial block (with the token it has not computed); under async scheduling also the block filled at the
    # step before the preemption: its last token is not known when that step is scheduled, nor stored before it.
    assert all(n <= (2 * BLOCK + 1 if overlap else BLOCK) for n in computed_again), computed_again
    assert recomputed - recovered <= sum(computed_again) and recovered > 0


def test_requests_loading_their_blocks_from_host_memory_count_against_the_cap(build, tmp_path):
    """vLLM starts a KV load for every waiting request whose blocks host memory holds, as long as blocks are free,
    and counts none against the cap: a loading request waits outside the running set, holding its blocks. Ten
    requests of 40 prompt and 200 output tokens, admitted at once (the cap forced) into 39 usable blocks, are
    preempted in turn; then the cap admits one more than the policy is told runs, and a load lasts about five
    steps. After every step the running requests and those loading are within the cap: the policy is shown the
    loading ones as running, and vLLM reaches only as many waiting requests as the cap has room for. The trace
    counts them at each step (`kv_held`)."""
    hasher = block_hasher()
    scheduler = build({"name": "forecast", "b_max": 16}, num_blocks=40, max_num_seqs=16, prefix_caching=True,
                      host_offload_bytes=1 << 24)
    spy_on(scheduler, answer=lambda state: 16 if state.step < 3 else state.num_running + 1)
    requests = [request(f"r{i}", 40, 200, block_hasher=hasher) for i in range(10)]
    seen = []  # (running, loading, cap) after each step

    def observe(clock, scheduler):
        loading = sum(r.status == RequestStatus.WAITING_FOR_REMOTE_KVS for r in requests)
        seen.append((len(scheduler.running), loading, getattr(scheduler, CAP)))

    result = Driver(scheduler, requests, StepTimeModel(base=0.01, per_seq=0.0, per_kv_token=0.0, per_prefill_token=0.0),
                    load_s_per_token=0.0005, cap_attr=CAP, observe=observe).run()
    assert all(len(r.output_token_ids) == 200 for r in requests)
    assert result.preemptions >= 5 and max(loading for _, loading, _ in seen) >= 2
    assert all(running + loading <= cap for running, loading, cap in seen[3:]), seen
    steps = trace_steps(tmp_path / "trace.jsonl")[3:]
    assert max(s.get("kv_held", 0) for s in steps) >= 2
    assert all(s["running"] + s.get("kv_held", 0) <= s["cap"] for s in steps)


@pytest.mark.parametrize("offloading", [False, True])
def test_with_kv_offloading_the_forecast_keeps_no_margin(build, offloading):
    """The adapter runs its policy under `PolicyConfig.under_kv_offloading` under vLLM's offloading connector:
    both margin bounds are forecast_margin_cap_offloading; without it they are the configured bounds."""
    scheduler = build({"name": "forecast", "b_max": 8, "forecast_margin_cap": 0.05,
                       "forecast_margin_cap_predicted": 0.2, "forecast_margin_cap_offloading": 0.01},
                      prefix_caching=True, host_offload_bytes=(1 << 24) if offloading else None)
    policy = scheduler.batch_policy.policy
    assert (policy.margin_cap, policy.margin_cap_predicted) == ((0.01, 0.01) if offloading else (0.05, 0.2))


@pytest.mark.parametrize("cls", [Scheduler, DynamicBatchScheduler])
def test_a_request_that_generated_nothing_computes_its_prompt_instead_of_loading_it(build, cls):
    """With KV offloading, host memory keeps a prompt's blocks after the GPU's prefix cache has reused them. A
    sample of that prompt arriving then would load them (vLLM's own scheduler does: the sample waits outside the
    running set for the load); the adapter has it compute its prompt instead, admitted at once. One sample runs
    alone and finishes, another prompt's request takes the cache its blocks held, then a sibling arrives."""
    hasher = block_hasher()
    scheduler = build({"name": "forecast", "b_max": 8}, num_blocks=9, prefix_caching=True,
                      host_offload_bytes=1 << 24, cls=cls)

    def sample(name: str, prompt: list[int], max_tokens: int) -> Request:
        return Request(request_id=name, prompt_token_ids=prompt, pooling_params=None, block_hasher=hasher,
                       sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True))

    prompt = [7] * (3 * BLOCK)
    Run(scheduler, [sample("first", prompt, 8)]).run()
    Run(scheduler, [sample("other", [9] * (3 * BLOCK), 5 * BLOCK)]).run()  # the 8 usable blocks
    sibling = sample("sibling", prompt, 8)
    run, first_step, statuses = Run(scheduler, [sibling]), None, []
    for output in run.steps():
        statuses.append(sibling.status)
        if first_step is None and "sibling" in output.num_scheduled_tokens:
            first_step = output.num_scheduled_tokens["sibling"]
    assert len(sibling.output_token_ids) == 8
    loaded = RequestStatus.WAITING_FOR_REMOTE_KVS in statuses
    if cls is Scheduler:  # the scene loads where nothing prevents it
        assert loaded and first_step < len(prompt)
    else:
        assert not loaded and first_step == len(prompt)


def test_where_vllm_defers_a_victims_block_free_its_blocks_free_at_once_and_loads_wait_for_the_step(build,
                                                                                                    monkeypatch):
    """Under async scheduling with a KV connector that loads, vLLM returns a preempted request's blocks to the
    pool only once the step in flight, which may still write them, has ended; vLLM 0.26's preemption loop then
    finds no block freed and preempts on down its running list (0.32 stops: the installed vLLM is taken as 0.26
    here, through `preemption_stops_at_deferred_frees`). The adapter frees the victim's blocks at once instead and
    starts no KV load until that step has been processed: a load runs unordered against it and could land in
    them. Three requests run; one is preempted and kept out at a cap of 2, waiting in host memory; then another is
    preempted as 0.26's loop does, while a step that ran it is in flight, with room for both: the waiting one's
    load waits for that step."""
    import dataclasses

    import rollout.vllm.scheduler as adapter

    monkeypatch.setattr(adapter, "HOOKS", dataclasses.replace(adapter.HOOKS, preemption_stops_at_deferred_frees=False))
    # Hashes for the host memory's keys; no prefix cache, so a resumed request finds its blocks in host memory.
    hasher = block_hasher()
    scheduler = build({"name": "static", "b_max": 8}, num_blocks=32, host_offload_bytes=1 << 24,
                      cls=AsyncDynamicBatchScheduler, async_scheduling=True)
    assert scheduler.defer_block_free and scheduler.offloading.free_at_preemption
    cap = [3]
    spy_on(scheduler, answer=lambda state: max(cap[0], state.num_running))
    first, waiter, victim = requests = [request(name, 30, 80, block_hasher=hasher)
                                        for name in ("first", "waiter", "victim")]
    run = Run(scheduler, requests, overlap=True)

    def preempt(request):  # as vLLM 0.26's loop does, a step that ran it in flight
        assert request.last_sched_seq > scheduler.processed_step_seq
        pool = scheduler.kv_cache_manager.block_pool
        free, held = pool.get_num_free_blocks(), len(scheduler.kv_cache_manager.get_block_ids(request.request_id)[0])
        scheduler.running.remove(request)
        scheduler._preempt_request(request, 0.0)
        assert pool.get_num_free_blocks() == free + held and not scheduler.deferred_frees  # freed at once

    for _ in range(20):
        run.step()
    cap[0] = 2  # the waiter stays out
    preempt(waiter)
    for _ in range(20):
        run.step()
    assert victim.status == RequestStatus.RUNNING and waiter.status == RequestStatus.PREEMPTED
    fence = victim.last_sched_seq
    cap[0] = 3  # room for both
    preempt(victim)
    loads = []  # the last step processed when the waiter's load was scheduled
    while scheduler.has_unfinished_requests() or run.in_flight:
        processed = scheduler.processed_step_seq
        output = run.step()
        if any(job.req_id == "waiter" for job in output.kv_connector_metadata.load_jobs.values()):
            loads.append(processed)
    assert loads and loads[0] >= fence
    assert all(len(r.output_token_ids) == 80 for r in requests)


@pytest.mark.parametrize("marked", [True, False])
def test_a_preempted_requests_blocks_in_host_memory_outlast_those_of_requests_that_finished(build, monkeypatch,
                                                                                              marked):
    """Host memory (vLLM's KV offloading) evicts the least recently used blocks first, and vLLM 0.32 marks a
    request's blocks used when it finishes: without the adapter's mark at a preemption (`HostBlocks`), the blocks
    of a request that finished after the victim wrote its own stand before the victim's, and the victim's are
    evicted first. Host memory holds 12 blocks. Three requests run; one finishes with 3 blocks written; the victim,
    with 3 written, is preempted at once and waits (a cap of 1) while the third writes 6 more: 3 blocks are
    evicted. Marked, the victim resumes loading its blocks and computes only its last, partial one; unmarked (the
    mark turned off), its first block is gone and it computes everything again."""
    from rollout.vllm.offloading import HostBlocks

    if not marked:
        monkeypatch.setattr(HostBlocks, "refresh", lambda self, request_id: None)
    scheduler = build({"name": "static", "b_max": 8}, num_blocks=64, host_offload_bytes=12 * BLOCK * 8,
                      kv_bytes_per_token=8)
    if RELEASE >= (0, 34):  # its offloading managers (tiers) mark no blocks on request: nothing is marked
        assert scheduler.offloading.host_blocks is None
        pytest.skip("vLLM 0.34's offloading manager has no touch(): the adapter marks no host blocks there")
    assert scheduler.offloading.host_blocks is not None
    cap = [3]
    spy_on(scheduler, answer=lambda state: max(cap[0], state.num_running))
    hasher = block_hasher()  # host memory finds blocks by their hashes; no prefix cache
    victim, short, other = requests = [request("victim", 32, 100, block_hasher=hasher),
                                       request("short", 32, 17, block_hasher=hasher),
                                       request("other", 32, 114, block_hasher=hasher)]
    run = Run(scheduler, requests)
    while not short.is_finished():
        run.step()
    assert victim.num_computed_tokens == 48  # three full blocks, as the short one wrote
    scheduler.running.remove(victim)
    scheduler._preempt_request(victim, 0.0)
    cap[0] = 1  # the victim waits while the other runs on
    computed_again = None  # the tokens the victim is scheduled when it resumes, past what it loads
    while scheduler.has_unfinished_requests():
        output = run.step()
        if computed_again is None and victim.request_id in output.num_scheduled_tokens:
            assert other.is_finished()
            computed_again = output.num_scheduled_tokens[victim.request_id]
    assert all(len(r.output_token_ids) == r.max_tokens for r in requests)
    assert computed_again <= BLOCK if marked else computed_again > 48, computed_again


@pytest.mark.parametrize("policy, order", [("static", None), ("forecast", "least_computed"),
                                           ("forecast", "least_output"), ("forecast", "vllm")])
def test_preemption_takes_the_request_that_computed_least_where_the_policy_orders_it(build, policy, order):
    """Six requests of 16 prompt tokens and 300 output tokens, then one of 400 and 600, all admitted at once into
    80 usable blocks: the six alone outgrow the cache at 200 tokens each. vLLM preempts the last of its running
    list: by default the last admitted, the long one, as it does where the forecast orders by output (all
    generated alike; of equals, the last admitted); with policy.forecast_preemption=least_computed the forecast
    (its cap forced to admit all) puts the running requests that computed least last."""
    settings = {"name": policy, "b_max": 8}
    if order is not None:
        settings["forecast_preemption"] = order
    scheduler = build(settings, num_blocks=81)
    spy_on(scheduler, answer=lambda state: 8)
    assert scheduler.batch_policy.preemption_order == (order or "vllm")
    requests = [request(f"s{i}", 16, 300) for i in range(6)] + [request("long", 400, 600)]
    run = Run(scheduler, requests)
    assert len(run.step().num_scheduled_tokens) == 7  # all admitted at the first step
    list(run.steps(3000))
    long = requests[-1]
    assert all(len(r.output_token_ids) == r.sampling_params.max_tokens for r in requests)
    assert sum(r.num_preemptions for r in requests) > 0
    if order == "least_computed":
        assert long.num_preemptions == 0  # shorter ones went instead
    else:
        assert long.num_preemptions > 0  # the last admitted


@pytest.mark.parametrize("order", ["least_output", "vllm", "least_computed"])
def test_the_longest_request_admitted_first_is_never_the_one_preempted(build, order):
    """The critical path of a tail-bound pass: the longest request (16 prompt tokens, 900 output tokens), admitted
    first as longest-first admission puts it, then six of 60 and 300, all at once into 80 usable blocks. Where the
    cache runs out, the forecast's default (least output) takes the shorter ones, as vLLM's own order does; it
    starts at the first step and never waits. Counting computed tokens instead takes the long one: its prompt is
    the shortest."""
    scheduler = build({"name": "forecast", "b_max": 8, "forecast_preemption": order}, num_blocks=81)
    spy_on(scheduler, answer=lambda state: 8)
    requests = [request("long", 16, 900)] + [request(f"s{i}", 60, 300) for i in range(6)]
    run = Run(scheduler, requests)
    assert len(run.step().num_scheduled_tokens) == 7  # all admitted at the first step
    list(run.steps(3000))
    long = requests[0]
    assert all(len(r.output_token_ids) == r.sampling_params.max_tokens for r in requests)
    assert sum(r.num_preemptions for r in requests) > 0
    assert (long.num_preemptions == 0) == (order != "least_computed")


# The scheduler on its own: no driver sends scales or probe groups (vllm serve, verl, OpenRLHF, TRL)


def prompt_request(name: str, prompt: int, max_tokens: int) -> Request:
    """Request `name` of prompt number `prompt` (20 tokens of its own), generating `max_tokens` tokens."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(request_id=name, prompt_token_ids=[prompt + 1] * 20, sampling_params=params, pooling_params=None)


def admission_order(scheduler, requests) -> list[str]:
    run = Run(scheduler, requests)
    admitted = []
    for _ in run.steps():
        admitted += [r.request_id for r in scheduler.running if r.request_id not in admitted]
    return admitted


def test_on_its_own_the_scheduler_learns_each_prompts_length_and_runs_the_longest_first(model_dir, tmp_path):
    """One request at a time. The first pass runs in arrival order; the next one (the same prompts, arriving in
    the same order) longest first by what the first taught; an engine started later with the same state_dir
    knows it from its first pass."""
    lengths = {0: 2, 1: 6, 2: 12}  # prompt -> output tokens
    settings = {"policy": {"name": "static", "b_max": 1}, "state_dir": str(tmp_path / "state")}

    def one_pass(scheduler, tag):
        return [name[1] for name in admission_order(
            scheduler, [prompt_request(f"{tag}{p}", p, n) for p, n in lengths.items()])]

    scheduler = make_scheduler(model_dir, None, {}, max_num_seqs=1, settings=settings)
    try:
        assert one_pass(scheduler, "a") == ["0", "1", "2"]
        assert one_pass(scheduler, "b") == ["2", "1", "0"]
    finally:
        scheduler.shutdown()
    saved = json.loads((tmp_path / "state" / "prompt_lengths.json").read_text())
    assert sorted(saved["mean_output_tokens"].values()) == pytest.approx([2.0, 6.0, 12.0])
    assert (tmp_path / "state" / "length_stats.json").is_file()
    restarted = make_scheduler(model_dir, None, {}, max_num_seqs=1, settings=settings)
    try:
        assert one_pass(restarted, "c") == ["2", "1", "0"]
    finally:
        restarted.shutdown()


def test_on_its_own_the_scheduler_probes_prompts_it_never_saw(build, model_dir, tmp_path):
    """One request at a time, a first pass. Prompt x (short) and y (long) have two samples each, z one; they
    arrive as x0 x1 y0 y1 z0. Each prompt's first sample runs first (its probe) and the second samples after
    every other request, longest probe first: y1 before x1 though x1 arrived first."""
    scheduler = make_scheduler(model_dir, None, {}, max_num_seqs=1,
                               settings={"policy": {"name": "static", "b_max": 1}})
    try:
        requests = [prompt_request("x0", 0, 2), prompt_request("x1", 0, 2), prompt_request("y0", 1, 10),
                    prompt_request("y1", 1, 10), prompt_request("z0", 2, 4)]
        assert admission_order(scheduler, requests) == ["x0", "y0", "z0", "y1", "x1"]
    finally:
        scheduler.shutdown()


def test_a_held_sample_already_waiting_stays_ahead_of_prompts_that_arrive_after_it(model_dir):
    """As a data-parallel engine's queue is refilled: x0 x1 arrive and x0 (the probe) runs, x1 held; then y0 y1
    arrive. x1 waits for its own probe, not for y's: the queue holds x1, then y0, then y1 (held)."""
    scheduler = make_scheduler(model_dir, None, {}, max_num_seqs=1,
                               settings={"policy": {"name": "static", "b_max": 1}})
    try:
        run = Run(scheduler, [prompt_request("x0", 0, 20), prompt_request("x1", 0, 20)])
        run.step()
        assert [r.request_id for r in scheduler.running] == ["x0"]
        later = [prompt_request("y0", 1, 20), prompt_request("y1", 1, 20)]
        run.add(later)
        run.step()
        assert [r.request_id for r in scheduler.running] == ["x0"]
        assert [r.request_id for r in scheduler.waiting] == ["x1", "y0", "y1"]
        for _ in run.steps():
            pass
    finally:
        scheduler.shutdown()


def test_a_cancelled_request_frees_its_place_but_teaches_no_length(model_dir, tmp_path):
    """a (prompt 0) is cancelled after a few tokens, as by a client that went away; b (prompt 1) finishes. The
    policy's length statistics and the scheduler's per-prompt memory learn b's length alone, though both left."""
    from rollout.policy.length_stats import PromptLengths, prompt_key

    settings = {"policy": {"name": "forecast", "b_max": 2}, "state_dir": str(tmp_path / "state")}
    scheduler = make_scheduler(model_dir, None, {}, max_num_seqs=2, settings=settings)
    try:
        run = Run(scheduler, [prompt_request("a", 0, 50), prompt_request("b", 1, 8)])
        for _ in range(4):
            run.step()
        scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
        for _ in run.steps():
            pass
        scheduler.schedule()  # the policy is told of the finishes at the next step
        assert scheduler.batch_policy.stats.count == 1
        memory = PromptLengths.load(tmp_path / "state" / "prompt_lengths.json")
        assert memory.mean == {prompt_key([2] * 20): 8.0}
    finally:
        scheduler.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_one_scheduler_name_builds_the_one_the_engines_scheduling_needs(model_dir, async_scheduling):
    scheduler = make_scheduler(model_dir, None, {}, cls=RolloutScheduler, async_scheduling=async_scheduling,
                               settings={"policy": {"name": "static", "b_max": 2}})
    try:
        assert type(scheduler) is (AsyncDynamicBatchScheduler if async_scheduling else DynamicBatchScheduler)
        run = Run(scheduler, [prompt_request("r", 0, 3)], overlap=async_scheduling)
        assert len(list(run.steps())) >= 3 and run.finished == 1
    finally:
        scheduler.shutdown()


def test_a_memory_rewritten_between_passes_is_read_when_the_next_opens(model_dir, tmp_path):
    """As rollout.parallel merges its engines' memories: after a pass, another process writes the state_dir's
    memory file (here: prompt 0 long, which this scheduler saw short). The next pass runs prompt 0 first, though it
    arrives last, and the scheduler's shutdown leaves a file rewritten since as it was written."""
    from rollout.policy.length_stats import PromptLengths, prompt_key

    settings = {"policy": {"name": "static", "b_max": 1}, "state_dir": str(tmp_path / "state")}
    memory_file = tmp_path / "state" / "prompt_lengths.json"
    scheduler = make_scheduler(model_dir, None, {}, max_num_seqs=1, settings=settings)
    try:
        assert admission_order(scheduler, [prompt_request(f"a{p}", p, n) for p, n in enumerate([2, 6])]) == [
            "a0", "a1"]
        merged = PromptLengths.load(memory_file)
        merged.update(prompt_key([1] * 20), [40])  # prompt 0's tokens, as prompt_request makes them
        merged.save(memory_file)
        # Arriving prompt 1 first: its own memory alone (0 short, 1 long) would keep that order.
        assert admission_order(scheduler, [prompt_request("b1", 1, 6), prompt_request("b0", 0, 2)]) == ["b0", "b1"]
        merged = PromptLengths.load(memory_file)
        merged.update(prompt_key([1] * 20), [400])
        merged.save(memory_file)
    finally:
        scheduler.shutdown()
    assert PromptLengths.load(memory_file).last[prompt_key([1] * 20)] == [400]


def test_engines_sharing_a_state_dir_keep_each_others_prompts(model_dir, tmp_path):
    """As verl's servers, all given one state_dir, whose passes overlap: A's pass learns prompt 0, B's (open
    before A's ended) prompt 1. The file holds both, and A's next pass knows prompt 1, which it never ran: it
    runs it first, though it arrives last. Their shutdowns lose neither."""
    from rollout.policy.length_stats import PromptLengths, prompt_key

    settings = {"policy": {"name": "static", "b_max": 1}, "state_dir": str(tmp_path / "state")}
    memory_file = tmp_path / "state" / "prompt_lengths.json"
    both = {prompt_key([1] * 20): 2.0, prompt_key([2] * 20): 12.0}  # prompts 0 and 1, as prompt_request makes them
    a = make_scheduler(model_dir, None, {}, max_num_seqs=1, settings=settings)
    b = make_scheduler(model_dir, None, {}, max_num_seqs=1, settings=settings)
    try:
        run_a, run_b = Run(a, [prompt_request("a0", 0, 2)]), Run(b, [prompt_request("b1", 1, 12)])
        run_b.step()
        for _ in run_a.steps():
            pass
        for _ in run_b.steps():
            pass
        assert PromptLengths.load(memory_file).mean == both
        assert admission_order(a, [prompt_request("c0", 0, 2), prompt_request("c1", 1, 12)]) == ["c1", "c0"]
    finally:
        a.shutdown()
        b.shutdown()
    assert PromptLengths.load(memory_file).mean == pytest.approx(both)


@pytest.mark.parametrize("settings, message", [
    (None, r"needs additional_config\['rollout'\], e\.g\. --additional-config"),
    ({"policy": {}, "state_path": "x"}, r"unknown key 'state_path'; known: policy, state_dir"),
    ({"policy": {"name": "forecast", "epsm": 0.1}}, r"epsm"),
    ({"policy": ["forecast"]}, r"\['policy'\] must be a mapping"),
], ids=["missing", "unknown-key", "unknown-policy-field", "policy-not-a-mapping"])
def test_bad_settings_name_what_is_wrong(model_dir, settings, message):
    model = ModelConfig(model=str(model_dir), dtype="float32", seed=0, skip_tokenizer_init=True, max_model_len=1024)
    with pytest.raises(ValueError, match=message):
        make_scheduler(model_dir, None, {}, settings=settings) if settings is not None else read_settings(
            VllmConfig(model_config=model).additional_config)


# A value other than its default for every PolicyConfig field, all valid together.
NON_DEFAULT_POLICY = {
    "name": "memory", "b_max": 6, "b_min": 2, "static_cap": 5, "eps_m": 0.1, "update_every": 8, "min_observations": 4,
    "forgetting": "window", "window": 100, "decay": 0.9, "d_sla_ms": 40.0, "sla_eps_ms": 2.0, "sla_relax": 3.0,
    "sla_hold": 1.5, "sla_window": 4, "sla_chunk": True, "sla_chunk_min_tokens": 16, "sla_chunk_relax_tokens": 32.0,
    "sla_chunk_hold_tokens": 16.0, "forecast_after": 4, "forecast_carry_over": 0.1, "forecast_cold_start": "memory",
    "forecast_cold_start_shape": 2.0, "forecast_cold_start_horizon": 0.1, "forecast_horizon_tokens": 500,
    "forecast_after_share": 0.2, "forecast_pointwise_running_peak": False, "forecast_min_wave": 0.1,
    "forecast_tail_confidence": 1.0, "forecast_margin_cap": 0.05, "forecast_margin_cap_predicted": 0.2,
    "forecast_margin_cap_offloading": 0.01, "forecast_margin_feedback": True, "forecast_backfill": False,
    "forecast_preemption": "least_computed", "forecast_siblings": False, "spec_draft_tokens": 2,
    "spec_min_gain": 0.25, "spec_max_batch": 8, "order": "fifo", "probe_first": False, "graph_cap": True,
}


def test_every_policy_setting_reaches_the_engine_through_additional_config(build):
    """What a `vllm serve`, verl or TRL user writes (additional_config["rollout"]["policy"]) is what the scheduler's
    policy and length statistics hold, field by field: no setting travels another way or is dropped."""
    from dataclasses import asdict, fields

    from rollout.policy.config import PolicyConfig

    assert set(NON_DEFAULT_POLICY) == {f.name for f in fields(PolicyConfig)}  # a new field needs a value here
    assert all(value != getattr(PolicyConfig(), key) for key, value in NON_DEFAULT_POLICY.items())
    scheduler = build({}, max_num_seqs=6, settings={"policy": dict(NON_DEFAULT_POLICY)})
    policy = scheduler.batch_policy.policy
    assert asdict(policy.config) == NON_DEFAULT_POLICY
    stats = policy.stats
    assert (stats.forgetting, stats.window, stats.decay) == ("window", 100, 0.9)


def test_scheduler_drafts_need_vllms_custom_class_method():
    """The scheduler's drafts reach the model runner through vLLM's speculative method `custom_class`, which vLLM
    0.34 removed: where it is gone, a speculating run stops before the engine starts (engine_kwargs)."""
    from typing import Literal

    from rollout.vllm.versions import scheduler_drafts_supported, speculative_methods

    assert "ngram" in speculative_methods()  # this vLLM's
    assert scheduler_drafts_supported() == (RELEASE < (0, 34))
    without = Literal["ngram", "medusa", Literal["eagle", "eagle3", Literal["mtp"]], "draft_model"]
    assert speculative_methods(without) == {"ngram", "medusa", "eagle", "eagle3", "mtp", "draft_model"}
    assert not scheduler_drafts_supported(without)
    assert scheduler_drafts_supported(Literal["ngram", Literal["custom_class"]])
