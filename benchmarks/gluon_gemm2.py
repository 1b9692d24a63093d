"""GEMM2 at prefill as Gluon kernels (Hopper: TMA, asynchronous warpgroup MMA, TMA stores, warp
specialisation), against the `triton` layer's GEMM2 with per-pair rows, each followed by the top-k sum.

    PYTHONPATH=. python -m benchmarks gluon_gemm2 [--shapes qwen3-235b-tp8,dsv3-tp8] [--tokens 1024,4096]
        [--forms persistent,pingpong] [--smoke]      (or all of it: bash benchmarks/device_gluon.sh)

Why: at prefill with a short K (I = 192-768) each GEMM2 tile does a few K steps and then its
epilogue (cast, store), which one-tile-per-program kernels do not overlap with the next tile's
loads: the layer sits 1.8-2.8x over the compute floor there (PERF.md section 1). Both forms run one
program per SM over its tiles (rows of one expert's block x BLOCK_N hidden columns) and store each
tile's rows in sorted order through TMA; the top-k sum then gathers them (row index = each pair's
sorted row, `pair_rows`) and applies the router weights.
- persistent: one flattened loop over (tile, K step); the TMA loads run NUM_BUFFERS - 1 steps ahead,
  across tile boundaries.
- pingpong: warp-specialised; one load warp fills the ring, two MMA warp groups take alternate
  tiles, so one group's epilogue runs while the other's MMAs do.

Both paths take the same aligned pairs (moebench's alignment at the layer's BLOCK_SIZE_M), the same
bf16 intermediate and router weights; each result is checked against a float64 torch reference of
the weighted sum, then CUDA-graph timed: `current` = `launch_gemm2(pair_store=True)` with the layer's
configs + `topk_sum`; `gluon ...` = the pairs' sorted rows (one torch scatter) + the kernel + the
gathering, weighting `topk_sum`, and "(rows prepared)" the same with the scatter made before the
timed region (where the alignment could write it). The Gluon kernels run on a GPU only (Gluon has
no interpreter; the CPU tests compile every variant for sm_90); --smoke runs the rest on a tiny
shape under the interpreter (times mean nothing). Writes gluon_gemm2.csv / .md under $OUT.
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton

from moebench.kernels.triton.align import moe_align_block_size, pair_rows
from moebench.kernels.triton.configs import layer_config, lookup_down_config
from moebench.kernels.triton.gemm import launch_gemm2, topk_sum
from moebench.kernels.triton.options import TritonOptions, resolve_use_tma
from moebench.kernels.triton.routing import fused_topk_softmax

from benchmarks.bench_common import ON_GPU, SHAPES, script_setup, seeded_inputs, timed_us, write_rows

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    # TMA copies: async_load / async_store in newer Gluon, async_copy_* before
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
except ImportError as ex:  # an older Triton
    gluon = None
    GLUON_MISSING = str(ex)

#: registers per thread of the ping-pong form's second MMA group (a 128 x 128 fp32 accumulator is 128
#: of them); its load warp gets 24
MMA_REGS = 232
#: (form, BLOCK_SIZE_N, BLOCK_SIZE_K, buffers, warps of one MMA group); BLOCK_SIZE_M is the layer's (the
#: alignment's block). "persistent": one loop, loads issued ahead; "pingpong": warp-specialised.
VARIANTS = [("persistent", 128, 64, 4, 4), ("persistent", 256, 64, 3, 8), ("persistent", 128, 64, 6, 4),
            ("pingpong", 128, 64, 4, 4), ("pingpong", 128, 64, 5, 4)]
#: --smoke: (E, topk, H, I, E local) small enough for the interpreter
SMOKE = {"tiny": (8, 2, 128, 64, 8)}
#: Hopper's shared memory per block (every variant fits with 64- and 128-row blocks)
SMEM_LIMIT = 232448


if gluon is not None:

    @gluon.jit
    def _issue_load(step, pid, k_steps, num_n, a_desc, b_desc, expert_ids_ptr, H, bars, a_bufs, b_bufs, pred,
                    num_programs, NUM_BUFFERS: gl.constexpr):
        # Step -> (this program's tile, K step) -> the block's rows and its expert's weight rows.
        BM: gl.constexpr = a_desc.block_type.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        BN: gl.constexpr = b_desc.block_type.shape[0]
        tile = pid + (step // k_steps) * num_programs
        kk = step % k_steps
        pid_m = tile // num_n
        pid_n = tile % num_n
        expert = gl.load(expert_ids_ptr + pid_m, mask=pred, other=0)
        buf = step % NUM_BUFFERS
        bar = bars.index(buf)
        mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=pred)
        _tma_load(a_desc, [pid_m * BM, kk * BK], bar, a_bufs.index(buf), pred)
        _tma_load(b_desc, [expert * H + pid_n * BN, kk * BK], bar, b_bufs.index(buf), pred)

    @gluon.jit
    def _schedule(a_desc, c_desc, ntpp_ptr, H, K, NUM_PROGRAMS: gl.constexpr):
        # This program's tiles: pid, pid + NUM_PROGRAMS, ... of the used blocks x hidden tiles (row-major,
        # so the programs running together share a few blocks' rows and experts' weights in L2), each
        # k_steps K steps: (pid, hidden tiles, k_steps, this program's steps).
        pid = gl.program_id(0)
        num_m = gl.cdiv(gl.load(ntpp_ptr), c_desc.block_type.shape[0])
        num_n = gl.cdiv(H, c_desc.block_type.shape[1])
        my_tiles = gl.maximum(gl.cdiv(num_m * num_n - pid, NUM_PROGRAMS), 0)
        k_steps = gl.cdiv(K, a_desc.block_type.shape[1])
        return pid, num_n, k_steps, my_tiles * k_steps

    @gluon.jit
    def gemm2_rows_kernel(a_desc, b_desc, c_desc, expert_ids_ptr, ntpp_ptr, H, K,
                          MMA_LAYOUT: gl.constexpr, NUM_PROGRAMS: gl.constexpr, NUM_BUFFERS: gl.constexpr):
        """c[r, :] = a[r, :] @ w2[e(r)]^T for the sorted rows r < ntpp, e(r) = its block's expert;
        a (R, K), w2 as (E * H, K), c (R, H)."""
        BM: gl.constexpr = c_desc.block_type.shape[0]
        BN: gl.constexpr = c_desc.block_type.shape[1]
        dtype: gl.constexpr = a_desc.dtype
        a_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS] + a_desc.block_type.shape, a_desc.layout)
        b_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS] + b_desc.block_type.shape, b_desc.layout)
        c_smem = gl.allocate_shared_memory(dtype, c_desc.block_type.shape, c_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_BUFFERS):
            mbarrier.init(bars.index(i), count=1)

        pid, num_n, k_steps, total = _schedule(a_desc, c_desc, ntpp_ptr, H, K, NUM_PROGRAMS)

        for s in gl.static_range(NUM_BUFFERS - 1):
            _issue_load(s, pid, k_steps, num_n, a_desc, b_desc, expert_ids_ptr, H, bars, a_bufs, b_bufs, s < total,
                        NUM_PROGRAMS, NUM_BUFFERS)
        acc = gl.zeros((BM, BN), dtype=gl.float32, layout=MMA_LAYOUT)
        for step in range(total):
            # The buffer of step - 1 is free (its MMA was waited for): load step + NUM_BUFFERS - 1 into it.
            nxt = step + NUM_BUFFERS - 1
            _issue_load(nxt, pid, k_steps, num_n, a_desc, b_desc, expert_ids_ptr, H, bars, a_bufs, b_bufs, nxt < total,
                        NUM_PROGRAMS, NUM_BUFFERS)
            buf = step % NUM_BUFFERS
            mbarrier.wait(bars.index(buf), (step // NUM_BUFFERS) & 1)
            kk = step % k_steps
            acc = warpgroup_mma(a_bufs.index(buf), b_bufs.index(buf).permute((1, 0)), acc, use_acc=kk > 0,
                                is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            if kk == k_steps - 1:
                # Epilogue: cast, then an asynchronous store of the tile's sorted rows (the previous
                # tile's store has long finished reading c_smem).
                tile = pid + (step // k_steps) * NUM_PROGRAMS
                pid_m = tile // num_n
                pid_n = tile % num_n
                tma.store_wait(pendings=0)
                c_smem.store(acc.to(dtype))
                fence_async_shared()
                _tma_store(c_desc, [pid_m * BM, pid_n * BN], c_smem)
        tma.store_wait(pendings=0)
        for i in gl.static_range(NUM_BUFFERS):
            mbarrier.invalidate(bars.index(i))

    # Warp-specialised, ping-pong form: one load warp streams every (tile, K step) of the program into
    # the ring; two MMA warp groups take alternate tiles, so one group's epilogue (cast, store) runs
    # while the other's MMAs do. Slot s % NUM_BUFFERS is "ready" once its loads land and "empty" once
    # the group that used it has waited for its MMA.

    @gluon.jit
    def _ws_load(a_desc, b_desc, c_desc, expert_ids_ptr, a_bufs, b_bufs, c_bufs, ready, empty, pid, num_n, k_steps,
                 total, H):
        NUM_BUFFERS: gl.constexpr = a_bufs.shape[0]
        for step in range(total):
            # a fresh barrier passes a wait for the parity before its first phase
            mbarrier.wait(empty.index(step % NUM_BUFFERS), ((step // NUM_BUFFERS) & 1) ^ 1)
            _issue_load(step, pid, k_steps, num_n, a_desc, b_desc, expert_ids_ptr, H, ready, a_bufs, b_bufs, True,
                        gl.num_programs(0), NUM_BUFFERS)

    @gluon.jit
    def _ws_mma(a_desc, b_desc, c_desc, expert_ids_ptr, a_bufs, b_bufs, c_bufs, ready, empty, pid, num_n, k_steps,
                total, H, GROUP: gl.constexpr):
        BM: gl.constexpr = c_desc.block_type.shape[0]
        BN: gl.constexpr = c_desc.block_type.shape[1]
        NUM_BUFFERS: gl.constexpr = a_bufs.shape[0]
        # one warp group: its warps stacked along M, one instruction as wide as the tile
        MMA_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                              instr_shape=[16, BN, 16])
        c_smem = c_bufs.index(GROUP)
        my_tiles = total // k_steps
        for t in range(GROUP, my_tiles, 2):
            acc = gl.zeros((BM, BN), dtype=gl.float32, layout=MMA_LAYOUT)
            for kk in range(k_steps):
                step = t * k_steps + kk
                buf = step % NUM_BUFFERS
                mbarrier.wait(ready.index(buf), (step // NUM_BUFFERS) & 1)
                acc = warpgroup_mma(a_bufs.index(buf), b_bufs.index(buf).permute((1, 0)), acc, use_acc=kk > 0,
                                    is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                mbarrier.arrive(empty.index(buf))
            tile = pid + t * gl.num_programs(0)
            pid_m = tile // num_n
            pid_n = tile % num_n
            tma.store_wait(pendings=0)
            c_smem.store(acc.to(c_desc.dtype))
            fence_async_shared()
            _tma_store(c_desc, [pid_m * BM, pid_n * BN], c_smem)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _ws_mma_even(a_desc, b_desc, c_desc, expert_ids_ptr, a_bufs, b_bufs, c_bufs, ready, empty, pid, num_n,
                     k_steps, total, H):
        _ws_mma(a_desc, b_desc, c_desc, expert_ids_ptr, a_bufs, b_bufs, c_bufs, ready, empty, pid, num_n, k_steps,
                total, H, 0)

    @gluon.jit
    def _ws_mma_odd(a_desc, b_desc, c_desc, expert_ids_ptr, a_bufs, b_bufs, c_bufs, ready, empty, pid, num_n,
                    k_steps, total, H):
        _ws_mma(a_desc, b_desc, c_desc, expert_ids_ptr, a_bufs, b_bufs, c_bufs, ready, empty, pid, num_n, k_steps,
                total, H, 1)

    @gluon.jit
    def gemm2_pingpong_kernel(a_desc, b_desc, c_desc, expert_ids_ptr, ntpp_ptr, H, K,
                              NUM_PROGRAMS: gl.constexpr, NUM_BUFFERS: gl.constexpr, MMA_WARPS: gl.constexpr,
                              MMA_REGS: gl.constexpr):
        """gemm2_rows_kernel's result, warp-specialised (the kernel's num_warps = one MMA group)."""
        dtype: gl.constexpr = a_desc.dtype
        a_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS] + a_desc.block_type.shape, a_desc.layout)
        b_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS] + b_desc.block_type.shape, b_desc.layout)
        c_bufs = gl.allocate_shared_memory(dtype, [2] + c_desc.block_type.shape, c_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_BUFFERS):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)

        pid, num_n, k_steps, total = _schedule(a_desc, c_desc, ntpp_ptr, H, K, NUM_PROGRAMS)
        args = (a_desc, b_desc, c_desc, expert_ids_ptr, a_bufs, b_bufs, c_bufs, ready, empty, pid, num_n, k_steps,
                total, H)
        gl.warp_specialize([(_ws_mma_even, args), (_ws_mma_odd, args), (_ws_load, args)], [MMA_WARPS, 1],
                           [MMA_REGS, 24])
        for i in gl.static_range(NUM_BUFFERS):
            mbarrier.invalidate(ready.index(i))
            mbarrier.invalidate(empty.index(i))


def _mma_layout(bm: int, bn: int, warps: int):
    """wgmma's accumulator layout: warps stacked along M in 16-row slices (then along N), the widest
    instruction N that divides each warp group's share of the columns."""
    wm = min(warps, max(4, bm // 16))
    wn = warps // wm
    n = 256
    while n > max(bn // wn, 8) or bn % n:
        n -= 8
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[wm, wn], instr_shape=[16, n, 16])


def gluon_gemm2(inter, w2, align, form: str, bn: int, bk: int, buffers: int, warps: int, out=None):
    """out (R, H) = each sorted row times its expert's w2 (rows past the used length unwritten)."""
    e, h, k = w2.shape
    bm = align.block_size_m
    rows = inter.shape[0]
    out = out if out is not None else torch.empty(rows, h, dtype=inter.dtype, device=inter.device)
    lay = lambda shape: gl.NVMMASharedLayout.get_default_for(shape, gl.bfloat16)  # noqa: E731
    a_desc = TensorDescriptor.from_tensor(inter, [bm, bk], lay([bm, bk]))
    b_desc = TensorDescriptor.from_tensor(w2.view(e * h, k), [bn, bk], lay([bn, bk]))
    c_desc = TensorDescriptor.from_tensor(out, [bm, bn], lay([bm, bn]))
    progs = torch.cuda.get_device_properties(inter.device).multi_processor_count
    args = (a_desc, b_desc, c_desc, align.expert_ids, align.num_tokens_post_padded, h, k)
    if form == "persistent":
        gemm2_rows_kernel[(progs, )](*args, _mma_layout(bm, bn, warps), progs, buffers, num_warps=warps)
    else:
        gemm2_pingpong_kernel[(progs, )](*args, progs, buffers, warps, MMA_REGS, num_warps=warps)
    return out


def compile_variant(form: str, bm: int, bn: int, bk: int, buffers: int, warps: int, arch: int = 90):
    """Build a variant for the GPU arch (no GPU needed): the kernel's compiled form, whose
    `metadata.shared` is its shared memory. Raises where the variant does not build."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    lay = lambda shape: gl.NVMMASharedLayout.get_default_for(shape, gl.bfloat16)  # noqa: E731
    desc = lambda shape: f"tensordesc<bf16[{shape[0]}, {shape[1]}],{lay(shape)!r}>"  # noqa: E731
    sig = {"a_desc": desc([bm, bk]), "b_desc": desc([bn, bk]), "c_desc": desc([bm, bn]),
           "expert_ids_ptr": "*i32", "ntpp_ptr": "*i32", "H": "i32", "K": "i32"}
    kernel = gemm2_rows_kernel
    consts = {"MMA_LAYOUT": _mma_layout(bm, bn, warps), "NUM_PROGRAMS": 132, "NUM_BUFFERS": buffers}
    if form == "pingpong":
        kernel = gemm2_pingpong_kernel
        consts = {"NUM_PROGRAMS": 132, "NUM_BUFFERS": buffers, "MMA_WARPS": warps, "MMA_REGS": MMA_REGS}
    first = len(sig)
    sig.update((name, "constexpr") for name in consts)
    src = GluonASTSource(kernel, sig, {(first + i, ): v for i, v in enumerate(consts.values())})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})


def sorted_products(act, w2, align):
    """(R, H) float64: each used sorted row times its block's expert's w2 (zeros elsewhere): what
    the Gluon kernels store, in torch."""
    used = int(align.num_tokens_post_padded.item())
    out = torch.zeros(act.shape[0], w2.shape[1], dtype=torch.float64, device=act.device)
    experts = align.expert_ids.long()[torch.arange(used, device=act.device) // align.block_size_m]
    for e in experts.unique().tolist():
        rows = torch.nonzero(experts == e).squeeze(1)
        out[rows] = act[rows].double() @ w2[e].double().t()
    return out


def reference_sum(act, w2, topk_weights, align, topk):
    """(M, H) float64: sum over each token's pairs of router weight x its sorted row's product."""
    m = topk_weights.shape[0]
    used = int(align.num_tokens_post_padded.item())
    sid = align.sorted_token_ids[:used].long()
    rows = torch.nonzero(sid < m * topk).squeeze(1)
    pair = sid[rows]
    ref = torch.zeros(m, w2.shape[1], dtype=torch.float64, device=act.device)
    prod = sorted_products(act, w2, align)[rows]
    return ref.index_add_(0, pair // topk, prod * topk_weights.reshape(-1)[pair].double()[:, None])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qwen3-235b-tp8,dsv3-tp8,qwen3-30b-a3b")
    ap.add_argument("--tokens", default="1024,4096")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--forms", default="persistent,pingpong", help="which kernel forms of VARIANTS to run")
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny shape under the interpreter: the layer's path and the reference only (checks the "
                         "script; the Gluon rows say they need a GPU)")
    a = ap.parse_args(argv)
    run_gluon = ON_GPU and gluon is not None
    if not run_gluon and not a.smoke:
        print("error: gluon_gemm2 needs a Hopper GPU and Triton's Gluon"
              + ("" if gluon is not None else f" ({GLUON_MISSING})") + "; --smoke checks the script on a CPU",
              file=sys.stderr)
        sys.exit(2)
    out_dir, dev, head = script_setup("gluon_gemm2")
    print(f"# {head}", flush=True)
    shapes = SMOKE if a.smoke else {s: SHAPES[s] for s in a.shapes.split(",")}
    rows_out: list[dict] = []
    for shape, (e, topk, h, inter_n, e_local) in shapes.items():
        assert e == e_local, "no expert map here"
        g = torch.Generator(device=dev).manual_seed(0)
        w2 = (torch.randn(e, h, inter_n, device=dev, generator=g) * inter_n**-0.5).to(torch.bfloat16)
        for m in ([16] if a.smoke else [int(t) for t in a.tokens.split(",")]):
            x, logits = seeded_inputs(m, h, e, torch.bfloat16, dev)
            tw, ids = fused_topk_softmax(logits, topk, renormalize=True)
            cfg, _ = layer_config(m, local_experts=e, inter=inter_n, hidden=h, topk=topk, num_experts=e,
                                  dtype=torch.bfloat16)
            down, _ = lookup_down_config(e, inter_n, m, cfg, torch.bfloat16, topk=topk, num_experts_global=e)
            cfg2 = down or cfg
            tma2 = bool(cfg2["USE_TMA"]) if "USE_TMA" in cfg2 else resolve_use_tma(TritonOptions(), cfg, torch.bfloat16)
            align = moe_align_block_size(ids, cfg["BLOCK_SIZE_M"], e)
            act = (torch.randn(align.sorted_token_ids.numel(), inter_n, device=dev, generator=g)).to(torch.bfloat16)
            ref = reference_sum(act, w2, tw, align, topk)
            out = torch.empty(m, h, dtype=torch.bfloat16, device=dev)
            ws = torch.empty(m * topk, h, dtype=torch.bfloat16, device=dev)

            def current():
                launch_gemm2(act, w2, tw, align, topk, cfg2, use_tma=tma2, ws=ws,
                             pair_store=True)
                return topk_sum(ws, out, topk)

            def err(y):
                return ((y.double() - ref).norm() / ref.norm()).item()

            base = dict(shape=shape, tokens=m, block_m=cfg["BLOCK_SIZE_M"], cfg2="/".join(
                str(cfg2[k]) for k in ("BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")))
            cur_err = err(current())
            cur_us = timed_us(current, a.reps, 5)
            rows_out.append(dict(base, variant="current", us=round(cur_us, 1), ratio=1.0, rel_err=f"{cur_err:.1e}"))
            write_rows(rows_out, out_dir, "gluon_gemm2", f"# {head}")
            srt = torch.empty(act.shape[0], h, dtype=torch.bfloat16, device=dev)
            pos_pre = pair_rows(align, 0)
            for form, bn, bk, nb, warps in (v for v in VARIANTS if v[0] in a.forms.split(",")):
                name = f"gluon {form} n{bn} k{bk} b{nb} w{warps}"

                def glu(form=form, bn=bn, bk=bk, nb=nb, warps=warps, prepared=False):
                    pos = pos_pre if prepared else pair_rows(align, 0)
                    gluon_gemm2(act, w2, align, form, bn, bk, nb, warps, out=srt)
                    return topk_sum(srt, out, topk, row_index=pos, weights=tw)
                try:
                    if not run_gluon:
                        raise RuntimeError("not run: needs a Hopper GPU")
                    e_g = err(glu())
                    for prepared in (False, True):
                        us = timed_us(lambda: glu(prepared=prepared), a.reps, 5)
                        rows_out.append(dict(base, variant=name + (" (rows prepared)" if prepared else ""),
                                             us=round(us, 1), ratio=round(us / cur_us, 3), rel_err=f"{e_g:.1e}"))
                except Exception as ex:  # a variant that does not build or run here: say why, keep going
                    rows_out.append(dict(base, variant=name, us=None, ratio=None,
                                         rel_err=f"failed: {type(ex).__name__}: {str(ex)[:200]}"))
                write_rows(rows_out, out_dir, "gluon_gemm2", f"# {head}")


if __name__ == "__main__":
    main()
