#!/usr/bin/env bash
# One GPU session on any machine with a GPU (NVIDIA, AMD or Intel): node check, GPU tests, the demo,
# the autotune warmup, the kernel benchmarks and, with MULTI_GPU=1, the multi-process checks.
# Every figure becomes a results-log record (scripts/results_log.py): with OUT set, they are
# collected in $OUT/records.jsonl and the logs in $OUT/logs.tgz (bring both back, then
# `python scripts/results_log.py add records.jsonl`); without OUT, the records are appended to
# scripts/results/log.jsonl and the logs stay in $LOG_DIR. Then `python scripts/results_log.py summary`
# regenerates scripts/results/RESULTS.md.
#
# Usage: [VAR=...] bash scripts/gpu_session.sh [bench names...]
#   bench names: the scripts/bench_<name>.py to run (default: rms_norm layer_norm fused_add_rms_norm glu
#   rope; also cross_entropy, fused_linear_cross_entropy, train_step, resolve); `none`: no benchmarks.
#   name:--arg,value,... runs that bench with those arguments, e.g. cross_entropy:--sweep or
#   train_step:--family,qwen2.
# Variables: CHECK=0 skips `liger-portable check`; TESTS=0 skips the GPU tests (TESTS='tests/test_rope.py'
#   runs only those), TEST_WORKERS (default 8), TEST_TIMEOUT (default 1800 s); DEMO=1 runs
#   `liger-portable demo`; WARMUP=llama-3-8b times the warmup from an empty cache and checks that a
#   re-run is a no-op (WARMUP_ARGS, WARMUP_TIMEOUT default 900 s); MULTI_GPU=1 runs
#   scripts/distributed_check.py, the run-time autotune agreement and the warmup under torchrun over
#   NPROC (default 2) GPUs; BENCH_ARGS for every bench, BENCH_ARGS_<name> for one, BENCH_TIMEOUT
#   (default 900 s a bench); LOG_DIR (without OUT; default a new folder under /tmp).
# Wheels in .whl/ (peers such as liger-kernel, for a machine without a package index) are installed
# to a folder on PYTHONPATH first.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
WORK=$(mktemp -d /tmp/liger_portable_session.XXXXXX)
FINAL=${OUT:-}
if [ -n "$FINAL" ]; then
  LOGS=$WORK/logs
  export OUT=$WORK/records   # each bench appends its records to $OUT/<name>.jsonl
  mkdir -p "$OUT"
else
  LOGS=${LOG_DIR:-$WORK/logs}
fi
mkdir -p "$LOGS"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" .whl/*.whl
  export PYTHONPATH="$PWD:$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
record() { python3 scripts/results_log.py record "$@"; }   # $OUT/<kind>.jsonl, or the log

{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader \
    || rocm-smi --showproductname || xpu-smi discovery; } 2>/dev/null | tee "$LOGS/gpu.txt"
python3 -m liger_portable info 2>&1 | tee "$LOGS/info.txt"
if [ "${CHECK:-1}" != 0 ]; then
  python3 -m liger_portable check 2>&1 | tee "$LOGS/check.txt"
  record check "$LOGS/check.txt"
fi
if [ "${TESTS:-tests/}" != 0 ]; then
  # -v: a line per test in the log, so a run cut by the timeout still names its failures
  timeout -s INT -k 20 "${TEST_TIMEOUT:-1800}" python3 -m pytest -v -rfE -n "${TEST_WORKERS:-8}" -m gpu \
    -p no:cacheprovider --durations=25 ${TESTS:-tests/} 2>&1 | tee "$LOGS/pytest_gpu.txt" \
    | grep -v "PASSED\|SKIPPED" | tail -80
  record pytest "$LOGS/pytest_gpu.txt" --shape "pytest -m gpu ${TESTS:-tests/}"
fi
if [ "${DEMO:-0}" != 0 ]; then
  timeout "${DEMO_TIMEOUT:-900}" python3 -m liger_portable demo --json > "$LOGS/demo.json" 2> "$LOGS/demo.txt"
  tail -3 "$LOGS/demo.txt"
  record demo "$LOGS/demo.json"
