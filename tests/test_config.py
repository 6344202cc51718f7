import pytest

from cadenza.config import Config, ConfigError, load_config, parse_overrides, to_dict
from cadenza.config.base import from_dict


def test_presets_load_and_override():
    cfg = load_config("tiny", ["train.steps=7", "model.q_lora_rank=null", "data.seq_len=64"])
    assert cfg.train.steps == 7
    assert cfg.model.q_lora_rank is None
    assert cfg.data.seq_len == 64
    k2 = load_config("k2")
    assert k2.model.n_routed_experts == 384 and k2.model.rope_scaling.type == "yarn"


def test_yaml_file_with_preset(tmp_path):
    p = tmp_path / "job.yaml"
    p.write_text(
        "preset: tiny\ntrain:\n  steps: 12\nmodel:\n  rope_scaling:\n    type: yarn\n    factor: 4\n"
    )
    cfg = load_config(str(p), ["train.seed=3"])
    assert cfg.train.steps == 12 and cfg.train.seed == 3
    assert cfg.model.rope_scaling.factor == 4.0


def test_round_trip_through_dict():
    cfg = load_config("k2")
    assert from_dict(Config, to_dict(cfg)) == cfg


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["train.stepz=1"], "unknown key(s) ['stepz']"),
        (["train.steps=abc"], "train.steps: expected an int, found 'abc'"),
        (["model.n_routed_experts=7"], "not divisible by n_group"),
        (["nokey"], "expected key=value"),
    ],
)
def test_bad_overrides_name_the_problem(overrides, needle):
    with pytest.raises(ConfigError, match=None) as e:
        load_config("tiny", overrides)
    assert needle in str(e.value)


def test_unknown_preset_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="expected a preset"):
        load_config("nope")
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "missing.yaml"))


def test_parse_overrides_nesting():
    assert parse_overrides(["a.b=1", "a.c=x", "d=true"]) == {"a": {"b": 1, "c": "x"}, "d": True}


def test_fixed_length_tuple_fields():
    from dataclasses import dataclass

    @dataclass
    class Betas:
        betas: tuple[float, int] = (0.9, 1)

    assert from_dict(Betas, {"betas": ["0.5", 3]}).betas == (0.5, 3)
    with pytest.raises(ConfigError, match="expected 2 items"):
        from_dict(Betas, {"betas": [1.0]})
