"""`cadenza model info`: counts against transformers' own model built on the meta device."""

from __future__ import annotations

import re

import pytest
import torch
from typer.testing import CliRunner

from cadenza.cli.main import app
from cadenza.config.model import k2_model, tiny_model
from cadenza.model import config_to_hf, save_pretrained
from cadenza.model.counts import param_counts


def _hf_total(cfg) -> int:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    with torch.device("meta"):
        hf = DeepseekV3ForCausalLM(DeepseekV3Config(**config_to_hf(cfg)))
    return sum(p.numel() for p in hf.parameters())


@pytest.mark.parametrize("preset", ["tiny", "k2"])
def test_total_matches_transformers(preset):
    cfg = k2_model() if preset == "k2" else tiny_model()
    assert param_counts(cfg)["total"] == _hf_total(cfg)


def _count(out: str, key: str) -> int:
    return int(re.search(rf"^\s+{re.escape(key)}\s+([\d,]+)", out, re.M).group(1).replace(",", ""))


def test_info_k2_preset():
    r = CliRunner().invoke(app, ["model", "info", "--preset", "k2"])
    assert r.exit_code == 0, r.output
    assert 1.02e12 < _count(r.output, "total") < 1.05e12
    assert 32e9 < _count(r.output, "activated") < 33.5e9


def test_info_on_checkpoint_and_errors(tmp_path):
    from cadenza.model import CausalLM

    cfg = tiny_model()
    save_pretrained(CausalLM(cfg), tmp_path)
    r = CliRunner().invoke(app, ["model", "info", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert _count(r.output, "total") == param_counts(cfg)["total"]
    r = CliRunner().invoke(app, ["model", "info", str(tmp_path / "missing")])
    assert r.exit_code == 2 and "does not exist" in r.output
    r = CliRunner().invoke(app, ["model", "info"])
    assert r.exit_code == 2
