"""`moebench demo`: the default job of `bash setup.sh` - what this machine can say about a model.

With a GPU: the measured sweep of the model's layer (every pair that runs, checked and timed).
Without one: the answer a GPU user would get, modeled - compare tp-vs-ep on the default target GPU
(the experts at that GPU's floor, the communication from the published fits), with the correctness
check of the kernels this machine runs. Either way it ends with the next commands to try."""

from __future__ import annotations

import click
import torch

from moebench.cli.options import console


@click.command()
@click.option("--model", default="qwen3-30b-a3b", show_default=True, help="A preset (moebench models).")
@click.option("--world-size", type=int, default=8, show_default=True, help="GPUs of the modeled comparison (no GPU here).")
@click.option("--tokens", default=None, help="Token counts [the command's own defaults].")
@click.option("--out", default="results", show_default=True, help="Results folder.")
@click.pass_context
def demo(ctx, model, world_size, tokens, out):
    """The default job: a measured sweep on a GPU, the modeled TP-vs-EP answer without one."""
    from moebench.cli.compare import tp_vs_ep
    from moebench.cli.run import sweep
    from moebench.report import say

    if torch.cuda.is_available():
        say(console, f"a GPU is here: the measured sweep of {model}'s layer", "bold")
        ctx.invoke(sweep, model=model, tokens=tokens, out=out)
        nxt = [f"moebench compare tp-vs-ep --model {model} --world-size 8   TP or EP on 8 of these GPUs",
               f"moebench tune --model {model}   tile configs for this GPU"]
    else:
        say(console, f"no GPU here: {model} on {world_size} H200s, modeled (experts at the GPU's floor, "
                     f"communication from published measurements); the kernels that run here are checked", "bold")
        ctx.invoke(tp_vs_ep, model=model, world_size=world_size, tokens=tokens, out=out)
        nxt = [f"moebench compare tp-vs-ep --model deepseek-v3 --world-size 32   the same question across 4 nodes",
               "moebench comm --transport deepep-ll --op dispatch --world-size 32 --tokens 128 --hidden 7168 "
               "--topk 8 --num-experts 256 --dtype fp8   one transport's cost",
               "bash setup.sh   on a GPU machine: the measured sweep"]
    say(console, "next:", "bold")
    for line in nxt:
        say(console, f"  {line}")
