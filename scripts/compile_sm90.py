"""Compile moebench's Triton GEMM, alignment and routing kernels (and the vllm-triton experts' kernels)
for Hopper (sm_90) without a GPU.

Lowers every kernel (the unquantised GEMMs, their fp8 and weight-only variants and the fp8
activation quantisation) through Triton's full pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin with the
ptxas Triton ships), so a kernel change that would fail to build on the H200 fails here, on a CPU
machine, first. Prints one line per kernel variant; exit status 1 on the first failure.

    python scripts/compile_sm90.py                 # not under TRITON_INTERPRET=1
    python scripts/compile_sm90.py --ptx-hashes    # + a hash of each variant's PTX
    python scripts/compile_sm90.py --sample        # the suite's run: 51 of the 111 variants (below)

--sample (tests/test_triton_compile.py) builds each weight-only scheme at one of its two tiles and
leaves out the variants whose every compile-time branch (each `if` on a constexpr, in the kernel or
in a @triton.jit helper it calls) and every kind of TTGIR operation (dots by operand types) another
variant of the sample builds in the same kernel or helper: the unquantised decode tile of the first
four-kernel group (GEMM1 and GEMM2 at that tile build with MAPPED / TOKEN_ROWS, the batched pair's
16-row bf16 dots with the int8 decode tile), that group's mid-size GEMM2 and batched GEMM2 (the
per-token and MAPPED GEMM2s, the quantised batched GEMM2s build their branches), its per-token and
block GEMM1s (built quantising the intermediate, QUANT_OUT, and with block weights by TMA), GEMM1
zeroing alone and both GEMMs' PDL alone (the TOKEN_ROWS GEMM1 zeroes and waits, the MAPPED GEMM2
reads its expert from L2 under PDL), the MAPPED GEMM1 and the TOKEN_ROWS GEMM2 (each builds its
branches in the other GEMM's variant: the block-expert and token-rows helpers are shared), each
weight-only scheme in only the kernels that take a branch of its own (the dequantisation is one
helper, wq_load: int8 in the batched GEMM2, int4 in GEMM2, int4 with zero points in both GEMM1
walks, mxfp4 in the wide GEMM1, GEMM2 and the batched GEMM2, and as launched in the paired GEMM1;
the batched pair with int4 is not built), gpt-oss's paired GEMM1 (its interleaved rows, swigluoai
and biases are gate-up helpers its batched GEMM1 builds), the swapped GEMM1s with one scale group
per step (the two-groups one builds the swapped branches; its static_range of K_GROUPS steps is no
`if`, so it stays), the swapped block GEMM2 and the two-groups GEMM1 without token rows, the fp8
block GEMM2 through TMA (GEMM2's TMA branch is the as-launched one's), the unquantised wide tiles
(the wide walk as launched, below), the bf16 pair store (built with fp8 block), the bf16 TMA tiles,
the vllm-triton GEMM at plain bf16 (its branches build in the other four) and the second softmax
top-k shape. The script without --sample builds all 111: run it before and after a kernel change.

--ptx-hashes ends each line with a hash of the PTX without its debug information (line
locations, their labels) and without the kernel's own name and parameter declarations: the entry
name is replaced by "kernel" wherever it appears (the entry, its parameters' names in the ld.param
loads), and the `.param` declaration lines and the `// .globl` comment (padded to the name's
length) are dropped, so that renaming a kernel or regrouping its
arguments (an argument group is passed as its fields, in order) hashes the same while any change
of which parameters are loaded, in what order, or of an instruction does not. A refactor that must
not change the generated code can so be checked on a CPU: the same hashes before and after mean
the same instructions in every variant.

Kernel arguments that are argument groups (named tuples: moebench.kernels.triton.common's Rows,
Scales, GateUp, Bias; gemm1's ZeroFill, Fp8Out) are given here by their fields' names, which are
unique within a kernel: constexpr fields in the consts, pointers in the pointer types, integer
fields in the launch values.

The last lines compile the two GEMMs at the prefill tile as the JIT specialises them at launch
(integer arguments equal to 1 become constants, pointers and integers divisible by 16 carry that
fact), which decides whether the pointer loads can be pipelined, and add ptxas's register and
spill counts and the number of pipelined (asynchronous) loads: a change that makes the prefill
kernels spill or lose their pipelining shows here too. (Without the specialisation the unit
strides are unknown and no pointer load is pipelined, so only these lines say anything about speed.)
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import os
import re
import subprocess
import sys
import tempfile

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("run without TRITON_INTERPRET=1: the interpreter replaces the kernels being compiled")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import triton.language as tl  # noqa: E402

from moebench.kernels.triton import align as A  # noqa: E402
from moebench.kernels.triton import batched as B  # noqa: E402
from moebench.kernels.triton import batched_layout as BL  # noqa: E402
from moebench.kernels.triton import common as C  # noqa: E402
from moebench.kernels.triton import gemm1 as G1  # noqa: E402
from moebench.kernels.triton import gemm2 as G2  # noqa: E402
from moebench.kernels.triton import quant as Q  # noqa: E402
from moebench.kernels.triton import routing as R  # noqa: E402
from moebench.kernels import vllm_triton as V  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


#: The argument groups, by the kernel parameter names that take them.
GROUPS = {"rows": C.Rows, "sc": C.Scales, "gu": C.GateUp, "b2": C.Bias, "zero": G1.ZeroFill, "fp8_out": G1.Fp8Out}
#: Their constexpr fields' values where a variant gives none.
FIELD_DEFAULTS = dict(TOPK_PAD=1, MAPPED=False, TOKEN_ROWS=False, QUANT=0, GROUP_N=1, GROUP_K=1, WQ=0, WQ_GROUP=1,
                      WQ_ZP=False, WQ_PACK=1, ACTIVATION=0, HAS_BIAS=False, INTERLEAVED=False, ZERO_OUT=False,
                      QUANT_OUT=False, ACT_DTYPE=tl.bfloat16)


def arg_names(jit) -> set[str]:
    """The names a variant can give for `jit`: its parameters and its argument groups' fields."""
    names = [f for n in inspect.signature(jit.fn).parameters for f in (GROUPS[n]._fields if n in GROUPS else (n,))]
    if len(set(names)) != len(names):
        raise KeyError(f"{jit.fn.__name__}: an argument group's field has a parameter's name")
    return set(names)


