"""Model presets, name lookup, local config.json reading, custom shapes."""

import json

import pytest

from moebench.errors import MoebenchError
from moebench.models import MoEShape, PRESETS, custom_shape, get_model, list_models, read_hf_config

REQUIRED = ["mixtral-8x7b", "mixtral-8x22b", "qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3", "deepseek-v2-lite",
            "gpt-oss-20b", "gpt-oss-120b", "olmoe-1b-7b", "dbrx"]

# (E, topk, H, I) from the models' config.json files.
EXPECTED = {
    "mixtral-8x7b": (8, 2, 4096, 14336),
    "mixtral-8x22b": (8, 2, 6144, 16384),
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "qwen3-235b-a22b": (128, 8, 4096, 1536),
    "deepseek-v3": (256, 8, 7168, 2048),
    "deepseek-v2-lite": (64, 6, 2048, 1408),
    "gpt-oss-20b": (32, 4, 2880, 2880),
    "gpt-oss-120b": (128, 4, 2880, 2880),
    "olmoe-1b-7b": (64, 8, 2048, 1024),
    "dbrx": (16, 4, 6144, 10752),
}


def test_required_presets_present_with_public_values():
    names = [m.name for m in list_models()]
    for n in REQUIRED:
        assert n in names
        m = get_model(n)
        assert (m.num_experts, m.topk, m.hidden, m.intermediate) == EXPECTED[n]


@pytest.mark.parametrize("shape", list_models(), ids=lambda m: m.name)
def test_presets_sane(shape: MoEShape):
    assert 1 <= shape.topk <= shape.num_experts
    assert shape.hidden > 0 and shape.intermediate > 0
    assert shape.scoring in ("softmax", "sigmoid")
    assert shape.source.startswith("https://huggingface.co/") and shape.hf_id in shape.source
    if shape.grouped:
        assert shape.num_experts % shape.n_group == 0
        assert shape.topk <= shape.topk_group * shape.num_experts // shape.n_group
    assert (shape.E, shape.K, shape.H, shape.I) == (shape.num_experts, shape.topk, shape.hidden, shape.intermediate)


def test_deepseek_v3_router_options():
    m = get_model("deepseek-v3")
    assert m.scoring == "sigmoid" and m.n_group == 8 and m.topk_group == 4 and m.renormalize
    assert m.shared_experts == 1 and m.routed_scaling_factor == 2.5
    assert get_model("deepseek-r1").num_experts == 256


@pytest.mark.parametrize("name,expected", [
    ("MIXTRAL-8X7B", "mixtral-8x7b"),
    ("mistralai/Mixtral-8x7B-v0.1", "mixtral-8x7b"),
    ("mistralai/Mixtral-8x22B-Instruct-v0.1", "mixtral-8x22b"),
    ("Qwen/Qwen3-30B-A3B", "qwen3-30b-a3b"),
    ("Qwen/Qwen3-235B-A22B-FP8", "qwen3-235b-a22b"),
    ("deepseek-ai/DeepSeek-V3", "deepseek-v3"),
    ("openai/gpt-oss-120b", "gpt-oss-120b"),
    ("databricks/dbrx-instruct", "dbrx"),
    ("allenai/OLMoE-1B-7B-0924", "olmoe-1b-7b"),
])
def test_lookup_by_hf_id(name, expected):
    assert get_model(name).name == expected


def test_unknown_model_suggests_near_names():
    with pytest.raises(MoebenchError, match=r"mixtral-8x7b.*moebench models"):
        get_model("mixtral-8x7")
    with pytest.raises(MoebenchError, match="unknown model"):
        get_model("llama-3-8b-dense-whatever")
    with pytest.raises(MoebenchError, match="no network"):
        get_model("someorg/SomeModel-7B")
    with pytest.raises(MoebenchError):
        get_model("")


def _write(tmp_path, cfg, name="config.json"):
    p = tmp_path / name
    p.write_text(json.dumps(cfg) if not isinstance(cfg, str) else cfg)
    return str(p)


def test_config_mixtral_like(tmp_path):
    p = _write(tmp_path, {"model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2,
                          "hidden_size": 4096, "intermediate_size": 14336, "_name_or_path": "my/mixtral"})
    m = get_model(p)
    assert (m.E, m.K, m.H, m.I) == (8, 2, 4096, 14336)
    assert m.scoring == "softmax" and m.renormalize and not m.grouped and m.name == "my/mixtral"


def test_config_deepseek_like(tmp_path):
    p = _write(tmp_path, {"model_type": "deepseek_v3", "n_routed_experts": 256, "num_experts_per_tok": 8,
                          "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
                          "scoring_func": "sigmoid", "n_group": 8, "topk_group": 4, "norm_topk_prob": True,
                          "n_shared_experts": 1, "routed_scaling_factor": 2.5})
    m = read_hf_config(p)
    assert (m.E, m.K, m.H, m.I) == (256, 8, 7168, 2048)  # moe_intermediate_size wins over the dense size
    assert m.scoring == "sigmoid" and (m.n_group, m.topk_group) == (8, 4) and m.renormalize
    assert m.shared_experts == 1 and m.routed_scaling_factor == 2.5


