"""Bad input to the CLI: one clear error line, exit status 2, before any engine starts."""

import json
import subprocess
import sys

import pytest


def run_cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "rollout.generate", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


def error_line(result):
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: "), result.stderr[-2000:]
    return lines[-1]


def test_help_lists_the_options_with_their_help_texts():
    result = run_cli("--help")
    assert result.returncode == 0
    for key in ("policy.eps_m=0.05", "sampling.n=4", "policy.name=forecast", "policy.order=longest_first",
                "model.path=smollm2-135m-instruct", "output.vllm_log_level=WARNING"):
        assert key in result.stdout
    assert "eps_M, the allowed probability that the admitted batch outgrows the KV cache" in " ".join(
        result.stdout.split())


@pytest.mark.parametrize("override, message", [
    ("policy.eps_m=1.5", "policy.eps_m must be in (0, 1), got 1.5"),
    ("policy.name=nope", "unknown policy 'nope'"),
])
def test_bad_config_value(override, message, tmp_path):
    assert message in error_line(run_cli(override, f"output.dir={tmp_path}/out"))


def test_b_min_above_b_max(tmp_path):
    line = error_line(run_cli("policy.b_min=10", "policy.b_max=4", f"output.dir={tmp_path}/out"))
    assert "policy.b_min (10) must not exceed policy.b_max (4)" in line


def write(path, content):
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return path


LONG = json.dumps({"id": "x", "prompt": "plus " * 3000})


@pytest.mark.parametrize("name, content, message", [
    # Every problem by the line an editor shows (1-based, blank lines counted).
    ("broken.jsonl", '{"prompt": "a"}\n\n{"prompt": \n', "line 3: invalid JSON"),
    ("notobject.jsonl", '{"prompt": "a"}\n[1, 2]\n', "line 2: expected a JSON object, got list"),
    ("nothing.jsonl", "", "is empty"),
    ("broken.json", '[{"prompt": "a"},\n {"prompt": }]', "line 2: invalid JSON"),
    ("nofield.jsonl", '\n{"id": 1, "question": "a"}\n', "line 2: missing prompt field 'prompt'"),
    ("empty.jsonl", '{"id": 1, "prompt": "   "}\n', "line 1: empty prompt"),
    ("dupe.jsonl", '{"id": 1, "prompt": "a"}\n\n{"id": 2, "prompt": "b"}\n\n{"id": 1, "prompt": "c"}\n',
     "line 5: duplicate prompt id '1' (first at line 1)"),
    ("dupe.json", '[\n {"id": 1, "prompt": "a"},\n {"id": 1, "prompt": "b"}\n]', "line 3: duplicate prompt id '1'"),
    ("long.jsonl", '{"id": "a", "prompt": "hi"}\n\n\n\n' + LONG + "\n", "line 5: prompt 'x' has"),
    ("prompts.csv", "prompt\nhello\n", "unsupported file type '.csv'"),
    ("latin1.jsonl", b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n', "line 2: not valid UTF-8"),
])
def test_bad_prompt_sets(name, content, message, tmp_path, tiny_model):
    path = write(tmp_path / name, content)
    line = error_line(run_cli(f"model.path={tiny_model}", f"data.source={path}", "model.max_model_len=512",
                              f"output.dir={tmp_path}/out"))
    assert message in line
    assert str(path) in line
    assert not (tmp_path / "out").exists()  # nothing written


def test_missing_prompt_set(tmp_path, tiny_model):
    line = error_line(run_cli(f"model.path={tiny_model}", f"data.source={tmp_path}/none.jsonl",
                              f"output.dir={tmp_path}/out"))
    assert "does not exist" in line


def test_missing_model_folder(tmp_path):
    line = error_line(run_cli(f"model.path={tmp_path}/no-model", "data.source=reasoning_gym:gsm_symbolic",
                              f"output.dir={tmp_path}/out"))
    assert "does not exist" in line


def test_own_data_without_a_model_says_what_to_give(tmp_path):
    line = error_line(run_cli(f"data.source={tmp_path}/prompts.jsonl", f"output.dir={tmp_path}/out"))
    assert "model.path is not set" in line


def test_existing_outputs_are_not_overwritten(tmp_path, tiny_model):
    out = tmp_path / "out"
    out.mkdir()
    (out / "samples.jsonl").write_text("precious\n")
    line = error_line(run_cli(f"model.path={tiny_model}", "data.source=reasoning_gym:gsm_symbolic",
                              "data.num_prompts=2", f"output.dir={out}"))
    assert "output.overwrite=true" in line
    assert (out / "samples.jsonl").read_text() == "precious\n"
    assert not (out / "manifest.json").exists()


def test_long_prompts_can_be_skipped(tmp_path, tiny_model):
    """data.long_prompts=skip leaves over-long prompts out with a warning; here every prompt is too long, so
    the run still stops, naming the reason, before any engine starts."""
    path = write(tmp_path / "long.jsonl", LONG + "\n")
    line = error_line(run_cli(f"model.path={tiny_model}", f"data.source={path}", "model.max_model_len=512",
                              "data.long_prompts=skip", f"output.dir={tmp_path}/out"))
    assert "every prompt is longer than 511 tokens" in line


def test_bad_long_prompts_value(tmp_path):
    line = error_line(run_cli("data.long_prompts=truncate", f"output.dir={tmp_path}/out"))
    assert "data.long_prompts must be 'fail' or 'skip'" in line


def test_overwrite_and_force_flags_are_config_overrides():
    from rollout.generate import parse_args

    args = parse_args(["--overwrite", "--force", "sampling.n=2"])
    assert args.overrides == ["sampling.n=2", "output.overwrite=true", "output.force=true"]