def gemm1(consts: dict):
    """GEMM1's kernel for a variant (WIDE: the wide walk, else the paired one) and its other consts."""
    consts = dict(consts)
    return (G1.gemm1_wide_kernel if consts.pop("WIDE", False) else G1.gemm1_paired_kernel), consts


def compile_kernel(jit, consts: dict, ptr_types: dict, unused: tuple[str, ...] = (), ints: dict | None = None,
                   options: dict | None = None, ptx_hashes: bool = False) -> str:
    """Compile `jit` with `consts` as constexprs; other args are pointers (ptr_types) or i32.
    `unused` args (TMA descriptors when USE_TMA=False; names the kernel lacks are skipped) are passed
    as None constexprs. ints: the integer arguments' values at a launch, to specialise as the JIT
    does (then the line also gives registers, spills and pipelined loads); options: num_warps,
    num_stages. An argument group's fields are named as kernel parameters are (`GROUPS`); its
    constexpr fields not in consts take FIELD_DEFAULTS."""
    params = inspect.signature(jit.fn).parameters
    names = list(params)
    ints = ints or {}
    unknown = set(consts) - arg_names(jit)
    if unknown:
        raise KeyError(f"{jit.fn.__name__} has no argument {', '.join(sorted(unknown))}")
    consts = dict(consts, **{n: 1 for n, v in ints.items() if v == 1})

    def arg(n, default):
        """(signature type, constexpr value or None, divisibility attribute) of one argument."""
        if n in consts or default is not None:
            return "constexpr", consts.get(n, default), False
        ty = ptr_types.get(n, "i32")
        return ty, None, bool(ints) and (ty.startswith("*") or ints.get(n, 1) % 16 == 0)

    sig, constexprs, attrs = {}, {}, {}
    for i, n in enumerate(names):
        if n in GROUPS:
            group = GROUPS[n]
            tys = []
            for j, f in enumerate(group._fields):
                default = FIELD_DEFAULTS.get(f) if f.isupper() else None
                if f.isupper() and default is None and f not in consts:
                    raise KeyError(f"{jit.fn.__name__}: give {n}.{f}")
                ty, value, div = arg(f, default)
                tys.append(ty)
                if ty == "constexpr":
                    constexprs[(i, j)] = value
                elif div:
                    attrs[(i, j)] = [["tt.divisibility", 16]]
            sig[n] = group(*tys)
            continue
        p = params[n]
        if n in unused:
            consts[n] = None
        elif p.default is not inspect.Parameter.empty and n not in ptr_types and n not in ints and n not in consts:
            consts[n] = p.default  # constexpr parameters left out take their defaults
        ty, value, div = arg(n, None)
        sig[n] = ty
        if ty == "constexpr":
            constexprs[(i,)] = value
        elif div:
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=jit, signature=sig, constexprs=constexprs, attrs=attrs)
    k = triton.compile(src, target=TARGET, options=options or {})
    line = f"{jit.fn.__name__}: cubin {len(k.asm['cubin'])} bytes, shared {k.metadata.shared} B"
    if ptx_hashes:
        line += f", ptx {ptx_hash(k.asm['ptx'])}"
    if ints:
        ttgir = k.asm["ttgir"]
        line += (", " + ptx_resources(k.asm["ptx"]) + f", pipelined loads {ttgir.count('async_copy_global_to_local')}"
                 f" + TMA {ttgir.count('async_tma_copy_global_to_local')}")
    return line


