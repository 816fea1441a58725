#!/usr/bin/env bash
# On the GPU machine (after scripts/device-bundle.sh's install): scripts/bench-gpus.sh into $OUT, then only
# $OUT/TAG.tgz is left there (the `device` tool returns at most 8 files a call) and a copy goes to /root, from
# where a later call on the same warm machine can fetch it (`cp /root/TAG.tgz $OUT/`).
#   bash scripts/device-bench.sh TAG SECONDS "GPU PROFILE:SCHEDULERS ..." ["GPU ..." ...]
export PYTHONPATH=/root/vllm-site:$PWD/.whl/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
bash "$(dirname "$0")/bench-gpus.sh" "$OUT" "$@"
cp "$OUT"/*.tgz /root/ 2>/dev/null
(cd "$OUT" && find . -mindepth 1 -maxdepth 1 ! -name "*.tgz" -exec rm -rf {} +)
