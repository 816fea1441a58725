"""The paper's batch-size algorithms as pure functions and small policy objects (no vLLM import).

Importing the package registers every policy (`POLICIES`): base.py defines the interface and the registry, and the
policy modules import it, never the other way.
"""

from rollout.policy.base import POLICIES, VLLM_DEFAULT, FallbackPolicy, Policy, StepState, make_policy, register
from rollout.policy.config import PolicyConfig
from rollout.policy.length_stats import LengthStats, Moments
from rollout.policy.memory import clamp_cap, clt_batch_bound, memory_batch_size, overflow_quantile, safety_buffer
from rollout.policy.policies import CLTPolicy, MemoryPolicy, SLAPolicy, StaticPolicy
from rollout.policy.forecast import ForecastPolicy
from rollout.policy.oracle import OraclePolicy
from rollout.policy.sla import SLAController, StepWindow
from rollout.policy.step import shared_prompt_blocks

__all__ = [
    "POLICIES", "VLLM_DEFAULT", "CLTPolicy", "FallbackPolicy", "ForecastPolicy", "LengthStats", "MemoryPolicy",
    "Moments", "OraclePolicy", "Policy", "PolicyConfig", "SLAController", "SLAPolicy", "StaticPolicy", "StepState",
    "StepWindow", "clamp_cap", "clt_batch_bound", "make_policy", "memory_batch_size", "overflow_quantile",
    "register", "safety_buffer", "shared_prompt_blocks",
]
