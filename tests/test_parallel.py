"""Data parallel rollouts: shares balanced by predicted work, two engines giving one engine's outputs."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rollout.parallel import split_by_work


def test_shares_cover_every_prompt_once_with_balanced_work():
    work = [100, 5, 5, 5, 5, 40, 40, 20, 1, 1]
    shares = split_by_work(work, 2)
    assert sorted(i for share in shares for i in share) == list(range(len(work)))
    assert all(share == sorted(share) for share in shares)  # each keeps the set's order
    loads = [sum(work[i] for i in share) for share in shares]
    assert max(loads) - min(loads) <= 20  # by count the split would be 5/5 whatever the work
    assert split_by_work([3.0], 3) == [[0], [], []]


PROMPTS = [{"id": f"p{i}", "prompt": f"Question {i}: what is {i} plus {2 * i}?", "answer": str(3 * i)}
           for i in range(8)]


def run(tiny_model, prompt_set, out_dir, *extra):
    args = [sys.executable, "-m", "rollout.generate", f"model.path={tiny_model}", f"data.source={prompt_set}",
            # (a later data.source in `extra` wins)
            "data.system_prompt=null", "sampling.n=2", "sampling.max_tokens=24", "sampling.temperature=0",
            "sampling.ignore_eos=true", "model.kv_cache_memory_bytes=8388608", "model.max_model_len=512",
            "policy.b_max=8", "output.progress=false", f"output.dir={out_dir}", *extra]
    result = subprocess.run(args, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [json.loads(line) for line in (out_dir / "samples.jsonl").read_text().splitlines()]
    return rows, json.loads((out_dir / "summary.json").read_text())


@pytest.fixture
def ray_cluster(tmp_path):
    """A cluster as `ray start` makes one (a head node of two CPUs), which a run on its host finds by itself."""
    import socket

    ray = Path(sys.executable).with_name("ray")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = subprocess.run([str(ray), "start", "--head", f"--port={port}", "--num-cpus=2", "--num-gpus=0",
                              "--include-dashboard=false", "--disable-usage-stats"],
                             capture_output=True, text=True, timeout=300)
    assert started.returncode == 0, started.stderr[-3000:]
    try:
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run([str(ray), "stop", "--force"], capture_output=True, timeout=300)


@pytest.mark.engine
def test_two_engines_on_a_ray_start_cluster_give_the_outputs_of_one(tiny_model, tmp_path, ray_cluster):
    prompt_set = tmp_path / "prompts.jsonl"
    prompt_set.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    one, _ = run(tiny_model, prompt_set, tmp_path / "one")
    two, summary = run(tiny_model, prompt_set, tmp_path / "two", "model.data_parallel_size=2")
    assert summary["ray_address"].endswith(":" + ray_cluster.split(":")[1])  # that cluster's, not a new one
    assert summary["engines"] == 2 and sum(summary["prompts_per_engine"]) == len(PROMPTS)
    assert all(n > 0 for n in summary["prompts_per_engine"])
    assert [(r["prompt_id"], r["sample_index"], r["group_index"]) for r in two] == [
        (p["id"], j, i) for i, p in enumerate(PROMPTS) for j in range(2)]  # merged in the set's order
    key = lambda r: (r["prompt_id"], r["sample_index"])  # noqa: E731
    assert {key(r): r["completion_token_ids"] for r in two} == {key(r): r["completion_token_ids"] for r in one}
    assert summary["generated_tokens"] == sum(r["completion_tokens"] for r in two) == 8 * 2 * 24


@pytest.mark.engine
def test_two_engines_score_in_the_parent(tiny_model, tmp_path):
    # reasoning-gym scorers are closures that cannot travel to the engine processes: the parent scores.
    source = ("data.source=reasoning_gym:basic_arithmetic", "data.num_prompts=6", "sampling.n=1")
    one, one_summary = run(tiny_model, "unused", tmp_path / "one", *source)
    two, summary = run(tiny_model, "unused", tmp_path / "two", *source, "model.data_parallel_size=2")
    assert all("reward" in r for r in one) and all("reward" in r for r in two)
    key = lambda r: (r["prompt_id"], r["sample_index"])  # noqa: E731
    scored = lambda rows: {key(r): (r["completion"], r["reward"]) for r in rows}  # noqa: E731
    assert scored(two) == scored(one)
    assert summary["reward_mean"] == pytest.approx(one_summary["reward_mean"])


@pytest.mark.engine
def test_a_killed_engine_share_is_rerun_exactly_once(tiny_model, tmp_path):
    import ray

    from rollout.config import load_config
    from rollout.data import Prompt
    from rollout.engine import RolloutEngine
    from rollout.parallel import ParallelEngines

    # Samples of 256 tokens: an engine's share lasts seconds, far longer than the half second between the checks
    # below, so engine 1 is seen holding samples it has not finished (at 24 tokens a share took about half a
    # second, and it could start and finish between two checks).
    overrides = [f"model.path={tiny_model}", "data.source=unused", "sampling.n=2", "sampling.max_tokens=256",
                 "sampling.temperature=0", "sampling.ignore_eos=true", "model.kv_cache_memory_bytes=8388608",
                 "model.max_model_len=512", "output.progress=false",
                 # Two running and two waiting per engine: each takes a prompt or two at a time.
                 "policy.b_max=2"]
    rng = np.random.default_rng(0)
    prompts = [Prompt(f"p{i}", "", [int(t) for t in rng.integers(5, 1000, size=int(rng.integers(4, 40)))])
               for i in range(10)]
    with RolloutEngine(load_config(overrides), tmp_path / "one") as engine:
        one = engine.generate(prompts, progress=False).records
    received, killed = [], []
    with ParallelEngines(load_config([*overrides, "model.data_parallel_size=2"]), tmp_path / "two") as engines:

        def sink(records):
            received.extend(records)
            # Killed while it holds samples it has not finished: they must be generated by the other engine.
            if not killed and ray.get(engines.dispatcher.progress.remote())["held"][1] >= 2:
                ray.kill(engines.actors[1])
                killed.append(True)

        result = engines.generate(prompts, sink=sink)
        summary = result.summary
        assert killed and summary["engines_alive"] == 1 and summary["per_engine"][1] == {"died": True,
                                                                                         "prompts_stolen": 0}
        assert summary["samples_rerun"] >= 1
        key = lambda r: (r["prompt_id"], r["sample_index"])  # noqa: E731
        assert sorted(key(r) for r in received) == sorted(key(r) for r in one)  # each sample once
        assert {key(r): r["completion_token_ids"] for r in result.records} == {
            key(r): r["completion_token_ids"] for r in one}
        # The engine left carries on: a second pass over it alone, its prompts all known now.
        again = engines.generate(prompts).summary
        assert again["engines_alive"] == 1 and again["prompts_per_engine"][0] == len(prompts)
        assert again["prompt_lengths"]["prompts_predicted"] == len(prompts)



@pytest.mark.engine
def test_a_trainer_drives_two_engines_as_one(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout.config import load_config
    from rollout.models import forced_token_weights
    from rollout.parallel import ParallelEngines

    overrides = [f"model.path={tiny_model}", "data.source=unused", "sampling.n=1", "sampling.max_tokens=8",
                 "sampling.temperature=0", "sampling.ignore_eos=true", "model.kv_cache_memory_bytes=8388608",
                 "model.max_model_len=512", "output.progress=false", "policy.b_max=4", "model.data_parallel_size=2"]
    rng = np.random.default_rng(1)
    texts = ["What is two plus two?", "Name a prime number."]
    prompts = [[int(t) for t in rng.integers(5, 1000, size=int(rng.integers(4, 30)))] for _ in range(8)] + texts
    state = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    with ParallelEngines(load_config(overrides), tmp_path) as engines:
        batch = engines.rollout(prompts, n=2, logprobs=0)
        assert len(batch) == 2 * len(prompts) and list(batch.group_index) == [i for i in range(10) for _ in (0, 1)]
        assert batch.prompt_ids[0] == prompts[0] and batch.prompt_ids[-1] == tokenizer.encode(texts[1])
        assert all(len(c) == 8 for c in batch.completion_ids) and all(len(lp) == 8 for lp in batch.logprobs)
        assert engines.cfg.sampling.n == 1  # the overrides held for that call only
        with pytest.raises(ValueError, match="unknown sampling setting"):
            engines.rollout(prompts, colour="red")

        forced_token = 77
        assert any(token != forced_token for c in batch.completion_ids for token in c)
        engines.update_weights(forced_token_weights(state, forced_token))
        forced = engines.rollout(prompts)
        assert all(n > 0 for n in forced.summary["prompts_per_engine"])  # both engines took the new weights
        assert all(token == forced_token for c in forced.completion_ids for token in c)
        engines.update_weights(state.items())
        assert engines.rollout(prompts).completion_ids == batch.completion_ids[::2]  # greedy: both samples alike

def jobs_of(works):
    from rollout.data import Prompt
    from rollout.engine import Job

    return [(float(w), Job(i, Prompt(f"p{i}", "", [1, 2, 3]), [0, 1])) for i, w in enumerate(works)]


def test_dispatcher_gives_own_queue_first_then_steals_from_the_fullest():
    from rollout.parallel import Dispatcher

    queues = [jobs_of([9, 5])[:2], [(w, j) for w, j in jobs_of([0, 0, 8, 7, 6, 1])[2:]]]
    dispatcher = Dispatcher(queues, expected=12)
    assert [j.index for j in dispatcher.take(0, 2, steal=True)] == [0]  # own queue, whole prompts, in order
    assert [j.index for j in dispatcher.take(0, 3, steal=True)] == [1]  # own queue before stealing
    assert [j.index for j in dispatcher.take(0, 4, steal=False)] == []  # nothing of its own left
    # Stealing: the heaviest prompts the fullest queue has not handed out, at most half of them.
    assert [j.index for j in dispatcher.take(0, 100, steal=True)] == [2, 3]
    assert [j.index for j in dispatcher.take(1, 100, steal=False)] == [4, 5]
    assert dispatcher.progress()["stolen"] == [2, 0]
    assert dispatcher.take(0, 100, steal=True) == []  # nothing left to give: it waits


def test_dispatcher_reruns_a_dead_engines_unfinished_samples_once():
    from rollout.parallel import Dispatcher

    dispatcher = Dispatcher([jobs_of([3, 2]), [(w, j) for w, j in jobs_of([0, 0, 4, 1])[2:]]], expected=8)
    taken = dispatcher.take(1, 2, steal=False)
    assert [j.index for j in taken] == [2]
    record = lambda i, s: {"group_index": i, "sample_index": s}  # noqa: E731
    dispatcher.put(1, [record(2, 0)])
    assert dispatcher.lost(1) == 1  # sample 1 of prompt 2; its queue (prompt 3) goes to the others as well
    rerun = dispatcher.take(0, 1, steal=False)
    assert [(j.index, j.samples) for j in rerun] == [(2, [1])]  # orphans before its own queue
    assert [(j.index, j.samples) for j in dispatcher.take(0, 100, steal=False)] == [(3, [0, 1]), (0, [0, 1]),
                                                                                  (1, [0, 1])]
    dispatcher.put(1, [record(2, 0), record(2, 1)])  # the dead engine's late copies: only the unseen one is kept
    dispatcher.put(0, [record(2, 1)])  # the rerun's copy of a sample already in
    assert dispatcher.collect() == [record(2, 0), record(2, 1)]
    dispatcher.put(0, [record(i, s) for i in (0, 1, 3) for s in (0, 1)])
    assert len(dispatcher.collect()) == 6 and dispatcher.take(0, 1, steal=True) is None  # every sample is in
    assert dispatcher.take(1, 1, steal=True) is None


def test_more_engines_than_the_ray_cluster_holds_is_one_clear_error(tiny_model, tmp_path):
    prompt_set = tmp_path / "prompts.jsonl"
    prompt_set.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    args = [sys.executable, "-m", "rollout.generate", f"model.path={tiny_model}", f"data.source={prompt_set}",
            "model.kv_cache_memory_bytes=8388608", "model.data_parallel_size=512", f"output.dir={tmp_path / 'out'}"]
    result = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "model.data_parallel_size=512 (model.tensor_parallel_size=1): 512 CPU needed" in result.stderr
    assert "Traceback" not in result.stderr
