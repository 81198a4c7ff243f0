"""Configuration files: one TOML reader and one checked loader for every daemon.

A configuration is a tree of dataclasses, one per TOML table. Each field's type is
checked (booleans are not numbers, numbers are not strings; an int is taken where a float
is wanted; sizes may be written "500G"), and a field may state its range in its metadata
with `limits(...)`:

    store_capacity: int = field(default=0, metadata=limits(min=0, size=True))

A bad value stops the start with one line naming the key, the value and what is
allowed (`fetch.store_capacity = -1: must be at least 0`); an unknown key is a warning
naming it (`warnings`), so a file written for a newer version still starts. Tables a
loader does not own can be passed through (`dict` fields) and checked by their owner.
"""

from __future__ import annotations

import logging
import math
import os
import tomllib
import types
import typing
from collections.abc import Callable
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from shoal.errors import UsageError

# The node's root (`shoal node --root`) when none is given; the other default places
# are folders in it: the region's store (region/), the swarm's torrent storage (swarm/).
DEFAULT_ROOT = "/var/lib/shoal"

_SIZE_UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


class ConfigError(UsageError):
    """A configuration value that is not allowed (exit status 2, like a bad flag);
    str() is the one-line message."""


def limits(min: float | None = None, max: float | None = None, choices: tuple | None = None,
           size: bool = False, check: Callable[[Any], str | None] | None = None) -> dict:
    """Field metadata: the allowed range (inclusive), a set of choices, whether the
    value is a byte size ("500G"), and a check returning what is wrong (or None)."""
    return {"shoal.limits": {"min": min, "max": max, "choices": choices, "size": size, "check": check}}


def parse_size(text: object) -> int:
    """"500G", "1.5M", "4096", 4096 -> bytes. ValueError otherwise."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    if isinstance(text, str):
        t = text.strip().lower().removesuffix("ib").removesuffix("b")
        if t and t[-1] in _SIZE_UNITS:
            value = float(t[:-1]) * _SIZE_UNITS[t[-1]]
            if not math.isfinite(value):
                raise ValueError(text)
            return int(value)
        return int(t)
    raise ValueError(text)  # (a bool or any other type is no size either)


def url_check(schemes: tuple[str, ...] = ("http", "https"), empty: bool = True,
              path: bool = True) -> Callable[[Any], str | None]:
    """A check for URL fields: SCHEME://HOST[:PORT][/path] with one of `schemes` (no
    path when `path` is false; "" when `empty`)."""

    def check(value: str) -> str | None:
        if value == "" and empty:
            return None
        try:
            parsed = urlparse(value)
            parsed.port  # noqa: B018 (raises on a bad port)
        except ValueError:
            parsed = None
        if (parsed is None or parsed.scheme not in schemes or not parsed.hostname
                or (not path and parsed.path not in ("", "/"))):
            return f"want {' or '.join(s + '://HOST[:PORT]' for s in schemes)}"
        return None

    return check


def host_port_check(value: str) -> str | None:
    """A check for HOST:PORT fields (port 0-65535; "" allowed)."""
    if value == "":
        return None
    try:
        split_host_port(value)
    except ValueError as e:
        return str(e)
    return None


def readable_file_check(value: str) -> str | None:
    """A check for file fields: "" or a file this process can read."""
    if value and not os.access(value, os.R_OK):
        return "not a readable file"
    return None


def split_host_port(value: str) -> tuple[str, int]:
    """("host", port) of "HOST:PORT" or "[V6]:PORT"; ValueError naming what is wrong."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError("want HOST:PORT")
    if int(port) > 65535:
        raise ValueError(f"port {port} is more than 65535")
    return host.strip("[]"), int(port)


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else f"{v:g}"


def _describe(meta: dict) -> str:
    lo, hi = meta["min"], meta["max"]
    if lo is not None and hi is not None:
        return f"must be between {_num(lo)} and {_num(hi)}"
    if lo is not None:
        return f"must be at least {_num(lo)}"
    return f"must be at most {_num(hi)}"


