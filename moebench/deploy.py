"""The layouts engines deploy an MoE model in, and the flags that deploy each one.

A candidate of a comparison over N GPUs (nodes of `gpus_per_node`):
- `TP{t}`: tensor parallel over t ranks: every rank holds 1/t of every expert; tokens replicated;
  one all-reduce after the experts. The group stays inside a node (at most TP_MAX_RANKS ranks);
  the rest of the GPUs are replicas, each on its share of the batch (`TP8x4`).
- `TP{t}+EP{t}`: the same TP group with the experts split by expert (E/t whole experts a rank),
  tokens still replicated and combined by the same all-reduce: vLLM's `--tensor-parallel-size t
  --enable-expert-parallel` with DP 1, SGLang's `--tp t --ep t` without an all-to-all backend.
- `DP{n}+EP{n}`: attention data parallel (each rank brings its own tokens), experts split by
  expert, tokens moved by dispatch / combine: one candidate per transport engines ship.
- `EP{a}/TP{b}`: experts split by expert over a groups and inside each expert over b ranks
  (TensorRT-LLM's `--ep_size a` with `--tp_size a*b`); tokens replicated, one all-reduce.
- `TP{2g}`: TP across two nodes (all-reduce over NVLink and RDMA), the usual baseline of a
  model that does not fit one node (DeepSeek-V3 as TP16 on 2 x 8 H100).

Flags are composed from the layout and from what each transport declares (`engine_flags` on its
prepare/finalize class): a layout whose transport no engine runs is shown, never recommended.
"""

from __future__ import annotations

from dataclasses import dataclass

from moebench.backends import get_prepare_finalize_class, prepare_finalize_names
from moebench.footprint import Placement
from moebench.layout import ParallelLayout

#: The largest TP group inside one node: past 8 ranks TP shards an expert's intermediate size below
#: what the GEMMs use well, and engines run TP8 groups even inside a 72-GPU NVLink domain (GB200 NVL72).
TP_MAX_RANKS = 8
ENGINES = ("vllm", "sglang", "trt-llm")


