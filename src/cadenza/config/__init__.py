"""Typed configs with presets, loaded from YAML and overridden with key=value."""

from cadenza.config.base import ConfigError, dump_yaml, from_dict, parse_overrides, to_dict
from cadenza.config.job import PRESETS, Config, load_config
from cadenza.config.model import ModelConfig, RopeScaling

__all__ = [
    "PRESETS",
    "Config",
    "ConfigError",
    "ModelConfig",
    "RopeScaling",
    "dump_yaml",
    "from_dict",
    "load_config",
    "parse_overrides",
    "to_dict",
]
