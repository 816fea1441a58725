"""python -m rollout.generate [--config FILE] [key=value ...]: n samples per prompt with dynamic batching.

Restarting a killed or interrupted run with the same command resumes it (see rollout/store.py).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from contextlib import contextmanager, suppress
from dataclasses import asdict
from pathlib import Path

from rollout.vllm import logs as vllm_logs
from rollout.config import ConfigError, RunConfig, describe_options, load_config, to_yaml
from rollout.data import DataError, load_prompts, load_tokenizer
from rollout.engine import check_platform, set_vllm_log_level
from rollout.models import ModelError, resolve_model
from rollout.store import SampleStore, StoreError, fingerprint

# vLLM starts its engine core as a new interpreter, which imports this module (the parent's __main__) before
# vLLM: its notices at import (rollout.vllm.logs) are left out there only if the filter is in place by then.
vllm_logs.apply()

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m rollout.generate", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Generate n samples per prompt with vLLM, the batch size chosen every step by a policy. "
                    "Run the same command again to resume a killed run.",
        epilog="options (override as key=value):\n" + describe_options())
    parser.add_argument("--config", help="a YAML file merged over the defaults")
    parser.add_argument("--overwrite", action="store_true", help="same as output.overwrite=true")
    parser.add_argument("--force", action="store_true", help="same as output.force=true")
    parser.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. policy.eps_m=0.01 sampling.n=8")
    args = parser.parse_args(argv)
    args.overrides += ["output.overwrite=true"] * args.overwrite + ["output.force=true"] * args.force
    return args


def output_settings(cfg: RunConfig) -> dict:
    """What decides the samples: a resumed run must match it (engine capacity knobs may change)."""
    from rollout.engine import engine_dtype

    m = cfg.model
    return {"model": {"path": m.path, "dtype": engine_dtype(m.dtype), "max_model_len": m.max_model_len},
            "data": asdict(cfg.data), "sampling": asdict(cfg.sampling)}


def scoped(summary: dict) -> dict:
    """The summary's numbers by what they cover, for summary.json: `all_samples` every sample of the set, resumed
    ones included; `this_run` what this command generated (its tokens, time and throughput)."""
    return {"all_samples": {"samples": summary["num_samples"], "resumed": summary["samples_resumed"],
                            "completion_tokens": summary["completion_tokens_total"]},
            "this_run": {"samples": summary["samples_generated"], "prompt_tokens": summary["prompt_tokens"],
                         "generated_tokens": summary["generated_tokens"], "wall_time_s": summary["wall_time_s"],
                         "generated_tokens_per_s": summary["generated_tokens_per_s"],
                         "preemptions": summary["preemptions"]}}


def closing_lines(summary: dict, out_dir: Path, latest: str = "this run") -> list[str]:
    """What a run ends with: the set's samples (resumed ones included), then what the latest run generated and how
    fast (`latest`: how to name it)."""
    blocks = scoped(summary)
    every, run = blocks["all_samples"], blocks["this_run"]
    resumed = f" ({every['resumed']} of them from an earlier run)" if every["resumed"] else ""
    reward = f", reward {summary['reward_mean']:.3f}" if "reward_mean" in summary else ""
    return [f"all samples: {every['samples']} in {out_dir}{resumed}, {every['completion_tokens']} completion tokens"
            f"{reward}",
            f"{latest}: {run['samples']} samples, {run['generated_tokens']} tokens in {run['wall_time_s']:.1f} s: "
            f"{run['generated_tokens_per_s'] or 0:.1f} tok/s, {run['preemptions']} preemptions, policy "
            f"{summary['policy']}"]


def interrupted(store: SampleStore, order: list) -> str:
    return (f"\ninterrupted: {len(store.done)} of {len(order)} samples are safe in {store.samples_path}; "
            "run the same command again to resume")


def fail(message: str) -> int:
    """Each line of `message` (a prompt set's problems are one a line) as an error line; the bad-input status."""
    print("".join(f"error: {line}\n" for line in message.split("\n")), end="", file=sys.stderr)
    return EXIT_BAD_INPUT


@contextmanager
def exit_on_interrupt(message: str, grace_s: float = 2.0):
    """Ctrl-C while vLLM's engine starts: the main thread then waits in C (a ZMQ poll of up to 10 minutes for
    the engine process), the signal went to another thread, and the KeyboardInterrupt was lost: the run went on
    to the end. The signal still reaches Python's wakeup fd, read here by a thread: if the main thread has not
    left the block `grace_s` later, print `message`, kill the engine's processes (nothing is generated yet; one
    still waiting for its handshake would wait 5 minutes for a parent gone) and exit 130. If it left the block in
    time without a KeyboardInterrupt (code in the block caught it), one is raised as the block ends."""
    import psutil

    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous = signal.set_wakeup_fd(write_fd)
    left = threading.Event()
    interrupted = threading.Event()

    def watch() -> None:
        while data := os.read(read_fd, 64):
            if signal.SIGINT in data:
                interrupted.set()
                if not left.wait(grace_s):
                    print(message, file=sys.stderr, flush=True)
                    for child in psutil.Process().children(recursive=True):
                        with suppress(psutil.Error):
                            child.kill()
                    os._exit(EXIT_INTERRUPTED)
        os.close(read_fd)

    watcher = threading.Thread(target=watch, name="startup-interrupt", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        left.set()
        signal.set_wakeup_fd(previous)
        os.close(write_fd)  # the watcher reads what is left of its end and stops
        watcher.join(timeout=60)  # a loaded host may not run it for a while; it ends once it reads the end
    if interrupted.is_set():
        raise KeyboardInterrupt


def size_kv_cache(cfg: RunConfig, model_path: str, prompts: list) -> None:
    """On the CPU, a KV cache the user gave no size gets one sized from the prompt set and the machine
    (rollout.cpu_memory), said in one line; vLLM's own default would take most of the host's memory."""
    from vllm.platforms import current_platform

    from rollout.engine import cpu_kv_cache, unsized

    if current_platform.is_cpu() and unsized(cfg):
        size = cpu_kv_cache(cfg, model_path, prompts)
        cfg.model.kv_cache_memory_bytes = size.bytes
        print(size.reason, file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    os.environ.update(OFFLINE)  # no network at run time: models and data must be local
    args = parse_args(argv)
    try:
        cfg = load_config(args.overrides, args.config)
        set_vllm_log_level(cfg.output.vllm_log_level)  # before anything here imports vLLM
        check_platform(cfg)
        model_path = resolve_model(cfg.model.path)
        tokenizer = load_tokenizer(model_path)
        prompts, skipped = load_prompts(cfg.data, tokenizer, max_prompt_tokens=cfg.model.max_model_len - 1)
        out_dir = Path(cfg.output.dir)
        store = SampleStore(out_dir, fingerprint(output_settings(cfg), prompts), overwrite=cfg.output.overwrite,
                            force=cfg.output.force)
        if (complete := store.completed()) is not None:
            print(f"nothing to do: {out_dir} holds this run, complete (output.overwrite=true generates it again)")
            print("\n".join(closing_lines(complete, out_dir, latest="last run")))
            return 0
        size_kv_cache(cfg, model_path, prompts)
        done = store.open()
    except (ConfigError, DataError, ModelError, StoreError, OSError) as exc:
        return fail(str(exc))
    except KeyboardInterrupt:
        print("interrupted before generating: nothing new was written", file=sys.stderr)
        return EXIT_INTERRUPTED

    from rollout.engine import TRACE_FILE, RolloutEngine
    from rollout.report import plot_trace

    order = [(p.prompt_id, j) for p in prompts for j in range(cfg.sampling.n)]
    for item in skipped:
        print(f"warning: skipped prompt {item['prompt_id']!r} ({cfg.data.source} {item['location']}): "
              f"{item['prompt_tokens']} tokens do not fit model.max_model_len={cfg.model.max_model_len}",
              file=sys.stderr)
    if done:
        print(f"resuming: {len(done)} of {len(order)} samples already in {store.samples_path}", file=sys.stderr)
    else:
        (out_dir / TRACE_FILE).unlink(missing_ok=True)
    trace = []
    try:
        (out_dir / "config.yaml").write_text(to_yaml(cfg))  # inside: a Ctrl-C from here on stops the run cleanly
        if cfg.model.data_parallel_size > 1:
            from rollout.parallel import generate_parallel

            summary = generate_parallel(cfg, prompts, out_dir, done, store.append)
        else:
            with exit_on_interrupt(interrupted(store, order)):
                engine = RolloutEngine(cfg, out_dir)
            with engine:
                result = engine.generate(prompts, progress=cfg.output.progress, done=done, sink=store.append)
            summary, trace = result.summary, result.trace
    except (FileNotFoundError, ModelError, RuntimeError) as exc:
        store.close()
        return fail(str(exc))
    except KeyboardInterrupt:
        store.close()
        print(interrupted(store, order), file=sys.stderr)
        return EXIT_INTERRUPTED
    summary["skipped_prompts"] = skipped
    summary["outputs"] = store.finalize(order, list(cfg.output.formats))
    plot = plot_trace(trace, out_dir / "trace.png", f"{cfg.policy.name}: cap, running, KV use") if trace else None
    summary["plot"] = str(plot) if plot else None
    summary.update(scoped(summary))
    store.write_summary(summary)
    print("\n".join(closing_lines(summary, out_dir)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
