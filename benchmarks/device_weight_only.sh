#!/usr/bin/env bash
# One device call for the weight-only schemes: gpt-oss-20b and gpt-oss-120b in mxfp4, Qwen3-30B-A3B
# in int4_w4a16 (group 128), each beside the bf16 layer (triton experts, no-dpep, tokens
# 1..4096, timed under CUDA graphs over 4 routings, checked against the float64 reference first),
# with the memory floor of the packed bytes; then the weight-only GPU tests. Results under $OUT:
# weight_only.md (the table), log.txt, weight-only-sweeps.tgz (the run folders).
#   PYTHONPATH=. bash benchmarks/device_weight_only.sh          (SKIP_TESTS=1: the sweeps alone)
TAIL="${TAIL:-6}"
source "$(dirname "$0")/device_env.sh"
TOK="${TOK:-1,16,64,256,1024,4096}"
# --activation silu --shared-experts none: the weight-only GEMMs alone, on both sides of each ratio, the
# same layer for every model (gpt-oss's own swigluoai: benchmarks/device_shared_experts.sh)
COMMON=(--tokens "$TOK" --experts triton --prepare-finalize no-dpep --reps 20 --routings 4 --activation silu
        --shared-experts none)

calibrate
for run in "gpt-oss-20b mxfp4" "gpt-oss-120b mxfp4" "qwen3-30b-a3b int4_w4a16"; do
  set -- $run
  step "bf16 / $2 sweeps: $1"
  mb sweep --model "$1" "${COMMON[@]}" --dtype bf16 --out "$R/bf16"
  mb sweep --model "$1" "${COMMON[@]}" --dtype "$2" --out "$R/$2"
  python3 -m benchmarks weight_only_table "$R" > "$OUT/weight_only.md" 2>>"$log"  # after every model: a cut-off run keeps it
done
cat "$OUT/weight_only.md" >> "$log"
archive weight-only-sweeps
if [ -z "${SKIP_TESTS:-}" ]; then
  step "weight-only gpu tests"
  python3 -m pytest -q -m gpu tests/gpu/test_weight_only_gpu.py 2>&1 | tail -15 | tee -a "$log"
fi
step done
