#!/usr/bin/env bash
# GEMM2's own tile configs (SGLang's `_down.json`) for one model, in one device call: the GPU tests
# of the down-config path, `moebench tune --down` against the GEMM1 config the layer looks up (the
# shipped file), then the layer with and without the new file in one process
# (`python -m benchmarks decode_launches`, `current/nodown`). The file and the tune report come back in
# $OUT/down.tgz (file names with '=' do not come back as plain files).
# LAYOUT: the tune's layout options (e.g. "--tp 8"); SHAPE: decode_launches' name for the same shard
# (e.g. qwen3-235b-tp8; default MODEL). FP8_BLOCK=1: fp8_w8a8 with 128 x 128 block scales (the tune's
# --dtype / --block-shape, decode_launches' --fp8-block).
#   PYTHONPATH=. [MODEL=qwen3-30b-a3b] [LAYOUT="--tp 8" SHAPE=qwen3-235b-tp8] [TOKS=1,2,4,8,16] [FP8_BLOCK=1] [BUDGET=N] [CW=12] bash benchmarks/device_down.sh
TAIL="${TAIL:-12}"
source "$(dirname "$0")/device_env.sh"
MODEL="${MODEL:-qwen3-30b-a3b}"
TOKS="${TOKS:-1,2,4,8,16}"
D=".gpu-out/down"
QUANT=() LAYER=()
if [ -n "${FP8_BLOCK:-}" ]; then QUANT=(--dtype fp8_w8a8 --block-shape 128,128) LAYER=(--fp8-block); fi
rm -rf "$D/runs" && mkdir -p "$D"  # configs stay: a later call adds token counts to the file
step "gpu tests (down config)"
python3 -m pytest -q -m gpu tests/gpu -k "gemm2_own" -p no:cacheprovider 2>&1 | tail -n 3 | tee -a "$log"
step "tune --down $MODEL $TOKS"
mb tune --model "$MODEL" ${LAYOUT:-} --tokens "$TOKS" "${QUANT[@]}" --down ${BUDGET:+--budget "$BUDGET"} --compile-workers "${CW:-12}" --out "$D/configs" --results-dir "$D/runs"
(cd "$D" && tar czf "$OUT/down.tgz" configs $(find runs -name 'report.*') 2>/dev/null)
step "layer with / without the down file"
MOEBENCH_CONFIG_DIR="$D/configs" OUT="$OUT" python3 -m benchmarks decode_launches --shapes "${SHAPE:-$MODEL}" --tokens "$TOKS" "${LAYER[@]}" \
  --variants nodown,again --rounds 2 2>&1 | tail -n 8
step done
