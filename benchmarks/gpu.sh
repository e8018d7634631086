#!/usr/bin/env bash
# The GPU check: densebatch against Hugging Face Trainer (DataCollatorWithFlattening + the best attention
# importable, and group_by_length), GPT-2 124M and a ~0.5B Llama built from configs (random weights),
# contexts 2,048 and 8,192, the same documents and real tokens a step; eager and compiled; one fp16 run.
# No downloads; at most ~8 minutes on one H100/H200 including installs (GPU_BENCH_LIMIT_S).
#
#   bash benchmarks/gpu.sh              # the benchmark (needs CUDA); the table goes into docs/benchmarks.md
#   bash benchmarks/gpu.sh --dry-run    # the same runs, CI-sized, on CPU: proves the script end to end
#   bash benchmarks/gpu.sh --models gpt2 --seq-lens 2048   # any option of python -m benchmarks.gpu.bench
#
# Python: $PYTHON if set, else the repository's .venv, else .venv-gpu (created here with the system
# site-packages, so a machine's preinstalled CUDA torch is used), else python3. densebatch is used
# from src/ (PYTHONPATH) and the benchmark runs as a module from the repository root, so no install is
# needed. Missing transformers / accelerate are installed when a package index is reachable.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
LIMIT_S="${GPU_BENCH_LIMIT_S:-470}"
[[ " $* " == *" --dry-run "* ]] && LIMIT_S="${GPU_BENCH_LIMIT_S:-1000}"  # CPU: the compiled runs take minutes

say() { printf '[gpu.sh] %s\n' "$*"; }

has_torch() { "$1" -c 'import torch' >/dev/null 2>&1; }
has_cuda() { "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; }

pick_python() {
  if [[ -n "${PYTHON:-}" ]]; then
    echo "$PYTHON"; return
  fi
  local sys_py=""
  for c in python3 python; do
    if command -v "$c" >/dev/null 2>&1; then sys_py="$(command -v "$c")"; break; fi
  done
  # Prefer an environment whose torch sees a GPU; fall back to any with torch.
  local cands=()
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
say "python: $PY"
"$PY" - <<'EOF'
import torch
print(f"[gpu.sh] torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}"
      + (f" ({torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda})" if torch.cuda.is_available() else ""))
EOF

for mod in numpy yaml safetensors tqdm transformers accelerate; do
  if ! "$PY" -c "import $mod" >/dev/null 2>&1; then
    pkg="$mod"; [[ "$mod" == yaml ]] && pkg=pyyaml
    say "$mod missing: trying pip install $pkg (works only with a reachable package index)"
    if ! timeout 60 "$PY" -m pip install --quiet "$pkg" >/dev/null 2>&1; then
      case "$mod" in
        transformers|accelerate) say "ERROR: $pkg is required (the Hugging Face models and peers) and could not be installed"; exit 2 ;;
        *) say "ERROR: $pkg is required by densebatch and could not be installed"; exit 2 ;;
      esac
    fi
  fi
done

export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
say "running python -m benchmarks.gpu.bench $* (limit ${LIMIT_S} s)"
status=0
if command -v timeout >/dev/null 2>&1; then
  timeout --signal=TERM "$LIMIT_S" "$PY" -m benchmarks.gpu.bench "$@" || status=$?
else
  "$PY" -m benchmarks.gpu.bench "$@" || status=$?
fi
if [[ $status -eq 124 ]]; then
  say "ERROR: stopped after ${LIMIT_S} s (lower --steps, --slots or --budget-s)"
elif [[ $status -ne 0 ]]; then
  say "ERROR: benchmarks.gpu.bench exited with status $status"
else
  say "done"
fi
exit "$status"
