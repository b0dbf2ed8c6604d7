"""Typed YAML configs: files with ``base:`` inheritance and ``a.b=value`` overrides, read into
validated dataclasses. Used by the Megatron integration (the ``model:`` section) and by the
training program's run config (megatron_moe/training/run_config.py).

    data = read_config_file(find_config("dmoe-xs"))       # a shipped config, or any path
    data = apply_overrides(data, ["model.moe.top_k=2"])
    model_cfg = build_dataclass(ModelConfig, data["model"], "model")

Rules:
  * ``base: other.yaml`` inherits another config: a path relative to the file that names it,
    else the name of a shipped config (``base: gpt-xs``); the child is deep-merged over it
    (mappings merge key by key, anything else replaces), chains of bases work, cycles are an
    error. ``name`` is never inherited: it is the file's own ``name:`` or, failing that, the
    file's stem.
  * Overrides ``a.b=value`` are applied last; the value is parsed as a YAML scalar/flow value
    (``3e-4`` is a float, ``null`` is None, ``[a.txt, b.txt]`` is a list).
  * Unknown keys are rejected with a "did you mean" suggestion; values of the wrong type are
    rejected naming the key; each dataclass's ``__post_init__`` then checks its own ranges and
    raises ``ValueError`` naming ``section.field``, which becomes a :class:`ConfigError`.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any

from megatron_moe.megatron import require

require("yaml")  # before its import below

import yaml  # noqa: E402

from megatron_moe._validation import is_int

__all__ = ["ConfigError", "find_config", "shipped_configs", "read_config_file", "apply_overrides",
           "parse_override", "build_dataclass"]


class ConfigError(ValueError):
    """A config that cannot be loaded: the message names the key and what would be valid."""


def _shipped_dir() -> Path:
    """The configs shipped with the package (an installed wheel), or the checkout's configs/."""
    pkg = Path(__file__).resolve().parent.parent
    for cand in (pkg / "configs", pkg.parent / "configs"):
        if cand.is_dir():
            return cand
    return pkg / "configs"


def shipped_configs() -> list[str]:
    """Names of the shipped configs (``tiny-cpu``, ``dmoe-xs``, ...)."""
    return sorted(p.stem for p in _shipped_dir().glob("*.yaml"))


def find_config(name_or_path: str | Path) -> Path:
    """A config file: an existing path, else a shipped config by name (``tiny-cpu`` or
    ``tiny-cpu.yaml``); else a ConfigError listing the shipped ones."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    shipped = _shipped_dir()
    if p.parent == Path("."):  # a bare name
        for cand in (shipped / p.name, shipped / f"{p.name}.yaml"):
            if cand.is_file():
                return cand
        raise ConfigError(f"config {str(name_or_path)!r}: no such file here and no shipped config of "
                          f"that name (shipped: {', '.join(shipped_configs()) or 'none'})")
    raise ConfigError(f"config file {p} does not exist (shipped configs, by name: "
                      f"{', '.join(shipped_configs()) or 'none'})")


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-4`` as a float (YAML 1.2) and rejects duplicate keys."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise ConfigError(f"duplicate key {key!r} {key_node.start_mark}".strip())
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _read_yaml(path: Path) -> dict:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from None
    try:
        data = yaml.load(text, Loader=_Loader)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections (name, model, train, data, "
                          f"logging) at the top, got {type(data).__name__}")
    return data


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def _resolve_file(path: Path, chain: tuple[Path, ...]) -> dict:
    path = path.resolve()
    if path in chain:
        cycle = " -> ".join(str(p) for p in (*chain, path))
        raise ConfigError(f"config inheritance cycle: {cycle}")
    data = _read_yaml(path)
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str) or not base:
        raise ConfigError(f"{path}: base={base!r} is invalid: expected a config file (relative to "
                          "this file) or the name of a shipped config")
    base_path = _find_base(path, base)
    parent = _resolve_file(base_path, (*chain, path))
    parent.pop("name", None)  # a run's name is never inherited
    return _deep_merge(parent, data)


def _find_base(path: Path, base: str) -> Path:
    """``base:`` of the file at ``path``: a file relative to it (``.yaml`` may be left out), else a
    shipped config of that name."""
    for cand in (path.parent / base, path.parent / f"{base}.yaml"):
        if cand.is_file():
            return cand
    shipped = _shipped_dir()
    name = Path(base).name
    for cand in (shipped / name, shipped / f"{name}.yaml"):
        if Path(base).parent == Path(".") and cand.is_file():
            return cand
    raise ConfigError(f"{path}: base config {base!r} does not exist: neither a file relative to this "
                      f"one ({path.parent / base}) nor a shipped config (shipped: "
                      f"{', '.join(shipped_configs()) or 'none'})")


def parse_override(text: str) -> tuple[list[str], Any]:
    """'a.b=value' -> (['a', 'b'], value parsed as YAML)."""
    if not isinstance(text, str) or "=" not in text:
        raise ConfigError(f"override {text!r} is invalid: expected key=value, e.g. train.lr=3e-4")
    key, _, raw = text.partition("=")
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {text!r} is invalid: expected a dotted key such as "
                          "train.lr or model.moe.top_k before '='")
    if parts[0] == "base":
        raise ConfigError(f"override {text!r} is invalid: base can only be set inside a config file")
    try:
        value = yaml.load(raw, Loader=_Loader) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: the value is not valid YAML: {e}") from None
    return parts, value


def _apply_override(data: dict, parts: list[str], value: Any, text: str) -> None:
    node = data
    for i, p in enumerate(parts[:-1]):
        nxt = node.get(p)
        if nxt is None:
            nxt = node[p] = {}
        elif not isinstance(nxt, dict):
            raise ConfigError(f"override {text!r} is invalid: {'.'.join(parts[:i + 1])} is a value "
                              f"({nxt!r}), not a section")
        node = nxt
    node[parts[-1]] = value


# ----------------------------------------------------------------------------- typed building


def _type_name(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(hint))
    if hint is type(None):
        return "null"
    if dataclasses.is_dataclass(hint):
        return "a mapping"
    if origin in (list, tuple):
        args = [a for a in typing.get_args(hint) if a is not Ellipsis]
        return f"a list of {_type_name(args[0])}" if args else "a list"
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    return {bool: "true or false", int: "an int", float: "a number", str: "a string"}.get(
        hint, getattr(hint, "__name__", str(hint)))


class _Mismatch(Exception):
    pass


def _convert(value: Any, hint: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``hint`` (converting int -> float and nested
    mappings -> dataclasses); raise ConfigError naming ``key`` when it does not fit."""
    try:
        return _convert_inner(value, hint, key)
    except _Mismatch:
        raise ConfigError(f"{key}={value!r} has the wrong type: expected {_type_name(hint)}, "
                          f"got {type(value).__name__}") from None


