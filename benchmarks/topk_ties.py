"""Where `fused_topk_softmax` and torch's softmax + topk pick different experts, by how much do
the probabilities at those ranks differ? (A near-tie at the k-th place may order either way.)

    PYTHONPATH=. python -m benchmarks topk_ties [--m 4096 --e 128 --k 8 --seeds 20]
"""

from __future__ import annotations

import argparse

import torch

from moebench.kernels.triton.routing import fused_topk_softmax


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=4096)
    ap.add_argument("--e", type=int, default=128)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--seeds", type=int, default=20)
    a = ap.parse_args(argv)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    total = 0
    worst = 0.0
    for seed in range(a.seeds):
        g = torch.Generator(device=dev).manual_seed(seed)
        logits = torch.randn(a.m, a.e, device=dev, generator=g)
        _, ids = fused_topk_softmax(logits, a.k)
        p = torch.softmax(logits, -1)
        rw, rids = p.topk(a.k, -1)
        bad = (ids.long() != rids).any(-1).nonzero().flatten()
        total += bad.numel()
        picked = p.gather(-1, ids.long())
        rel = ((picked - rw).abs() / rw).max().item()
        worst = max(worst, rel)
        for r in bad[:2].tolist():
            print(f"seed {seed} row {r}: kernel {ids[r].tolist()} torch {rids[r].tolist()} "
                  f"probs at the ranks: kernel {picked[r].tolist()} torch {rw[r].tolist()}")
    print(f"rows differing: {total} of {a.seeds * a.m}; max relative difference of the picked probability "
          f"from torch's at the same rank: {worst:.2e}")
