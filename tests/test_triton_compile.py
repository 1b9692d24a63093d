"""The Triton GEMM kernels build for sm_90 (the H200) on a CPU machine: TTIR -> cubin with
Triton's own ptxas, in a subprocess without the interpreter (which conftest turns on). The sample
(compile_sm90.py --sample, 51 variants) builds every kernel family and every compile-time branch
(each constexpr `if` of a kernel and of the helpers it calls) at least once: the unquantised GEMMs
(GEMM1 and the batched GEMM1 at a mid-size tile; GEMM1 and GEMM2 at the decode tile), their fp8
variants (per-token and block[128,128] scales), GEMM1 zeroing GEMM2's accumulator, both GEMMs under
programmatic dependent launch (griddepcontrol), with an expert map and in the token-rows layout,
GEMM1's wide walk (fp8 block; the prefill tile as launched, also through TMA, A gathered or from
the sorted copy: its weight box lands in shared memory by TMA), GEMM1 storing a per-tensor fp8
intermediate, GEMM2 storing per-pair rows (pair_store, fp8 block) and the top-k sum (also gathered
and weighted), the deepgemm experts' row copy and SiLU-and-mul-quantise kernels, the batched
layout's row copy, the fp8 GEMMs with swapped operands (swap_ab: per-token GEMM2, block scales
GEMM1 with two scale groups per K step and GEMM2), GEMM1's paired walk with fp8 block weight tiles
through TMA, each weight-only scheme (its dequantisation in every kernel that branches on it), the
fp8 activation quantisation kernel (2 variants), the alignment and routing kernels and the
vllm-triton kernels; and both GEMMs at the prefill tile specialised as at a launch: no register
spills, pointer loads pipelined; and gpt-oss's mxfp4 GEMM1 at one token as launched, its packed
weight bytes pipelined."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_kernels_compile_for_hopper(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # really compile, never a cached cubin
    # --sample: each weight-only scheme at one of its two tiles, and none of the variants whose every
    # compile-time branch another variant builds (the script's docstring lists them; the full set,
    # 111 variants, is the script without it: run it before and after a kernel change)
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "compile_sm90.py"), "--sample"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 51 and all("cubin" in line for line in lines), res.stdout
    assert sum(line.startswith("batched_rows_kernel:") for line in lines) == 1, res.stdout
    assert sum("quant_rows_kernel" in line for line in lines) == 2, res.stdout
    # deepgemm's glue: the top-k sum plain and gathered + weighted, sorted rows (fp8, fp32 scales),
    # SiLU-and-mul with and without the requantisation
    assert [sum(line.startswith(f"{k}:") for line in lines) for k in
            ("topk_sum_kernel", "sorted_rows_kernel", "silu_mul_rows_kernel")] == [2, 2, 2], res.stdout
    for line in lines[-5:-3]:  # the prefill tile: no register spills, its pointer loads pipelined
        m = re.match(r"as launched: (\w+): .* spills (\d+) B, pipelined loads (\d+) \+ TMA (\d+)$", line)
        assert m and m.group(2) == "0" and int(m.group(3)) > 0, line
    for line in lines[-3:-1]:  # the wide TMA GEMM1: weights (and with A_TMA the rows) by TMA, no spills
        m = re.match(r"as launched, WIDE TMA, A_TMA=(\w+): .* spills (\d+) B, pipelined loads (\d+) \+ TMA (\d+)$", line)
        assert m and m.group(2) == "0" and int(m.group(4)) > 0, line
        assert (int(m.group(3)) == 0) == (m.group(1) == "True"), line  # A's pointer loads pipelined, or none
    # gpt-oss's mxfp4 GEMM1 at one token: no spills; A and both packed weight tiles pipelined
    m = re.match(r"as launched, mxfp4: .* spills (\d+) B, pipelined loads (\d+) \+ TMA 0$", lines[-1])
    assert m and m.group(1) == "0" and int(m.group(2)) >= 6, lines[-1]