def _convert_inner(value: Any, hint: Any, key: str) -> Any:
    if hint is Any or hint is object:
        return value
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None:
            if type(None) in args:
                return None
            raise _Mismatch
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert_inner(value, a, key)
            except _Mismatch:
                continue
        raise _Mismatch
    if hint is type(None):
        if value is None:
            return None
        raise _Mismatch
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise _Mismatch
        return _build(hint, value, key)
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch
    if hint is int:
        if is_int(value):
            return value
        raise _Mismatch
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise _Mismatch
    if hint is str:
        if isinstance(value, str):
            return value
        raise _Mismatch
    if origin is typing.Literal:
        if value in typing.get_args(hint):
            return value
        raise _Mismatch
    if origin in (list, tuple) or hint in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise _Mismatch
        args = typing.get_args(hint)
        if origin is tuple and args and Ellipsis not in args:
            if len(value) != len(args):
                raise _Mismatch
            items = [_convert(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args))]
        else:
            elem = args[0] if args else Any
            items = [_convert(v, elem, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if (origin is tuple or hint is tuple) else items
    if origin is dict or hint is dict:
        if isinstance(value, dict):
            return value
        raise _Mismatch
    if isinstance(hint, type):
        if isinstance(value, hint):
            return value
        raise _Mismatch
    return value


def _unknown_key(section: str, key: str, valid: list[str]) -> ConfigError:
    full = f"{section}.{key}" if section else str(key)
    close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.6)
    if close:
        hint = f"{section}.{close[0]}" if section else close[0]
        return ConfigError(f"unknown key '{full}': did you mean '{hint}'?")
    where = f"'{section}'" if section else "the top level"
    return ConfigError(f"unknown key '{full}': valid keys in {where} are {', '.join(valid)}")


def _build(cls: type, data: dict, section: str) -> Any:
    fields = [f for f in dataclasses.fields(cls) if f.init]
    names = [f.name for f in fields]
    for k in data:
        if k not in names:
            raise _unknown_key(section, k, names)
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # unresolvable annotation: fall back to no type checking
        hints = {}
    kwargs = {}
    for f in fields:
        key = f"{section}.{f.name}" if section else f.name
        if f.name in data:
            kwargs[f.name] = _convert(data[f.name], hints.get(f.name, Any), key)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"missing key '{key}' (required)")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        msg = str(e)
        if section and not msg.startswith(section):
            # MoEConfig-style messages ("MoEConfig.top_k=...") or bare field names: say where.
            msg = f"{section}: {msg}"
        raise ConfigError(msg) from None


def read_config_file(path: str | Path) -> dict:
    """The config at ``path`` with its ``base:`` chain merged in, as a plain dict; ``name``
    defaults to the file's stem."""
    path = Path(path)
    data = _resolve_file(path, ())
    data.setdefault("name", path.stem)
    return data


def apply_overrides(data: dict, overrides: list[str] | None) -> dict:
    """A deep copy of ``data`` with ``key=value`` overrides applied."""
    data = copy.deepcopy(data) if data else {}
    for text in overrides or []:
        parts, value = parse_override(text)
        _apply_override(data, parts, value, text)
    return data


def build_dataclass(cls: type, data: dict, section: str) -> Any:
    """``cls(**data)`` with every key checked (unknown keys, types) and errors naming
    ``section.key``; nested dataclass fields are built from nested mappings."""
    return _build(cls, data, section)
