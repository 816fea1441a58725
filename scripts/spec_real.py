"""Tail speculation end to end with real weights: vLLM's default scheduler, our policy, and our policy with the
scheduler's drafts (policy.spec_draft_tokens), over real reasoning prompts, several RL iterations a run.

  python scripts/spec_real.py export OUT.jsonl [--num-prompts 256]     # CPU: reasoning-gym prompts as token ids
  python scripts/spec_real.py run --model DIR --prompts OUT.jsonl --out runs/spec-real [--reps 3]
  python scripts/spec_real.py report runs/spec-real                    # ratios, tails, loops, replayed acceptance

`run` starts one process per (repetition, condition), the conditions in a rotated order each repetition, so that
one engine holds the GPU at a time and drift spreads over all of them. Each writes its passes' wall time, tokens,
finish times (the tail: the time after all but 16 or 64 samples have finished) and speculation counts to
OUT/<rep>-<condition>.json, and its samples' token ids to OUT/<rep>-<condition>.samples.jsonl.gz.

A small model at temperature 1 often ends a sample in a loop, which drafts from its own text predict well: `report`
counts samples whose last 256 tokens repeat a period of at most 64 apart, and replays the drafts offline on the
non-speculating runs' samples to give the acceptance of looping and other samples separately. The replay is exact
in distribution: for a draft that is one token (no draft probabilities, as here) vLLM's rejection sampler accepts
it with the target's probability of that token, which is the chance that a sample drawn without speculation has
that token there.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

VLLM_COMPILATION = ["model.engine_kwargs.compilation_config.mode=null",
                    "model.engine_kwargs.compilation_config.cudagraph_mode=null"]
CONDITIONS = {
    "vllm": ["policy.name=vllm"],
    "forecast": [],
    "spec4": ["policy.spec_draft_tokens=4"],
    "spec4-b64": ["policy.spec_draft_tokens=4", "policy.spec_max_batch=64"],
    # What a speculating engine changes besides drafts: synchronous scheduling and full graphs of every batch shape
    # (sync-full), and those with vLLM's speculation configured but (almost) no drafts (spec4-idle).
    "sync-full": ["model.async_scheduling=false", "model.engine_kwargs.compilation_config.cudagraph_mode=FULL"],
    "spec4-idle": ["policy.spec_draft_tokens=4", "policy.spec_max_batch=1"],
    # vLLM's own compilation (torch.compile, piecewise graphs for steps of mixed shape, full graphs of uniform
    # decodes), as a speculating engine built by rollout.generate keeps it: steps without drafts are not eager.
    "spec4-vdefault": ["policy.spec_draft_tokens=4", *VLLM_COMPILATION],
    "forecast-vdefault": VLLM_COMPILATION,
}
TAIL_SIZES = (16, 64)
LOOP_WINDOW, LOOP_PERIOD = 256, 64


def export(args) -> None:
    from rollout.config import load_config
    from rollout.data import load_prompts
    from rollout.models import ensure_smollm2
    from transformers import AutoTokenizer

    cfg = load_config([f"data.num_prompts={args.num_prompts}"], preset="demo")
    tokenizer = AutoTokenizer.from_pretrained(str(ensure_smollm2()))
    prompts, _ = load_prompts(cfg.data, tokenizer, max_prompt_tokens=1024)
    with open(args.out, "w") as f:
        for p in prompts:
            f.write(json.dumps({"id": p.prompt_id, "token_ids": p.token_ids}) + "\n")
    print(f"{len(prompts)} prompts ({cfg.data.source}) -> {args.out}")


def common_overrides(args) -> list[str]:
    return [f"model.path={args.model}", f"data.source={args.prompts}", f"sampling.n={args.n}",
            f"sampling.max_tokens={args.max_tokens}", "sampling.temperature=1.0",
            f"model.max_model_len={args.max_tokens + 1024}", "output.stats_in=null", "output.progress=false",
            "policy.b_max=1024", "model.enforce_eager=false",  # vLLM's default max_num_seqs; CUDA graphs
            "model.engine_kwargs.compilation_config.mode=0",
            "model.engine_kwargs.compilation_config.cudagraph_mode=FULL_DECODE_ONLY"]


def one(args) -> None:
    from rollout.config import load_config
    from rollout.data import Prompt
    from rollout.engine import RolloutEngine

    cfg = load_config(common_overrides(args) + CONDITIONS[args.condition] + args.set)
    rows = [json.loads(line) for line in open(args.prompts)][:args.num_prompts or None]
    prompts = [Prompt(r["id"], "", r["token_ids"]) for r in rows]
    out = Path(args.out)
    tag = f"{args.rep}-{args.condition}"
    result = {"condition": args.condition, "rep": args.rep, "passes": []}
    samples = []
    with RolloutEngine(cfg, out / "work" / tag) as engine:
        result["engine_start_s"] = engine.engine_start_s
        base_seed = cfg.sampling.seed
        for iteration in range(args.iterations):
            # Each iteration its own samples' seeds, as an RL iteration's new weights would give it its own samples:
            # with the same seeds the second iteration repeats the first and its history drafts are all accepted.
            engine.cfg.sampling.seed = base_seed + iteration * len(prompts) * args.n
            finished: list[float] = []
            start = time.monotonic()

            def sink(records):
                finished.extend([time.monotonic() - start] * len(records))

            run = engine.generate(prompts, progress=False, sink=sink, sink_every_s=0.0)
            wall = run.summary["wall_time_s"]
            finished.sort()
            tails = {f"tail{m}_s": round(wall - finished[-m - 1], 3) for m in TAIL_SIZES if len(finished) > m}
            result["passes"].append({
                "iteration": iteration, "wall_s": wall, "generated_tokens": run.summary["generated_tokens"],
                "tok_s": run.summary["generated_tokens_per_s"], **tails,
                "max_tokens_hit": sum(r["finish_reason"] == "length" for r in run.records),
                "speculation": run.summary.get("speculation"), "preemptions": run.summary["preemptions"],
                "steps": run.summary["steps"]})
            samples += [{"iteration": iteration, "prompt": r["group_index"], "sample": r["sample_index"],
                         "tokens": r["completion_token_ids"]} for r in run.records]
            print(tag, json.dumps(result["passes"][-1]), flush=True)
            if run.trace:
                by_batch: dict[int, list] = {}
                for s in run.trace:
                    if s.get("decode_requests") and s.get("step_ms") is not None:
                        bucket = 1 << int(np.log2(max(s["decode_requests"], 1)))
                        by_batch.setdefault(bucket, []).append(
                            (s["decode_requests"] + s.get("accepted_tokens", 0), s["decode_requests"], s["step_ms"]))
                result["passes"][-1]["by_batch"] = {
                    str(b): {"steps": len(v), "tokens_per_decode": round(sum(x[0] for x in v) / sum(x[1] for x in v), 3),
                             "step_ms": round(float(np.mean([x[2] for x in v])), 3)} for b, v in sorted(by_batch.items())}
    (out / f"{tag}.json").write_text(json.dumps(result, indent=1))
    with gzip.open(out / f"{tag}.samples.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(s) + "\n" for s in samples)


def run(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = args.conditions.split(",")
    for rep in range(args.reps):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for name in order:
            if (out / f"{rep}-{name}.json").exists():
                continue
            cmd = [sys.executable, __file__, "one", "--condition", name, "--rep", str(rep), "--model", args.model,
                   "--prompts", args.prompts, "--out", args.out, "--num-prompts", str(args.num_prompts), "--n", str(args.n),
                   "--max-tokens", str(args.max_tokens), "--iterations", str(args.iterations),
                   *[f"--set={o}" for o in args.set]]
            started = time.monotonic()
            code = subprocess.call(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"})
            print(f"rep {rep} {name}: exit {code} in {time.monotonic() - started:.0f} s", flush=True)


def ends_in_loop(tokens: list[int], window: int = LOOP_WINDOW, max_period: int = LOOP_PERIOD) -> bool:
    """The last `window` tokens repeat with a period of at most `max_period`."""
    if len(tokens) < window:
        return False
    end = np.asarray(tokens[-window:])
    return any(np.array_equal(end[p:], end[:-p]) for p in range(1, max_period + 1))


def replay_acceptance(samples: list[dict], prompts: list[list[int]], k: int = 4) -> dict:
    """Drafts of rollout.drafts replayed over samples drawn without speculation, as the adapter would propose them
    if every step drafted: a prompt's samples advance together, step by step, each by its accepted drafts and the
    token it samples; each draws on its siblings' texts so far, its prompt's earlier iterations and its own text
    (prompt included). Split by whether the sample ends in a loop."""
    from rollout.drafts import DraftSource

    by_iteration: dict[int, dict[int, list]] = {}
    for s in samples:
        by_iteration.setdefault(s["iteration"], {}).setdefault(s["prompt"], []).append(s["tokens"])
    source = DraftSource()
    totals = {True: [0, 0, 0], False: [0, 0, 0]}  # loop? -> drafted, accepted, verify steps
    for iteration in sorted(by_iteration):
        for prompt, group in by_iteration[iteration].items():
            head = list(prompts[prompt])
            ids = [f"{iteration}:{prompt}:{j}" for j in range(len(group))]
            loops = [ends_in_loop(tokens) for tokens in group]
            known = [head + tokens[:1] for tokens in group]  # the first output token comes from the prefill
            active = [j for j, tokens in enumerate(group) if len(tokens) > 1]
            while active:
                for j in active:
                    source.track(ids[j], known[j])
                for j in active:
                    tokens, done = group[j], len(known[j]) - len(head)
                    draft = source.propose(ids[j], known[j], str(prompt), ids, min(k, len(tokens) - done - 1))
                    accepted = 0
                    while accepted < len(draft) and draft[accepted] == tokens[done + accepted]:
                        accepted += 1
                    counts = totals[loops[j]]
                    counts[0] += len(draft)
                    counts[1] += accepted
                    counts[2] += 1
                    known[j].extend(tokens[done:done + accepted + 1])
                active = [j for j in active if len(known[j]) - len(head) < len(group[j])]
            for j in ids:
                source.forget(j)
        for prompt, group in by_iteration[iteration].items():
            for tokens in group:
                source.remember(str(prompt), tokens)
    return {("loop" if loop else "other"): {
        "draft_tokens": d, "accepted_tokens": a, "acceptance": round(a / d, 4) if d else None,
        "tokens_per_step": round((a + s) / s, 3) if s else None} for loop, (d, a, s) in totals.items()}


def report(args) -> None:
    out = Path(args.out)
    results = [json.loads(p.read_text()) for p in sorted(out.glob("*-*.json"))]
    by = {}
    for r in results:
        by.setdefault(r["condition"], []).append(r)
    print(f"{len(results)} runs: " + ", ".join(f"{c} x{len(v)}" for c, v in by.items()))
    base = {r["rep"]: r for r in by.get("vllm", [])}
    for cond, runs in by.items():
        for it in range(max(len(r["passes"]) for r in runs)):
            walls = [r["passes"][it]["wall_s"] for r in runs]
            ratios = [base[r["rep"]]["passes"][it]["wall_s"] / r["passes"][it]["wall_s"] for r in runs
                      if r["rep"] in base]
            tail = [r["passes"][it].get("tail16_s", np.nan) for r in runs]
            spec = [r["passes"][it]["speculation"] for r in runs if r["passes"][it].get("speculation")]
            line = (f"{cond:10s} it{it}: wall {np.mean(walls):7.2f} s  tok/s "
                    f"{np.mean([r['passes'][it]['tok_s'] for r in runs]):8.0f}  vs vllm (time) "
                    f"{np.mean(ratios) if ratios else float('nan'):.3f}x ({min(ratios, default=0):.3f}-"
                    f"{max(ratios, default=0):.3f})  tail16 {np.mean(tail):.2f} s")
            if spec:
                line += f"  acceptance {np.mean([s['acceptance'] for s in spec]):.3f}"
            print(line)
    for path in sorted(out.glob("0-*.samples.jsonl.gz")):
        samples = [json.loads(line) for line in gzip.open(path, "rt")]
        loops = [ends_in_loop(s["tokens"]) for s in samples]
        looped_tokens = sum(len(s["tokens"]) for s, lp in zip(samples, loops) if lp)
        print(f"{path.name}: {sum(loops)} of {len(samples)} samples end in a loop, "
              f"{looped_tokens / max(sum(len(s['tokens']) for s in samples), 1):.1%} of the tokens")
        if "spec" not in path.name and args.replay:
            prompts = [json.loads(line)["token_ids"] for line in open(args.prompts)]
            for iteration in sorted({s["iteration"] for s in samples})[:args.replay_iterations]:
                chosen = [s for s in samples if s["iteration"] <= iteration]
                print(f"  replayed drafts (k=4), iterations 0-{iteration}:",
                      json.dumps(replay_acceptance(chosen, prompts)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("export")
    p.add_argument("out")
    p.add_argument("--num-prompts", type=int, default=256)
    for name in ("run", "one"):
        p = sub.add_parser(name)
        p.add_argument("--model", required=True)
        p.add_argument("--prompts", required=True)
        p.add_argument("--out", required=True)
        p.add_argument("--n", type=int, default=8)
        p.add_argument("--num-prompts", type=int, default=0, help="the file's first ones; 0: all")
        p.add_argument("--max-tokens", type=int, default=2048)
        p.add_argument("--iterations", type=int, default=2)
        p.add_argument("--set", action="append", default=[], help="another config override (key=value)")
        if name == "run":
            p.add_argument("--reps", type=int, default=3)
            p.add_argument("--conditions", default="vllm,forecast,spec4,spec4-b64")
        else:
            p.add_argument("--condition", required=True, choices=sorted(CONDITIONS))
            p.add_argument("--rep", type=int, required=True)
    p = sub.add_parser("report")
    p.add_argument("out")
    p.add_argument("--replay", action="store_true", help="replay drafts over rep 0's non-speculating samples")
    p.add_argument("--prompts", default="runs/spec-real/prompts.jsonl", help="the prompts the runs used")
    p.add_argument("--replay-iterations", type=int, default=None, help=(
        "replay the first this many iterations (runs whose iterations shared their seeds: 1)"))
    args = parser.parse_args()
    {"export": export, "run": run, "one": one, "report": report}[args.command](args)


if __name__ == "__main__":
    main()
