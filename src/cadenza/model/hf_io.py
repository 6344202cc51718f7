"""Hugging Face checkpoints: config.json + safetensors in the layout of DeepseekV3ForCausalLM.

Reading accepts the hub's per-expert tensors (`mlp.experts.{i}.gate_proj.weight`, which is
also what transformers 5 `save_pretrained` writes) and the stacked in-memory layout of
transformers 5 (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]),
single-file or sharded with `model.safetensors.index.json`. Writing uses the hub layout.
Every problem with a checkpoint is reported at once, as a `CheckpointError`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from cadenza.config.base import ConfigError, from_dict
from cadenza.config.model import ModelConfig
from cadenza.model.transformer import CausalLM

MODEL_TYPES = ("deepseek_v3", "kimi_k2")
ARCHITECTURE = "DeepseekV3ForCausalLM"
EXAMPLES = 5

# transformers' DeepseekV3Config defaults, used for keys a config.json leaves out.
HF_DEFAULTS: dict[str, Any] = dict(
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=61,
    num_attention_heads=128,
    n_shared_experts=1,
    n_routed_experts=256,
    routed_scaling_factor=2.5,
    kv_lora_rank=512,
    q_lora_rank=1536,
    qk_rope_head_dim=64,
    v_head_dim=128,
    qk_nope_head_dim=128,
    n_group=8,
    topk_group=4,
    num_experts_per_tok=8,
    first_k_dense_replace=3,
    norm_topk_prob=True,
    hidden_act="silu",
    max_position_embeddings=4096,
    initializer_range=0.02,
    rms_norm_eps=1e-6,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=None,
    tie_word_embeddings=False,
    rope_interleave=True,
    attention_bias=False,
    num_nextn_predict_layers=1,
)
_PASSTHROUGH = [k for k in HF_DEFAULTS] + ["scoring_func"]
_NONE_MEANS = {"n_group": 1, "topk_group": 1, "n_routed_experts": 0, "first_k_dense_replace": 0}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CheckpointError(ValueError):
    """A checkpoint cannot be used; the message says what is wrong and what to do."""


# ---------------------------------------------------------------------------- config


def config_from_hf(d: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """ModelConfig from a Hugging Face DeepseekV3 config dict (rope_scaling or rope_parameters)."""
    model_type = d.get("model_type")
    if model_type not in MODEL_TYPES:
        raise CheckpointError(
            f"{source}: unsupported model_type {model_type!r}; cadenza loads the DeepSeek-V3"
            f" architecture (model_type one of {list(MODEL_TYPES)})"
        )
    archs = d.get("architectures") or [ARCHITECTURE]
    if ARCHITECTURE not in archs:
        raise CheckpointError(
            f"{source}: unsupported architectures {archs}; expected {ARCHITECTURE}"
        )
    if d.get("quantization_config"):
        method = d["quantization_config"].get("quant_method", "?")
        raise CheckpointError(
            f"{source}: quantized checkpoint (quant_method {method!r}) is not supported;"
            " convert it to bf16/fp32 weights first"
        )
    fields: dict[str, Any] = {}
    for key in _PASSTHROUGH:
        if key in d:
            value = d[key]
            fields[key] = _NONE_MEANS.get(key, value) if value is None else value
        elif key in HF_DEFAULTS:
            fields[key] = HF_DEFAULTS[key]
    if "num_mtp_layers" in d and "num_nextn_predict_layers" not in d:
        fields["num_nextn_predict_layers"] = d["num_mtp_layers"]
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise CheckpointError(f"{source}: rope_parameters must be a mapping, found {rope!r}")
    fields["rope_theta"] = rope.get("rope_theta", d.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "yarn":
        fields["rope_scaling"] = dict(
            type="yarn",
            factor=rope.get("factor") or 1.0,
            original_max_position_embeddings=rope.get(
                "original_max_position_embeddings", fields["max_position_embeddings"]
            ),
            beta_fast=rope.get("beta_fast") or 32.0,
            beta_slow=rope.get("beta_slow") or 1.0,
            # Absent mscale: YaRN's plain attention factor, as transformers computes it.
            mscale=rope.get("mscale") or 0.0,
            mscale_all_dim=rope.get("mscale_all_dim") or 0.0,
            truncate=rope.get("truncate", True),
            attention_factor=rope.get("attention_factor"),
        )
    elif rope_type != "default":
        raise CheckpointError(
            f"{source}: unsupported rope type {rope_type!r}; expected 'default' or 'yarn'"
        )
    try:
        return from_dict(ModelConfig, fields, "config.json")
    except (ConfigError, ValueError) as e:
        raise CheckpointError(f"{source}: {e}") from e


def config_to_hf(cfg: ModelConfig, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """config.json contents that transformers 5 reads as DeepseekV3Config."""
    d: dict[str, Any] = {"architectures": [ARCHITECTURE], "model_type": "deepseek_v3"}
    for key in _PASSTHROUGH:
        d[key] = getattr(cfg, key)
    d["num_key_value_heads"] = cfg.num_attention_heads
    d["topk_method"] = "noaux_tc"
    d["attention_dropout"] = 0.0
    r = cfg.rope_scaling
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if r.type == "yarn":
        rope.update(rope_type="yarn", **{k: v for k, v in asdict(r).items() if k != "type"})
        if rope["attention_factor"] is None:
            del rope["attention_factor"]
    d["rope_parameters"] = rope
    if dtype is not None:
        d["dtype"] = str(dtype).removeprefix("torch.")
    return d


# ---------------------------------------------------------------------------- names

_RULES = [
    (r"^embed\.", "model.embed_tokens."),
    (r"^norm\.", "model.norm."),
    (r"^layers\.(\d+)\.attn_norm\.", r"model.layers.\1.input_layernorm."),
    (r"^layers\.(\d+)\.mlp_norm\.", r"model.layers.\1.post_attention_layernorm."),
    (r"^layers\.(\d+)\.attn\.", r"model.layers.\1.self_attn."),
    (r"^layers\.(\d+)\.mlp\.router\.", r"model.layers.\1.mlp.gate."),
    (r"^layers\.(\d+)\.mlp\.shared\.", r"model.layers.\1.mlp.shared_experts."),
    (r"^layers\.(\d+)\.mlp\.", r"model.layers.\1.mlp."),
]
_EXPERT = re.compile(r"^layers\.(\d+)\.mlp\.experts\.w_(gate|up|down)$")


def hf_name(name: str) -> str:
    """Hugging Face name of a cadenza (non-expert) tensor."""
    for pattern, repl in _RULES:
        if re.match(pattern, name):
            return re.sub(pattern, repl, name)
    return name


def _state(model: CausalLM) -> dict[str, torch.Tensor]:
    state = model.state_dict(keep_vars=True)
    if model.cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def _expected(model: CausalLM, stacked_layers: set[int]) -> dict[str, tuple[tuple[int, ...], Any]]:
    """hf name -> (shape, target); target: cadenza name, (name, expert) or ("gate_up", L)."""
    out: dict[str, tuple[tuple[int, ...], Any]] = {}
    for name, t in _state(model).items():
        m = _EXPERT.match(name)
        if not m:
            out[hf_name(name)] = (tuple(t.shape), name)
            continue
        layer, which = int(m.group(1)), m.group(2)
        prefix = f"model.layers.{layer}.mlp.experts"
        E, rows, cols = t.shape
        if layer in stacked_layers:
            if which == "gate":
                out[f"{prefix}.gate_up_proj"] = ((E, 2 * rows, cols), ("gate_up", layer))
            elif which == "down":
                out[f"{prefix}.down_proj"] = ((E, rows, cols), name)
        else:
            for e in range(E):
                out[f"{prefix}.{e}.{which}_proj.weight"] = ((rows, cols), (name, e))
    return out


def _skippable(key: str, cfg: ModelConfig) -> bool:
    """Tensors that hub checkpoints carry but the model does not use."""
    if key.endswith("rotary_emb.inv_freq"):
        return True
    if key == "lm_head.weight" and cfg.tie_word_embeddings:
        return True
    m = re.match(r"^model\.layers\.(\d+)\.", key)
    n = cfg.num_hidden_layers
    return bool(m) and n <= int(m.group(1)) < n + cfg.num_nextn_predict_layers  # MTP layers


# ---------------------------------------------------------------------------- reading


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); fix or regenerate it") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def load_config(path: str | Path) -> ModelConfig:
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    cfg_path = path / "config.json" if path.is_dir() else path
    if not cfg_path.is_file():
        raise CheckpointError(
            f"{cfg_path} not found: expected a Hugging Face model directory with config.json"
        )
    return config_from_hf(_read_json(cfg_path), str(cfg_path))


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: expected a non-empty 'weight_map' object")
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            raise CheckpointError(
                f"{index} names {len(missing)} shard file(s) that do not exist, e.g. {missing[:EXAMPLES]}"
            )
        return [path / f for f in files]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    raise CheckpointError(
        f"{path}: no model.safetensors or model.safetensors.index.json (found {found[:10]});"
        " cadenza reads safetensors checkpoints only"
    )


def _open(file: Path):
    try:
        return safe_open(str(file), framework="pt")
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise CheckpointError(
            f"{file} is not a readable safetensors file ({e}); it may be truncated or corrupt:"
            " re-download or re-save it"
        ) from e


def _examples(items: list[str]) -> str:
    return ", ".join(items[:EXAMPLES]) + (", ..." if len(items) > EXAMPLES else "")


def from_pretrained(path: str | Path, dtype: torch.dtype | None = None) -> CausalLM:
    """Load a DeepseekV3ForCausalLM checkpoint directory into a cadenza CausalLM.

    dtype: parameter dtype (default: config.json's dtype, else the embedding's stored dtype);
    the router weight and its correction bias stay fp32 as in the reference model."""
    path = Path(path)
    cfg = load_config(path)
    files = _weight_files(path)
    handles = {f: _open(f) for f in files}
    where: dict[str, Path] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, str] = {}
    for f, h in handles.items():
        for key in h.keys():
            sl = h.get_slice(key)
            where[key], shapes[key], dtypes[key] = f, tuple(sl.get_shape()), sl.get_dtype()

    with torch.device("meta"):
        model = CausalLM(cfg)
    stacked = {
        int(m.group(1))
        for k in shapes
        if (m := re.match(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$", k))
    }
    expected = _expected(model, stacked)
    present = {k for k in shapes if not _skippable(k, cfg)}
    missing = sorted(set(expected) - present)
    unexpected = sorted(present - set(expected))
    misshaped = sorted(
        f"{k} {list(shapes[k])} (expected {list(expected[k][0])})"
        for k in present & set(expected)
        if shapes[k] != expected[k][0]
    )
    quantized = sorted(
        k for k in present if dtypes[k].startswith("F8") or dtypes[k] in ("I8", "U8", "I32")
    )
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} tensor(s), e.g. {_examples(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor(s), e.g. {_examples(unexpected)}")
    if misshaped:
        problems.append(f"{len(misshaped)} tensor(s) with the wrong shape: {_examples(misshaped)}")
    if quantized:
        problems.append(
            f"{len(quantized)} quantized/integer tensor(s) (e.g. {quantized[0]} is {dtypes[quantized[0]]})"
        )
    if problems:
        raise CheckpointError(
            f"checkpoint {path} does not match its config.json ({cfg.num_hidden_layers} layers,"
            f" {cfg.n_routed_experts} experts): "
            + "; ".join(problems)
            + ". Check that config.json belongs to these weights."
        )

    if dtype is None:
        stored = _read_json(path / "config.json")
        name = stored.get("dtype") or stored.get("torch_dtype")
        dtype = _DTYPES.get(name) if isinstance(name, str) else None
        if dtype is None:
            embed = dtypes.get("model.embed_tokens.weight", "F32")
            dtype = {"BF16": torch.bfloat16, "F16": torch.float16}.get(embed, torch.float32)
    model = model.to(dtype)
    for moe in model.moe_layers():
        moe.router.float()
        moe.tokens_per_expert.data = moe.tokens_per_expert.float()
    model = model.to_empty(device="cpu")
    model.tie_weights()
    state = _state(model)
    with torch.no_grad():
        for key, (_, target) in expected.items():
            t = handles[where[key]].get_tensor(key)
            if isinstance(target, str):
                state[target].copy_(t)
            elif target[0] == "gate_up":
                layer = target[1]
                rows = t.shape[1] // 2
                state[f"layers.{layer}.mlp.experts.w_gate"].copy_(t[:, :rows])
                state[f"layers.{layer}.mlp.experts.w_up"].copy_(t[:, rows:])
            else:
                state[target[0]][target[1]].copy_(t)
        for moe in model.moe_layers():
            moe.tokens_per_expert.zero_()
        model.rope.reset_parameters()
    return model


# ---------------------------------------------------------------------------- writing


def _hf_tensors(model: CausalLM) -> Iterator[tuple[str, torch.Tensor]]:
    for name, t in _state(model).items():
        t = t.detach()
        m = _EXPERT.match(name)
        if not m:
            yield hf_name(name), t.contiguous()
            continue
        layer, which = m.groups()
        for e in range(t.shape[0]):
            # A clone: safetensors refuses tensors sharing one storage.
            yield f"model.layers.{layer}.mlp.experts.{e}.{which}_proj.weight", t[e].clone()


def save_pretrained(model: CausalLM, path: str | Path, max_shard_bytes: int = 5 * 2**30) -> None:
    """Write config.json + safetensors (sharded with an index above `max_shard_bytes`) in the
    hub layout that transformers' DeepseekV3ForCausalLM loads. Files are written to a temp
    directory first and moved into `path` only when complete; other files there are kept."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    dtype = model.embed.weight.dtype
    tmp = Path(tempfile.mkdtemp(prefix=".save-", dir=path))
    try:
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for key, t in _hf_tensors(model):
            nbytes = t.numel() * t.element_size()
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][key] = t
            size += nbytes
        names = (
            ["model.safetensors"]
            if len(shards) == 1
            else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        )
        weight_map = {}
        for shard, name in zip(shards, names):
            save_file(shard, str(tmp / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, name))
        if len(shards) > 1:
            total = sum(t.numel() * t.element_size() for s in shards for t in s.values())
            index = {
                "metadata": {"total_size": total},
                "weight_map": dict(sorted(weight_map.items())),
            }
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        (tmp / "config.json").write_text(
            json.dumps(config_to_hf(model.cfg, dtype), indent=2) + "\n"
        )
        new = {p.name for p in tmp.iterdir()}
        for p in sorted(tmp.iterdir(), key=lambda p: p.name == "config.json"):
            os.replace(p, path / p.name)
        for old in path.glob("model*.safetensors*"):
            if old.name not in new:  # shards of an earlier save with another layout
                old.unlink()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
