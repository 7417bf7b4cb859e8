#!/usr/bin/env bash
# One GPU session on any machine with a GPU (NVIDIA, AMD or Intel): node check, GPU tests, the demo,
# the autotune warmup, the kernel benchmarks and, with MULTI_GPU=1, the multi-process checks.
# Every figure becomes a results-log record (scripts/results_log.py): with OUT set, they are
# collected in $OUT/records.jsonl and the logs in $OUT/logs.tgz (bring both back, then
# `python scripts/results_log.py add records.jsonl`); without OUT, the records are appended to
# scripts/results/log.jsonl and the logs stay in $LOG_DIR. Then `python scripts/results_log.py summary`
# regenerates scripts/results/RESULTS.md.
#
# Usage: [VAR=...] bash scripts/gpu_session.sh [-h|--help] [bench names...]
#   bench names: the scripts/bench_<name>.py to run (default: rms_norm layer_norm fused_add_rms_norm glu
#   rope; also cross_entropy, fused_linear_cross_entropy, host_overhead, preference_loss, train_step,
#   resolve); `none` alone: no benchmarks.
#   name:--arg,value,... runs that bench with those arguments, e.g. cross_entropy:--sweep or
#   train_step:--family,qwen2. An unknown name stops the session before anything runs.
# Variables: CHECK=0 skips `liger-portable check`; TESTS=0 skips the GPU tests (TESTS='tests/test_rope.py'
#   runs only those), TEST_WORKERS (default 8), TEST_TIMEOUT (default 1800 s); DEMO=1 runs
#   `liger-portable demo`; WARMUP=llama-3-8b times the warmup from an empty cache and checks that a
#   re-run is a no-op: every problem cached (WARMUP_ARGS, WARMUP_TIMEOUT default 900 s); MULTI_GPU=1 runs
#   scripts/distributed_check.py, the run-time autotune agreement and the warmup under torchrun over
#   NPROC (default 2) GPUs; BENCH_ARGS for every bench, BENCH_ARGS_<name> for one, BENCH_TIMEOUT
#   (default 900 s a bench); LOG_DIR (without OUT; default a new folder under /tmp).
#   LIGER_PORTABLE_COMMIT: the commit the records name as the package's version (default: the checkout's
#   git HEAD; set it where the working tree was copied to this machine without its current .git).
#   ALLOW_CPU=1 runs the session where `liger-portable info` finds no GPU (the PyTorch fallback: a test
#   of this script, not a measurement); it needs OUT, so that CPU figures never reach the committed log.
# Wheels in .whl/ (peers such as liger-kernel, for a machine without a package index) are installed
# to a folder on PYTHONPATH first.
# Exit status: 0 every step passed; 1 a step failed (the remaining steps still run, and the records
# and logs are still written; the failed steps are named at the end); 2 the session could not start
# (an unknown bench name or option, no GPU, OUT not writable).
set -uo pipefail
ME=gpu_session.sh
usage_error() { echo "$ME: error: $*" >&2; exit 2; }
for arg in "$@"; do
  case $arg in
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; exit 0 ;;
    -*) usage_error "unknown option $arg: the arguments are bench names (see --help)" ;;
  esac
