"""`moebench comm`: what one collective or dispatch/combine costs on a cluster, from the model."""

from __future__ import annotations

import json
import textwrap

import click

from moebench.cli.options import console
from moebench.errors import MoebenchError

TRANSPORTS = ("nccl-all-reduce", "custom-all-reduce", "nccl-all-gather", "nccl-reduce-scatter", "nccl-all-to-all",
              "deepep-ll", "deepep-ht", "deepep-v2", "pplx", "mori")
OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "dispatch", "combine")
#: the width `comm`'s lines keep to
WIDTH = 100

GPUS = ("H100", "H200", "H800", "H20", "A100", "B200", "GB200", "B300", "GB300", "MI300X", "MI325X", "MI355X")


@click.command("comm")
@click.option("--transport", required=True, type=click.Choice(TRANSPORTS), help="The transport priced.")
@click.option("--op", "op", required=True, type=click.Choice(OPS), help="The operation.")
@click.option("--target-gpu", "--gpu", "gpu", default="H200", show_default=True,
              type=click.Choice(GPUS, case_sensitive=False),
              help="The GPUs priced (their NVLink, or AMD's xGMI); --gpu is the same.")
@click.option("--world-size", type=int, required=True, help="Ranks taking part.")
@click.option("--gpus-per-node", "gpus_per_node", type=int, default=None,
              help="GPUs per NVLink domain [8; 72 for GB200]: past it traffic goes over RDMA.")
@click.option("--rdma", "rdma_name", default="rdma-400g", show_default=True,
              help="RDMA link between nodes, per GPU: rdma-400g (InfiniBand, 50 GB/s) | roce-400g | efa-400g (AWS EFA, "
                          "2 x 200 Gb/s) | rdma-800g (100 GB/s, no published point).")
@click.option("--bytes", "size", type=float, default=None,
              help="Bytes per rank as nccl-tests counts them (all-reduce: the buffer; all-gather: the gathered "
                   "buffer; reduce-scatter: the input; all-to-all: the send buffer; dispatch / combine: the rows "
                   "a rank sends, local ones included).")
@click.option("--tokens", type=int, default=None, help="Tokens per rank (instead of --bytes), routed uniformly.")
@click.option("--hidden", type=int, default=None, help="Hidden size of a token row (with --tokens).")
@click.option("--topk", type=int, default=None, help="Experts per token (dispatch / combine with --tokens).")
@click.option("--num-experts", "experts", type=int, default=None, help="Experts (dispatch / combine with --tokens).")
@click.option("--dtype", default="bf16", show_default=True, type=click.Choice(("bf16", "fp8")),
              help="Row payload with --tokens (fp8: one fp32 scale per 128 values; a combine carries bf16).")
@click.option("--max-nodes", "max_nodes", type=int, default=None,
              help="Node-limited routing with --tokens: each token reaches at most this many nodes "
                   "(DeepSeek-V3's router: 4).")
@click.option("--num-sms", "num_sms", type=int, default=None,
              help="SMs DeepEP's normal kernels run on [DeepEP's default, Buffer.num_sms = 20].")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def comm(transport, op, gpu, world_size, gpus_per_node, rdma_name, size, tokens, hidden, topk, experts, dtype,
         max_nodes, num_sms, as_json):
    """What one collective or dispatch/combine costs: modeled from published points (docs/comm-model.md)."""
    from moebench.backends import declared_communication
    from moebench.comm.links import default_link, nvlink_domain
    from moebench.comm.model import CommModel, ask

    if (size is None) == (tokens is None):
        raise MoebenchError("give exactly one of --bytes N or --tokens M")
    if max_nodes is not None and tokens is None:
        raise MoebenchError("--max-nodes limits how tokens are routed: give it with --tokens")
    gpu = gpu.upper()
    gpn = gpus_per_node if gpus_per_node is not None else nvlink_domain(gpu)
    model = CommModel.from_link(default_link(gpu), declared_communication(), rdma=rdma_name, gpus_per_node=gpn,
                                use_measurement=False, num_sms=num_sms)
    res = ask(model, transport, op, world_size, size, tokens=tokens, hidden=hidden, topk=topk, experts=experts,
              dtype=dtype, gpu=gpu, max_nodes=max_nodes)
    if as_json:
        click.echo(json.dumps(res, default=float))
        return
    for line in report_lines(res, model, rdma_name):
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def report_lines(res: dict, model, rdma_name: str, width: int = WIDTH) -> list[str]:
    """The printed answer, each line at most `width` characters (long ones wrap, indented)."""
    world, gpn, gpu = res["world_size"], res["gpus_per_node"], res["gpu"]
    where = f"{world} x {gpu} ({model.nvlink} {model.nvlink_gbps:g} GB/s"
    where += f", {rdma_name} between domains of {gpn})" if world > gpn else f", one NVLink domain of {gpn})"
    tag = "modeled, extrapolated" if res["extrapolated"] else "modeled"
    out = [f"{res['transport']} {res['op']}: {res['time_us']:.1f} us ({tag}) over {where}",
           f"bytes per rank: NVLink {res['nvlink_bytes'] / 1e6:.3f} MB, RDMA {res['rdma_bytes'] / 1e6:.3f} MB "
           f"({res['bytes_how']})",
           f"fit: {res['fit']}"]
    out += [f"  {k}: {v}" for k, v in res["provenance"].items()]
    if res["nearest"]:
        out.append("nearest published points (published / modeled):")
        for p in res["nearest"]:
            out.append(f"  {p['point']}: {p['published_us']:.1f} us published, {p['modeled_us']:.1f} modeled, "
                       f"x{p['ratio']:.2f} ({p['file']} line {p['line']}: {short_source(p['source'])})")
    n = len(res["points"])
    if n:
        out.append(f"{n} published point{'s' if n > 1 else ''} behind it: --json lists them with their sources")
    out += [f"extrapolated: {e}" for e in res["extrapolated"]]
    lines = []
    for text in out:
        lines += textwrap.wrap(text, width, subsequent_indent="    ", break_long_words=False,
                               break_on_hyphens=False) or [""]
    return lines


def short_source(source: str) -> str:
    """A source's repository and path (or first words): what a line has room for."""
    return source.split(" (", 1)[0].split(", ", 1)[0]
