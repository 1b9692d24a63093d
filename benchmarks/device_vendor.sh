#!/usr/bin/env bash
# DeepGEMM and DeepEP from the package index on one GPU, and DeepEP's two modes with two ranks sharing it:
#  (0) `moebench vendor install deepgemm|deepep --find-links .whl-vendor --target $VENDOR` (the wheels travel in
#      .whl-vendor/, ignored by git), then `moebench env` and `vendor status --json` ($OUT/vendor.json);
#  (1) GPU tests: two ranks on one GPU through `sweep --world-size 2 --device cuda` (deepep-ll, deepep-ht,
#      all2all-ll, allgather-rs, TP; tests/gpu/test_shared_gpu_gpu.py), the DeepGEMM / DeepEP adapters
#      (tests/gpu/test_vendor_gpu.py);
#  (2) sweeps, two ranks sharing the GPU: DeepSeek-V3 EP2 decode, deepep-ll vs all2all-ll (bf16, then fp8 block);
#      prefill, deepep-ht vs allgather-rs (bf16); then DeepSeek-V3 TP8 fp8 block `--experts deepgemm,triton` (one
#      rank's share). Run folders in $OUT/vendor_sweeps.tgz.
# Before the call, where pip reaches the index (wheels for the device's torch 2.11.0+cu130, CPython 3.12, x86_64):
#   for l in deepgemm deepep; do python -m moebench.cli vendor download $l --dest .whl-vendor --torch 2.11.0+cu130 \
#     --python 3.12 --platform manylinux_2_28_x86_64; done
# and name .whl-vendor in the call's carry.
#   PYTHONPATH=. [SKIP_INSTALL=1] [SKIP_TESTS=1] [SKIP_SWEEPS=1] [TOKENS_LL=1,16,64,128] [TOKENS_HT=128,1024,4096] \
#     bash benchmarks/device_vendor.sh
source "$(dirname "$0")/device_env.sh"
VENDOR="${VENDOR:-/tmp/moebench-vendor}"
step "machine"
python3 -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'python', sys.version.split()[0], \
  torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU', torch.cuda.device_count(), 'GPU(s)')" 2>&1 | tee -a "$log"
if [ -z "${SKIP_INSTALL:-}" ]; then
  step "(0) vendor install from .whl-vendor into $VENDOR"
  ls .whl-vendor 2>&1 | tee -a "$log"
  for l in deepgemm deepep; do
    python3 -m moebench.cli vendor install "$l" --find-links .whl-vendor --target "$VENDOR" 2>&1 | tail -n 5 | tee -a "$log"
  done
fi
export PYTHONPATH="$VENDOR:$PYTHONPATH"
# DeepEP's extension looks for NVSHMEM's host library where its build machine had it: point at the installed one
nv=$(python3 -c "import nvidia.nvshmem as n, os; print(os.path.join(list(n.__path__)[0], 'lib'))" 2>/dev/null)
[ -n "$nv" ] && export LD_LIBRARY_PATH="$nv${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
step "env"
python3 -m moebench.cli vendor status --json > "$OUT/vendor.json" 2>>"$log"
mb env | tail -n 40
if [ -z "${SKIP_TESTS:-}" ]; then
  step "(1) gpu tests: shared GPU, vendor adapters"
  timeout "${TESTS_S:-420}" python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/gpu/test_shared_gpu_gpu.py \
    tests/gpu/test_vendor_gpu.py 2>&1 | tail -n 40 | tee -a "$log"
fi
if [ -z "${SKIP_SWEEPS:-}" ]; then
  TL="${TOKENS_LL:-1,16,64,128}"; TH="${TOKENS_HT:-128,1024,4096}"
  step "(2a) DeepSeek-V3 EP2, two ranks on one GPU: deepep-ll vs all2all-ll, bf16"
  TAIL=25 mb sweep --model deepseek-v3 --dtype bf16 --ep 2 --world-size 2 --device cuda --tokens "$TL" \
    --prepare-finalize deepep-ll,all2all-ll --experts batched-triton --out "$R"
  step "(2b) the same, fp8 block (DeepEP quantises in its dispatch)"
  TAIL=25 mb sweep --model deepseek-v3 --ep 2 --world-size 2 --device cuda --tokens "$TL" \
    --prepare-finalize deepep-ll,all2all-ll --experts batched-triton --out "$R"
  step "(2c) DeepSeek-V3 EP2 prefill, two ranks on one GPU: deepep-ht vs allgather-rs, bf16"
  TAIL=25 mb sweep --model deepseek-v3 --dtype bf16 --ep 2 --world-size 2 --device cuda --tokens "$TH" \
    --prepare-finalize deepep-ht,allgather-rs --experts triton --out "$R"
  step "(2d) DeepSeek-V3 TP8 fp8 block: deepgemm vs triton (one rank's share)"
  TAIL=25 mb sweep --model deepseek-v3 --tp 8 --tokens 16,256,4096 --prepare-finalize no-dpep \
    --experts deepgemm,triton --out "$R"
  archive vendor_sweeps
fi
step done
