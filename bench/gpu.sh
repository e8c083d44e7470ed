#!/usr/bin/env bash
# GPU check in one go, for whenever a CUDA machine is lent (no network there):
#   1. build a Llama-3-8B-shaped random-weight model (bf16, weights drawn on the GPU),
#   2. run the CUDA tests (pytest -m cuda),
#   3. run bench/throughput.py (ours vs HF generate, bf16) on it.
# Everything lands in bench/out/gpu/ (logs, pytest output, throughput.json).
# Budget: under 10 minutes on one H100/H200-class GPU; each step has its own
# timeout so a hang in one still leaves the others' results.
#
# Usage: bench/gpu.sh [--tiny] [--python PY]
#   --tiny        the same flow on CPU with a tiny model (a smoke test of this script)
#   --python PY   interpreter with torch+CUDA and our package (default: .venv/bin/python)
# Env: GPU_MODEL_DIR (where the 8B-shaped model goes; default ~/.cache/sessionserve/models/llama3-8b-shape),
#      GPU_KV_GIB (KV budget per engine, default 16), GPU_REPEATS (default 3).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="$ROOT/.venv/bin/python"
TINY=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --tiny) TINY=1; shift ;;
    --python) PY="$2"; shift 2 ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done

OUT="$ROOT/bench/out/gpu"
if [[ $TINY == 1 ]]; then
  OUT="$ROOT/bench/out/gpu-tiny"
  SHAPE=tiny DEVICE=cpu DTYPE=float32
  MODEL_DIR="${GPU_MODEL_DIR:-$HOME/.cache/sessionserve/models/bench-tiny-shape}"
  CASES=2x16x4 REPEATS=1 KV_GIB=1 THREADS=2
else
  SHAPE=llama3-8b DEVICE=cuda DTYPE=bfloat16
  MODEL_DIR="${GPU_MODEL_DIR:-$HOME/.cache/sessionserve/models/llama3-8b-shape}"
  # The two standard cases (prefill-heavy, decode-heavy); on an H200 an 8B bf16 run of each takes seconds, so
  # load time (2 x ~15 GB) dominates and 3 repeats fit the budget.
  CASES=prefill,decode REPEATS="${GPU_REPEATS:-3}" KV_GIB="${GPU_KV_GIB:-16}" THREADS=8
fi
mkdir -p "$OUT"
SECONDS=0
STATUS=0
step() { echo "== [$((SECONDS / 60))m$((SECONDS % 60))s] $*" | tee -a "$OUT/gpu.log"; }

step "python: $PY"
"$PY" - <<EOF 2>&1 | tee -a "$OUT/gpu.log"
import torch, sys
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
elif "$DEVICE" == "cuda":
    sys.exit("no CUDA device: run with --tiny for the CPU smoke test")
EOF
[[ ${PIPESTATUS[0]} == 0 ]] || exit 1

# 1. Model (skipped when a complete folder of this shape is already there).
step "model: $SHAPE -> $MODEL_DIR"
if ! timeout 240 "$PY" bench/throughput.py --make-model "$MODEL_DIR" --shape "$SHAPE" --device "$DEVICE" \
     --dtype "$DTYPE" 2>&1 | tee -a "$OUT/gpu.log"; then
  step "model build failed"; exit 1
fi

# 2. CUDA tests. Exit code 5 means none were collected, which is not a failure.
step "pytest -m cuda"
timeout 150 "$PY" -m pytest -q -m cuda tests > "$OUT/pytest-cuda.log" 2>&1
rc=$?
tail -5 "$OUT/pytest-cuda.log" | tee -a "$OUT/gpu.log"
if [[ $rc != 0 && $rc != 5 ]]; then step "pytest -m cuda failed (exit $rc)"; STATUS=1; fi

# 3. Throughput, ours vs HF (vLLM's CPU build has no place here).
step "throughput: $CASES, $DTYPE on $DEVICE"
# Whatever is left of the 10 minutes (at least 2), half of it at most per engine.
LEFT=$(( 570 - SECONDS )); (( LEFT < 120 )) && LEFT=120
timeout "$LEFT" "$PY" bench/throughput.py --engines ours,hf --device "$DEVICE" --dtype "$DTYPE" \
  --model "$MODEL_DIR" --cases "$CASES" --repeats "$REPEATS" --kv-gib "$KV_GIB" --threads "$THREADS" \
  --max-model-len 2048 --worker-timeout $(( LEFT / 2 )) --out "$OUT/throughput.json" > "$OUT/throughput.log" 2>&1
rc=$?
grep -E '^\||^WARNING|start-up|results:' "$OUT/throughput.log" | tee -a "$OUT/gpu.log"
if [[ $rc != 0 ]]; then step "throughput failed (exit $rc): see $OUT/throughput.log"; STATUS=1; fi

step "done (exit $STATUS); results in $OUT"
exit $STATUS
