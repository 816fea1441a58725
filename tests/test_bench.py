"""The benchmark's CPU mode end to end (tiny model): tables, plots and consistent numbers; the suite's
configuration and scheduler names without an engine; the package's layering (no library module imports a
command-line module)."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.engine
def test_cpu_benchmark_smoke(tmp_path):
    out = tmp_path / "bench"
    result = subprocess.run(
        [sys.executable, "-m", "rollout.bench", "--config", "configs/bench/cpu-smoke.yaml", f"out_dir={out}",
         "schedulers=[vllm,static-64,memory,oracle]"], capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads((out / "results.json").read_text())
    assert report["machine"]["gpus"] == [] and report["machine"]["cpu_count"] >= 1  # what ran it, named
    assert report["machine"]["vllm"].split(".")[0].isdigit()
    runs = report["results"]
    assert {(r["profile"], r["scheduler"]) for r in runs} == {
        (p, s) for p in ("kv-bound", "grpo-groups") for s in ("vllm", "static-64", "memory", "oracle")}
    for r in runs:
        assert r["generated_tokens"] == r["requested_tokens"] > 0  # every imposed token, no more, no less
        assert r["tokens_per_s"] == pytest.approx(r["generated_tokens"] / r["makespan_s"], rel=0.01)
        passes = r["per_iteration_tokens_per_s"]  # the whole run's rate is a weighted mean of its passes'
        assert len(passes) == (2 if r["profile"] == "grpo-groups" else 1), passes
        assert min(passes) * 0.99 <= r["tokens_per_s"] <= max(passes) * 1.01
        assert r["started_at"] < r["ended_at"] <= report["started"] + 3600  # for pairs across GPUs by time
        if r["scheduler"] == "oracle":
            assert r["preemptions"] == 0 and r["recomputed_tokens"] == 0  # it knows the lengths: no preemption
        if r["scheduler"] != "vllm":
            assert 0.0 <= r["drain_tail_fraction"] <= 1.0
            assert r["recomputed_fraction"] >= 0.0
    kv_bound = {r["scheduler"]: r for r in runs if r["profile"] == "kv-bound"}
    assert kv_bound["static-64"]["preemptions"] > 0  # the profile really overflows the cache
    table = (out / "results.md").read_text()
    assert table.startswith("Machine: CPU only")
    assert "### kv-bound" in table and "### grpo-groups" in table
    assert "| vllm |" in table and "| 1.000 |" in table
    for name in ("throughput.png", "timeline-kv-bound.png", "timeline-grpo-groups.png"):
        assert (out / name).stat().st_size > 1000


@pytest.mark.engine
def test_a_later_pass_runs_alone_from_the_learned_files(tmp_path):
    """start_iteration=1 on the real engine: the second pass alone, every one of its tokens, its scheduler
    started from the files the first pass would have left (`output.stats_in`)."""
    from rollout.suite import load_bench_config
    from rollout.workloads import profile_requests

    out = tmp_path / "bench"
    args = ["--config", "configs/bench/cpu-smoke.yaml", "only=[grpo-groups]", "schedulers=[forecast-lpt]",
            "start_iteration=1"]
    result = subprocess.run([sys.executable, "-m", "rollout.bench", *args, f"out_dir={out}"], capture_output=True,
                            text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-4000:]
    bench = load_bench_config("configs/bench/cpu-smoke.yaml", args[2:])
    second = sum(r.output_tokens for r in profile_requests(bench.profiles[0], 1, bench.seed, bench.vocab_size))
    (run,) = json.loads((out / "results.json").read_text())["results"]
    assert len(run["per_iteration_tokens_per_s"]) == 1
    assert run["generated_tokens"] == run["requested_tokens"] == second


def test_bad_bench_config_fails_before_any_engine():
    result = subprocess.run([sys.executable, "-m", "rollout.bench", "--config", "configs/bench/cpu-smoke.yaml",
                             "schedulers=[fastest]"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "unknown scheduler 'fastest'" in result.stderr


def test_kv_offloading_on_the_cpu_fails_before_any_engine(tmp_path):
    result = subprocess.run([sys.executable, "-m", "rollout.bench", "--config", "configs/bench/cpu-smoke.yaml",
                             "kv_offloading_gib=8", f"out_dir={tmp_path / 'bench'}"], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 2
    assert "kv_offloading_gib=8.0: vLLM's KV offloading copies blocks between a GPU and host memory" in result.stderr
    assert not (tmp_path / "bench").exists()


def test_a_scheduler_name_carries_policy_settings():
    from rollout.suite import load_bench_config, scheduler_policy

    bench = load_bench_config("configs/bench/cpu-smoke.yaml", ["schedulers=[vllm,forecast-lpt:forecast_siblings=false]"])
    settings = scheduler_policy(bench, bench.schedulers[1])
    assert settings["name"] == "forecast" and settings["order"] == "longest_first"
    assert settings["forecast_siblings"] is False
    result = subprocess.run([sys.executable, "-m", "rollout.bench", "--config", "configs/bench/cpu-smoke.yaml",
                             "schedulers=[forecast:siblings]"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "key=value" in result.stderr


def test_a_misspelt_policy_setting_in_a_scheduler_name_is_an_error():
    from rollout.config import ConfigError
    from rollout.sim.runs import scheduler_settings
    from rollout.suite import load_bench_config

    # Unchecked, a misspelt key would run the defaults under the variant's name.
    with pytest.raises(ConfigError, match="'cold_start_horizon' not in 'PolicyConfig'"):
        load_bench_config("configs/bench/cpu-smoke.yaml", ["schedulers=[vllm,forecast:cold_start_horizon=0.1]"])
    bench = load_bench_config("configs/bench/cpu-smoke.yaml", [])
    with pytest.raises(ConfigError, match="could not be converted"):
        scheduler_settings(bench, "forecast:eps_m=often")
    assert scheduler_settings(bench, "forecast:forecast_cold_start_horizon=0.1")["forecast_cold_start_horizon"] == 0.1


def test_prefix_caching_can_be_turned_off_for_the_runs():
    from rollout.suite import bench_run_config, load_bench_config

    for overrides, expected in (([], True), (["prefix_caching=false"], False)):
        bench = load_bench_config("configs/bench/cpu-smoke.yaml", overrides)
        assert bench_run_config(bench, bench.profiles[0], "vllm", "some/model").model.enable_prefix_caching is expected


def test_the_machine_is_named_without_nvidia_smi(monkeypatch):
    from rollout.suite import machine

    monkeypatch.setenv("PATH", "")  # no nvidia-smi to ask (as on a machine without NVIDIA's driver)
    ran_on = machine(gpu=True)
    assert ran_on["gpus"] == [] and ran_on["cpu_count"] >= 1


def test_runs_pair_with_the_default_run_that_ran_at_the_same_time_on_another_gpu():
    from rollout.suite import summarize_ratios, time_paired_ratios

    def run(scheduler, gpu, start, end, tok_s, profile="cap-bound"):
        return {"profile": profile, "scheduler": scheduler, "gpu": gpu, "started_at": start, "ended_at": end,
                "tokens_per_s": tok_s}

    results = [run("forecast", "0", 0, 50, 100.0), run("vllm", "1", 1, 52, 90.0),  # a slow slot
               run("vllm", "0", 50, 100, 120.0), run("forecast", "1", 52, 101, 125.0),  # a fast one
               run("vllm", "1", 200, 250, 80.0),  # ran alone
               run("forecast", "0", 300, 350, 50.0), run("vllm", "0", 300, 350, 60.0),  # one GPU: no pair
               run("forecast", "0", 400, 450, 70.0), run("vllm", "1", 400, 450, 70.0, profile="kv-bound"),
               run("forecast", "1", 500, 600, 70.0), run("vllm", "0", 570, 640, 70.0)]  # overlap under half
    pairs = time_paired_ratios(results)
    assert sorted((p["gpu"], p["base_gpu"], round(p["ratio"], 4)) for p in pairs) == [
        ("0", "1", round(100 / 90, 4)), ("1", "0", round(125 / 120, 4))]
    summary = summarize_ratios([1.1, 1 / 1.1])
    assert summary["geometric_mean"] == pytest.approx(1.0) and summary["n"] == 2
    assert summary["min"] == pytest.approx(1 / 1.1) and summary["log_standard_error"] == pytest.approx(0.0953, abs=1e-3)


def test_benchmarks_write_under_runs_by_default():
    from rollout.suite import load_bench_config, load_capacity_config

    assert load_bench_config(None, []).out_dir == "runs/bench/default"
    assert load_bench_config("configs/bench/cpu-smoke.yaml", []).out_dir == "runs/bench/cpu-smoke"
    assert load_capacity_config("configs/online/cpu-smoke.yaml", []).out_dir == "runs/online/cpu-smoke"
    assert load_bench_config(None, ["out_dir=elsewhere"]).out_dir == "elsewhere"
    for path in sorted((ROOT / "configs/bench").glob("*.yaml")):
        assert load_bench_config(str(path), []).out_dir.startswith("runs/"), path
    for path in sorted((ROOT / "configs/online").glob("*.yaml")):
        assert load_capacity_config(str(path), []).out_dir.startswith("runs/"), path


# What a user runs from a shell; every other module under rollout/ is the library they call.
CLI_MODULES = {"rollout.bench", "rollout.online", "rollout.generate", "rollout.sim.__main__"}


def imported_modules(path: Path, module: str) -> set[str]:
    """Every module `path` (the module named `module`) imports, relative imports resolved, `from a import b`
    counted as both a and a.b (b may be a module)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def test_no_library_module_imports_a_command_line_module():
    found = {}
    for path in sorted((ROOT / "rollout").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        if module in CLI_MODULES:
            continue
        found[module] = imported_modules(path, module)
        wrong = found[module] & CLI_MODULES
        assert not wrong, f"{module} imports {sorted(wrong)}: the library must not depend on a command line"
    assert "rollout.suite" in found["rollout.sim.runs"]  # the walk sees imports at all


def test_the_import_walk_sees_every_form_of_import(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("import rollout.bench\nfrom rollout import online\nfrom .. import generate\n"
                    "def f():\n    from .__main__ import main\n")
    names = imported_modules(path, "rollout.sim.m")
    assert {"rollout.bench", "rollout.online", "rollout.generate", "rollout.sim.__main__"} <= names
