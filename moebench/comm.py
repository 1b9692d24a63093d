"""What a prepare/finalize sends between ranks, declared as data.

Every prepare/finalize class declares `communication`: the operations one layer pays on each
rank, in order. The communication model (moebench.runtime.comm_model) prices them; the simulated
runner and `moebench comm` read the same declarations, so no code asks a backend for its name.

    CommOp(op, transports, traffic, payload, calls, row_extra)

op         what the operation does: dispatch, combine, all-reduce, all-gather, reduce-scatter
transports the fitted transports that can carry it; where there are several (TP's all-reduce:
           NCCL or the custom all-reduce) each is a candidate and a run keeps the faster, saying
           which (the `allreduce` column)
traffic    how rows travel, which decides the bytes on each link:
             "pair"  one row per (token, expert) pair whose expert lives on another rank
                     (DeepEP low-latency, pplx, moebench's all2all-ll);
             "rank"  one row per (token, remote rank) the token has experts on (DeepEP normal);
                     past one node one row per (token, remote node) over RDMA to the GPU of the
                     same index there, then one per (token, rank) over NVLink;
             "tensor" a collective over a whole tensor of `rows` rows (all-reduce, all-gather,
                     reduce-scatter): its algorithm (ring, one-shot...) belongs to the transport
payload    what one row carries: "activations" (the tokens going to the experts: fp8 with their
           scales where the layer quantises activations and the transport carries fp8, else the
           activation dtype), "outputs" (the experts' output rows, in the activation dtype)
calls      calls of the transport per layer (all2all-ll: a counts exchange, rows, ids = 3)
row_extra  bytes each row carries beyond its payload (a local expert id)
topk_extra bytes each row carries per top-k slot (routing ids and weights travelling with a token)
chunk      tokens per rank one call moves at most (its buffer); a larger batch takes
           ceil(tokens / chunk) calls, as engines chunk it (0: no limit)
"""

from __future__ import annotations

from dataclasses import dataclass

OPS = ("dispatch", "combine", "all-reduce", "all-gather", "reduce-scatter", "all-to-all")
TRAFFIC = ("pair", "rank", "tensor")
PAYLOADS = ("activations", "outputs")


@dataclass(frozen=True)
class CommOp:
    op: str
    transports: tuple[str, ...]
    traffic: str
    payload: str
    calls: int = 1
    row_extra: int = 0
    topk_extra: int = 0
    chunk: int = 0

    def __post_init__(self):
        if self.op not in OPS or self.traffic not in TRAFFIC or self.payload not in PAYLOADS:
            raise ValueError(f"CommOp({self.op}, {self.traffic}, {self.payload}): op, traffic or payload unknown")
        if not self.transports or self.calls < 1:
            raise ValueError("a CommOp needs at least one transport and one call")


def tp_allreduce() -> tuple[CommOp, ...]:
    """TP's all-reduce of the (M, H) output after finalize: NCCL's ring, or the custom all-reduce
    (one-shot / two-shot through peer memory) that vLLM and SGLang run at decode sizes."""
    return (CommOp("all-reduce", ("nccl-all-reduce", "custom-all-reduce"), "tensor", "outputs"),)
