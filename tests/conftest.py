import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A random 2-layer Llama with a locally trained tokenizer, built once per test session (no download)."""
    from rollout.models import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(autouse=True)
def vllm_log_level_restored():
    """rollout.engine.set_vllm_log_level writes VLLM_LOGGING_LEVEL for the engines a process starts: one test's
    engine must not set the level of the processes the next tests start."""
    before = os.environ.get("VLLM_LOGGING_LEVEL")
    yield
    if before is None:
        os.environ.pop("VLLM_LOGGING_LEVEL", None)
    else:
        os.environ["VLLM_LOGGING_LEVEL"] = before

