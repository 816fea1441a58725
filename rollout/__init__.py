"""rollout: fast RL rollouts on vLLM with memory-aware dynamic batching."""

__version__ = "0.1.0"
