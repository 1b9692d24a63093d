"""Communication between ranks: what a prepare/finalize sends, declared as data (this module),
and the package that prices it:

    links.py        link profiles (NVLink by GPU, PCIe, RDMA NICs), which one a run models
    traffic.py      the rows and bytes each rank sends (one count: the model's, the GB/s columns', the metrics')
    points.py       the published points (comm_points.csv fitted, comm_heldout.csv never fitted)
    fit.py          the fit of each (transport, op) to its points
    model.py        CommModel: the time of declared operations over the links; `ask` (`moebench comm`)
    calibration.py  fits measured on this machine's GPUs (`moebench env --calibrate-link`)
    robustness.py   the flip factor and the band of published transports behind a TP-vs-EP answer

Every prepare/finalize class declares `communication`: the operations one layer pays on each
rank, in order. The model is given those declarations (moebench.backends.declared_communication)
and prices them; the simulated runner and `moebench comm` read the same, so no code asks a backend
for its name. This module imports nothing of moebench: the kernels' contract imports it.

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