def _fail(where: str, value: object, why: str) -> ConfigError:
    shown = repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return ConfigError(f"{where} = {shown}: {why}")


def _typed(value: object, hint: object, meta: dict | None, where: str, warnings: list[str]) -> object:
    if is_dataclass(hint):
        if not isinstance(value, dict):
            raise _fail(where, value, "must be a table")
        return build(hint, value, where, warnings)  # type: ignore[arg-type]
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None or value == "" and meta and meta.get("size"):
            return None
        hint, origin = args[0], typing.get_origin(args[0])
    if origin is list:
        (item,) = typing.get_args(hint) or (object,)
        if not isinstance(value, list):
            raise _fail(where, value, "must be a list")
        return [_typed(v, item, None, f"{where}[{i}]", warnings) for i, v in enumerate(value)]
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise _fail(where, value, "must be a table")
        return dict(value)
    if meta and meta.get("size"):
        try:
            value = parse_size(value)
        except ValueError:
            raise _fail(where, value, "must be a size in bytes (e.g. 500G, 64M, 4096)") from None
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if hint in (int, float, str, bool) and type(value) is not hint:
        names = {int: "a whole number", float: "a number", str: "a string", bool: "true or false"}
        raise _fail(where, value, f"must be {names[hint]}")
    if isinstance(value, float) and not math.isfinite(value):
        raise _fail(where, value, "must be a finite number")
    if meta:
        if meta.get("choices") is not None and value not in meta["choices"]:
            raise _fail(where, value, "must be one of " + ", ".join(map(repr, meta["choices"])))
        lo, hi = meta.get("min"), meta.get("max")
        if isinstance(value, (int, float)) and ((lo is not None and value < lo) or (hi is not None and value > hi)):
            raise _fail(where, value, _describe(meta))
        if meta.get("check") is not None:
            why = meta["check"](value)
            if why:
                raise _fail(where, value, why)
    return value


def build(cls: type, data: dict, where: str = "", warnings: list[str] | None = None,
          ignore: tuple[str, ...] = ()) -> Any:
    """An instance of the dataclass `cls` from a TOML table, every value checked.
    Unknown keys (except `ignore`) are skipped with a warning added to `warnings`."""
    warnings = warnings if warnings is not None else []
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in fields(cls)}
    kwargs = {}
    for key, value in data.items():
        name = f"{where}.{key}" if where else key
        f = known.get(key)
        if f is None:
            if key not in ignore:
                warnings.append(f"unknown configuration key {name} ignored (known here: {', '.join(sorted(known))})")
            continue
        kwargs[key] = _typed(value, hints[key], f.metadata.get("shoal.limits"), name, warnings)
    obj = cls(**kwargs)
    for f in fields(cls):  # defaults are checked too: they must be inside their own limits
        meta = f.metadata.get("shoal.limits")
        if meta and f.name not in kwargs and f.default is not MISSING and f.default is not None:
            _typed(f.default, hints[f.name], meta, f"{where}.{f.name}" if where else f.name, warnings)
    return obj


def load(cls: type, path: str | Path | None, overrides: dict | None = None,
         logger: logging.Logger | None = None) -> Any:
    """`cls` from the defaults, the TOML file in `path` (if any) and the non-None
    `overrides` (command-line flags win), every value checked; unknown keys are logged
    as warnings. ConfigError names the file, the key, the value and what is allowed."""
    data = read_toml(path) if path else {}
    data.update({k: v for k, v in (overrides or {}).items() if v is not None})
    warnings: list[str] = []
    try:
        obj = build(cls, data, "", warnings)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}" if path else str(e)) from None
    for w in warnings:
        (logger or logging.getLogger("shoal")).warning("%s: %s", path, w)
    return obj


def read_toml(path: str | Path) -> dict:
    """The TOML document in `path`; ConfigError naming the file on any problem."""
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the configuration: {e.strerror or e}") from None
