#!/usr/bin/env bash
# Benchmark runs side by side on the GPUs of one host: one chain of runs per GPU, each run its own process.
#   bash scripts/bench-gpus.sh OUT TAG SECONDS "GPU PROFILE:SCHEDULERS ..." ["GPU ..." ...]
# e.g. bash scripts/bench-gpus.sh runs/bench/gpus A 530 "0 long-cot:vllm long-cot:forecast" "1 long-cot:forecast long-cot:vllm"
# Each run is `python -m rollout.bench --config $CONFIG only=[PROFILE] reps=1 schedulers=[SCHEDULERS]` on that GPU
# (CUDA_VISIBLE_DEVICES), written to OUT/TAG-g<GPU>-<PROFILE>-<SCHEDULERS>/ (-2, -3: a chain's repeats) with its log
# beside it; a run that would start with under a minute of SECONDS left is skipped, one still running at the end is
# stopped (rc=124, no results in TAG-order.txt). Compare schedulers within one GPU's chain (GPUs of one host
# differ by a few percent), and order them both ways; or cross the chains ("0 cap-bound:forecast cap-bound:vllm"
# "1 cap-bound:vllm cap-bound:forecast") and pair the runs that ran at the same time, where the host's speed
# cancels: python scripts/paired_ratios.py OUT. OUT/TAG.tgz packs everything the runs wrote (plots left out), to
# copy off the machine in one file. PYTHON picks the interpreter (default python3).
set -u
out=$1; tag=$2; limit=$3; shift 3
config=${CONFIG:-configs/bench/gpu.yaml}
mkdir -p "$out"
start=$(date +%s)
for chain in "$@"; do
  read -r gpu items <<< "$chain"
  ( seen=" "
    for item in $items; do
      profile=${item%%:*}; schedulers=${item#*:}; name=$tag-g$gpu-$profile-${schedulers//,/_}
      k=2; base=$name
      while [[ "$seen" == *" $name "* ]]; do name=$base-$k; k=$((k + 1)); done  # a repeat gets its own folder
      seen="$seen$name "
      left=$(( limit - ($(date +%s) - start) ))
      [ "$left" -lt 60 ] && { echo "$(date +%T) g$gpu skip $profile $schedulers" >> "$out/$tag-order.txt"; continue; }
      echo "$(date +%T) g$gpu start $profile $schedulers" >> "$out/$tag-order.txt"
      CUDA_VISIBLE_DEVICES=$gpu timeout "$left" "${PYTHON:-python3}" -m rollout.bench --config "$config" "only=[$profile]" reps=1 \
        "schedulers=[$schedulers]" "out_dir=$out/$name" > "$out/$name.log" 2>&1
      rc=$?  # before the line below: its $(date) would reset $?
      [ -f "$out/$name/results.json" ] || rc="$rc, no results"
      echo "$(date +%T) g$gpu end $profile $schedulers rc=$rc" >> "$out/$tag-order.txt"
    done ) &
done
wait
cat "$out/$tag-order.txt"
grep -H "^| [a-z]\|Error\|Traceback" "$out/$tag"-*.log
(cd "$out" && tar czf "$tag.tgz" --exclude="*.png" "$tag"-*)
