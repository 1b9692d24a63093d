"""Bind and compile moebench's Triton layers for Hopper (sm_90) as the launchers call them, without a GPU.

`compile_sm90.py` builds each kernel from a signature written by hand; this script instead runs
the layers (`triton` and `batched-triton` experts) on CPU tensors with Triton's JIT pointed at an
sm_90 target: every launch goes through the JIT's own binder with the launchers' real arguments
(argument groups, constexpr fields, specialisations) and is compiled to a cubin, but never launched
(no GPU). A launcher change that Triton's binder would refuse on the device fails here. The layers'
outputs are not computed, so nothing is checked but binding and building; the TMA paths need CUDA
tensors and are not reached.

    python scripts/bind_sm90.py            # not under TRITON_INTERPRET=1

Prints the kernels each case compiled; exit status 1 when a case fails.
"""

from __future__ import annotations

import os
import sys

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("run without TRITON_INTERPRET=1: the interpreter replaces the kernels being compiled")

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver, jit  # noqa: E402


class Sm90Target:
    """The driver the JIT asks for its device, stream and target: an sm_90 device that is never launched on."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_device_interface(self):
        return torch.cuda


def compile_only(compiled: list[str]):
    """JITFunction.run as a compile: bind, build, record the kernel's name, never launch."""
    run = jit.JITFunction.run

    def warmup(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append(self.fn.__name__)
        return kernel

    return warmup


def cases():
    """(label, call) per layer case: bf16 decode / mid / prefill, fp8 block and per-tensor, two
    weight-only schemes, the batched experts."""
    import moebench
    from moebench.quant import parse_quant, quantize_weights

    torch.manual_seed(0)
    e, k, h, i = 8, 2, 256, 128
    w13 = torch.randn(e, 2 * i, h, dtype=torch.bfloat16)
    w2 = torch.randn(e, h, i, dtype=torch.bfloat16)

    def inputs(m):
        w, ids = torch.softmax(torch.randn(m, e), -1).topk(k, -1)
        return torch.randn(m, h, dtype=torch.bfloat16), w, ids.to(torch.int32)

    def layer(experts, pf, m, a, b):
        x, w, ids = inputs(m)
        return lambda: moebench.make_kernel(experts, pf).apply(x, a, b, w, ids, None, e)

    out = [(f"bf16 M={m}", layer("triton", "no-dpep", m, w13, w2)) for m in (1, 16, 1024)]
    for dtype, block in (("fp8_w8a8", "128,128"), ("fp8_w8a8", None), ("int4_w4a16", None), ("mxfp4", None)):
        q13, q2 = quantize_weights(w13, w2, parse_quant(dtype, block), torch.bfloat16)
        for m in (4, 1024):
            out.append((f"{dtype}{' block ' + block if block else ''} M={m}", layer("triton", "no-dpep", m, q13, q2)))
    out.append(("batched M=16", layer("batched-triton", "batched-local", 16, w13, w2)))
    return out


def main() -> int:
    driver.set_active(Sm90Target())
    compiled: list[str] = []
    jit.JITFunction.run = compile_only(compiled)
    from moebench.kernels.triton import env, options

    # the launch rules see an H100 / H200's SM count (on CPU tensors they would see 1)
    env.num_sms = options.num_sms = lambda *a, **kw: 132
    failed = 0
    for label, call in cases():
        try:
            call()
            print(f"{label}: {', '.join(compiled)}")
        except Exception as ex:  # noqa: BLE001 - report each case, then the status
            failed += 1
            print(f"{label}: FAILED after {compiled}: {type(ex).__name__}: {str(ex)[:300]}")
        compiled.clear()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
