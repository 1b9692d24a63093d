"""Layer work/bytes, roofline, DeepEP byte counting, ceilings (cache, datasheet, CPU)."""

import json

import pytest
import torch

from moebench.bench import hardware
from moebench.bench.hardware import Ceilings, calibrate_cpu, datasheet_ceilings, get_ceilings, save_ceilings
from moebench.bench.metrics import experts_hit, layer_bytes, layer_flops, metrics, roofline
from moebench.comm.traffic import deepep_rows, dtype_row_bytes
from moebench.errors import MoebenchError

CEIL = Ceilings(device_name="Test GPU", mem_read_gbps=1000.0, mem_copy_gbps=800.0,
                matmul_tflops={"bf16": 100.0, "fp32": 10.0}, source="measured 2026-01-01")


def test_layer_flops_and_bytes_by_hand():
    assert layer_flops(3, 2, 4, 5) == 2 * 3 * 2 * 3 * 4 * 5 == 720
    ids = torch.tensor([[0, 2], [2, 5], [0, 5]])
    assert experts_hit(ids, 8) == 3
    assert experts_hit(torch.tensor([[-1, 1], [1, -1]]), 4) == 1
    # 3 experts hit * 3*H*I elements + 2 * tokens * H, times 2 bytes
    assert layer_bytes(ids, 8, 4, 5, 2) == (3 * 3 * 4 * 5 + 2 * 3 * 4) * 2 == 408
    assert layer_bytes(ids, 8, 4, 5, 2, tokens=10) == (180 + 2 * 10 * 4) * 2
    assert layer_bytes(torch.empty(0, 2, dtype=torch.int32), 8, 4, 5, 2) == 0


def test_roofline_and_metrics_by_hand():
    # memory-bound: 1e9 bytes at 1000 GB/s = 1000 us; 1e12 flops at 100 TFLOP/s = 10000 us -> compute-bound
    assert roofline(0, 1e9, CEIL) == pytest.approx(1000.0)
    assert roofline(1e12, 1e9, CEIL) == pytest.approx(10000.0)
    assert roofline(1e12, 0, CEIL, dtype="fp32") == pytest.approx(100000.0)
    assert roofline(1e12, 0, CEIL, dtype=torch.float16) == pytest.approx(10000.0)  # fp16 missing -> highest known
    m = metrics(2000.0, 1e12, 1e9, CEIL)
    assert m["tflops"] == pytest.approx(500.0)  # 1e12 / 2e-3 s = 5e14
    assert m["gbps"] == pytest.approx(500.0)
    assert m["roofline_frac"] == pytest.approx(10000.0 / 2000.0) and m["floor_us"] == pytest.approx(10000.0)
    assert m["roofline_ref"] == "measured 2026-01-01"
    m = metrics(2000.0, 0, 1e9, CEIL)
    assert m["roofline_frac"] == pytest.approx(0.5)
    none = metrics(2000.0, 1e12, 1e9, None)
    assert none["roofline_frac"] is None and none["floor_us"] is None and none["tflops"] == pytest.approx(500.0)
    assert metrics(0.0, 1, 1, CEIL)["tflops"] is None
    with pytest.raises(MoebenchError, match="calibrate"):
        roofline(1, 1, Ceilings("x", None, None, {}, "datasheet"))


def test_deepep_bytes_match_published_figures():
    # 128 tokens, hidden 7168, top-8: DeepEP LL dispatch (FP8) 77 us ~ 98 GB/s, combine 114 us ~ 127 GB/s.
    ids = torch.stack([torch.randperm(256)[:8] for _ in range(128)])
    assert dtype_row_bytes("fp8", 7168) == 7168 + 56 * 4
    d = deepep_rows(ids) * dtype_row_bytes("fp8", 7168)
    c = deepep_rows(ids) * dtype_row_bytes("bf16", 7168)
    assert d == 128 * 8 * 7392
    assert c == 128 * 8 * 7168 * 2
    assert d / 77e-6 / 1e9 == pytest.approx(98, rel=0.02)
    assert c / 114e-6 / 1e9 == pytest.approx(127, rel=0.02)


