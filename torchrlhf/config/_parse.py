"""Loading a YAML config and applying command-line overrides.

Overrides follow the tune/hydra conventions:

- ``key=value``   set an existing key (a typo is an error that names close matches),
- ``+key=value``  add a key that is not in the file,
- ``~key``        remove a key (e.g. drop a whole ``_component_`` section).

Values are parsed as YAML (``lr=1e-5`` is a float, ``stop=[a,b]`` a list, ``x=null`` None).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from torchrlhf.config._errors import ConfigError, close_matches

_MISSING = object()


def load_config(path: str | os.PathLike, overrides: Sequence[str] = (), *, add_missing: bool = False) -> DictConfig:
    """Read an OmegaConf YAML file and apply ``overrides`` in order (see `apply_overrides`)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file not found: {path}")
    cfg = OmegaConf.load(path)
    if not isinstance(cfg, DictConfig):
        raise ConfigError(f"{path}: the top level of a config must be a mapping, got {type(cfg).__name__}")
    return apply_overrides(cfg, overrides, add_missing=add_missing)


def apply_overrides(cfg: DictConfig, overrides: Sequence[str], *, add_missing: bool = False) -> DictConfig:
    """Apply ``key=value`` / ``+key=value`` / ``~key`` overrides to ``cfg`` (in place; returned for chaining).

    ``add_missing=True`` lets ``key=value`` add a key the file does not set, for configs that are checked
    against a schema afterwards (the schema then reports a misspelt key, with the close matches).
    """
    for item in overrides:
        if item.startswith("~"):
            key = item[1:]
            if not key or "=" in key:
                raise ConfigError(f"override {item!r}: removal takes a key only, e.g. ~critic")
            parent, last = _parent(cfg, key, item)
            if isinstance(parent, ListConfig):
                del parent[int(last)]
            else:
                parent.pop(last)
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.lstrip("+"):
            raise ConfigError(f"override {item!r} is not of the form key=value, +key=value or ~key")
        add = key.startswith("+")
        key = key.lstrip("+")
        parsed = _parse_value(value)
        if add_missing and not add and _select(cfg, key) is _MISSING:
            OmegaConf.update(cfg, key, parsed, merge=False, force_add=True)
        elif add:
            if _select(cfg, key) is not _MISSING:
                raise ConfigError(f"override {item!r}: key {key!r} already exists; set it with {key}=...")
            OmegaConf.update(cfg, key, parsed, merge=False, force_add=True)
        else:
            parent, last = _parent(cfg, key, item)
            if isinstance(parent, ListConfig):
                parent[int(last)] = parsed
            else:
                # Replace, not merge: `actor=...` should not keep stale keys of the old node.
                OmegaConf.update(cfg, key, parsed, merge=False)
    return cfg


def parse_args(argv: Sequence[str] | None = None) -> tuple[str, list[str]]:
    """Split a recipe command line ``--config X.yaml key=value ...`` into (config path, overrides)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    config_path: str | None = None
    overrides: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("--config", "-c"):
            if i + 1 >= len(argv):
                raise ConfigError(f"{arg} needs a path: --config recipes/configs/<name>.yaml")
            config_path = argv[i + 1]
            i += 2
            continue
        if arg.startswith("--config="):
            config_path = arg.split("=", 1)[1]
        elif arg.startswith("-") and not arg.startswith("~"):
            raise ConfigError(f"unknown argument {arg!r}; usage: --config X.yaml [key=value | +key=value | ~key ...]")
        elif "=" in arg or arg.startswith("~"):
            overrides.append(arg)
        else:
            raise ConfigError(f"argument {arg!r} is not an override (key=value, +key=value or ~key)")
        i += 1
    if config_path is None:
        raise ConfigError("missing --config: usage: --config X.yaml [key=value | +key=value | ~key ...]")
    return config_path, overrides


# ---------------------------------------------------------------------------- helpers
def _parse_value(value: str) -> Any:
    # OmegaConf's dotlist parser is YAML with the float fix (1e-5 is a float, not a string).
    return OmegaConf.to_container(OmegaConf.from_dotlist([f"v={value}"]))["v"]


def _select(cfg: DictConfig, key: str) -> Any:
    node: Any = cfg
    for part in key.split("."):
        if isinstance(node, DictConfig) and part in node.keys():
            node = node._get_node(part)
        elif isinstance(node, ListConfig) and part.lstrip("-").isdigit() and -len(node) <= int(part) < len(node):
            node = node._get_node(int(part))
        else:
            return _MISSING
    return node


def _parent(cfg: DictConfig, key: str, item: str) -> tuple[Any, str]:
    """The node holding ``key`` and its last component; unknown keys are an error with suggestions."""
    parts = key.split(".")
    node: Any = cfg
    for depth, part in enumerate(parts):
        where = ".".join(parts[:depth])
        if isinstance(node, DictConfig):
            if part not in node.keys():  # `in` is False for a mandatory "???" value
                siblings = [f"{where}.{k}" if where else str(k) for k in node.keys()]
                hint = close_matches(key, dict.fromkeys(siblings + _all_keys(cfg))) or (
                    f"; keys under {where!r}: {sorted(map(str, node.keys()))}" if where else ""
                )
                raise ConfigError(f"override {item!r}: unknown key {key!r}{hint}. Use +{key}=... to add a new key")
        elif isinstance(node, ListConfig):
            if not (part.lstrip("-").isdigit() and -len(node) <= int(part) < len(node)):
                raise ConfigError(f"override {item!r}: {where!r} is a list of {len(node)}; {part!r} is not an index")
        else:
            raise ConfigError(f"override {item!r}: {where!r} is a value ({node!r}), it has no key {part!r}")
        if depth < len(parts) - 1:
            node = node[part] if isinstance(node, DictConfig) else node[int(part)]
    return node, parts[-1]


def _all_keys(node: Any, prefix: str = "") -> list[str]:
    keys: list[str] = []
    if isinstance(node, DictConfig):
        for k in node.keys():
            full = f"{prefix}.{k}" if prefix else str(k)
            keys.append(full)
            child = node._get_node(k)
            if isinstance(child, (DictConfig, ListConfig)):
                keys.extend(_all_keys(child, full))
    return keys
