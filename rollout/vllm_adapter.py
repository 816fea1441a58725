"""The scheduler's path in engine configurations written for earlier versions of rollout
(`scheduler_cls="rollout.vllm_adapter.RolloutScheduler"`): the same classes as rollout.vllm.scheduler."""

from rollout.vllm.scheduler import AsyncDynamicBatchScheduler, DynamicBatchScheduler, RolloutScheduler

__all__ = ["RolloutScheduler", "DynamicBatchScheduler", "AsyncDynamicBatchScheduler"]
