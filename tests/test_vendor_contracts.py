"""scripts/vendor_contracts.py: the DeepEP / DeepGEMM adapters' calls bound to a build's Python layer
(read from the wheel as files: neither library imports without a CUDA driver)."""

from __future__ import annotations

import importlib.util
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("vendor_contracts", ROOT / "scripts" / "vendor_contracts.py")
vc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(vc)

BUFFER = '''
class Buffer:
    def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False, num_qps_per_rank=24):
        pass
    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts):
        pass
    def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None):
        pass
    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None):
        pass
    def combine(self, x, handle, topk_weights=None):
        pass
    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, {fp8}
                             async_finish=False, return_recv_hook=False):
        pass
    def low_latency_combine(self, x, topk_idx, topk_weights, handle, async_finish=False, return_recv_hook=False):
        pass
'''
INIT = '''
from ._C import m_grouped_fp8_gemm_nt_contiguous, m_grouped_fp8_gemm_nt_masked, m_grouped_bf16_gemm_nt_masked
from ._C import {contiguous}
from .utils import *
'''
UTILS = "from .layout import *\n"
LAYOUT = "from .._C import get_mk_alignment_for_contiguous_layout\n"
STUB = '''
def m_grouped_bf16_gemm_nt_contiguous(a, b, d, grouped_layout, compiled_dims="nk", use_psum_layout=False,
                                      expected_m_for_psum_layout=None) -> None: ...
def m_grouped_bf16_gemm_nt_masked(a, b, d, masked_m, expected_m, compiled_dims="nk") -> None: ...
'''


def _wheel(tmp_path: Path, name: str, files: dict[str, str]) -> Path:
    path = tmp_path / name
    with zipfile.ZipFile(path, "w") as z:
        for member, text in files.items():
            z.writestr(member, text)
    return path


def _builds(tmp_path, fp8="use_fp8=True,", contiguous="m_grouped_bf16_gemm_nt_contiguous"):
    ep = _wheel(tmp_path, "deep_ep.whl", {"deep_ep/buffer.py": BUFFER.replace("{fp8}", fp8)})
    dg = _wheel(tmp_path, "deep_gemm.whl", {"deep_gemm/__init__.py": INIT.replace("{contiguous}", contiguous),
                                            "deep_gemm/utils/__init__.py": UTILS, "deep_gemm/utils/layout.py": LAYOUT,
                                            "deep_gemm/_C.pyi": STUB})
    return str(ep), str(dg)


def test_adapters_bind_to_a_matching_build(tmp_path, capsys):
    assert vc.main(list(_builds(tmp_path))) == 0
    out = capsys.readouterr().out
    assert "MISMATCH" not in out and "buf.low_latency_dispatch" in out and "buf.combine" in out
    assert "dg.get_mk_alignment_for_contiguous_layout" in out  # found through the star imports
    assert "dg.m_grouped_bf16_gemm_nt_masked" in out and "name only" in out  # fp8 ones: no stub signature


def test_a_changed_signature_and_a_missing_function_are_mismatches(tmp_path, capsys):
    assert vc.main(list(_builds(tmp_path, fp8="", contiguous="m_grouped_bf16_gemm_nt_contiguous_v2"))) == 1
    out = capsys.readouterr().out
    bad = [ln for ln in out.splitlines() if ln.startswith("MISMATCH")]
    assert any("low_latency_dispatch" in ln and "use_fp8" in ln for ln in bad), out
    assert any("exports no m_grouped_bf16_gemm_nt_contiguous" in ln for ln in bad), out


def test_refusals(tmp_path, capsys):
    assert vc.main([str(tmp_path / "none.whl")]) == 2
    assert vc.main([str(_wheel(tmp_path, "x.whl", {"other/__init__.py": ""}))]) == 2
    assert "no deep_ep/buffer.py" in capsys.readouterr().err


WHEELS = sorted((ROOT / ".whl-vendor").glob("tokenspeed_deep*.whl"))


@pytest.mark.skipif(not WHEELS, reason="no DeepEP / DeepGEMM wheel in .whl-vendor (moebench vendor download deepep|deepgemm)")
def test_adapters_bind_to_the_downloaded_builds(capsys):
    assert vc.main([str(w) for w in WHEELS]) == 0, capsys.readouterr().out