def test_per_rank_messages():
    ids = torch.tensor([[0, 1, 4], [2, 6, 7], [-1, 5, 0]])
    owner = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])  # 2 ranks
    assert deepep_rows(ids) == 8
    assert deepep_rows(ids, expert_owner=owner) == 8
    # token 0 -> ranks {0, 1}; token 1 -> {0, 1}; token 2 -> {1, 0} (the -1 is skipped)
    assert deepep_rows(ids, per="rank", expert_owner=owner) == 6
    with pytest.raises(MoebenchError, match="expert_owner"):
        deepep_rows(ids, per="rank")
    with pytest.raises(MoebenchError, match="per must be"):
        deepep_rows(ids, per="token")


# -- ceilings ----------------------------------------------------------------------------------


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEBENCH_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_ceilings_cache_round_trip(cache_dir):
    path = save_ceilings(CEIL)
    assert path == str(cache_dir / "ceilings.json")
    data = json.loads((cache_dir / "ceilings.json").read_text())
    assert any(k.startswith("Test GPU | torch ") for k in data)
    back = hardware.cached_ceilings("Test GPU")
    assert back == CEIL
    assert hardware.cached_ceilings("Other GPU") is None
    # A second device does not overwrite the first.
    save_ceilings(Ceilings("Other GPU", 1.0, 1.0, {"bf16": 1.0}, "measured 2026-01-02"))
    assert hardware.cached_ceilings("Test GPU") == CEIL


def test_corrupt_cache_is_ignored(cache_dir):
    (cache_dir / "ceilings.json").write_text("{broken")
    with pytest.warns(UserWarning, match="unreadable"):
        assert hardware.cached_ceilings("Test GPU") is None
    with pytest.warns(UserWarning):
        save_ceilings(CEIL)
    assert hardware.cached_ceilings("Test GPU") == CEIL


@pytest.mark.parametrize("name,gbps", [("NVIDIA H200", 4800.0), ("NVIDIA H100 80GB HBM3", 3350.0),
                                       ("NVIDIA A100-SXM4-80GB", 2039.0), ("NVIDIA B200", 8000.0),
                                       ("AMD Instinct MI300X", 5300.0), ("NVIDIA L40S", 864.0),
                                       ("NVIDIA H20", 4000.0)])
def test_datasheet_fallback_is_labelled(name, gbps):
    c = datasheet_ceilings(name)
    assert c is not None and c.source == "datasheet" and c.mem_read_gbps == gbps and c.label == "datasheet"
    assert c.tflops("bf16") > c.tflops("fp32") > 0


def test_unknown_gpu_has_no_datasheet():
    assert datasheet_ceilings("Some Future Accelerator") is None


def test_get_ceilings_prefers_cache_then_datasheet(cache_dir, monkeypatch):
    dev = torch.device("cuda", 0)
    monkeypatch.setattr(hardware, "_resolve", lambda d: dev)
    monkeypatch.setattr(hardware, "_device_name", lambda d: "NVIDIA H200")
    assert get_ceilings("cuda").source == "datasheet"
    save_ceilings(Ceilings("NVIDIA H200", 4700.0, 4270.0, {"bf16": 702.0}, "measured 2026-11-29"))
    assert get_ceilings("cuda").source == "measured 2026-11-29"
    monkeypatch.setattr(hardware, "_device_name", lambda d: "Mystery GPU")
    assert get_ceilings("cuda") is None


def test_cpu_ceilings_are_measured_quickly_and_marked(cache_dir):
    from helpers import WorkCounter

    with WorkCounter() as work:  # quick = a bounded amount of work: 6 copies, sums and 512^3 matmuls, 128 MiB at most
        c = calibrate_cpu()
    assert all(1 <= work.count(op) <= 6 for op in ("copy_", "sum", "mm")), work.calls  # a warm-up and 5 at most
    assert work.largest_bytes <= 128 * 2**20
    assert c.device_type == "cpu" and not c.is_gpu and c.source.startswith("cpu measured")
    assert "not GPU" in c.label
    assert c.mem_read_gbps > 0 and c.mem_copy_gbps > 0 and c.tflops("bf16") == c.matmul_tflops["fp32"] > 0
    got = get_ceilings("cpu")  # measures and caches
    assert got.device_type == "cpu"
    assert get_ceilings("cpu") == got  # second call reads the cache
    m = metrics(1000.0, 1e9, 1e8, got)
    assert m["roofline_frac"] > 0 and "not GPU" in m["roofline_ref"]


