"""The adapter on other vLLM releases than the one installed: scripts/test-vllm-versions.sh runs the model-free
adapter tests (tests/test_adapter.py) on the oldest supported release, the one OpenRLHF 0.11.2 pins and the newest,
each in an environment of its own made from its published wheel (docs/vllm-versions.md lists every release)."""

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RELEASES = ("0.24", "0.29", "0.34")


@pytest.mark.parametrize("release", RELEASES)
def test_the_adapter_tests_pass_on_the_release(release):
    result = subprocess.run(["bash", str(ROOT / "scripts" / "test-vllm-versions.sh"), release], cwd=ROOT,
                            capture_output=True, text=True, timeout=1800)
    lines = result.stdout.strip().splitlines()
    assert result.returncode == 0 and lines and lines[-1].startswith(f"vLLM {release}: passed"), (
        result.stdout[-3000:] + result.stderr[-3000:])
