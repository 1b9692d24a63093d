"""Tuned-config files (vLLM naming and content), lookup order, nearest key, default heuristic."""

from __future__ import annotations

import json

import pytest
import torch

from moebench.errors import MoebenchError
from moebench.kernels.triton import configs as C
from moebench.kernels import tuned_files as TF

GOOD = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1, "num_warps": 4, "num_stages": 4}
BIG = {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 8, "num_warps": 8, "num_stages": 3}


def test_file_name_like_vllm():
    assert TF.config_file_name(8, 14336, "NVIDIA H200") == "E=8,N=14336,device_name=NVIDIA_H200.json"
    assert TF.config_file_name(128, 768, "NVIDIA_H200", torch.bfloat16) == "E=128,N=768,device_name=NVIDIA_H200.json"
    assert (
        TF.config_file_name(256, 256, "NVIDIA_H200", "fp8_w8a8", [128, 128])
        == "E=256,N=256,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128,128].json"
    )
    assert TF.device_name("cpu") == "cpu"


def test_write_then_load_roundtrip(tmp_path):
    p = TF.write_config_file(tmp_path / "sub" / "x.json", {1: GOOD, "64": BIG}, triton_version="3.6.0")
    raw = json.loads(p.read_text())
    assert raw["triton_version"] == "3.6.0" and list(raw) == ["triton_version", "1", "64"]
    assert TF.load_config_file(p) == {1: GOOD, 64: BIG}
    assert not list((tmp_path / "sub").glob("*.tmp"))  # atomic: no temporary left behind


@pytest.mark.parametrize(
    "content,needle",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        (json.dumps({"abc": GOOD}), "not a token count"),
        (json.dumps({"1": {k: v for k, v in GOOD.items() if k != "num_warps"}}), "missing num_warps"),
        (json.dumps({"1": dict(GOOD, BLOCK_SIZE_N=48)}), "power of two"),
        (json.dumps({"1": dict(GOOD, num_stages=0)}), "positive integer"),
        (json.dumps({"1": dict(GOOD, SPLIT_K=2)}), "unknown key"),
        (json.dumps({"triton_version": "3.6.0"}), "no token-count entries"),
    ],
)
def test_malformed_files_raise_clear_error(tmp_path, content, needle):
    p = tmp_path / "E=8,N=64,device_name=cpu.json"
    p.write_text(content)
    with pytest.raises(MoebenchError, match=needle) as ei:
        TF.load_config_file(p)
    assert str(p) in str(ei.value)


def test_missing_file_error(tmp_path):
    with pytest.raises(MoebenchError, match="cannot read"):
        TF.load_config_file(tmp_path / "nope.json")


def test_nearest_entry_and_ties():
    table = {1: GOOD, 16: BIG, 64: GOOD}
    assert TF.nearest_entry(table, 1) == (1, GOOD)
    assert TF.nearest_entry(table, 30) == (16, BIG)
    assert TF.nearest_entry(table, 40) == (16, BIG)  # tie 16 / 64 -> smaller count
    assert TF.nearest_entry(table, 41) == (64, GOOD)
    assert TF.nearest_entry(table, 100000) == (64, GOOD)


def test_lookup_order(tmp_path, monkeypatch):
    name = TF.config_file_name(8, 64, "cpu")
    env_dir = tmp_path / "env"
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(TF.ENV_CONFIG_DIR, raising=False)
    dirs = TF.config_search_dirs()
    # nothing anywhere -> default heuristic
    cfg, src = C.lookup_config(8, 64, 10, torch.bfloat16, "cpu", folders=dirs, hidden=64, topk=2)
    assert src == "default heuristic" and cfg == C.default_config(10, 8, 64, 64, 2, torch.bfloat16)
    # results/configs under the current directory (a write makes the lookup look again)
    TF.write_config_file(tmp_path / "results" / "configs" / name, {1: GOOD})
    cfg, src = C.lookup_config(8, 64, 10, None, "cpu", folders=dirs)
    assert cfg == GOOD and src.endswith(f"{name}[1]") and "results" in src
    # $MOEBENCH_CONFIG_DIR wins over results/configs
    TF.write_config_file(env_dir / name, {8: BIG, 1024: GOOD})
    monkeypatch.setenv(TF.ENV_CONFIG_DIR, str(env_dir))
    assert C.lookup_config(8, 64, 10, None, "cpu", folders=dirs)[0] == GOOD  # the folders resolved before it was set
    dirs = TF.config_search_dirs()
    cfg, src = C.lookup_config(8, 64, 10, None, "cpu", folders=dirs)
    assert cfg == BIG and src == f"{env_dir / name}[8]"
    assert C.lookup_config(8, 64, 900, None, "cpu", folders=dirs)[0] == GOOD
    # another device name or shape does not match
    assert C.lookup_config(8, 64, 10, None, "NVIDIA_H200", folders=dirs)[1] == "default heuristic"
    assert C.lookup_config(16, 64, 10, None, "cpu", folders=dirs)[1] == "default heuristic"