@dataclass(frozen=True)
class Candidate:
    """One way to deploy the model on the GPUs. name: 'TP8', 'TP8+EP8', 'DP8+EP8', 'EP2/TP4',
    'TP16', with 'xN' for N replicas; kind: tp | tp-ep | dp-ep | ep-tp; layout: one replica's
    ParallelLayout (its moe expert-TP in `etp`); prepare_finalize: the transports it runs over;
    replicas: copies of it, each on 1/replicas of the batch."""

    name: str
    kind: str
    layout: ParallelLayout
    prepare_finalize: tuple[str, ...]
    replicas: int = 1
    etp: int = 1

    @property
    def ranks(self) -> int:
        return self.layout.world_size

    @property
    def moves_tokens(self) -> bool:
        return self.kind == "dp-ep"

    @property
    def placement(self) -> Placement:
        """How one rank holds the model (moebench.footprint)."""
        if self.kind == "dp-ep":
            return Placement(attn_tp=1, ep=self.ranks, etp=1, dp_attention=True, ranks=self.ranks)
        if self.kind == "tp":
            return Placement(attn_tp=self.ranks, ep=1, etp=self.ranks, dp_attention=False, ranks=self.ranks)
        return Placement(attn_tp=self.ranks, ep=self.ranks // self.etp, etp=self.etp, dp_attention=False,
                         ranks=self.ranks)

    def transport(self) -> str:
        return self.prepare_finalize[0] if self.kind == "dp-ep" else ""

    def flags(self, gpus_per_node: int = 8, overlap: bool = False) -> dict[str, str]:
        """engine -> the launch flags that deploy one replica of this candidate (engines that
        cannot: absent); past one node each engine's own multi-node form is named."""
        n, out = self.ranks, {}
        nodes = -(-n // gpus_per_node)
        if self.kind == "tp":
            out = {"vllm": f"--tensor-parallel-size {n}", "sglang": f"--tp {n}", "trt-llm": f"--tp_size {n}"}
        elif self.kind == "tp-ep":
            out = {"vllm": f"--tensor-parallel-size {n} --enable-expert-parallel", "sglang": f"--tp {n} --ep {n}",
                   "trt-llm": f"--tp_size {n} --ep_size {n}"}
        elif self.kind == "ep-tp":
            out = {"trt-llm": f"--tp_size {n} --ep_size {n // self.etp}"}
        else:
            declared = get_prepare_finalize_class(self.prepare_finalize[0]).engine_flags
            base = {"vllm": f"--data-parallel-size {n} --enable-expert-parallel",
                    "sglang": f"--tp {n} --dp {n} --enable-dp-attention --ep {n}"}
            ov = {"vllm": " --enable-dbo", "sglang": " --enable-two-batch-overlap"} if overlap else {}
            out = {e: " ".join(x for x in (base[e], declared[e]) if x) + ov.get(e, "")
                   for e in base if e in declared}
        if nodes > 1:
            multi = {"sglang": f" --nnodes {nodes} --node-rank R --dist-init-addr HOST:PORT",
                     "vllm": (f" --data-parallel-size-local {gpus_per_node} (one launch per node)"
                              if self.kind == "dp-ep" else f" (a Ray cluster of {nodes} nodes)"),
                     "trt-llm": f" (mpirun over {nodes} nodes)"}
            out = {e: f + multi[e] for e, f in out.items()}
        return out

    @property
    def deployable(self) -> bool:
        """Some engine runs it (a transport no engine ships is priced, never recommended)."""
        return bool(self.flags())


def _name(base: str, replicas: int) -> str:
    return base if replicas == 1 else f"{base}x{replicas}"


def _tp_group(world: int, gpus_per_node: int) -> int:
    group = min(gpus_per_node, TP_MAX_RANKS, world)
    while world % group:
        group -= 1
    return group


def dispatch_transports() -> list[str]:
    """The prepare/finalize backends that move tokens between ranks (the DP+EP transports)."""
    out = []
    for name in prepare_finalize_names():
        cls = get_prepare_finalize_class(name)
        if cls.communicates and (cls.max_world_size is None or cls.max_world_size > 1):
            out.append(name)
    return out


def tp_transports() -> list[str]:
    """The prepare/finalize backends that keep tokens in place on many ranks (TP's)."""
    return [n for n in prepare_finalize_names() if not get_prepare_finalize_class(n).communicates
            and get_prepare_finalize_class(n).max_world_size is None]


def candidates(world: int, gpus_per_node: int, num_experts: int, intermediate: int) -> list[Candidate]:
    """Every layout engines deploy on `world` GPUs that this shape can be split into (see the
    module docstring); the shape decides which divide (experts per rank, intermediate per rank)."""
    out: list[Candidate] = []
    tp_pf = tuple(tp_transports())
    t = _tp_group(world, gpus_per_node)
    n = world // t
    if intermediate % t == 0:
        out.append(Candidate(_name(f"TP{t}", n), "tp", ParallelLayout(tp=t), tp_pf, n, etp=t))
    if t <= num_experts and t > 1:
        out.append(Candidate(_name(f"TP{t}+EP{t}", n), "tp-ep", ParallelLayout(tp=t, enable_ep=True), tp_pf, n))
    for etp in (2, 4):  # EP x TP inside the experts (TensorRT-LLM), within the TP group
        a = t // etp
        if a >= 2 and t % etp == 0 and intermediate % etp == 0 and a <= num_experts:
            out.append(Candidate(_name(f"EP{a}/TP{etp}", n), "ep-tp", ParallelLayout(tp=t, enable_ep=True, expert_tp=etp), tp_pf,
                                 n, etp=etp))
    g = world
    if num_experts < world:  # fewer experts than ranks: the largest EP group that gets every rank one
        g = max(d for d in range(1, num_experts + 1) if world % d == 0)
    if g > 1:
        for pf in dispatch_transports():
            out.append(Candidate(_name(f"DP{g}+EP{g}", world // g), "dp-ep", ParallelLayout(dp=g, enable_ep=True),
                                 (pf,), world // g))
    t2 = 2 * gpus_per_node
    if world > gpus_per_node and world % t2 == 0 and intermediate % t2 == 0 and gpus_per_node <= TP_MAX_RANKS:
        out.append(Candidate(_name(f"TP{t2}", world // t2), "tp", ParallelLayout(tp=t2), tp_pf, world // t2, etp=t2))
    return out
