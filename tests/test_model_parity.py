"""cadenza's model against transformers' DeepseekV3ForCausalLM (fp32): logits and gradients,
loading what transformers saved and the other way round."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

import cadenza.model as cm
from model_oracle import CONFIGS, hf_model

ATOL = 1e-5


def _ids(vocab: int, B: int = 2, T: int = 13) -> torch.Tensor:
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_both_directions(name, tmp_path):
    from transformers import DeepseekV3ForCausalLM

    hf = hf_model(name)
    hf.save_pretrained(tmp_path / "hf")
    ours = cm.from_pretrained(tmp_path / "hf").eval()
    ids = _ids(hf.config.vocab_size)
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours(ids)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)

    cm.save_pretrained(ours, tmp_path / "ours")
    back = DeepseekV3ForCausalLM.from_pretrained(
        tmp_path / "ours", attn_implementation="eager", experts_implementation="eager"
    ).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, got, atol=ATOL, rtol=0)
    # the bias buffer survives the round trip (it is not a parameter)
    layer = next(i for i, b in enumerate(ours.layers) if hasattr(b.mlp, "router"))
    torch.testing.assert_close(
        back.model.layers[layer].mlp.gate.e_score_correction_bias,
        ours.layers[layer].mlp.router.e_score_correction_bias,
    )


def test_gradients_match():
    hf = hf_model("noqlora-groups-yarn")
    ours = _from_hf_memory(hf)
    ids = _ids(hf.config.vocab_size)
    for m in (hf, ours):
        m.train()
    ref = hf(ids).logits.log_softmax(-1)[..., 0].sum()
    ref.backward()
    got = ours(ids).log_softmax(-1)[..., 0].sum()
    got.backward()
    L = 1
    I = hf.config.moe_intermediate_size
    hf_gate_up = hf.model.layers[L].mlp.experts.gate_up_proj.grad
    ex = ours.layers[L].mlp.experts
    torch.testing.assert_close(ex.w_gate.grad, hf_gate_up[:, :I], atol=5e-5, rtol=1e-3)
    torch.testing.assert_close(ex.w_up.grad, hf_gate_up[:, I:], atol=5e-5, rtol=1e-3)
    torch.testing.assert_close(
        ex.w_down.grad, hf.model.layers[L].mlp.experts.down_proj.grad, atol=5e-5, rtol=1e-3
    )
    torch.testing.assert_close(
        ours.layers[0].attn.kv_b_proj.weight.grad,
        hf.model.layers[0].self_attn.kv_b_proj.weight.grad,
        atol=ATOL,
        rtol=1e-4,
    )
    torch.testing.assert_close(
        ours.embed.weight.grad, hf.model.embed_tokens.weight.grad, atol=5e-5, rtol=1e-3
    )


def _from_hf_memory(hf):
    """cadenza model from transformers' in-memory (stacked gate_up_proj) state, via a file."""
    import tempfile
    from pathlib import Path

    d = Path(tempfile.mkdtemp())
    state = {k: v.detach().contiguous() for k, v in hf.state_dict().items()}
    if hf.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    save_file(state, str(d / "model.safetensors"))
    hf.config.to_json_file(d / "config.json")
    return cm.from_pretrained(d)


def test_loads_stacked_and_sharded_layouts(tmp_path):
    hf = hf_model("qlora-4groups-k2yarn")
    ids = _ids(hf.config.vocab_size)
    with torch.no_grad():
        ref = hf(ids).logits
    # transformers' in-memory names: mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I]
    state = {k: v.detach().contiguous() for k, v in hf.state_dict().items()}
    state.pop("lm_head.weight")  # tied
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    (tmp_path / "stacked").mkdir()
    save_file(state, str(tmp_path / "stacked" / "model.safetensors"))
    hf.config.to_json_file(tmp_path / "stacked" / "config.json")
    with torch.no_grad():
        torch.testing.assert_close(
            cm.from_pretrained(tmp_path / "stacked")(ids), ref, atol=ATOL, rtol=0
        )
    # sharded with model.safetensors.index.json
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    with torch.no_grad():
        torch.testing.assert_close(
            cm.from_pretrained(tmp_path / "sharded")(ids), ref, atol=ATOL, rtol=0
        )


def test_cadenza_sharded_save_loads_in_transformers(tmp_path):
    from transformers import DeepseekV3ForCausalLM

    hf = hf_model("qlora-plainrope")
    hf.save_pretrained(tmp_path / "hf")
    ours = cm.from_pretrained(tmp_path / "hf").eval()
    cm.save_pretrained(ours, tmp_path / "ours", max_shard_bytes=30_000)
    assert (tmp_path / "ours" / "model.safetensors.index.json").exists()
    back = DeepseekV3ForCausalLM.from_pretrained(tmp_path / "ours").eval()
    ids = _ids(hf.config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ours(ids), atol=ATOL, rtol=0)


def test_max_logit_matches_eager_attention_logits(monkeypatch):
    """Oracle: transformers' eager attention, patched to record its pre-softmax logits."""
    import transformers.models.deepseek_v3.modeling_deepseek_v3 as ds

    hf = hf_model("noqlora-groups-yarn")
    ours = _from_hf_memory(hf)
    ours.eval()
    recorded = []
    original = ds.eager_attention_forward

    def spy(module, query, key, value, attention_mask, scaling, **kw):
        logits = torch.matmul(query, key.transpose(2, 3)) * scaling
        T, S = logits.shape[-2:]
        causal = torch.ones(T, S, dtype=torch.bool).tril(S - T)
        recorded.append(logits.masked_fill(~causal, float("-inf")).amax(dim=(0, 2, 3)))
        return original(module, query, key, value, attention_mask, scaling, **kw)

    monkeypatch.setattr(ds, "eager_attention_forward", spy)
    ids = _ids(hf.config.vocab_size)
    for block in ours.layers:
        block.attn.record_max_logit = True
    with torch.no_grad():
        got_logits = ours(ids)
        ref_logits = hf(ids).logits
    torch.testing.assert_close(got_logits, ref_logits, atol=ATOL, rtol=0)
    assert len(recorded) == len(ours.layers)
    for block, ref in zip(ours.layers, recorded):
        assert block.attn.max_logit.shape == (hf.config.num_attention_heads,)
        torch.testing.assert_close(block.attn.max_logit, ref, atol=ATOL, rtol=1e-5)