def test_config_deepseek_v2_lite_like_has_no_groups(tmp_path):
    p = _write(tmp_path, {"model_type": "deepseek_v2", "n_routed_experts": 64, "num_experts_per_tok": 6,
                          "hidden_size": 2048, "moe_intermediate_size": 1408, "intermediate_size": 10944,
                          "scoring_func": "softmax", "n_group": 1, "topk_group": 1, "norm_topk_prob": False,
                          "n_shared_experts": 2})
    m = read_hf_config(p)
    assert (m.E, m.K, m.I) == (64, 6, 1408) and not m.grouped and not m.renormalize


def test_config_dbrx_like_in_a_folder(tmp_path):
    _write(tmp_path, {"model_type": "dbrx", "d_model": 6144,
                      "ffn_config": {"moe_num_experts": 16, "moe_top_k": 4, "ffn_hidden_size": 10752,
                                     "moe_normalize_expert_weights": 1}})
    m = get_model(str(tmp_path))  # a folder holding config.json
    assert (m.E, m.K, m.H, m.I) == (16, 4, 6144, 10752) and m.renormalize


def test_config_qwen3_like(tmp_path):
    p = _write(tmp_path, {"model_type": "qwen3_moe", "num_experts": 128, "num_experts_per_tok": 8,
                          "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
                          "norm_topk_prob": True})
    m = get_model(p)
    assert (m.E, m.K, m.H, m.I) == (128, 8, 2048, 768)


def test_config_llama4_text_config(tmp_path):
    p = _write(tmp_path, {"model_type": "llama4", "text_config": {
        "model_type": "llama4_text", "num_local_experts": 16, "num_experts_per_tok": 1, "hidden_size": 5120,
        "intermediate_size": 8192, "intermediate_size_mlp": 16384}})
    m = get_model(p)
    assert (m.E, m.K, m.H, m.I) == (16, 1, 5120, 8192) and m.scoring == "sigmoid" and not m.renormalize


def test_config_errors(tmp_path):
    with pytest.raises(MoebenchError, match="not valid JSON"):
        get_model(_write(tmp_path, "{not json", "bad.json"))
    with pytest.raises(MoebenchError, match="not an object"):
        get_model(_write(tmp_path, [1, 2], "list.json"))
    with pytest.raises(MoebenchError, match="not a Mixture-of-Experts"):
        get_model(_write(tmp_path, {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008}, "dense.json"))
    with pytest.raises(MoebenchError, match="does not exist"):
        get_model(str(tmp_path / "missing.json"))
    with pytest.raises(MoebenchError, match="experts-per-token"):
        get_model(_write(tmp_path, {"num_experts": 8, "hidden_size": 64, "intermediate_size": 32}, "notopk.json"))
    with pytest.raises(MoebenchError, match="hidden_size must be a positive integer"):
        get_model(_write(tmp_path, {"num_experts": 8, "num_experts_per_tok": 2, "hidden_size": "big",
                                    "intermediate_size": 32}, "str.json"))
    with pytest.raises(MoebenchError, match="topk"):
        get_model(_write(tmp_path, {"num_experts": 4, "num_experts_per_tok": 8, "hidden_size": 64,
                                    "intermediate_size": 32}, "topk.json"))
    with pytest.raises(MoebenchError, match="scoring_func"):
        get_model(_write(tmp_path, {"num_experts": 8, "num_experts_per_tok": 2, "hidden_size": 64,
                                    "intermediate_size": 32, "scoring_func": "tanh"}, "scoring.json"))
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    with pytest.raises(MoebenchError, match="no config.json"):
        get_model(str(empty_dir))


def test_custom_shape_validation():
    s = custom_shape(60, 4, 100, 50)
    assert (s.E, s.K, s.H, s.I) == (60, 4, 100, 50) and s.name == "custom"
    with pytest.raises(MoebenchError, match="topk"):
        custom_shape(8, 0, 64, 32)
    with pytest.raises(MoebenchError, match="topk"):
        custom_shape(8, 9, 64, 32)
    with pytest.raises(MoebenchError, match="--hidden"):
        custom_shape(8, 2, 0, 32)
    with pytest.raises(MoebenchError, match="--intermediate"):
        custom_shape(8, 2, 64, -1)
    with pytest.raises(MoebenchError, match="--num-experts"):
        custom_shape(0, 1, 64, 32)
    with pytest.raises(MoebenchError, match="--hidden"):
        custom_shape(8, 2, 64.0, 32)
    with pytest.raises(MoebenchError, match="n_group"):
        custom_shape(10, 2, 64, 32, n_group=3, topk_group=1)


def test_presets_table_keys_match_names():
    assert all(k == v.name for k, v in PRESETS.items())


def test_folder_named_like_a_preset_does_not_hide_it(tmp_path, monkeypatch):
    (tmp_path / "dbrx").mkdir()
    monkeypatch.chdir(tmp_path)
    assert get_model("dbrx").name == "dbrx"
    with pytest.raises(MoebenchError, match="no config.json"):
        get_model(str(tmp_path / "dbrx"))


def test_every_preset_deploy_layout_fits_its_shape():
    # the shards `moebench configs coverage` asks tuned files for must be valid layouts
    from moebench.models import PRESETS
    from moebench.tuning.tuner import deploy_layout

    for shape in PRESETS.values():
        assert shape.deploy, shape.name
        for name in shape.deploy:
            deploy_layout(name)[0].validate_shape(shape.num_experts, shape.intermediate)