fi
if [ -n "${WARMUP:-}" ]; then   # e.g. WARMUP=llama-3-8b: time the warmup from an empty cache, keep the cache it wrote
  export LIGER_PORTABLE_CACHE_DIR=$WORK/warmup_cache
  timeout "${WARMUP_TIMEOUT:-900}" python3 -m liger_portable warmup "$WARMUP" ${WARMUP_ARGS:-} 2>&1 \
    | tee "$LOGS/warmup.txt" | tail -20
  record warmup "$LOGS/warmup.txt" --label "$WARMUP${WARMUP_ARGS:+ $WARMUP_ARGS}"
  cp "$LIGER_PORTABLE_CACHE_DIR"/*.json "$LOGS/" 2>/dev/null
  timeout "${WARMUP_TIMEOUT:-900}" python3 -m liger_portable warmup "$WARMUP" ${WARMUP_ARGS:-} 2>&1 | tail -3 \
    | tee "$LOGS/warmup_rerun.txt"  # must be a no-op
  unset LIGER_PORTABLE_CACHE_DIR
fi
if [ "${MULTI_GPU:-0}" != 0 ]; then
  TR="python3 -m torch.distributed.run --standalone --nproc-per-node ${NPROC:-2}"
  # DTensor norms, FSDP2 norm gradients, a patched tiny Llama under DDP and FSDP2 against one GPU
  timeout 900 $TR scripts/distributed_check.py --json "$LOGS/distributed_check.json" 2>&1 \
    | tee "$LOGS/distributed_check.txt" | grep -E "^(ok|FAIL)"
  record distributed "$LOGS/distributed_check.json"
  # run-time tuning with an empty cache: every rank must resolve the same configs
  export LIGER_PORTABLE_CACHE_DIR=$WORK/autotune_cache
  LIGER_PORTABLE_AUTOTUNE=1 timeout 900 $TR scripts/distributed_check.py --checks ddp --dtype bfloat16 --steps 3 \
    --json "$LOGS/autotune_ddp.json" 2>&1 | tee "$LOGS/autotune_ddp.txt" | grep -E "^(ok|FAIL)"
  record distributed "$LOGS/autotune_ddp.json" --label "LIGER_PORTABLE_AUTOTUNE=1, ddp"
  # the warmup under torchrun: one cache file that every rank agrees on
  export LIGER_PORTABLE_CACHE_DIR=$WORK/warmup_cache_torchrun
  timeout 900 $TR scripts/autotune_warmup.py llama-3.2-1b --tokens 8192 2>&1 | tee "$LOGS/warmup_torchrun.txt" | tail -30
  cp -r "$LIGER_PORTABLE_CACHE_DIR" "$LOGS/warmup_cache_torchrun" 2>/dev/null
  unset LIGER_PORTABLE_CACHE_DIR
fi
names=("$@")
[ ${#names[@]} -eq 0 ] && names=(rms_norm layer_norm fused_add_rms_norm glu rope)
[ "${names[0]}" = none ] && names=()
for spec in "${names[@]}"; do   # a name, or name:--arg,value,... for a run with its own arguments
  n=${spec%%:*}; extra=""; tag=""
  if [[ $spec == *:* ]]; then extra=${spec#*:}; extra=${extra//,/ }; tag=_$(echo "$extra" | tr -cd 'a-z0-9'); fi
  args_var="BENCH_ARGS_$n"
  timeout "${BENCH_TIMEOUT:-900}" python3 "scripts/bench_$n.py" ${BENCH_ARGS:-} ${!args_var:-} $extra 2>&1 \
    | tee "$LOGS/bench_$n$tag.txt" | tail -40
done
if [ -n "$FINAL" ]; then
  cat "$OUT"/*.jsonl > "$FINAL/records.jsonl" 2>/dev/null
  tar czf "$FINAL/logs.tgz" -C "$LOGS" .
  echo "$(wc -l < "$FINAL/records.jsonl") records in $FINAL/records.jsonl, logs in $FINAL/logs.tgz"
  rm -rf "$WORK"
else
  echo "records appended to scripts/results/log.jsonl, logs in $LOGS; python scripts/results_log.py summary"
fi
