"""Malformed checkpoints give one clear CheckpointError (real files, each broken one way)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import cadenza.model as cm
from cadenza.config.model import ModelConfig

CFG = dict(
    vocab_size=64,
    hidden_size=24,
    intermediate_size=32,
    moe_intermediate_size=8,
    num_hidden_layers=2,
    num_attention_heads=2,
    q_lora_rank=None,
    kv_lora_rank=8,
    qk_nope_head_dim=4,
    qk_rope_head_dim=4,
    v_head_dim=4,
    n_routed_experts=4,
    n_group=2,
    topk_group=1,
    num_experts_per_tok=2,
)


@pytest.fixture
def ckpt(tmp_path):
    model = cm.CausalLM(ModelConfig(**CFG))
    path = tmp_path / "ckpt"
    cm.save_pretrained(model, path)
    return path


def _rewrite(path, edit):
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def _config(path, edit):
    d = json.loads((path / "config.json").read_text())
    edit(d)
    (path / "config.json").write_text(json.dumps(d))


def test_round_trip_loads(ckpt):
    model = cm.from_pretrained(ckpt)
    assert model.layers[1].mlp.experts.w_gate.shape == (4, 8, 24)


def test_missing_tensors(ckpt):
    def drop(t):
        del t["model.layers.1.mlp.experts.3.up_proj.weight"]
        del t["model.norm.weight"]

    _rewrite(ckpt, drop)
    with pytest.raises(
        cm.CheckpointError,
        match=r"missing 2 tensor\(s\), e\.g\. model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight, model\.norm\.weight",
    ):
        cm.from_pretrained(ckpt)


def test_unexpected_tensor(ckpt):
    _rewrite(
        ckpt,
        lambda t: t.update({"model.layers.1.mlp.experts.4.up_proj.weight": torch.zeros(8, 24)}),
    )
    with pytest.raises(
        cm.CheckpointError,
        match=r"1 unexpected tensor\(s\), e\.g\. model\.layers\.1\.mlp\.experts\.4\.up_proj\.weight",
    ):
        cm.from_pretrained(ckpt)


def test_wrong_shape(ckpt):
    _rewrite(
        ckpt, lambda t: t.update({"model.layers.0.self_attn.kv_b_proj.weight": torch.zeros(17, 8)})
    )
    with pytest.raises(
        cm.CheckpointError,
        match=r"1 tensor\(s\) with the wrong shape: model\.layers\.0\.self_attn\.kv_b_proj\.weight \[17, 8\] \(expected \[16, 8\]\)",
    ):
        cm.from_pretrained(ckpt)


def test_all_problems_in_one_error(ckpt):
    def edit(t):
        del t["lm_head.weight"]
        t["extra.weight"] = torch.zeros(1)
        t["model.embed_tokens.weight"] = torch.zeros(65, 24)

    _rewrite(ckpt, edit)
    with pytest.raises(cm.CheckpointError) as e:
        cm.from_pretrained(ckpt)
    msg = str(e.value)
    assert "missing 1" in msg and "1 unexpected" in msg and "wrong shape" in msg


def test_invalid_json_config(ckpt):
    (ckpt / "config.json").write_text('{"model_type": "deepseek_v3",')
    with pytest.raises(cm.CheckpointError, match="is not valid JSON"):
        cm.from_pretrained(ckpt)


def test_bad_config_values(ckpt):
    _config(ckpt, lambda d: d.update(hidden_size="wide"))
    with pytest.raises(cm.CheckpointError, match="hidden_size: expected an int, found 'wide'"):
        cm.from_pretrained(ckpt)
    _config(ckpt, lambda d: d.update(hidden_size=24, n_group=3))
    with pytest.raises(cm.CheckpointError, match="n_routed_experts=4 not divisible by n_group=3"):
        cm.from_pretrained(ckpt)


def test_unsupported_model_type(ckpt):
    _config(ckpt, lambda d: d.update(model_type="llama", architectures=["LlamaForCausalLM"]))
    with pytest.raises(cm.CheckpointError, match="unsupported model_type 'llama'"):
        cm.from_pretrained(ckpt)


def test_quantized_config_is_refused(ckpt):
    _config(ckpt, lambda d: d.update(quantization_config={"quant_method": "fp8"}))
    with pytest.raises(cm.CheckpointError, match="quantized checkpoint"):
        cm.from_pretrained(ckpt)


def test_truncated_safetensors(ckpt):
    f = ckpt / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(cm.CheckpointError, match="truncated or corrupt"):
        cm.from_pretrained(ckpt)


def test_no_weights_and_missing_shard(ckpt):
    (ckpt / "model.safetensors").rename(ckpt / "weights.bin")
    with pytest.raises(cm.CheckpointError, match="no model.safetensors"):
        cm.from_pretrained(ckpt)
    (ckpt / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}})
    )
    with pytest.raises(cm.CheckpointError, match="1 shard file"):
        cm.from_pretrained(ckpt)


def test_missing_directory(tmp_path):
    with pytest.raises(cm.CheckpointError, match="does not exist"):
        cm.from_pretrained(tmp_path / "nowhere")


def test_mtp_layers_are_skipped(ckpt):
    """Hub checkpoints carry multi-token-prediction layers after the main ones."""
    _config(ckpt, lambda d: d.update(num_nextn_predict_layers=1))
    _rewrite(ckpt, lambda t: t.update({"model.layers.2.eh_proj.weight": torch.zeros(24, 48)}))
    cm.from_pretrained(ckpt)


def test_save_is_atomic_and_keeps_other_files(ckpt, monkeypatch):
    (ckpt / "tokenizer.json").write_text("{}")
    before = (ckpt / "model.safetensors").read_bytes()
    model = cm.from_pretrained(ckpt)
    import cadenza.model.hf_io as hf_io

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(hf_io, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        cm.save_pretrained(model, ckpt)
    assert (ckpt / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    ]
