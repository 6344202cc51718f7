"""Every parameter of the model declares its Muon units explicitly (tiny and K2 on meta)."""

from __future__ import annotations

import pytest
import torch

from cadenza.config.model import k2_model, tiny_model
from cadenza.model import CausalLM
from cadenza.model.units import param_units


def _declared(model):
    names = set()
    for mname, module in model.named_modules():
        if callable(getattr(type(module), "param_units", None)):
            names |= {f"{mname}.{k}" if mname else k for k in module.param_units()}
    return names


@pytest.mark.parametrize("preset", ["tiny", "tiny-noqlora", "k2"])
def test_every_parameter_has_declared_units(preset):
    cfg = k2_model() if preset == "k2" else tiny_model()
    if preset == "tiny-noqlora":
        cfg.q_lora_rank = None
    with torch.device("meta"):
        model = CausalLM(cfg)
    units = {n: u for n, _, u in param_units(model)}
    params = dict(model.named_parameters())
    assert set(units) == set(params)
    assert set(params) <= _declared(model), set(params) - _declared(model)

    h, nope, rope, v = (
        cfg.num_attention_heads,
        cfg.qk_nope_head_dim,
        cfg.qk_rope_head_dim,
        cfg.v_head_dim,
    )
    q = "q_proj" if cfg.q_lora_rank is None else "q_b_proj"
    assert units[f"layers.0.attn.{q}.weight"].sizes == (nope, rope) * h
    assert units["layers.0.attn.kv_b_proj.weight"].sizes == (nope, v) * h
    assert units["layers.0.attn.o_proj.weight"].kind == "cols"
    assert units["layers.0.attn.o_proj.weight"].sizes == (v,) * h
    assert units["layers.0.attn.kv_a_proj_with_mqa.weight"].kind == "matrix"
    if cfg.q_lora_rank is not None:
        assert units["layers.0.attn.q_a_proj.weight"].kind == "matrix"
    assert units["layers.0.mlp.gate_proj.weight"].kind == "matrix"  # dense layer
    moe = f"layers.{cfg.first_k_dense_replace}.mlp"
    for w in ("w_gate", "w_up", "w_down"):
        assert units[f"{moe}.experts.{w}"].kind == "experts"
        assert len(units[f"{moe}.experts.{w}"].unit_shapes(params[f"{moe}.experts.{w}"].shape)) == (
            cfg.n_routed_experts
        )
    assert units[f"{moe}.shared.down_proj.weight"].kind == "matrix"
    for adamw in ("embed.weight", "lm_head.weight", "norm.weight", f"{moe}.router.weight"):
        assert units[adamw].kind == "adamw"
    assert units["layers.0.attn_norm.weight"].kind == "adamw"
    assert units["layers.0.attn.kv_a_layernorm.weight"].kind == "adamw"
