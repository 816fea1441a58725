"""python -m rollout.generate [--config FILE] [key=value ...]: n samples per prompt with dynamic batching."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from rollout.config import ConfigError, describe_options, load_config, to_yaml
from rollout.data import DataError, load_prompts
from rollout.models import ModelError, resolve_model
from rollout.report import OUTPUT_NAMES, SUMMARY_FILE, plot_trace, write_samples, write_summary


class RunError(RuntimeError):
    """The run cannot start as configured."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m rollout.generate", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Generate n samples per prompt with vLLM, the batch size chosen every step by a policy.",
        epilog="options (override as key=value):\n" + describe_options())
    parser.add_argument("--config", help="a YAML file merged over the defaults")
    parser.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. policy.eps_m=0.01 sampling.n=8")
    return parser.parse_args(argv)


def check_output_dir(out_dir: Path, overwrite: bool) -> None:
    existing = [name for name in [*OUTPUT_NAMES.values(), SUMMARY_FILE] if (out_dir / name).exists()]
    if existing and not overwrite:
        raise RunError(f"{out_dir} already holds {', '.join(existing)}; pass output.overwrite=true to replace them")


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = parse_args(argv)
    try:
        cfg = load_config(args.overrides, args.config)
        out_dir = Path(cfg.output.dir)
        check_output_dir(out_dir, cfg.output.overwrite)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(resolve_model(cfg.model.path))
        prompts = load_prompts(cfg.data, tokenizer, max_prompt_tokens=cfg.model.max_model_len - 1)
    except (ConfigError, DataError, ModelError, RunError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    from rollout.engine import TRACE_FILE, RolloutEngine

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / TRACE_FILE).unlink(missing_ok=True)  # a replaced run's trace would otherwise be appended to
    (out_dir / "config.yaml").write_text(to_yaml(cfg))
    try:
        engine = RolloutEngine(cfg, out_dir)
    except (FileNotFoundError, ModelError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with engine:
        result = engine.generate(prompts, progress=cfg.output.progress)
    result.summary["outputs"] = write_samples(result.records, out_dir, list(cfg.output.formats))
    plot = plot_trace(result.trace, out_dir / "trace.png", f"{cfg.policy.name}: cap, running, KV use")
    result.summary["plot"] = str(plot) if plot else None
    write_summary(result.summary, out_dir)
    s = result.summary
    line = (f"{s['num_samples']} samples, {s['generated_tokens']} tokens in {s['wall_time_s']:.1f} s: "
            f"{s['generated_tokens_per_s']:.1f} tok/s, {s['preemptions']} preemptions, policy {s['policy']}")
    if "reward_mean" in s:
        line += f", reward {s['reward_mean']:.3f}"
    print(line)
    print(f"outputs in {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
