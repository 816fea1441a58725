"""The paper's batch-size algorithms as pure functions and small policy objects (no vLLM import)."""

from rollout.policy.length_stats import LengthStats, Moments
from rollout.policy.memory import (clamp_cap, clt_batch_bound, memory_batch_size, overflow_quantile,
                                   safety_buffer)
from rollout.policy.policies import (POLICIES, CLTPolicy, FallbackPolicy, MemoryPolicy, SLAPolicy, StaticPolicy,
                                     StepState, make_policy, shared_prompt_blocks)
from rollout.policy.sla import SLAController, StepWindow

__all__ = [
    "LengthStats", "Moments", "clamp_cap", "clt_batch_bound", "memory_batch_size", "overflow_quantile",
    "safety_buffer", "POLICIES", "CLTPolicy", "FallbackPolicy", "MemoryPolicy", "SLAPolicy", "SLAController", "StaticPolicy",
    "StepState", "StepWindow", "make_policy", "shared_prompt_blocks",
]
