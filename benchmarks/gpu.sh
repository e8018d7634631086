#!/usr/bin/env bash
# The GPU check, in one call of at most ~8 minutes on one H100/H200: the CUDA unit tests first (~20 s), then
# densebatch against Hugging Face Trainer (DataCollatorWithFlattening with the best kernel the image has, and a
# bounded group_by_length peer), GPT-2 124M and a ~0.5B Llama built from configs (random weights), key
# comparisons at 2,048 first, then compile, fp16 and 8,192 (python -m benchmarks.gpu.bench says what each run is).
# No downloads. Each row is printed as it finishes; SIGTERM (or the time limit) still prints the table and
# writes the JSON.
#
#   bash benchmarks/gpu.sh --out DIR            # the check (needs CUDA); DIR gets log, table.md, results.json
#   bash benchmarks/gpu.sh --dry-run --out DIR  # the same runs, tiny, on CPU: proves the script end to end
#   bash benchmarks/gpu.sh --no-tests --models gpt2 --seq-lens 2048   # any option of python -m benchmarks.gpu.bench
#
# GPU_CHECK_LIMIT_S (default 470; dry run 1000) bounds the whole call: the benchmark is given what the tests
# left (--budget-s), and a run starts only if its estimated cost fits. Python: $PYTHON if set, else the
# repository's .venv, else .venv-gpu (created here with the system site-packages, so a machine's preinstalled
# CUDA torch is used), else python3. densebatch is used from src/ (PYTHONPATH): no install needed.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
T0=$SECONDS
OUT="" DRY=0 TESTS=1 BUDGET_GIVEN=0 ARGS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --out) OUT="$2"; shift 2 ;;
    --out=*) OUT="${1#--out=}"; shift ;;
    --no-tests) TESTS=0; shift ;;
    --dry-run|--smoke) DRY=1; ARGS+=("$1"); shift ;;
    --budget-s|--budget-s=*) BUDGET_GIVEN=1; ARGS+=("$1"); shift ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
LIMIT_S="${GPU_CHECK_LIMIT_S:-$([[ $DRY == 1 ]] && echo 1000 || echo 470)}"
OUT="${OUT:-runs/gpu-check}"
mkdir -p "$OUT"
LOG="$OUT/log"
: >"$LOG"

say() { printf '[gpu.sh] %s\n' "$*" | tee -a "$LOG"; }

has_torch() { "$1" -c 'import torch' >/dev/null 2>&1; }
has_cuda() { "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; }

pick_python() {
  if [[ -n "${PYTHON:-}" ]]; then
    echo "$PYTHON"; return
  fi
  local sys_py="" c
  for c in python3 python; do
    if command -v "$c" >/dev/null 2>&1; then sys_py="$(command -v "$c")"; break; fi
  done
  local cands=()  # prefer an environment whose torch sees a GPU; fall back to any with torch
  [[ -x .venv/bin/python ]] && cands+=(".venv/bin/python")
  [[ -x .venv-gpu/bin/python ]] && cands+=(".venv-gpu/bin/python")
  [[ -n "$sys_py" ]] && cands+=("$sys_py")
  for c in "${cands[@]}"; do
    if has_torch "$c" && has_cuda "$c"; then echo "$c"; return; fi
  done
  if [[ -n "$sys_py" ]] && has_torch "$sys_py" && [[ ! -x .venv-gpu/bin/python ]]; then
    "$sys_py" -m venv --system-site-packages .venv-gpu >&2 && { echo ".venv-gpu/bin/python"; return; }
  fi
  for c in "${cands[@]}"; do
    if has_torch "$c"; then echo "$c"; return; fi
  done
  echo ""
}

PY="$(pick_python)"
if [[ -z "$PY" ]]; then
  say "ERROR: no Python with torch found (set PYTHON=/path/to/python)"; exit 2
fi
missing="$("$PY" -c 'import importlib.util as u; print(" ".join(m for m in ("numpy", "yaml", "safetensors", "tqdm", "transformers", "accelerate") if u.find_spec(m) is None))')"
if [[ -n "$missing" ]]; then
  say "ERROR: $PY lacks $missing (densebatch and the Hugging Face peers need them)"; exit 2
fi
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
say "python: $PY; out: $OUT; limit ${LIMIT_S} s"
# Run "$@" in the background with its output in the log; SIGTERM / SIGINT to this script reach it, and this
# script waits for it to finish (the benchmark prints its table and writes its JSON when stopped).
CHILD=""
trap '[[ -n "$CHILD" ]] && kill -TERM "$CHILD" 2>/dev/null; STOPPED=1' TERM INT
STOPPED=0
run_child() {
  "$@" > >(tee -a "$LOG") 2>&1 &
  CHILD=$!
  local status=0
  wait "$CHILD" || status=$?
  while kill -0 "$CHILD" 2>/dev/null; do
    status=0; wait "$CHILD" || status=$?
  done
  CHILD=""
  return "$status"
}

if [[ $TESTS == 1 ]]; then
  say "CUDA unit tests: tests/model/test_attention.py tests/model/test_torch_releases.py -k cuda"
  run_child timeout --signal=TERM 120 "$PY" -m pytest -q -p no:cacheprovider -p no:randomly \
    tests/model/test_attention.py tests/model/test_torch_releases.py -k cuda || say "CUDA unit tests failed (status $?): the benchmark runs all the same"
fi
if [[ $STOPPED == 1 ]]; then say "stopped before the benchmark"; exit 143; fi

LEFT=$((LIMIT_S - (SECONDS - T0)))
BUDGET=()
[[ $BUDGET_GIVEN == 0 ]] && BUDGET=(--budget-s "$((LEFT > 40 ? LEFT - 30 : 10))")  # 30 s for the last teardown and table
say "python -m benchmarks.gpu.bench ${ARGS[*]} ${BUDGET[*]} --out $OUT (${LEFT} s left)"
status=0
run_child timeout --signal=TERM --kill-after=30 "$((LEFT > 10 ? LEFT : 10))" "$PY" -m benchmarks.gpu.bench "${ARGS[@]}" "${BUDGET[@]}" --out "$OUT" || status=$?
case $status in
  0) say "done in $((SECONDS - T0)) s: $OUT/table.md, $OUT/results.json, $OUT/log" ;;
  124) say "stopped at the time limit (${LIMIT_S} s): the table holds every run that finished" ;;
  143) say "stopped by SIGTERM: the table holds every run that finished" ;;
  *) say "ERROR: benchmarks.gpu.bench exited with status $status" ;;
esac
exit "$status"
