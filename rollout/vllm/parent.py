"""The engine process ends with the driver that started it. No vLLM import."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
import threading
import time

PARENT_GONE_GRACE_S = 10.0  # how long vLLM's own shutdown may take once the driver is gone


def end_with_parent() -> None:
    """Have Linux end this process (SIGTERM) when its parent dies. vLLM's engine core does not watch the driver
    that started it: after a SIGKILL of `rollout.generate` (the OOM killer, a job scheduler, a test's timeout)
    it ran the requests on with nobody to read them, holding the accelerator's memory, its worker spinning a
    CPU core. SIGTERM is vLLM's own shutdown, which also ends the worker; where that shutdown hangs, a watch
    thread ends the process PARENT_GONE_GRACE_S after the parent is gone. Linux sends the SIGTERM when the
    parent's *thread* that started this process ends: so only for engines a main thread started
    (rollout.vllm.settings.adapter_settings), not one a trainer starts from a worker thread that then returns."""
    parent = multiprocessing.parent_process()
    if parent is None or not sys.platform.startswith("linux"):
        return  # the driver's own process (vLLM without multiprocessing), or no prctl
    pr_set_pdeathsig = 1
    if ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM) == 0 and os.getppid() != parent.pid:
        os.kill(os.getpid(), signal.SIGTERM)  # the parent died before this was set

    def watch() -> None:
        # vLLM's shutdown after the SIGTERM can wait for ever on the dead driver (its output thread sending to
        # nobody): PARENT_GONE_GRACE_S after the parent is gone the process ends at once. Its worker ends by
        # itself (vLLM's death pipe); nothing it would still send has a reader.
        while os.getppid() == parent.pid:
            time.sleep(1.0)
        time.sleep(PARENT_GONE_GRACE_S)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="rollout-parent-watch", daemon=True).start()