done
FINAL=${OUT:-}
case $FINAL in "" | /*) ;; *) FINAL=$PWD/$FINAL ;; esac   # a relative OUT is the caller's, not the checkout's
cd "$(dirname "${BASH_SOURCE[0]}")/.."
names=("$@")
[ ${#names[@]} -eq 0 ] && names=(rms_norm layer_norm fused_add_rms_norm glu rope)
if [ "${names[0]}" = none ]; then
  [ ${#names[@]} -eq 1 ] || usage_error "'none' means no benchmarks: give it alone, not with ${names[*]:1}"
  names=()
fi
for spec in ${names[@]+"${names[@]}"}; do  # (the guard: an empty array is unbound under set -u in bash <= 4.3)
  n=${spec%%:*}
  if ! [[ $n =~ ^[A-Za-z0-9_]+$ ]] || [ ! -f "scripts/bench_$n.py" ]; then
    known=$(cd scripts && ls bench_*.py | sed 's/^bench_//; s/\.py$//' | tr '\n' ' ')
    usage_error "unknown bench '$n' (no scripts/bench_$n.py): choose from ${known% }, or none"
  fi
done
export PYTHONUNBUFFERED=1
# A GPU, or nothing runs: on the CPU the steps would test the PyTorch fallback and record it as a measurement.
info=$(PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" python3 -m liger_portable info --json) \
  && backend=$(python3 -c 'import json, sys; print(json.load(sys.stdin)["backend"])' <<< "$info") \
  || usage_error "\`python3 -m liger_portable info --json\` failed (above): fix that first; nothing was run"
if [ "$backend" = cpu ]; then
  [ "${ALLOW_CPU:-0}" != 0 ] || usage_error "no GPU in use (liger-portable info: backend cpu): this session" \
    "needs a GPU (ALLOW_CPU=1 with OUT set runs it on the CPU fallback)"
  [ -n "$FINAL" ] || usage_error "ALLOW_CPU=1 needs OUT: a CPU run's records must not go to scripts/results/log.jsonl"
  echo "$ME: no GPU: running on the CPU fallback (ALLOW_CPU=1); records go to $FINAL only"
fi
if [ -n "$FINAL" ]; then
  mkdir -p "$FINAL" 2>/dev/null && [ -w "$FINAL" ] || usage_error "OUT=$OUT is not a writable folder: set OUT to one"
fi
WORK=$(mktemp -d /tmp/liger_portable_session.XXXXXX)
if [ -n "$FINAL" ]; then
  LOGS=$WORK/logs
  export OUT=$WORK/records   # each bench appends its records to $OUT/<name>.jsonl
  mkdir -p "$OUT"
else
  LOGS=${LOG_DIR:-$WORK/logs}
  log_lines=$(cat scripts/results/log.jsonl 2>/dev/null | wc -l)
fi
mkdir -p "$LOGS"
failed=()   # the steps that failed
step() {    # step NAME STATUS: note a failure
  if [ "$2" != 0 ]; then failed+=("$1 (exit $2)"); echo "$ME: $1 failed (exit $2)"; fi
}
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" .whl/*.whl
  step "pip install .whl/" $?
  export PYTHONPATH="$PWD:$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
record() {  # $OUT/<kind>.jsonl, or the log
  python3 scripts/results_log.py record "$@"
  step "record $1" $?
}

{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader \
    || rocm-smi --showproductname || xpu-smi discovery; } 2>/dev/null | tee "$LOGS/gpu.txt"
python3 -m liger_portable info 2>&1 | tee "$LOGS/info.txt"
step info "${PIPESTATUS[0]}"
if [ "${CHECK:-1}" != 0 ]; then
  python3 -m liger_portable check 2>&1 | tee "$LOGS/check.txt"
  step check "${PIPESTATUS[0]}"
  record check "$LOGS/check.txt"
fi
if [ "${TESTS:-tests/}" != 0 ]; then
  # -v: a line per test in the log, so a run cut by the timeout still names its failures
  timeout -s INT -k 20 "${TEST_TIMEOUT:-1800}" python3 -m pytest -v -rfE -n "${TEST_WORKERS:-8}" -m gpu \
    -p no:cacheprovider --durations=25 ${TESTS:-tests/} 2>&1 | tee "$LOGS/pytest_gpu.txt" \
    | grep -v "PASSED\|SKIPPED" | tail -80
  step pytest "${PIPESTATUS[0]}"
  record pytest "$LOGS/pytest_gpu.txt" --shape "pytest -m gpu ${TESTS:-tests/}"
fi
if [ "${DEMO:-0}" != 0 ]; then
  timeout "${DEMO_TIMEOUT:-900}" python3 -m liger_portable demo --json > "$LOGS/demo.json" 2> "$LOGS/demo.txt"
  step demo $?
  tail -3 "$LOGS/demo.txt"
  record demo "$LOGS/demo.json"
fi
if [ -n "${WARMUP:-}" ]; then   # e.g. WARMUP=llama-3-8b: time the warmup from an empty cache, keep the cache it wrote
  export LIGER_PORTABLE_CACHE_DIR=$WORK/warmup_cache
  timeout "${WARMUP_TIMEOUT:-900}" python3 -m liger_portable warmup "$WARMUP" ${WARMUP_ARGS:-} 2>&1 \
    | tee "$LOGS/warmup.txt" | tail -20
  step warmup "${PIPESTATUS[0]}"
  record warmup "$LOGS/warmup.txt" --label "$WARMUP${WARMUP_ARGS:+ $WARMUP_ARGS}"
  cp "$LIGER_PORTABLE_CACHE_DIR"/*.json "$LOGS/" 2>/dev/null
  # the re-run must be a no-op: it fails unless it exits 0 and its --json lists every problem as cached
  timeout "${WARMUP_TIMEOUT:-900}" python3 -m liger_portable warmup "$WARMUP" ${WARMUP_ARGS:-} --json \
    > "$LOGS/warmup_rerun.json" 2> "$LOGS/warmup_rerun.txt"
  rc=$?
  python3 - "$LOGS/warmup_rerun.json" <<'END' 2>&1 | tee -a "$LOGS/warmup_rerun.txt"
import json, sys
try:
    with open(sys.argv[1]) as f:
        rows = json.load(f)["results"]
    redone = ["%s %s %s: %s" % (r["kernel"], r["problem"], r["dtype"], r["status"]) for r in rows
              if r["status"] != "cached"]
except (OSError, ValueError, KeyError, TypeError) as e:
    sys.exit("warmup re-run: no results in its --json output (%s: %s)" % (type(e).__name__, e))
if redone or not rows:
    sys.exit("warmup re-run: not a no-op: %d of %d problems not cached: %s" % (len(redone), len(rows), "; ".join(redone)))
print("warmup re-run: a no-op (%d problems, all cached)" % len(rows))
END
  checked=${PIPESTATUS[0]}
  [ "$rc" != 0 ] || rc=$checked
  step "warmup re-run" "$rc"
  unset LIGER_PORTABLE_CACHE_DIR
fi
if [ "${MULTI_GPU:-0}" != 0 ]; then
  TR="python3 -m torch.distributed.run --standalone --nproc-per-node ${NPROC:-2}"
  # DTensor norms, FSDP2 norm gradients, a patched tiny Llama under DDP and FSDP2 against one GPU
  timeout 900 $TR scripts/distributed_check.py --json "$LOGS/distributed_check.json" 2>&1 \
    | tee "$LOGS/distributed_check.txt" | grep -E "^(ok|FAIL)"
  step distributed_check "${PIPESTATUS[0]}"
  record distributed "$LOGS/distributed_check.json"
  # run-time tuning with an empty cache: every rank must resolve the same configs
  export LIGER_PORTABLE_CACHE_DIR=$WORK/autotune_cache
  LIGER_PORTABLE_AUTOTUNE=1 timeout 900 $TR scripts/distributed_check.py --checks ddp --dtype bfloat16 --steps 3 \
    --json "$LOGS/autotune_ddp.json" 2>&1 | tee "$LOGS/autotune_ddp.txt" | grep -E "^(ok|FAIL)"
  step "distributed_check autotune" "${PIPESTATUS[0]}"
  record distributed "$LOGS/autotune_ddp.json" --label "LIGER_PORTABLE_AUTOTUNE=1, ddp"
  # the warmup under torchrun: one cache file that every rank agrees on
  export LIGER_PORTABLE_CACHE_DIR=$WORK/warmup_cache_torchrun
  timeout 900 $TR scripts/autotune_warmup.py llama-3.2-1b --tokens 8192 2>&1 | tee "$LOGS/warmup_torchrun.txt" | tail -30
  step "warmup under torchrun" "${PIPESTATUS[0]}"
  cp -r "$LIGER_PORTABLE_CACHE_DIR" "$LOGS/warmup_cache_torchrun" 2>/dev/null
  unset LIGER_PORTABLE_CACHE_DIR
fi
for spec in ${names[@]+"${names[@]}"}; do   # a name, or name:--arg,value,... for a run with its own arguments
  n=${spec%%:*}; extra=""; tag=""
  if [[ $spec == *:* ]]; then extra=${spec#*:}; extra=${extra//,/ }; tag=_$(echo "$extra" | tr -cd 'a-z0-9'); fi
  args_var="BENCH_ARGS_$n"
  timeout "${BENCH_TIMEOUT:-900}" python3 "scripts/bench_$n.py" ${BENCH_ARGS:-} ${!args_var:-} $extra 2>&1 \
    | tee "$LOGS/bench_$n$tag.txt" | tail -40
  step "bench $spec" "${PIPESTATUS[0]}"
done
if [ -n "$FINAL" ]; then
  cat "$OUT"/*.jsonl > "$FINAL/records.jsonl" 2>/dev/null
  tar czf "$FINAL/logs.tgz" -C "$LOGS" . || step "tar logs" $?
  n=$(wc -l < "$FINAL/records.jsonl")
  if [ "$n" -gt 0 ]; then
    echo "$n records in $FINAL/records.jsonl, logs in $FINAL/logs.tgz"
  else
    echo "no records in $FINAL/records.jsonl; logs in $FINAL/logs.tgz"
  fi
  rm -rf "$WORK"
else
  n=$(( $(cat scripts/results/log.jsonl 2>/dev/null | wc -l) - log_lines ))
  if [ "$n" -gt 0 ]; then
    echo "$n records appended to scripts/results/log.jsonl, logs in $LOGS; python scripts/results_log.py summary"
  else
    echo "no records appended to scripts/results/log.jsonl; logs in $LOGS"
  fi
fi
if [ ${#failed[@]} -gt 0 ]; then
  list=$(printf '%s, ' "${failed[@]}")
  echo "$ME: ${#failed[@]} step(s) failed: ${list%, }" >&2
  exit 1
fi
