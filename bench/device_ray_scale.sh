#!/usr/bin/env bash
# Sustainable rate (R_sus) of `voxpipe bench load` on the device machine (16 cores, one GPU):
# the in-process server, then the Ray Serve deployment with 1 and with 2 replicas per stage
# (deploy/ray-serve-gpu.yaml: fractional GPUs, ASR and LLM on the device, TTS on CPU cores).
# Goal (issue 14): 2 replicas >= 1.8x the R_sus of 1.
#
#   bash bench/device_ray_scale.sh inproc|ray1|ray2|all [OUT_DIR]
#
# Each mode takes ~3 min (a server start, a sweep of 20 s steps from 0.5 turns/s up by 1.5x
# until the SLO breaks, one row at R_sus). Run the modes as separate calls when one command
# may only last 10 minutes. Needs the project's venv with the ray extra (bash .ci/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-all}
OUT=${2:-${OUT:-bench-out}}
mkdir -p "$OUT"
PY=.venv/bin/python
SWEEP=(--llm smollm2 --duration 20 --start-rate 0.5 --max-rate 12 --multiples 1 --llm-table-requests 0
       --slo-ms 2000 --turn-timeout 60)
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader > "$OUT/gpu.txt" 2>&1 || true

run() {  # run NAME SERVE_ARGS...
  local name=$1; shift
  echo "== $name: voxpipe serve $*" | tee "$OUT/$name.txt"
  local start=$(date +%s)
  "$PY" -m cli bench load "${SWEEP[@]}" --serve-args "$*" --server-log "$OUT/$name.serve.log" \
    | tee -a "$OUT/$name.txt"
  echo "$name took $(( $(date +%s) - start )) s" | tee -a "$OUT/$name.txt"
  .venv/bin/ray stop --force >/dev/null 2>&1 || true  # this machine only: nothing of one run survives into the next
}

RAY=(--ray auto --ray-cpus 16 --ray-config deploy/ray-serve-gpu.yaml --device cuda --max-batch-size 16)
case "$MODE" in
  inproc) run inproc --device cuda --max-batch-size 16 --tts-threads 2 ;;
  ray1)   run ray1 "${RAY[@]}" ;;
  ray2)   run ray2 "${RAY[@]}" --ray-replicas asr=2 --ray-replicas llm=2 --ray-replicas tts=2 ;;
  all)    "$0" inproc "$OUT"; "$0" ray1 "$OUT"; "$0" ray2 "$OUT" ;;
  *) echo "usage: $0 inproc|ray1|ray2|all [OUT_DIR]" >&2; exit 2 ;;
esac
grep -h "R_sus=" "$OUT"/*.txt 2>/dev/null | sed 's/^/  /' || true
