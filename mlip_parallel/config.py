"""YAML configurations of the command-line tools (mlip-md, mlip-train): a schema of
``key: (type, default, help)`` entries (a dict value is a nested section), validation that names the
offending key, and help text listing every key."""
from __future__ import annotations

import argparse

from .errors import MLIPError


class ConfigError(MLIPError, ValueError):
    """An invalid configuration; the message names the key."""


def schema_help(schema: dict, prefix: str = "") -> str:
    """Every key with its help text and default, one per line, sections indented."""
    lines = []
    for key, spec in schema.items():
        if isinstance(spec, dict):
            lines.append(f"{prefix}{key}:")
            lines.append(schema_help(spec, prefix + "  "))
        else:
            types, default, text = spec
            lines.append(f"{prefix}{key}: {text} (default: {default})")
    return "\n".join(lines)


def validate(config, schema: dict, choices: dict | None = None, path: str = "") -> dict:
    """Fill defaults and check every key and type (ints are accepted for floats, numbers must be >= 0,
    ``choices[dotted.key]`` lists allowed values); raise ConfigError naming the key."""
    choices = choices or {}
    if config is None:
        config = {}
    if not isinstance(config, dict):
        raise ConfigError(f"{path.rstrip('.') or 'the config'} must be a mapping, got {type(config).__name__}")
    unknown = sorted(set(config) - set(schema))
    if unknown:
        raise ConfigError(f"unknown key {path}{unknown[0]!s} (known: {', '.join(schema)})")
    out = {}
    for key, spec in schema.items():
        name = f"{path}{key}"
        if isinstance(spec, dict):
            out[key] = validate(config.get(key), spec, choices, name + ".")
            continue
        types, default, _ = spec
        value = config.get(key, default)
        if value is not None:
            if types is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if not isinstance(value, types) or (types is not bool and isinstance(value, bool)):
                raise ConfigError(f"{name} must be {types.__name__}, got {value!r}")
            if name in choices and value not in choices[name]:
                raise ConfigError(f"{name} must be one of {choices[name]}, got {value!r}")
            if types in (int, float) and value < 0:
                raise ConfigError(f"{name} must be >= 0, got {value}")
        out[key] = value
    return out


def read_config(path) -> dict:
    """The YAML file at ``path``; ConfigError when it cannot be read or parsed."""
    import yaml

    try:
        with open(path) as f:
            return yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read config {str(path)!r}: {exc}") from None


def config_parser(prog: str, description: str, schema: dict) -> argparse.ArgumentParser:
    """``prog CONFIG.yaml``, its ``--help`` listing every key of ``schema``."""
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="configuration keys (YAML):\n" + schema_help(schema))
    parser.add_argument("config", help="YAML configuration file")
    return parser
