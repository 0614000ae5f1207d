"""Building objects from ``_component_`` config nodes.

A node ``{_component_: torch.optim.AdamW, lr: 1e-5}`` becomes ``torch.optim.AdamW(lr=1e-5)``.
Nested nodes with a ``_component_`` are built first (depth first) and passed in as
arguments; plain mappings and lists are passed as Python dicts and lists.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from torchrlhf.config._errors import ConfigError, close_matches

COMPONENT_KEY = "_component_"


def get_component(path: str) -> Any:
    """Import ``pkg.mod.Name`` (or ``pkg.mod:Name``) and return the object."""
    if not isinstance(path, str) or not path:
        raise ConfigError(f"component path must be a non-empty string, got {path!r}")
    if ":" in path:
        module_name, _, attr_path = path.partition(":")
        try:
            obj: Any = importlib.import_module(module_name)
        except ImportError as e:
            raise ConfigError(f"cannot import component {path!r}: {e}") from e
        return _getattr_path(obj, attr_path.split("."), path)
    parts = path.split(".")
    # Import the longest importable module prefix, then walk attributes (for nested classes).
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name and not module_name.startswith(e.name) and not e.name.startswith(module_name):
                raise ConfigError(f"cannot import component {path!r}: {e}") from e
            continue
        return _getattr_path(module, parts[cut:], path)
    raise ConfigError(f"cannot import component {path!r}: no module named {parts[0]!r}")


def load_callable(spec: str, what: str = "function") -> Any:
    """Import a user function (or class) from ``pkg.mod:fn``, ``pkg.mod.fn`` or ``/path/file.py:fn``.

    The one loader for user code named in a config (reward functions, tools, environments). The
    code runs with the permissions of the user who launched training: only name code you trust. A file,
    like a module, is imported once per process (kept in ``sys.modules``), however many names are taken from it.
    """
    path, sep, name = spec.rpartition(":")
    if sep and (path.endswith(".py") or os.sep in path):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{what} file not found: {path} (from {spec!r})")
        module_name = "torchrlhf_user_" + hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:12]
        module = sys.modules.get(module_name)
        if module is None:
            module_spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[module_name] = module
            try:
                module_spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[module_name]  # a file that fails to import is tried afresh next time
                raise
        if not hasattr(module, name):
            public = [n for n in vars(module) if not n.startswith("_")]
            raise ValueError(f"{what} {name!r} not found in {path}; it defines {public}")
        fn = getattr(module, name)
    else:
        fn = get_component(spec)
    if not callable(fn):
        raise ValueError(f"{what} {spec!r} is not callable (got {type(fn).__name__})")
    return fn


def _getattr_path(obj: Any, attrs: list[str], path: str) -> Any:
    for i, attr in enumerate(attrs):
        if not hasattr(obj, attr):
            owner = getattr(obj, "__name__", type(obj).__name__)
            names = [n for n in dir(obj) if not n.startswith("_")]
            raise ConfigError(f"cannot import component {path!r}: {owner!r} has no attribute {attr!r}"
                              f"{close_matches(attr, names)}")
        obj = getattr(obj, attr)
    return obj


def instantiate(node: DictConfig | Mapping[str, Any] | None, *args: Any, **kwargs: Any) -> Any:
    """Build the object described by ``node``.

    ``args`` and ``kwargs`` go to the top-level component (kwargs override config
    values), e.g. ``instantiate(cfg.optimizer, model.parameters())``. Returns None for a
    None node so optional sections can be left out of a config.
    """
    if node is None:
        return None
    if isinstance(node, DictConfig):
        container = OmegaConf.to_container(node, resolve=True)
    elif isinstance(node, Mapping):
        container = dict(node)
    else:
        raise ConfigError(f"instantiate expects a config mapping with {COMPONENT_KEY!r}, got {type(node).__name__}")
    if COMPONENT_KEY not in container:
        raise ConfigError(f"instantiate: the node has no {COMPONENT_KEY!r} key (keys: {sorted(container)})")
    container.update(kwargs)
    key = str(node._get_full_key(None)) if isinstance(node, DictConfig) and node._get_parent() is not None else ""
    return _build(container, key, args)


def _build(node: Any, key: str, args: tuple[Any, ...] = ()) -> Any:
    if isinstance(node, (dict, DictConfig)):
        if COMPONENT_KEY in node:
            return _call_component(node, key, args)
        return {k: _build(v, _join(key, str(k))) for k, v in node.items()}
    if isinstance(node, (list, ListConfig)):
        return [_build(v, f"{key}[{i}]") for i, v in enumerate(node)]
    return node


def _call_component(node: Mapping[str, Any], key: str, args: tuple[Any, ...]) -> Any:
    path = node[COMPONENT_KEY]
    where = f" (config key {key!r})" if key else ""
    try:
        fn = get_component(path)
    except ConfigError as e:
        raise ConfigError(f"{e}{where}") from e
    if not callable(fn):
        raise ConfigError(f"component {path!r}{where} is not callable")
    kwargs = {k: _build(v, _join(key, k)) for k, v in node.items() if k != COMPONENT_KEY}
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: let the call check the arguments
        sig = None
    if sig is not None:
        try:
            sig.bind(*args, **kwargs)
        except TypeError as e:
            params = [p for p in sig.parameters if p not in ("self", "args", "kwargs")]
            unknown = [k for k in kwargs if k not in sig.parameters]
            if unknown and not any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
                bad = unknown[0]
                raise ConfigError(
                    f"component {path!r}{where}: unexpected argument {_join(key, bad)!r}"
                    f"{close_matches(bad, params)}; accepted arguments: {params}"
                ) from e
            raise ConfigError(f"component {path!r}{where}: {e}; accepted arguments: {params}") from e
    try:
        return fn(*args, **kwargs)
    except Exception as e:
        e.add_note(f"while instantiating {path!r}{where} with arguments {sorted(kwargs)}")
        raise


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key
