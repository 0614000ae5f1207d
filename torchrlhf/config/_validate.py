"""Checking a config section against a dataclass schema.

The schema is plain dataclasses (one per section, nested for sub-sections). `validate`
reports every problem at once — unknown keys with close matches, wrong types, values
outside a ``Literal`` — each with its full dotted key, then returns typed objects.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, TypeVar, Union

from omegaconf import DictConfig, ListConfig, OmegaConf

from torchrlhf.config._errors import ConfigError, close_matches

T = TypeVar("T")
_INVALID = object()


def validate(cfg: DictConfig | Mapping[str, Any], schema: type[T], *, key: str = "") -> T:
    """Check ``cfg`` against the dataclass ``schema`` and return an instance of it.

    Args:
        cfg: the section (interpolations are resolved first).
        schema: a dataclass; fields without a default are required keys.
        key: dotted prefix for error messages, e.g. ``"algorithm"`` when validating ``cfg.algorithm``.

    Raises:
        ConfigError: listing every bad key as ``<key>: expected <type>, got <value>``.
    """
    if not (dataclasses.is_dataclass(schema) and isinstance(schema, type)):
        raise TypeError(f"validate: schema must be a dataclass type, got {schema!r}")
    if isinstance(cfg, (DictConfig, ListConfig)):
        cfg = OmegaConf.to_container(cfg, resolve=True)
    errors: list[str] = []
    result = _check_dataclass(cfg, schema, key, errors)
    if errors:
        where = f" in {key!r}" if key else ""
        raise ConfigError(f"invalid config{where}:\n" + "\n".join(f"  - {e}" for e in errors))
    return result


def _check_dataclass(value: Any, schema: type, key: str, errors: list[str]) -> Any:
    if value is None:
        value = {}
    if not isinstance(value, Mapping):
        errors.append(f"{key or '<root>'}: expected a mapping for section {schema.__name__}, got {value!r}")
        return _INVALID
    hints = typing.get_type_hints(schema)
    fields = {f.name: f for f in dataclasses.fields(schema) if f.init}
    for k in value:
        if k not in fields:
            errors.append(f"{_join(key, k)}: unknown key{close_matches(str(k), fields)}; "
                          f"valid keys of {schema.__name__}: {sorted(fields)}")
    kwargs = {}
    for name, field in fields.items():
        if name in value:
            checked = _check(value[name], hints[name], _join(key, name), errors)
            if checked is not _INVALID:
                kwargs[name] = checked
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            if dataclasses.is_dataclass(hints[name]):  # a section that may be left out entirely
                kwargs[name] = _check_dataclass({}, hints[name], _join(key, name), errors)
            else:
                errors.append(f"{_join(key, name)}: missing required key (expected {_type_name(hints[name])})")
    if any(v is _INVALID for v in kwargs.values()) or errors:
        return _INVALID
    try:
        return schema(**kwargs)
    except (TypeError, ValueError) as e:  # a schema's own __post_init__ checks; "field: why" names the key
        text = str(e)
        name, sep, why = text.partition(": ")
        if sep and name in fields:
            errors.append(f"{_join(key, name)}: {why}")
        else:  # a message that names its section already is kept as it is
            errors.append(text if key and text.startswith(f"{key}") else f"{key or '<root>'}: {text}")
        return _INVALID


def _check(value: Any, tp: Any, key: str, errors: list[str]) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any or tp is object:
        return value
    if dataclasses.is_dataclass(tp):
        return _check_dataclass(value, tp, key, errors)
    if origin is Literal:
        if value in args and not (isinstance(value, bool) and not any(isinstance(a, bool) for a in args)):
            return value
        errors.append(f"{key}: expected one of {list(args)}, got {value!r}{close_matches(str(value), map(str, args))}")
        return _INVALID
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        for option in options:
            trial: list[str] = []
            checked = _check(value, option, key, trial)
            if not trial:
                return checked
        if len(options) == 1:  # Optional[X]: report X's own error (e.g. the Literal choices)
            trial = []
            _check(value, options[0], key, trial)
            errors.extend(e.replace(f"{key}: expected ", f"{key}: expected None or ", 1) for e in trial)
        else:
            errors.append(f"{key}: expected {_type_name(tp)}, got {value!r}")
        return _INVALID
    if origin in (list, tuple, typing.Sequence, typing.MutableSequence) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            errors.append(f"{key}: expected {_type_name(tp)}, got {value!r}")
            return _INVALID
        if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
            if len(value) != len(args):
                errors.append(f"{key}: expected {len(args)} items ({_type_name(tp)}), got {value!r}")
                return _INVALID
            items = [_check(v, a, f"{key}[{i}]", errors) for i, (v, a) in enumerate(zip(value, args))]
        else:
            item_tp = args[0] if args else Any
            items = [_check(v, item_tp, f"{key}[{i}]", errors) for i, v in enumerate(value)]
        if any(v is _INVALID for v in items):
            return _INVALID
        return tuple(items) if (origin is tuple or tp is tuple) else items
    if origin in (dict, typing.Mapping, typing.MutableMapping) or tp is dict:
        if not isinstance(value, Mapping):
            errors.append(f"{key}: expected {_type_name(tp)}, got {value!r}")
            return _INVALID
        val_tp = args[1] if len(args) == 2 else Any
        out = {k: _check(v, val_tp, _join(key, str(k)), errors) for k, v in value.items()}
        return _INVALID if any(v is _INVALID for v in out.values()) else out
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif isinstance(tp, type):
        if isinstance(value, tp):
            return value
    else:
        return value  # an annotation we do not interpret (e.g. a TypeVar): accept as is
    errors.append(f"{key}: expected {_type_name(tp)}, got {value!r} ({type(value).__name__})")
    return _INVALID


def _type_name(tp: Any) -> str:
    if isinstance(tp, type) and not typing.get_args(tp):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _join(prefix: str, key: Any) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def schema_from_signature(fn: Any, *, name: str, exclude: tuple[str, ...] = ()) -> type:
    """A dataclass whose fields are ``fn``'s keyword parameters, so a config section mirrors a constructor.

    Parameters without a default become required keys; ``exclude`` drops the ones the recipe sets itself
    (they then read as unknown keys if a config sets them). ``fn`` may be a class (its ``__init__``); a
    subclass whose ``__init__`` forwards ``**kwargs`` also gets its bases' parameters.
    """
    targets = [c.__init__ for c in fn.__mro__ if "__init__" in vars(c)] if isinstance(fn, type) else [fn]
    required, optional, seen = [], [], set(exclude) | {"self"}
    for target in targets:
        hints = typing.get_type_hints(target)
        params = inspect.signature(target).parameters.values()
        for p in params:
            if p.name in seen or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            seen.add(p.name)
            tp = hints.get(p.name, Any)
            if p.default is inspect.Parameter.empty:
                required.append((p.name, tp))
            else:
                optional.append((p.name, tp, dataclasses.field(default=p.default)))
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return dataclasses.make_dataclass(name, required + optional)


def as_section(cls: type[T], value: T | Mapping[str, Any] | None) -> T:
    """A section object from itself, a mapping (a notebook's dict), or None (its defaults): the one way a
    constructor takes a checked section such as `PolicyLoss` without checking one it was given again."""
    return value if isinstance(value, cls) else cls(**(value or {}))