def test_cuda_without_gpu_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(MoebenchError, match="no CUDA GPU"):
        get_ceilings("cuda")
    with pytest.raises(MoebenchError, match="no CUDA GPU"):
        hardware.device_summary("cuda")


def test_device_summary_cpu():
    s = hardware.device_summary("cpu")
    assert s["device"] == "cpu" and s["torch"] == torch.__version__ and "name" in s


def test_read_kernel_sums_its_chunks():
    """The calibration read kernel (Triton; interpreter on CPU) reduces each chunk exactly once."""
    x = torch.rand(4096 * 2 * 3)
    partial = torch.empty(3)
    hardware.read_reduce(x, partial, block_size=4096, iters=2, num_warps=4)
    torch.testing.assert_close(partial, x.view(3, -1).sum(dim=1))
    with pytest.raises(ValueError):
        hardware.read_reduce(x[:-1], partial, 4096, 2, 4)


def test_tf32_off_restores_setting():
    before = torch.backends.cuda.matmul.fp32_precision
    with hardware._tf32_off():
        assert torch.backends.cuda.matmul.fp32_precision == "ieee"
    assert torch.backends.cuda.matmul.fp32_precision == before


def test_read_walk_kernel_sums_its_rows():
    """The 2-D tile-walk read kernel (interpreter on CPU) reduces each program's rows exactly once."""
    x = torch.rand(64 * 4 * 3)
    partial = torch.empty(3)
    hardware.read_walk(x, partial, cols=64, block_r=4, block_c=16, num_warps=4, num_stages=2)
    torch.testing.assert_close(partial, x.view(3, -1).sum(dim=1))
    with pytest.raises(ValueError):
        hardware.read_walk(x, partial, cols=64, block_r=4, block_c=24, num_warps=4, num_stages=2)


def test_triton_read_candidates_check_and_name_every_variant(monkeypatch):
    """Every stream and walk variant runs, is checked to sum all elements, and gets a GB/s."""
    monkeypatch.setattr(hardware, "READ_STREAM_CONFIGS", ((1024, 2, 4),))
    monkeypatch.setattr(hardware, "READ_WALK_COLS", 64)
    monkeypatch.setattr(hardware, "READ_WALK_CONFIGS", ((8, 32, 4, 2), (16, 64, 4, 3)))
    runs = hardware._triton_read_gbps(torch.ones(1024 * 2 * 3 + 5), time_us=lambda fn: 1.0)
    assert sorted(runs) == ["triton stream BLOCK_SIZE=1024 ITERS=2 warps=4",
                            "triton walk BLOCK_R=16 BLOCK_C=64 warps=4 stages=3",
                            "triton walk BLOCK_R=8 BLOCK_C=32 warps=4 stages=2"]
    assert runs["triton stream BLOCK_SIZE=1024 ITERS=2 warps=4"] == pytest.approx(1024 * 2 * 3 * 4 / 1e-6 / 1e9)


def test_triton_read_variant_that_fails_is_named_and_the_others_stand(monkeypatch):
    """A variant that cannot launch (here 3 warps, which a GPU compile rejects) is reported in
    failures; the remaining variants are still measured (one bad config once hid them all)."""
    monkeypatch.setattr(hardware, "READ_STREAM_CONFIGS", ((1024, 2, 4),))
    monkeypatch.setattr(hardware, "READ_WALK_COLS", 64)
    monkeypatch.setattr(hardware, "READ_WALK_CONFIGS", ((8, 32, 3, 2), (16, 64, 4, 3)))
    failures: list[str] = []
    runs = hardware._triton_read_gbps(torch.ones(1024 * 2 * 3), time_us=lambda fn: 1.0, failures=failures)
    assert sorted(runs) == ["triton stream BLOCK_SIZE=1024 ITERS=2 warps=4",
                            "triton walk BLOCK_R=16 BLOCK_C=64 warps=4 stages=3"]
    assert len(failures) == 1 and "BLOCK_R=8 BLOCK_C=32 warps=3" in failures[0] and "power of two" in failures[0]


def test_shipped_read_variants_are_launchable():
    for _, _, warps in hardware.READ_STREAM_CONFIGS:
        assert warps & (warps - 1) == 0
    for _, _, warps, stages in hardware.READ_WALK_CONFIGS:
        assert warps & (warps - 1) == 0 and stages >= 1
