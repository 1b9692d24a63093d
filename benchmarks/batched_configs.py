"""The batched Triton experts with the tuned-config lookup against their default heuristic, in one
run (issue 3: every launch takes the lookup's config, else the heuristic).

    PYTHONPATH=. python -m benchmarks batched_configs [--shapes a,b] [--rows 1,16,64,256,1024] [--smoke]

`BatchedTritonExperts` looks up the vLLM-format file of (E_local, I) at the entry nearest to the
routed token count (PrepareResult.num_tokens; here the count whose pairs per local expert match
the batch's mean rows, 3T/4 x E / topk) and falls back to `batched_default_config` at the mean
rows per expert (`heuristic`). `rows_key`: the entry nearest to T itself, the key vLLM's batched
Triton experts use (their max tokens); `heuristic_v1`: the heuristic with 64-row tiles at any row
count (as if batched_wide_rows were unbounded). The files are tuned for the sorted-token kernel, so this measures whether
the batched kernel gains from them. Each point: a (E_local, T, H) bf16 batch with
expert_num_tokens drawn from [T/2, T], the configs checked against each other on the written rows,
then timed (CUDA-graph replay). Writes batched_configs.csv / .md under $OUT (default ./bench-out). --smoke: tiny shapes on CPU under the Triton interpreter
(checks the script; its times mean nothing).
"""

from __future__ import annotations

import argparse

import torch

from moebench.kernels.triton.batched import batched_default_config, batched_moe, mean_rows
from moebench.kernels.triton.experts import BatchedTritonExperts
from moebench.kernels.triton.options import TritonOptions

from benchmarks.bench_common import ON_GPU, SHAPES, script_setup, timed_us, write_rows

DEFAULT_SHAPES = "mixtral,qwen3-30b-a3b,dsv3-ep8"
SMOKE = {"tiny": (8, 2, 64, 32, 4)}


def _cfg_text(cfg: dict) -> str:
    return "/".join(str(cfg[c]) for c in ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M",
                                          "num_warps", "num_stages"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--rows", default="1,16,64,256,1024", help="rows per expert T of the batched layout")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    if args.smoke:
        SHAPES.update(SMOKE)
        args.shapes, args.rows = "tiny", "3,20"
    out_dir, dev, head = script_setup("bf16; batched-triton experts, us")
    print("# " + head, flush=True)
    dt = torch.bfloat16
    rows = []
    for shape in args.shapes.split(","):
        e, k, h, inter_size, e_local = SHAPES[shape]
        g = torch.Generator(device=dev).manual_seed(0)
        w13 = torch.randn(e_local, 2 * inter_size, h, dtype=dt, device=dev, generator=g).mul_(h**-0.5)
        w2 = torch.randn(e_local, h, inter_size, dtype=dt, device=dev, generator=g).mul_(inter_size**-0.5)
        for t in (int(v) for v in args.rows.split(",")):
            a = torch.randn(e_local, t, h, dtype=dt, device=dev, generator=g)
            counts = torch.randint(max(t // 2, 1), t + 1, (e_local,), device=dev, generator=g, dtype=torch.int32)
            exp = BatchedTritonExperts()
            tokens = max(1, round(0.75 * t * e / k))
            heur = dict(batched_default_config(mean_rows(t, tokens, k, e), inter_size, h, dt))
            looked = exp.config_for(t, e_local, inter_size, h, dt, device_type=dev.type, tokens=tokens, topk=k,
                                    num_experts=e)
            row = dict(shape=shape, rows_per_expert=t, tokens=tokens, heuristic=_cfg_text(heur), lookup=_cfg_text(looked),
                       lookup_source=str(exp.last_config_source).rsplit("/", 1)[-1])
            rows_key = exp.config_for(t, e_local, inter_size, h, dt, device_type=dev.type, tokens=t)
            v1 = dict(batched_default_config(min(t, TritonOptions().batched_wide_rows), inter_size, h, dt))
            row.update(rows_key=_cfg_text(rows_key), heuristic_v1=_cfg_text(v1))
            outs = {}
            for name, cfg in (("heuristic", heur), ("lookup", looked), ("rows_key", rows_key), ("heuristic_v1", v1)):
                fn = lambda cfg=cfg: batched_moe(a, counts, w13, w2, cfg)  # noqa: E731
                outs[name] = fn()
                row[f"{name}_us"] = round(timed_us(fn, reps=20, graph_calls=3), 1)
            mask = torch.arange(t, device=dev)[None, :] < counts[:, None]
            base = outs["heuristic"].float()[mask]
            row["max_rel_diff"] = max(float(((outs[n].float()[mask] - base).norm() / base.norm())) for n in outs)
            if row["max_rel_diff"] > 2e-2:
                raise SystemExit(f"{shape} T={t}: the configs disagree by {row['max_rel_diff']:.1e}")
            row["lookup/heuristic"] = round(row["lookup_us"] / row["heuristic_us"], 3)
            row["rows_key/heuristic"] = round(row["rows_key_us"] / row["heuristic_us"], 3)
            row["heuristic/heuristic_v1"] = round(row["heuristic_us"] / row["heuristic_v1_us"], 3)
            rows.append(row)
            write_rows(rows, out_dir, "batched_configs", head)
            a = outs = None
        w13 = w2 = None
        if ON_GPU:
            torch.cuda.empty_cache()
    return 0
