"""A calibrated simulator of vLLM's scheduling, for evaluating policies in seconds on a CPU."""

from rollout.sim.engine import SimResult, Speculation, StepTimeModel, simulate
from rollout.sim.fit import fit_step_time

__all__ = ["SimResult", "Speculation", "StepTimeModel", "simulate", "fit_step_time"]
