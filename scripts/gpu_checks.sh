#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one command, for a GPU machine with ComfyUI installed and this pack in its
# custom_nodes (COMFYUI or COMFYUI_PATH: its folder; python3: ComfyUI's Python). Results go to OUT (default
# ./gpu-out): logs, JSON reports and profiles, and a summary at the end of the output.
#   bash scripts/gpu_checks.sh STAGE...   the stages in the order given:
#     tests      the CUDA tests (tests/gpu, the loader's copy stream)
#     graphs     CUDA graphs: their tests, then bench_memory for SDXL with them (Train LoRA's default) and without
#                (and without gradient checkpointing), two steps of each profiled, and for Flux dev with and without
#     share      bench_memory for Flux dev with half of its blocks recomputed and with none, and SDXL with half
#     sdxl       bench_memory for SDXL: TrainLoraNode, Train LoRA plain and with fp8 weights in bypass mode
#     compiled   bench_memory for SDXL: Train LoRA plain and with its blocks compiled, two steps of each profiled
#     flux       bench_memory for Flux dev: TrainLoraNode, Train LoRA plain and with fp8 weights in bypass mode
#     auto       bench_memory with Memory & Precision's plan auto: SDXL (beside TrainLoraNode), Flux dev, and Flux dev
#                within 24 GiB (the memory plan's line of each summary is in its report, estimate beside peak)
#     offloading bench_memory for SDXL and Flux dev with offloading, both trainers
#     loader     bench-loader (the copy stream against compute alone)
#     encode     scripts/bench_encode.py (Encode Dataset against ComfyUI's own nodes)
#   or one of the presets: quick (tests compiled), train (sdxl flux), full (every stage)
# Each stage has its own time limit (STAGE_S, default 240 s; TESTS_S, SDXL_S, ... for one stage).
set -u
export PYTHONUNBUFFERED=1
COMFYUI=${COMFYUI:-${COMFYUI_PATH:-}}
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
[ -n "$COMFYUI" ] && [ -f "$COMFYUI/main.py" ] || { echo "set COMFYUI to the ComfyUI folder" >&2; exit 2; }
T0=$(date +%s)
say() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
limit() { local v="${1}_S"; echo "${!v:-${STAGE_S:-240}}"; }
memory() {  # report name, model, seconds, extra arguments
  local name=$1 model=$2 seconds=$3; shift 3
  timeout "$seconds" python3 scripts/bench_memory.py --comfyui "$COMFYUI" --model "$model" --json "$@" \
    > "$OUT/$name.json" 2> "$OUT/$name.log"
  say "bench_memory $name rc=$?"
  grep '^\[bench\]' "$OUT/$name.log" | cut -c1-420
}
stage() {
  case "$1" in
    tests)
      COMFYUI_PATH=$COMFYUI COMFYUI_PYTHON=$(command -v python3) timeout "$(limit TESTS)" python3 -m pytest -q \
        -p no:cacheprovider -s tests/gpu tests/engine/test_loader.py -k "cuda or gpu or copy or first" \
        > "$OUT/tests.log" 2>&1
      say "tests rc=$?: $(tail -1 "$OUT/tests.log")" ;;
    sdxl) memory sdxl sdxl "$(limit SDXL)" --steps 6 --timeout "$(limit CONFIG)" \
            --only "${SDXL_ONLY:-streaming,comfyui,streaming_fp8_bypass}" ;;
    graphs)
      timeout "$(limit GRAPHS)" python3 -m pytest -q -p no:cacheprovider tests/train/test_graph_replay.py tests/gpu/test_gpu_loop.py \
        > "$OUT/graphs_tests.log" 2>&1
      say "graph tests rc=$?: $(tail -1 "$OUT/graphs_tests.log")"
      memory sdxl_graphs sdxl "$(limit SDXL)" --steps 8 --timeout 150 --profile "$OUT/prof" \
        --only streaming,streaming_eager,comfyui,streaming_no_checkpointing,streaming_eager_no_checkpointing
      cat "$OUT"/prof/*.txt > "$OUT/profiles.txt" 2>/dev/null && rm -rf "$OUT/prof"
      memory flux_graphs flux "$(limit FLUX)" --steps 6 --timeout 150 --only streaming,streaming_eager ;;
    share)
      memory flux_share flux "$(limit SHARE)" --steps 6 --timeout 150 \
        --only streaming_half_recomputed,streaming_no_checkpointing
      memory sdxl_share sdxl "$(limit SHARE)" --steps 8 --timeout 150 --only streaming_half_recomputed ;;
    compiled)
      memory compiled sdxl "$(limit COMPILED)" --steps 8 --timeout 200 --only streaming,streaming_compiled \
        --profile "$OUT/prof"
      cat "$OUT"/prof/*.txt > "$OUT/profiles.txt" 2>/dev/null && rm -rf "$OUT/prof" ;;
    flux) memory flux flux "$(limit FLUX)" --steps 6 --only streaming,comfyui,streaming_fp8_bypass ;;
    auto)
      memory sdxl_auto sdxl "$(limit AUTO)" --steps 6 --only streaming_auto,comfyui
      memory flux_auto flux "$(limit AUTO)" --steps 6 --only streaming_auto,streaming_auto_24gib ;;
    offloading)
      memory sdxl_offloading sdxl "$(limit OFFLOADING)" --steps 6 --only comfyui_offloading,streaming_offloading
      memory flux_offloading flux "$(limit OFFLOADING)" --steps 6 --only comfyui_offloading,streaming_offloading ;;
    loader)
      timeout "$(limit LOADER)" python3 -m streaming_cache bench-loader --json > "$OUT/loader.json" 2> "$OUT/loader.log"
      say "bench-loader rc=$?: $(tail -c 600 "$OUT/loader.json")" ;;
    encode)
      timeout "$(limit ENCODE)" python3 scripts/bench_encode.py --comfyui "$COMFYUI" --images 64 --json \
        > "$OUT/encode.json" 2> "$OUT/encode.log"
      say "bench_encode rc=$?: $(tail -c 600 "$OUT/encode.json")" ;;
    *) echo "unknown stage $1 (tests graphs share sdxl compiled flux auto offloading loader encode, or quick train full)" >&2
       exit 2 ;;
  esac
}
stages=("${@:-quick}")
case "${stages[*]}" in
  quick) stages=(tests compiled) ;;
  train) stages=(sdxl flux) ;;
  full) stages=(tests graphs share sdxl compiled flux auto offloading loader encode) ;;
esac
for s in "${stages[@]}"; do stage "$s"; done
say end
