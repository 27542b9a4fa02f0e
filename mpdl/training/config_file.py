"""A `TrainConfig` as TOML: the file of `mpdl train --config run.toml` and `--print-config`.

A table per section, its options by name; an option left out keeps its default (an option whose
value is None is left out; an unset learning rate is a comment giving the default it gets):

    [model]
    name = "gpt"

    [optim]
    epochs = 8
    lr = 0.003
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import tomli_w

from mpdl.training.config import (
    OPTIONS,
    SECTIONS,
    ConfigError,
    TrainConfig,
    default_lr,
    literal,
    option_type,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

#: what a value of each option type must be in the file
EXPECTED = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The options the TOML file at path sets, by key ({"optim.epochs": 8}); ConfigError naming
    the file and the key for a section or option that does not exist or a value of the wrong
    type."""
    try:
        with open(path, "rb") as f:
            tables = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(literal(f"{path}: cannot read the configuration: "
                                  f"{exc.strerror or exc}")) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(literal(f"{path}: not TOML: {exc}")) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(literal(f"{path}: not UTF-8 text (byte {exc.object[exc.start]:#04x} "
                                  f"at offset {exc.start}); TOML files are UTF-8")) from None
    values = {}
    for section, table in tables.items():
        if section not in SECTIONS:
            what = f"[{section}]: no such section" if isinstance(table, dict) else \
                f"{section}: not in a section"
            raise ConfigError(literal(f"{path}: {what} (the sections: {', '.join(SECTIONS)})"))
        if not isinstance(table, dict):
            raise ConfigError(literal(f"{path}: {section}: expected a table [{section}] of "
                                      f"options, got {table!r}"))
        for name, value in table.items():
            key = f"{section}.{name}"
            if key not in OPTIONS:
                names = ", ".join(k.split(".")[1] for k in OPTIONS if k.startswith(section + "."))
                raise ConfigError(literal(f"{path}: {key}: no such option (the options of "
                                          f"[{section}]: {names})"))
            values[key] = _typed(path, key, value)
    return values


def _typed(path: str | Path, key: str, value: Any) -> Any:
    """value as the option's type (an integer where a number is expected is one)."""
    kind = option_type(key)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if type(value) is not kind:
        raise ConfigError(literal(f"{path}: {key}: expected {EXPECTED[kind]}, got {value!r}"))
    return value


def config_toml(config: TrainConfig) -> str:
    """The configuration as TOML that `read_config_file` reads back into the same one; an unset
    learning rate is a comment that gives the default the run uses."""
    text = tomli_w.dumps({section: {name: value for name, value in values.items()
                                    if value is not None}
                          for section, values in dataclasses.asdict(config).items()})
    if config.optim.lr is not None:
        return text
    c = config
    lr = default_lr(c.model.name, c.optim.optimizer, c.communication.compression,
                    experts=bool(c.model.moe_experts))
    unset = (f"# lr = {lr!r}  # unset: {c.model.name} with {c.optim.optimizer} uses this "
             f"default; set lr to choose another\n")
    return text.replace("[optim]\n", "[optim]\n" + unset, 1)