def test_lookup_reads_a_file_once(tmp_path):
    # The lookup reads each (folders, file) once per process: a file changed behind its back is
    # seen only after clear_lookup_cache (the writers of moebench.tuning.files call it).
    dirs = (tmp_path,)
    path = tmp_path / TF.config_file_name(8, 64, "cpu")
    assert C.lookup_config(8, 64, 1, None, "cpu", folders=dirs)[1] == "default heuristic"
    path.write_text(json.dumps({"1": GOOD}))
    assert C.lookup_config(8, 64, 1, None, "cpu", folders=dirs)[1] == "default heuristic"
    TF.clear_lookup_cache()
    assert C.lookup_config(8, 64, 1, None, "cpu", folders=dirs) == (GOOD, f"{path}[1]")
    path.write_text(json.dumps({"1": BIG}))
    assert C.lookup_config(8, 64, 1, None, "cpu", folders=dirs)[0] == GOOD
    TF.write_config_file(path, {1: BIG})
    assert C.lookup_config(8, 64, 1, None, "cpu", folders=dirs)[0] == BIG


def test_package_dir_is_last(tmp_path, monkeypatch):
    monkeypatch.delenv(TF.ENV_CONFIG_DIR, raising=False)
    monkeypatch.chdir(tmp_path)
    dirs = TF.config_search_dirs()
    assert dirs == (tmp_path / "results" / "configs", TF.PACKAGE_CONFIG_DIR)
    monkeypatch.setenv(TF.ENV_CONFIG_DIR, str(tmp_path))
    assert TF.config_search_dirs()[0] == tmp_path
    monkeypatch.setenv(TF.ENV_CONFIG_DIR, str(tmp_path / "missing"))  # a folder that is not there: said, not ignored
    with pytest.raises(MoebenchError, match="does not exist"):
        TF.config_search_dirs()


def test_lookup_malformed_file_raises(tmp_path):
    (tmp_path / TF.config_file_name(8, 64, "cpu")).write_text("{}")
    with pytest.raises(MoebenchError, match="no token-count entries"):
        C.lookup_config(8, 64, 1, None, "cpu", folders=(tmp_path,))


def test_default_heuristic_sanity():
    # Decode (few tokens per expert) -> smallest BLOCK_SIZE_M; prefill -> large tiles, more warps.
    mix = [C.default_config(m, 8, 14336, 4096, 2) for m in (1, 16, 64, 256, 1024, 4096)]
    bms = [c["BLOCK_SIZE_M"] for c in mix]
    assert bms == sorted(bms) and bms[0] == 16 and bms[-1] == 128
    qwen1 = C.default_config(1, 128, 768, 2048, 8)
    assert qwen1["BLOCK_SIZE_M"] == 16 and qwen1["BLOCK_SIZE_K"] == 128  # short K loops (I = 768)
    assert C.default_config(1, 8, 14336, 4096, 2)["BLOCK_SIZE_K"] == 256
    big = C.default_config(4096, 8, 14336, 4096, 2)
    assert big["num_warps"] == 8 and big["GROUP_SIZE_M"] > 1
    # valid configs everywhere, fp32 uses a smaller K tile, tiny shapes clamp N and K
    for m in (1, 7, 100, 5000, 100000):
        for dt in (torch.float32, torch.float16, torch.bfloat16):
            TF.validate_tile_config(C.default_config(m, 60, 40, 72, 4, dt))
    assert C.default_config(1, 8, 14336, 4096, 2, torch.float32)["BLOCK_SIZE_K"] < mix[0]["BLOCK_SIZE_K"]
    tiny = C.default_config(5000, 8, 40, 72, 2)
    assert tiny["BLOCK_SIZE_N"] <= 64 and tiny["BLOCK_SIZE_K"] <= 128


def test_down_files_sglang_name_and_use_tma(tmp_path):
    # GEMM2's file: SGLang's `_down` name; its entries may carry USE_TMA (a bool), GEMM1's may not.
    assert TF.config_file_name(128, 768, "NVIDIA H200", down=True) == "E=128,N=768,device_name=NVIDIA_H200_down.json"
    assert (TF.config_file_name(32, 2048, "NVIDIA_H200", "fp8_w8a8", [128, 128], down=True)
            == "E=32,N=2048,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128,128]_down.json")
    down = tmp_path / "E=4,N=8,device_name=cpu_down.json"
    down.write_text(json.dumps({"1": dict(GOOD, USE_TMA=True), "64": BIG}))
    table = TF.load_config_file(down)
    assert table[1]["USE_TMA"] is True and "USE_TMA" not in table[64]
    up = tmp_path / "E=4,N=8,device_name=cpu.json"
    up.write_text(json.dumps({"1": dict(GOOD, USE_TMA=True)}))
    with pytest.raises(MoebenchError, match="unknown key.*USE_TMA"):
        TF.load_config_file(up)
    down.write_text(json.dumps({"1": dict(GOOD, USE_TMA=1)}))
    with pytest.raises(MoebenchError, match="USE_TMA must be true or false"):
        TF.load_config_file(down)


