#!/usr/bin/env bash
# Shared experts and activations on one H200 (about 2 minutes): DeepSeek-V3 TP8 (one rank's
# shard measured, the all-reduce modeled) with its shared expert fused, separate and left out, in
# bf16 and fp8 block[128,128]; gpt-oss-20b in bf16 and in mxfp4 (as it ships) with its swigluoai
# activation and biases against plain silu. Tables in $OUT/shared_experts.md (ratio to the layer without shared experts and to
# the memory / compute floor); log in $OUT/log.txt; result folders in $OUT/shared-sweeps.tgz.
#   PYTHONPATH=. bash benchmarks/device_shared_experts.sh        (TOK=1,64 narrows it)
TAIL="${TAIL:-14}"
source "$(dirname "$0")/device_env.sh"
TOK="${TOK:-1,16,64,256,1024,4096}"
COMMON=(--tokens "$TOK" --experts triton --prepare-finalize no-dpep --reps 20 --routings 4)

step "deepseek-v3 TP8 bf16, shared experts none / fused / separate"
mb sweep --model deepseek-v3 --tp 8 --simulate --dtype bf16 --shared-experts all "${COMMON[@]}" --out "$R/ds-bf16"
step "deepseek-v3 TP8 fp8 block[128,128] (the checkpoint's quantization_config), shared experts none / fused / separate"
mb sweep --model deepseek-v3 --tp 8 --simulate --shared-experts all "${COMMON[@]}" --out "$R/ds-fp8"
python3 -m benchmarks shared_table "$R" > "$OUT/shared_experts.md" 2>>"$log"  # a cut-off run keeps this part
step "gpt-oss-20b bf16: swigluoai with biases vs silu"
mb sweep --model gpt-oss-20b --dtype bf16 "${COMMON[@]}" --out "$R/oss"
mb sweep --model gpt-oss-20b --dtype bf16 --activation silu "${COMMON[@]}" --out "$R/oss"
step "gpt-oss-20b mxfp4 (as it ships): swigluoai with biases vs silu"
mb sweep --model gpt-oss-20b --dtype mxfp4 "${COMMON[@]}" --out "$R/oss-mxfp4"
mb sweep --model gpt-oss-20b --dtype mxfp4 --activation silu "${COMMON[@]}" --out "$R/oss-mxfp4"
python3 -m benchmarks shared_table "$R" > "$OUT/shared_experts.md" 2>>"$log"
cat "$OUT/shared_experts.md" >> "$log"
archive shared-sweeps
step done
