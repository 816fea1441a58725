#!/usr/bin/env bash
# Here, before GPU runs with the `device` tool: vLLM 0.26 for the GPU machine in .device/ (ignored by git) as
# parts of 25 MiB (a call carries at most 64 MiB with the working tree, whose docs/benchmarks hold ~33 MiB), and
# omegaconf for it in .whl/site. Then six `run` calls back to back, call k carrying .device/vllm-part0k and
# .device/device-install.sh (the first also .device/zstd), each running `bash .device/device-install.sh 6`; the
# sixth also carries .whl and appends `&& bash scripts/device-bench.sh TAG SECONDS "GPU PROFILE:SCHEDULERS ..." ...`.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx "/.device/" .git/info/exclude 2>/dev/null || echo /.device/ >> .git/info/exclude
bash ../shared/device/build-vllm-bundle.sh .device
cat .device/vllm-part0? > .device/vllm.tar.zst && rm .device/vllm-part0?
split -b 25M -d .device/vllm.tar.zst .device/vllm-part && rm .device/vllm.tar.zst
python3 -m pip install -q --target .whl/site --no-deps omegaconf==2.3.0 antlr4-python3-runtime==4.9.3
ls -la .device .whl/site
