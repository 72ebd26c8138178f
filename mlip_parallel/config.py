"""YAML configurations of the command-line tools (mlip-md, mlip-train): a schema of
``key: (type, default, help)`` entries (a dict value is a nested section), validation that names the
offending key, and help text listing every key; the error report and output-directory check the CLIs
share. This module imports neither torch nor MPI: a CLI validates its config before it needs them."""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
from pathlib import Path
from typing import Callable

from potentials.rules import describe_rule, number_problem, obeys  # noqa: F401  (obeys: the CLIs' rule check)

from .errors import MLIPError
from .launch import launch_rank  # noqa: F401  (re-exported: where the CLIs' helpers are)


class ConfigError(MLIPError, ValueError):
    """An invalid configuration; the message names the key."""


@dataclasses.dataclass(frozen=True)
class ConfigTable:
    """A tool's configuration keys (mlip-md's, mlip-train's): ``sections`` {key: (types, default, help), or a nested
    section of such}, ``rules`` {dotted key: rule} (``validate``), and ``model()`` -> (keys, rules): the model
    section's keys and rules that come from the model families (``model_section``), built at each use since another
    package's family may join the registry. Those keys go after the first ``model_after`` of the section's own keys
    (a table without a model section gets one, first). A model key's spec may be a function that returns it, called
    at each use (a help text that lists what the registry holds)."""

    sections: dict
    rules: dict
    model: Callable[[], tuple]
    model_after: int = 0

    def schema(self) -> dict:
        """The whole table, the families' model keys in it."""
        own = [(key, spec() if callable(spec) else spec) for key, spec in self.sections.get("model", {}).items()]
        model = dict(own[:self.model_after] + list(self.model()[0].items()) + own[self.model_after:])
        return {**self.sections, "model": model} if "model" in self.sections else {"model": model, **self.sections}

    def all_rules(self) -> dict:
        """``rules`` with the families' model rules (the tool's own win)."""
        return {**self.model()[1], **self.rules}

    def validate(self, config) -> dict:
        """Fill defaults and check every key and type of ``config``; ConfigError naming the key."""
        return validate(config, self.schema(), self.all_rules())

    def help(self) -> str:
        """Every key with its help text and default (``schema_help``)."""
        return schema_help(self.schema())


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


def check_number(name: str, value, rule: str = ">= 0") -> None:
    """ConfigError naming ``name`` unless ``value`` is a finite number (not a bool) obeying ``rule``
    (``potentials.rules``)."""
    problem = number_problem(name, value, rule)
    if problem:
        raise ConfigError(problem)


def validate(config, schema: dict, rules: dict | None = None, path: str = "") -> dict:
    """Fill defaults and check every key and type (ints are accepted for floats); raise ConfigError
    naming the key. A key's type may be a tuple of types. ``rules[dotted.key]``: a tuple of allowed values,
    or a range of a number (``obeys``); a number without a rule must be finite and >= 0."""
    rules = rules or {}
    if config is None:
        config = {}
    if not isinstance(config, dict):
        raise ConfigError(f"{path.rstrip('.') or 'the config'} must be a mapping, got {type(config).__name__}")
    unknown = sorted(set(config) - set(schema))
    if unknown:
        close = difflib.get_close_matches(str(unknown[0]), list(schema), n=1)
        hint = f"did you mean {path}{close[0]}?" if close else f"known: {', '.join(schema)}"
        raise ConfigError(f"unknown key {path}{unknown[0]!s} ({hint})")
    out = {}
    for key, spec in schema.items():
        name = f"{path}{key}"
        if isinstance(spec, dict):
            out[key] = validate(config.get(key), spec, rules, name + ".")
            continue
        types, default, _ = spec
        value = config.get(key, default)
        if value is not None:
            if types is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if not isinstance(value, types) or (types is not bool and isinstance(value, bool)):
                names = " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
                raise ConfigError(f"{name} must be {names}, got {value!r}")
            if types in (int, float):
                check_number(name, value, rules.get(name, ">= 0"))
            elif name in rules and value not in rules[name]:
                raise ConfigError(f"{name} must be {describe_rule(rules[name])}, got {value!r}")
        out[key] = value
    return out


def read_config(path) -> dict:
    """The YAML file at ``path``; ConfigError when it cannot be read or parsed."""
    import yaml

    try:
        with open(path) as f:
            return yaml.safe_load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read config {str(path)!r}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"cannot read config {str(path)!r}: {exc}") from None


def config_parser(prog: str, description: str, schema: dict) -> argparse.ArgumentParser:
    """``prog CONFIG.yaml``, its ``--help`` listing every key of ``schema`` (plain text: reST double
    backquotes are dropped)."""
    parser = argparse.ArgumentParser(prog=prog, description=description.replace("``", ""),
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="configuration keys (YAML):\n" + schema_help(schema).replace("``", ""))
    parser.add_argument("config", help="YAML configuration file")
    parser.add_argument("--no-progress", action="store_true", help="no progress report (output.progress: false); "
                        "by default a bar on a terminal, a line every so often in a log file")
    return parser


def read_job(args, schema: dict, rules: dict) -> dict:
    """The validated config of a CLI's ``args`` (``config_parser``): the YAML file, then ``--no-progress``."""
    config = validate(read_config(args.config), schema, rules)
    if args.no_progress:
        config["output"]["progress"] = False
    return config


def report_error(prog: str, exc) -> None:
    """Print ``prog: error: exc`` to stderr once per job: on rank 0 only (every rank raises the same
    ConfigError; each then exits with status 2)."""
    if launch_rank() == 0:
        print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)


def check_output_directory(directory, overwrite: bool, key: str = "output.directory") -> None:
    """ConfigError when ``directory`` exists and is not an empty directory, unless ``overwrite`` (a run
    that continues another, from a restart or resume, does not call this)."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"{key}: {str(directory)!r} exists and is not a directory")
    held = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
    if held and not overwrite:
        shown = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
        raise ConfigError(f"{key}: {str(directory)!r} is not empty ({shown}); set output.overwrite: true to "
                          f"write over it, or choose another directory")
