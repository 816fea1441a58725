import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A random 2-layer Llama with a locally trained tokenizer, built once per test session (no download)."""
    from rollout.models import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


def _restore_environment():
    before = dict(os.environ)
    yield
    if dict(os.environ) != before:
        os.environ.clear()
        os.environ.update(before)


# Each test's and each module's changes to the environment end with it (a module's engine fixture is built before
# its first test starts): the processes later tests start inherit the environment, and an engine writes variables
# there (rollout.engine.set_vllm_log_level's VLLM_LOGGING_LEVEL; vLLM's own VLLM_ENABLE_V1_MULTIPROCESSING=0 under
# TRL's external launcher, VLLM_DIST_IDENT from a CPU worker in this process; TRL's VLLM_LOGGING_LEVEL at import).
environment_restored_per_module = pytest.fixture(scope="module", autouse=True)(_restore_environment)
environment_restored = pytest.fixture(autouse=True)(_restore_environment)
