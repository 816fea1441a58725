"""The one place that touches vLLM's scheduler: rollout's scheduler class and what it needs, one concern a file.

- `scheduler`: the subclass of vLLM's scheduler that vLLM loads (`RolloutScheduler`, named here as
  `rollout.vllm.RolloutScheduler`), thin: each step it asks the policy (rollout.policy) and sets the cap;
- `versions`: the supported vLLM releases and every private name of vLLM the adapter touches, resolved per release;
- `settings`: what an engine's owner writes under additional_config["rollout"], checked;
- `pass_state`: the pass's requests as the policy is told them;
- `prompt_store`: the per-prompt memory, its file in the state_dir, and the waiting queue's order;
- `offloading`: the rules under a KV connector (KV offloading);
- `drafting`: tail speculation's drafts from the scheduler;
- `recompute`: what preemptions throw away and what resumes find again;
- `trace`: the per-step trace and the timer of the adapter's own time;
- `parent`: the engine process ends with the driver that started it;
- `plugin`: the vLLM plugin (the ROLLOUT_SCHEDULER switch, exact speculative sampling on CPU, quiet logs);
- `logs`: the vLLM, torch and Triton start-up notices the driver's console leaves out.

Importing the package imports nothing of vLLM (the plugin is loaded in every vLLM process, the driver reads the
trace); the scheduler classes are imported when first asked for.
"""

_SCHEDULER_NAMES = ("RolloutScheduler", "DynamicBatchScheduler", "AsyncDynamicBatchScheduler")


def __getattr__(name: str):
    if name in _SCHEDULER_NAMES:
        from rollout.vllm import scheduler

        return getattr(scheduler, name)
    raise AttributeError(f"module 'rollout.vllm' has no attribute {name!r}")