def ptx_hash(ptx: str) -> str:
    """16 hex digits of the PTX's sha256 without its debug information (the .loc / .file lines,
    the labels they use and the debug sections), with the kernel's entry name replaced by "kernel"
    and its `.param` declaration lines and `// .globl` comment dropped."""
    name = re.search(r"\.entry\s+(\w+)", ptx).group(1)
    code = ptx.split("\t.section\t.debug")[0]
    lines = [ln for ln in code.splitlines()
             if not re.match(r"\s*\.(loc|file)\b", ln) and not re.fullmatch(r"\s*\$L__tmp\d+:", ln)
             and not re.match(r"\s*(\.param\b|// \.globl\b)", ln)]
    code = re.sub(r"\b%s(?=\b|_param_)" % re.escape(name), "kernel", "\n".join(lines))
    return hashlib.sha256(re.sub(r"\$L__tmp\d+", "L", code).encode()).hexdigest()[:16]


def ptx_resources(ptx: str) -> str:
    """'regs R, spills S B' of the kernel in `ptx`, from Triton's ptxas run with -v."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        res = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", path, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True, check=True)
    text = res.stdout + res.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores", text)
    return f"regs {regs.group(1) if regs else '?'}, spills {spills.group(1) if spills else '?'} B"


def main(argv: list[str]) -> int:
    build = functools.partial(compile_kernel, ptx_hashes="--ptx-hashes" in argv)
    sample = "--sample" in argv
    std_ptrs = {"x_ptr": "*bf16", "w13_ptr": "*bf16", "w2_ptr": "*bf16", "inter_ptr": "*bf16", "ws_ptr": "*fp32",
                "topk_weights_ptr": "*fp32", "sorted_ids_ptr": "*i32", "expert_ids_ptr": "*i32", "expert_map_ptr": "*i32", "ntpp_ptr": "*i32",
                "a_scale_ptr": "*fp32", "w_scale_ptr": "*fp32"}
    no_quant = dict(QUANT=0, GROUP_N=1, GROUP_K=1)
    # unquantised: a decode and a mid-size tile; fp8: per-token (epilogue scales) on the decode
    # tile, block [128, 128] (scales per K step) on the mid-size one.
    variants = [((16, 64, 256), no_quant), ((64, 128, 64), no_quant),
                ((16, 64, 128), dict(QUANT=1, GROUP_N=1, GROUP_K=1)),
                ((64, 128, 64), dict(QUANT=2, GROUP_N=128, GROUP_K=128))]
    for (bm, bn, bk), quant in variants[1:] if sample else variants:
        fp8 = quant["QUANT"] != 0
        c = dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=16, TOPK=8, EVEN_K=True,
                 UPCAST=False, IEEE_DOT=False, USE_TMA=False, **quant)
        # fp8: fp8 activations and weights in both GEMMs, the intermediate stored as bf16 by GEMM1
        # and read as fp8 (after the activation quantisation) by GEMM2.
        p1 = dict(std_ptrs, x_ptr="*fp8e4nv", w13_ptr="*fp8e4nv") if fp8 else std_ptrs
        p2 = dict(std_ptrs, inter_ptr="*fp8e4nv", w2_ptr="*fp8e4nv") if fp8 else std_ptrs
        # (--sample: GEMM1 unquantised, GEMM2 per-token, the batched GEMM2 quantised)
        if not (sample and fp8):
            print(build(*gemm1(dict(c, ZERO_OUT=False, WIDE=False)), p1, ("w13_desc", "x_desc")))
        if not (sample and quant["QUANT"] != 1):
            print(build(G2.gemm2_weighted_sum_kernel, c, p2, ("w2_desc",)))
        for name, fp8_ptrs in (("batched_silu_mul_gemm1_kernel", ("a_ptr", "w13_ptr")),
                               ("batched_gemm2_kernel", ("inter_ptr", "w2_ptr"))):
            if sample and name == "batched_gemm2_kernel" and not fp8:
                continue
            jit = getattr(B, name)
            params = arg_names(jit)
            ptrs = {p: ("*i32" if "num_tokens" in p else "*fp32" if "scale" in p else "*bf16")
                    for p in params if p.endswith("_ptr")}
            if fp8:
                ptrs.update({p: "*fp8e4nv" for p in fp8_ptrs})
            print(build(jit, {k: v for k, v in c.items() if k in params}, ptrs))
    # Weight-only schemes (moebench.kernels.triton.wquant): int8 per channel, int4 with and without
    # zero points, mxfp4; a decode tile (BLOCK_SIZE_K 128 = int4's group: one scale column per tile)
    # and a prefill one whose BLOCK_SIZE_K (64) spans two mxfp4 groups (one scale per K index),
    # GEMM1 in both walks, GEMM2 and the batched GEMMs
    wq_variants = [(dict(WQ=1, WQ_GROUP=1, WQ_ZP=False, WQ_PACK=1), "*i8", "*bf16"),
                   (dict(WQ=2, WQ_GROUP=128, WQ_ZP=False, WQ_PACK=2), "*u8", "*bf16"),
                   (dict(WQ=2, WQ_GROUP=128, WQ_ZP=True, WQ_PACK=2), "*u8", "*bf16"),
                   (dict(WQ=3, WQ_GROUP=32, WQ_ZP=False, WQ_PACK=2), "*u8", "*u8")]
    wq_tiles = ((16, 64, 128), (64, 128, 64))
    # --sample: the kernels each scheme is built in (its dequantisation is one helper, wq_load, in all)
    wq_sample = ({"batched_gemm2_kernel"}, {"gemm2"}, {"gemm1_paired", "gemm1_wide"},
                 {"gemm1_wide", "gemm2", "batched_gemm2_kernel"})
    for i, (wq, wtype, stype) in enumerate(wq_variants):
        built = (lambda k: True) if not sample else wq_sample[i].__contains__
        for bm, bn, bk in (wq_tiles[i % 2],) if sample else wq_tiles:
            c = dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=16, TOPK=8, EVEN_K=False,
                     UPCAST=False, IEEE_DOT=False, USE_TMA=False, **no_quant, **wq)
            wp = dict(std_ptrs, w13_ptr=wtype, w2_ptr=wtype, w_scale_ptr=stype, wz_ptr="*u8")
            for wide in (False, True):
                if built("gemm1_wide" if wide else "gemm1_paired"):
                    print(build(*gemm1(dict(c, ZERO_OUT=True, WIDE=wide)),
                                dict(wp, zero_ptr="*fp32"), ("w13_desc", "x_desc")))
            if built("gemm2"):
                print(build(G2.gemm2_weighted_sum_kernel, c, wp, ("w2_desc",)))
            if sample and wq["WQ"] == 2:
                continue
            for name in ("batched_silu_mul_gemm1_kernel", "batched_gemm2_kernel"):
                if not built(name):
                    continue
                jit = getattr(B, name)
                params = arg_names(jit)
                ptrs = {p: ("*i32" if "num_tokens" in p else "*fp32" if "scale" in p else "*bf16")
                        for p in params if p.endswith("_ptr")}
                ptrs.update(w13_ptr=wtype, w2_ptr=wtype, w_scale_ptr=stype, wz_ptr="*u8")
                print(build(jit, {k: v for k, v in c.items() if k in params},
                                     {k: v for k, v in ptrs.items() if k in params}))
    # gpt-oss as it ships: mxfp4 w13 with gate and up rows interleaved, swigluoai with biases, in
    # both GEMM1s (paired walk: the interleaved layout never takes the wide one)
    c = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=64, GROUP_SIZE_M=16, TOPK=4, EVEN_K=False, UPCAST=False,
             IEEE_DOT=False, USE_TMA=False, ZERO_OUT=True, WIDE=False, ACTIVATION=2, HAS_BIAS=True, INTERLEAVED=True,
             **no_quant, **wq_variants[-1][0])
    wp = dict(std_ptrs, w13_ptr="*u8", w_scale_ptr="*u8", wz_ptr="*u8", zero_ptr="*fp32", b13_ptr="*bf16")
    if not sample:
        print(build(*gemm1(c), wp, ("w13_desc", "x_desc")))
    params = arg_names(B.batched_silu_mul_gemm1_kernel)
    ptrs = {p: ("*i32" if "num_tokens" in p else "*fp32" if "scale" in p else "*bf16") for p in params if p.endswith("_ptr")}
    ptrs.update(w13_ptr="*u8", w_scale_ptr="*u8", wz_ptr="*u8")
    print(build(B.batched_silu_mul_gemm1_kernel, {k: v for k, v in c.items() if k in params}, ptrs))
    # GEMM1 also zeroing GEMM2's fp32 accumulator (decode tile)
    c = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=256, GROUP_SIZE_M=16, TOPK=8, EVEN_K=True, UPCAST=False,
             IEEE_DOT=False, USE_TMA=False, ZERO_OUT=True, WIDE=False, **no_quant)
    if not sample:
        print(build(*gemm1(c), dict(std_ptrs, zero_ptr="*fp32"), ("w13_desc", "x_desc")))
    # Programmatic dependent launch (griddepcontrol): GEMM1 waiting and releasing, GEMM2 reading
    # its expert from L2 before waiting (decode tile, where options.pdl "auto" uses it)
    c2 = dict(c, BLOCK_SIZE_K=64, PDL=True)
    del c2["ZERO_OUT"], c2["WIDE"]
    if not sample:
        print(build(*gemm1(dict(c, PDL=True)), dict(std_ptrs, zero_ptr="*fp32"), ("w13_desc", "x_desc")))
        print(build(G2.gemm2_weighted_sum_kernel, c2, std_ptrs, ("w2_desc",)))
    # a direct alignment under EP: both GEMMs map their block's global expert id (MAPPED)
    if not sample:
        print(build(*gemm1(dict(c, MAPPED=True)), dict(std_ptrs, zero_ptr="*fp32"), ("w13_desc", "x_desc")))
    print(build(G2.gemm2_weighted_sum_kernel, dict(c2, MAPPED=True), std_ptrs, ("w2_desc",)))
    # the token-rows layout (decode: each program finds its expert's tokens in topk_ids), under EP
    # and PDL; and with fp8 block scales on the swapped 16 x 128 tile, two groups per step in GEMM1
    print(build(*gemm1(dict(c, PDL=True, MAPPED=True, TOKEN_ROWS=True)), dict(std_ptrs, zero_ptr="*fp32"),
                ("w13_desc", "x_desc")))
    if not sample:
        print(build(G2.gemm2_weighted_sum_kernel, dict(c2, MAPPED=True, TOKEN_ROWS=True), std_ptrs, ("w2_desc",)))
    cq = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=128, BLOCK_SIZE_K=128, GROUP_SIZE_M=16, TOPK=8, EVEN_K=True, UPCAST=False,
              IEEE_DOT=False, USE_TMA=False, SWAP_AB=True, QUANT=2, GROUP_N=128, GROUP_K=128, PDL=True, TOKEN_ROWS=True)
    print(build(*gemm1(dict(cq, ZERO_OUT=True, WIDE=False, K_GROUPS=2)),
                dict(std_ptrs, x_ptr="*fp8e4nv", w13_ptr="*fp8e4nv", zero_ptr="*fp32"), ("w13_desc", "x_desc")))
    print(build(G2.gemm2_weighted_sum_kernel, cq, dict(std_ptrs, inter_ptr="*fp8e4nv", w2_ptr="*fp8e4nv"), ("w2_desc",)))
    # GEMM1 with gate and up as one tile and one dot: decode and prefill tiles (BLOCK_SIZE_N is
    # per half here, as launch_gemm1 passes it), and fp8 block scales
    wide_tiles = (((16, 32, 256), no_quant), ((128, 128, 64), no_quant),
                  ((64, 64, 64), dict(QUANT=2, GROUP_N=128, GROUP_K=128)))
    for (bm, bn, bk), quant in (wide_tiles[2:] if sample else wide_tiles):
        c = dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=16, TOPK=8, EVEN_K=True, UPCAST=False,
                 IEEE_DOT=False, USE_TMA=False, ZERO_OUT=False, WIDE=True, **quant)
        p1 = dict(std_ptrs, x_ptr="*fp8e4nv", w13_ptr="*fp8e4nv") if quant["QUANT"] else std_ptrs
        print(build(*gemm1(c), p1, ("w13_desc", "x_desc")))
    # GEMM2 storing each pair's bf16 row (pair_store) at the prefill tile, bf16 and fp8 block
    for quant in ((dict(QUANT=2, GROUP_N=128, GROUP_K=128),) if sample
                  else (no_quant, dict(QUANT=2, GROUP_N=128, GROUP_K=128))):
        c = dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=128, BLOCK_SIZE_K=128 if quant["QUANT"] else 64, GROUP_SIZE_M=16,
                 TOPK=8, EVEN_K=True, UPCAST=False, IEEE_DOT=False, USE_TMA=False, PAIR_STORE=True, **quant)
        p2 = dict(std_ptrs, ws_ptr="*bf16", **(dict(inter_ptr="*fp8e4nv", w2_ptr="*fp8e4nv") if quant["QUANT"] else {}))
        print(build(G2.gemm2_weighted_sum_kernel, c, p2, ("w2_desc",)))
    # fp8 dots as w^T x^T into a transposed accumulator (swap_ab): per-token scales on the decode
    # tile and block scales on the 16 x 128 tile "auto" swaps, GEMM1 (paired walk) and GEMM2
    for quant, bn in ((dict(QUANT=1, GROUP_N=1, GROUP_K=1), 64), (dict(QUANT=2, GROUP_N=128, GROUP_K=128), 128)):
        c = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=128, GROUP_SIZE_M=16, TOPK=8, EVEN_K=True,
                 UPCAST=False, IEEE_DOT=False, USE_TMA=False, SWAP_AB=True, **quant)
        if not sample:
            print(build(*gemm1(dict(c, ZERO_OUT=False, WIDE=False)),
                        dict(std_ptrs, x_ptr="*fp8e4nv", w13_ptr="*fp8e4nv"), ("w13_desc", "x_desc")))
        if not (sample and quant["QUANT"] == 2):
            print(build(G2.gemm2_weighted_sum_kernel, c, dict(std_ptrs, inter_ptr="*fp8e4nv", w2_ptr="*fp8e4nv"),
                        ("w2_desc",)))
    # ... and GEMM1's paired walk taking two block-scale groups per iteration (fp8_k_groups "auto")
    if not sample:
        print(build(*gemm1(dict(c, ZERO_OUT=False, WIDE=False, K_GROUPS=2)),
                    dict(std_ptrs, x_ptr="*fp8e4nv", w13_ptr="*fp8e4nv"), ("w13_desc", "x_desc")))
    # per-tensor fp8: GEMM1 quantising the intermediate in its epilogue (fp8 store)
    c = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128, GROUP_SIZE_M=16, TOPK=8, EVEN_K=True, UPCAST=False,
             IEEE_DOT=False, USE_TMA=False, QUANT=1, GROUP_N=1, GROUP_K=1, QUANT_OUT=True)
    print(build(*gemm1(c), dict(std_ptrs, x_ptr="*fp8e4nv", w13_ptr="*fp8e4nv",
                                                            inter_ptr="*fp8e4nv", out_scale_ptr="*fp32"), ("w13_desc", "x_desc")))
    # TMA variants at the prefill tile: GEMM1's weights (paired walk), GEMM2's weights
    bm, bn, bk = 128, 128, 64
    c = dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=8, TOPK=8, EVEN_K=True, UPCAST=False,
             IEEE_DOT=False, USE_TMA=True, **no_quant)
    if not sample:
        print(build(*gemm1(dict(c, ZERO_OUT=False, WIDE=False)),
                    dict(std_ptrs, w13_desc=f"tensordesc<bf16[{bn}, {bk}]>"), ("x_desc",)))
        print(build(G2.gemm2_weighted_sum_kernel, dict(c, BLOCK_SIZE_N=2 * bn),
                    dict(std_ptrs, w2_desc=f"tensordesc<bf16[{2 * bn}, {bk}]>")))
    # fp8 block weights through TMA (use_tma: 64-row tiles) at a prefill tile: GEMM1's paired walk, GEMM2
    blk = dict(QUANT=2, GROUP_N=128, GROUP_K=128)
    c = dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=128, BLOCK_SIZE_K=128, GROUP_SIZE_M=16, TOPK=8, EVEN_K=True, UPCAST=False,
             IEEE_DOT=False, USE_TMA=True, **blk)
    print(build(*gemm1(dict(c, ZERO_OUT=False, WIDE=False)),
                dict(std_ptrs, x_ptr="*fp8e4nv", w13_ptr="*fp8e4nv", w13_desc="tensordesc<fp8e4nv[128, 128]>"),
                ("x_desc",)))
    if not sample:
        print(build(G2.gemm2_weighted_sum_kernel, c,
                    dict(std_ptrs, inter_ptr="*fp8e4nv", w2_ptr="*fp8e4nv", w2_desc="tensordesc<fp8e4nv[128, 128]>")))
    # The activation quantisation of the fp8 path: block groups (one chunk) and per-token rows
    # (looped chunks), dynamic scales, rows limited on the device.
    qptrs = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "static_ptr": "*fp32", "limit_ptr": "*i32"}
    for one_chunk, block_m, block_k, limit in ((True, 32, 128, 1), (False, 4, 1024, 2)):
        qc = dict(STATIC=False, LIMIT=limit, ONE_CHUNK=one_chunk, BLOCK_M=block_m, BLOCK_K=block_k, EXACT_ROUND=False)
        print(build(Q.quant_rows_kernel, qc, qptrs))
    # Alignment: the two-kernel paths (scan: 2048-pair chunks; sort: 256-pair chunks, Qwen3 4096
    # tokens x top-8 over 128 local experts) and the one launch for few pairs (Qwen3 64 tokens),
    # with an expert map
    aptrs = {p: "*i32" for p in ("topk_ids_ptr", "expert_map_ptr", "counts_ptr", "sorted_ptr", "expert_ids_ptr",
                                 "ntpp_ptr")}
    print(build(A.count_pairs_kernel, dict(HAS_MAP=True, CHUNK=2048, NUM_CHUNKS=4), aptrs))
    print(build(A.place_pairs_kernel, dict(HAS_MAP=True, BLOCK_SIZE_M=64, CHUNK=2048, NUM_CHUNKS=4, NC_POW2=4,
                                                     E_POW2=128), aptrs))
    print(build(A.chunk_counts_kernel, dict(HAS_MAP=True, CHUNK=256, E_POW2=128, TILE=1024), aptrs))
    print(build(A.chunk_place_kernel, dict(HAS_MAP=True, BLOCK_SIZE_M=128, CHUNK=256, NC_POW2=128, E_POW2=128,
                                                     TILE=64), aptrs))
    print(build(A.align_one_launch_kernel, dict(HAS_MAP=True, BLOCK_SIZE_M=16, CHUNK=512, E_POW2=128), aptrs))
    # ... launched with PDL (waits for the routing, then releases GEMM1), as it is where PDL is on
    print(build(A.align_one_launch_kernel, dict(HAS_MAP=False, BLOCK_SIZE_M=16, CHUNK=128, E_POW2=128,
                                                          PDL=True), aptrs))
    # Softmax top-k routing: Qwen3-Next's (512 experts, top-10) and DeepSeek's (256, top-8) shapes
    for block_e, topk, rows in ((512, 10, 4), (128, 8, 1)) if sample else ((512, 10, 4), (256, 8, 8), (128, 8, 1)):
        rc = dict(TOPK=topk, TOPK_P2=triton.next_power_of_2(topk), RENORMALIZE=True, BLOCK_E=block_e, ROWS=rows,
                  RELEASE=rows == 1)  # (the decode shape releasing a PDL-launched successor early)
        print(build(R.topk_softmax_kernel, rc, {"logits_ptr": "*bf16", "weights_ptr": "*fp32", "ids_ptr": "*i32"}))
    # The vllm-triton experts (moebench.kernels.vllm_triton): its GEMM as GEMM1 (bf16, decode tile),
    # as GEMM2 with the router weight, on the per-pair path, and fp8 block [128, 128] with and
    # without swap-AB; its SiLU-and-mul and top-k sum
    vptrs = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16", "a_scale_ptr": "*fp32", "b_scale_ptr": "*fp32",
             "w_ptr": "*fp32", "sorted_ids_ptr": "*i32", "expert_ids_ptr": "*i32", "ntpp_ptr": "*i32"}
    vfp8 = dict(vptrs, a_ptr="*fp8e4nv", b_ptr="*fp8e4nv")
    vbase = dict(TOP_K=8, GROUP_N=1, GROUP_K=1, FP8_BLOCK=False, MUL_WEIGHT=False, PER_PAIR=False, SWAP_AB=False,
                 UPCAST=False, BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128, GROUP_SIZE_M=1)
    fp8_block = dict(FP8_BLOCK=True, GROUP_N=128, GROUP_K=128, BLOCK_SIZE_N=128)
    for consts, ptrs in ((vbase, vptrs), (dict(vbase, MUL_WEIGHT=True), vptrs), (dict(vbase, PER_PAIR=True), vptrs),
                         (dict(vbase, **fp8_block), vfp8), (dict(vbase, **fp8_block, SWAP_AB=True), vfp8)):
        if not (sample and consts is vbase):
            print(build(V.vllm_moe_gemm_kernel, consts, ptrs))
    print(build(V.silu_and_mul_kernel, dict(BLOCK=1024), {"x_ptr": "*bf16", "y_ptr": "*bf16"}))
    tsum = {"x_ptr": "*bf16", "y_ptr": "*bf16", "row_ptr": "*bf16", "w_ptr": "*bf16"}
    print(build(G2.topk_sum_kernel, dict(TOP_K=8, GATHER=False, WEIGHTED=False, BLOCK=1024, EXACT=False), tsum))
    # deepgemm's glue: the sum gathering GEMM2's rows by index, weighted; x's rows in sorted order
    # (fp8, padding unset) and their scales; SiLU-and-mul with and without the requantisation
    print(build(G2.topk_sum_kernel, dict(TOP_K=8, GATHER=True, WEIGHTED=True, BLOCK=1024, EXACT=False),
                dict(tsum, row_ptr="*i32", w_ptr="*fp32")))
    srows = {"sorted_ids_ptr": "*i32", "ntpp_ptr": "*i32"}
    print(build(G1.sorted_rows_kernel, dict(TOPK=8, ROWS=32, BLOCK_H=512, ZERO_PAD=False),
                dict(srows, x_ptr="*fp8e4nv", xs_ptr="*fp8e4nv")))
    print(build(G1.sorted_rows_kernel, dict(TOPK=8, ROWS=32, BLOCK_H=256, ZERO_PAD=True),
                dict(srows, x_ptr="*fp32", xs_ptr="*fp32")))
    # the batched layout's rows into their slots (bytes: bf16 as two, fp8 as one)
    print(build(BL.batched_rows_kernel, dict(TOP_K=8, BLOCK=1024), {"x_ptr": "*u8", "out_ptr": "*u8", "slot_ptr": "*i64"}))
    for q, out in ((True, "*fp8e4nv"), (False, "*bf16")):
        print(build(Q.silu_mul_rows_kernel, dict(QUANT=q, BLOCK_M=16, GROUP=128, EXACT=False),
                    {"gu_ptr": "*bf16", "q_ptr": out, "s_ptr": "*fp32", "limit_ptr": "*i32"}))
    # As launched: the prefill tile of Qwen3-30B-A3B at 4096 tokens (H 2048, I 768, 32768 pairs),
    # 128 x 256 x 64, 8 warps, 4 stages (the shipped file's entry), GEMM1 wide with pointer loads
    # (as on a device without TMA), GEMM2 with w2 through TMA
    h, n_inter, pairs, blocks = 2048, 768, 32768, 400
    ints1 = dict(zero_numel=4096 * h, num_pairs=pairs, N_INTER=n_inter, H=h, num_blocks_m=blocks, stride_xm=h,
                 stride_xk=1, stride_we=2 * n_inter * h, stride_wn=h, stride_wk=1, stride_im=n_inter, stride_in=1,
                 stride_asm=0, stride_asg=0, stride_wse=0, stride_wsn=0, stride_wsk=0)
    ints2 = dict(num_pairs=pairs, H=h, N_INTER=n_inter, num_blocks_m=blocks, k_per_split=n_inter, stride_im=n_inter,
                 stride_ik=1, stride_we=h * n_inter, stride_wn=n_inter, stride_wk=1, stride_om=h, stride_on=1,
                 stride_asm=0, stride_asg=0, stride_wse=0, stride_wsn=0, stride_wsk=0)
    c = dict(BLOCK_SIZE_M=128, BLOCK_SIZE_K=64, GROUP_SIZE_M=8, TOPK=8, EVEN_K=True, UPCAST=False, IEEE_DOT=False,
             **no_quant)
    opts = dict(num_warps=8, num_stages=4)
    print("as launched: " + build(
        *gemm1(dict(c, BLOCK_SIZE_N=128, USE_TMA=False, ZERO_OUT=True, WIDE=True)),
        dict(std_ptrs, zero_ptr="*fp32"), ("w13_desc", "x_desc"), ints1, opts))
    print("as launched: " + build(
        G2.gemm2_weighted_sum_kernel, dict(c, BLOCK_SIZE_N=256, USE_TMA=True),
        dict(std_ptrs, w2_desc="tensordesc<bf16[256, 64]>"), (), ints2, opts))
    # The wide GEMM1 through TMA (as on the H200): the (2, BN, BK) weight box of the (2E, I, H)
    # view, A gathered by pointer loads or (sorted_a) through TMA from the sorted copy
    for a_tma in (False, True):
        ptrs = dict(std_ptrs, zero_ptr="*fp32", w13_desc="tensordesc<bf16[2, 128, 64]>")
        unused = ("x_desc",)
        if a_tma:
            ptrs["x_desc"], unused = "tensordesc<bf16[128, 64]>", ()
        print("as launched, WIDE TMA, A_TMA=%s: " % a_tma + build(
            *gemm1(dict(c, BLOCK_SIZE_N=128, USE_TMA=True, ZERO_OUT=True, WIDE=True, A_TMA=a_tma)),
            ptrs, unused, ints1, opts))
    # gpt-oss-20b's mxfp4 GEMM1 at one token as launched (H = I = 2880, 4 pairs, the shipped
    # file's 16 x 64 x 64 tile, 4 warps, 3 stages): the packed weight bytes come through cp.async
    # (pipelined loads 6: A, gate and up bytes; the e8m0 scales are plain loads)
    h, n_inter, g = 2880, 2880, 2880 // 32
    ints_wq = dict(zero_numel=h, num_pairs=4, N_INTER=n_inter, H=h, num_blocks_m=40, stride_xm=h, stride_xk=1,
                   stride_we=2 * n_inter * h // 2, stride_wn=h // 2, stride_wk=1, stride_im=n_inter, stride_in=1,
                   stride_asm=0, stride_asg=0, stride_wse=2 * n_inter * g, stride_wsn=g, stride_wsk=1,
                   stride_wze=0, stride_wzn=0, stride_wzk=0)
    c = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=64, GROUP_SIZE_M=16, TOPK=4, EVEN_K=True, UPCAST=False,
             IEEE_DOT=False, USE_TMA=False, ZERO_OUT=True, WIDE=False, **no_quant, **wq_variants[-1][0])
    wp = dict(std_ptrs, w13_ptr="*u8", w_scale_ptr="*u8", wz_ptr="*u8", zero_ptr="*fp32")
    print("as launched, mxfp4: " + build(*gemm1(c), wp, ("w13_desc", "x_desc"), ints_wq,
                                                  dict(num_warps=4, num_stages=3)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