def test_lookup_down_config(tmp_path):
    dirs = (tmp_path,)
    assert C.lookup_down_config(4, 8, 16, GOOD, torch.bfloat16, device_name="cpu", folders=dirs) == \
        (None, "GEMM1's config")
    down2 = dict(GOOD, BLOCK_SIZE_K=64, num_stages=5)
    TF.write_config_file(tmp_path / TF.config_file_name(4, 8, "cpu", down=True), {1: down2, 64: BIG})
    cfg, src = C.lookup_down_config(4, 8, 16, GOOD, torch.bfloat16, device_name="cpu", folders=dirs)
    assert cfg == down2 and src.endswith("_down.json[1]")
    # the entry nearest to 60 tokens has BLOCK_SIZE_M 64, GEMM1's 16: one alignment cannot serve
    # both, so GEMM2 keeps GEMM1's config, and the source says why
    cfg, src = C.lookup_down_config(4, 8, 60, GOOD, torch.bfloat16, device_name="cpu", folders=dirs)
    assert cfg is None and "_down.json[64] has BLOCK_SIZE_M 64, GEMM1's config 16 at 60 tokens" in src


def test_tuned_routing_reads_token_keys_as_the_tunes_load(tmp_path):
    # A file tuned for an EP8 shard (top-8 over 256 experts, 32 local): M tokens of a layer routing
    # top-8 over the same 32 experts load each local expert 8x as much, so they read its 8M entry.
    dirs = (tmp_path,)
    path = tmp_path / TF.config_file_name(32, 64, "cpu")
    TF.write_config_file(path, {1: GOOD, 8: BIG})
    TF.write_config_file(tmp_path / TF.config_file_name(32, 64, "cpu", down=True), {1: GOOD, 8: BIG})
    # no record: keys are tokens (vLLM's meaning), whatever the layer's routing
    assert C.lookup_config(32, 64, 1, None, "cpu", folders=dirs, topk=8, num_experts_global=32) == (GOOD, f"{path}[1]")
    TF.write_tuned_routing(path, (256, 8))
    TF.write_tuned_routing(path.with_name(TF.config_file_name(32, 64, "cpu", down=True)), (256, 8))
    assert TF.tuned_routing(path) == (256, 8)
    assert json.loads((tmp_path / TF.ROUTING_FILE).read_text())[path.name] == {"experts": 256, "topk": 8}
    # the tune's own routing: unchanged; unknown topk: unchanged
    assert C.lookup_config(32, 64, 1, None, "cpu", folders=dirs, topk=8,
                           num_experts_global=256) == (GOOD, f"{path}[1]")
    assert C.lookup_config(32, 64, 1, None, "cpu", folders=dirs)[0] == GOOD
    # top-8 over the 32: 1 token = 8 tokens of the tune
    cfg, src = C.lookup_config(32, 64, 1, None, "cpu", folders=dirs, topk=8, num_experts_global=32)
    assert cfg == BIG and src == f"{path}[8] (its routing's load at 8 tokens, here 1)"
    assert C.layer_config(1, local_experts=32, inter=64, hidden=64, topk=8, num_experts=32, dtype=None,
                          folders=dirs, device_name="cpu")[0] == BIG
    down, dsrc = C.lookup_down_config(32, 64, 1, BIG, None, device_name="cpu", folders=dirs, topk=8,
                                      num_experts_global=32)
    assert down == BIG and dsrc.endswith("_down.json[8] (its routing's load at 8 tokens, here 1)")
    assert TF.file_tokens(path, 3, 2, 32) == 6  # top-2 over 32 experts: 2/32 = 2x the tune's 8/256
    # a record for another file or a removed one changes nothing else
    TF.write_tuned_routing(path, None)
    assert TF.tuned_routing(path) is None
    assert C.lookup_config(32, 64, 1, None, "cpu", folders=dirs, topk=8, num_experts_global=32)[0] == GOOD


def test_claim_tuned_routing(tmp_path):
    path = tmp_path / TF.config_file_name(32, 64, "cpu")
    TF.claim_tuned_routing(path, 256, 8)  # a new file: recorded before its first entry
    assert TF.tuned_routing(path) == (256, 8)
    TF.write_config_file(path, {1: GOOD})
    TF.claim_tuned_routing(path, 256, 8)  # the same routing again: fine
    with pytest.raises(MoebenchError, match="top-8 over 256 experts; this tune routes top-8 over 32: give another --out"):
        TF.claim_tuned_routing(path, 32, 8)
    old = tmp_path / TF.config_file_name(16, 64, "cpu")
    TF.write_config_file(old, {1: GOOD})
    TF.claim_tuned_routing(old, 16, 2)  # a file of unknown routing stays unknown
    assert TF.tuned_routing(old) is None


@pytest.mark.parametrize("content", ['[1, 2]', '{"f.json": {"experts": 8}}', '{"f.json": {"experts": 4, "topk": 8}}', "{no"])
def test_bad_tuned_routing_file_is_one_clear_error(tmp_path, content):
    (tmp_path / TF.ROUTING_FILE).write_text(content)
    with pytest.raises(MoebenchError, match="tuned_routing.json"):
        TF.tuned_routing(tmp_path / "f.json")
