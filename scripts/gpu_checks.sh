#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one command, for a GPU machine with ComfyUI installed and this pack in its
# custom_nodes (COMFYUI or COMFYUI_PATH: its folder; python3: ComfyUI's Python). Results go to OUT (default
# ./gpu-out): logs, JSON reports and profiles, and a summary at the end of the output.
#   bash scripts/gpu_checks.sh quick   the CUDA tests, then SDXL: TrainLoraNode, Train LoRA fused and with weight
#                                      wrappers, with offloading; two steps of each profiled
#   bash scripts/gpu_checks.sh train   bench_memory for SDXL and Flux dev: TrainLoraNode, Train LoRA plain, with
#                                      offloading and with fp8 weights in bypass mode
#   bash scripts/gpu_checks.sh full    the CUDA tests, bench-loader, bench_encode, and bench_memory for SDXL and
#                                      Flux dev in every configuration
set -u
export PYTHONUNBUFFERED=1
COMFYUI=${COMFYUI:-${COMFYUI_PATH:-}}
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
[ -n "$COMFYUI" ] && [ -f "$COMFYUI/main.py" ] || { echo "set COMFYUI to the ComfyUI folder" >&2; exit 2; }
T0=$(date +%s)
say() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
tests() {
  COMFYUI_PATH=$COMFYUI COMFYUI_PYTHON=$(command -v python3) timeout "${TESTS_S:-240}" python3 -m pytest -q -p no:cacheprovider \
    -s tests/gpu tests/engine/test_loader.py -k "cuda or gpu or copy or first" > "$OUT/tests.log" 2>&1
  say "tests rc=$?: $(tail -1 "$OUT/tests.log")"
}
memory() {  # model, seconds, extra arguments
  local model=$1 limit=$2; shift 2
  timeout "$limit" python3 scripts/bench_memory.py --comfyui "$COMFYUI" --model "$model" --json "$@" \
    > "$OUT/$model.json" 2> "$OUT/$model.log"
  say "bench_memory $model rc=$?"
  grep '^\[bench\]' "$OUT/$model.log" | cut -c1-420
}
case "${1:-quick}" in
  quick)
    tests
    memory sdxl "${SDXL_S:-300}" --steps 6 --only comfyui,streaming,streaming_wrapped,streaming_offloading \
      --profile "$OUT/prof"
    cat "$OUT"/prof/*.txt > "$OUT/profiles.txt" 2>/dev/null && rm -rf "$OUT/prof" ;;
  train)
    memory sdxl "${SDXL_S:-130}" --steps 6 --only streaming,comfyui,streaming_offloading,streaming_fp8_bypass
    memory flux "${FLUX_S:-190}" --steps 6 --only streaming,comfyui,streaming_fp8_bypass,streaming_offloading ;;
  full)
    tests
    timeout 120 python3 -m streaming_cache bench-loader --json > "$OUT/loader.json" 2> "$OUT/loader.log"
    say "bench-loader rc=$?: $(tail -c 600 "$OUT/loader.json")"
    timeout 150 python3 scripts/bench_encode.py --comfyui "$COMFYUI" --images 64 --json > "$OUT/encode.json" 2>> "$OUT/loader.log"
    say "bench_encode rc=$?: $(tail -c 600 "$OUT/encode.json")"
    memory sdxl "${SDXL_S:-240}" --steps 8
    memory flux "${FLUX_S:-330}" --steps 6 ;;
  *) echo "unknown mode $1 (quick or full)" >&2; exit 2 ;;
esac
say end
