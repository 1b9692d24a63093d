"""What a tune writes and what a sweep's rows hold, against a golden record made before the tuner
ran through the sweep's loop and the tuned files moved into one store (tests/golden/outputs.json).

A tune's config files must come out byte for byte the same, and a sweep's rows the same but for
their timing columns. The tunes use a timer whose answers follow from the order of its calls, so
the same search in the same order writes the same files.

Regenerate the record (only when the output is meant to change) from a checkout of the code
whose output it records: `PYTHONPATH=<checkout> python tests/test_same_outputs.py OUT.json`.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
from pathlib import Path

import torch

GOLDEN = Path(__file__).parent / "golden" / "outputs.json"

TILE_SPACE = {"BLOCK_SIZE_M": [16, 32], "BLOCK_SIZE_N": [32, 64], "BLOCK_SIZE_K": [32, 64], "GROUP_SIZE_M": [1, 16],
              "num_warps": [4], "num_stages": [2]}
SMALL_SPACE = {"BLOCK_SIZE_M": [16], "BLOCK_SIZE_N": [32, 64], "BLOCK_SIZE_K": [64], "GROUP_SIZE_M": [1],
               "num_warps": [4], "num_stages": [2]}
#: Columns that hold times (or follow from them): left out of the comparison.
TIMING = {"latency_us", "p10_us", "p90_us", "tflops", "gbps", "roofline_frac", "floor_us", "timing_method",
          "ceilings_source", "dispatch_us", "experts_us", "combine_us", "allreduce_us", "x_dispatch_gbps",
          "x_combine_gbps", "x_allreduce_gbps"}
#: Columns that hold a float32 error against the float64 reference: its last digits follow the CPU's
#: vector code paths (they differ between machines of one kind), so they are compared to 1e-6.
ERRORS = {"max_rel_err", "err_vs_unquantized"}
SIZES = ["--num-experts", "4", "--topk", "2", "--hidden", "64", "--intermediate", "32", "--dtype", "fp32",
         "--reps", "1"]
SWEEPS = {
    "local": ["--tokens", "1,5", "--experts", "torch,triton,batched-torch", "--prepare-finalize", "no-dpep,batched-local"],
    "simulated-ep2": ["--tokens", "3", "--ep", "2", "--simulate", "--experts", "torch,triton",
                      "--prepare-finalize", "all2all-ll,allgather-rs,no-dpep"],
}


class StepTimer:
    """Calls the candidate once; its latency follows from how many calls came before."""

    def __init__(self):
        self.n = 0

    def __call__(self, fn, reps):
        from moebench.bench.timing import Timing

        fn()
        self.n += 1
        us = 100.0 + (self.n * 37) % 23
        return Timing(us, us - 1, us + 1, reps, "cpu-wallclock")


def _tunes():
    from moebench.layout import ParallelLayout
    from moebench.quant import QuantScheme

    return {
        "halving": dict(layout=ParallelLayout(), tokens=[1, 4], strategy="halving", budget=4),
        "grid-tp2": dict(layout=ParallelLayout.from_args(2, None, None), tokens=[2], strategy="grid", space=SMALL_SPACE),
        "random-ep2": dict(layout=ParallelLayout.from_args(None, None, 2), tokens=[3], strategy="random", budget=4),
        "vllm": dict(layout=ParallelLayout(), tokens=[1], strategy="halving", budget=4, kernel="vllm",
                     dtype=torch.bfloat16),
        "down": dict(layout=ParallelLayout(), tokens=[1, 4], strategy="grid", down=True, space=SMALL_SPACE),
        "fp8-tensor": dict(layout=ParallelLayout(), tokens=[2], strategy="random", budget=3,
                           quant=QuantScheme("fp8_w8a8", "tensor"), dtype=torch.bfloat16),
    }


def generate(work: Path) -> dict:
    """Run the tunes and sweeps with the working directory `work` (and MOEBENCH_CONFIG_DIR an
    empty folder, set by the caller): {"tunes": {name: {file: text}}, "sweeps": {name: [row]}}."""
    from test_cli import moebench_inproc

    from moebench.models import custom_shape
    from moebench.tuning import tuner as T

    shape = custom_shape(4, 2, 64, 32, name="tiny")
    out = {"tunes": {}, "sweeps": {}}
    takes_spec = "spec" in inspect.signature(T.tune).parameters
    for name, kw in _tunes().items():
        kw = dict(kw)
        dtype, space = kw.pop("dtype", torch.float32), kw.pop("space", TILE_SPACE)
        folder = work / "cfg" / name
        where = dict(out_dir=folder, results_dir=work / "res" / name, timer=StepTimer())
        if takes_spec:
            spec = T.TuneSpec(shape=shape, layout=kw.pop("layout"), tokens=kw.pop("tokens"), dtype=dtype, device="cpu",
                              space=space, **kw)
            T.tune(spec, **where)
        else:  # the tuner before it took a TuneSpec
            T.tune(shape, kw.pop("layout"), kw.pop("tokens"), dtype, "cpu", space=space, **kw, **where)
        out["tunes"][name] = {str(p.relative_to(folder)): p.read_text() for p in sorted(folder.rglob("*.json"))}
    for name, args in SWEEPS.items():
        folder = work / "sweep" / name
        res = moebench_inproc("sweep", *SIZES, "--out", str(folder), *args)
        assert res.returncode == 0, res.stdout + res.stderr
        lines = next(folder.rglob("rows.jsonl")).read_text().splitlines()
        out["sweeps"][name] = [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in lines if line]
    return out


def test_tune_files_and_sweep_rows_are_as_recorded(tmp_path, monkeypatch):
    (tmp_path / "no-configs").mkdir()
    monkeypatch.setenv("MOEBENCH_CONFIG_DIR", str(tmp_path / "no-configs"))
    monkeypatch.chdir(tmp_path)
    got = generate(tmp_path)
    want = json.loads(GOLDEN.read_text())
    assert got["tunes"].keys() == want["tunes"].keys()
    for name in want["tunes"]:
        assert got["tunes"][name] == want["tunes"][name], name
    for name in want["sweeps"]:
        rows, golden = got["sweeps"][name], want["sweeps"][name]
        assert [{k: v for k, v in r.items() if k not in ERRORS} for r in rows] == \
            [{k: v for k, v in r.items() if k not in ERRORS} for r in golden], name
        for r, g in zip(rows, golden):
            for k in ERRORS:
                assert (r.get(k) is None) == (g.get(k) is None), (name, k)
                if g.get(k) is not None:
                    assert abs(r[k] - g[k]) <= 1e-6, (name, k, r[k], g[k])


if __name__ == "__main__":
    import tempfile

    sys.path.insert(0, str(Path(__file__).parent))
    os.environ.setdefault("TRITON_INTERPRET", "1")
    here = Path(tempfile.mkdtemp(prefix="moebench-outputs-"))
    (here / "no-configs").mkdir()
    os.environ["MOEBENCH_CONFIG_DIR"] = str(here / "no-configs")
    target = Path(sys.argv[1]).resolve()
    os.chdir(here)
    target.write_text(json.dumps(generate(here), indent=1, sort_keys=True) + "\n")
    print(f"wrote {target}")
