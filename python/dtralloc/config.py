"""DTRALLOC_CONF: reading, validating and describing the settings.

The option table itself lives in C++ (allocator/config.h); this module only
formats what the core reports, so there is one source of truth.
"""
from __future__ import annotations

import os
from typing import Mapping, Union

from . import _core

ConfLike = Union[None, str, Mapping[str, object]]


def conf_text(conf: ConfLike) -> str:
    """Normalise a conf given as text, a mapping, or None (= $DTRALLOC_CONF)."""
    if conf is None:
        return os.environ.get("DTRALLOC_CONF", "")
    if isinstance(conf, str):
        return conf
    if isinstance(conf, Mapping):
        return ",".join(f"{k}:{v}" for k, v in conf.items())
    raise TypeError(
        f"dtralloc: conf must be a 'key:value,...' string or a dict, not {type(conf).__name__}"
    )


def size_in_bytes(value, who: str, accepts: str = "bytes (an int) or a size such as '512M' or '20G'",
                  fraction: str = "") -> int:
    """A positive size given as an int (bytes) or a string with a unit
    ("512M", "20G"); `who` names the caller in the error, `accepts` what it
    takes, `fraction` what to write for a share instead (a caller that takes
    one)."""
    if isinstance(value, str):
        try:
            size = _core.parse_size(value)
        except _core.ConfigError:
            raise _core.ConfigError(f"{who}: bad budget {value!r}: expected a size with a unit such as "
                                    f"'512M' or '20G', or bytes as an int") from None
        try:
            bare = float(value)
        except ValueError:
            bare = None
        if bare is not None and not bare.is_integer():
            # parse_size reads a bare number as bytes, rounded up: "0.5" would
            # be a 1-byte budget, where DTRALLOC_CONF's budget:0.5 is half the
            # device's memory.
            raise _core.ConfigError(
                f"{who}: bad budget {value!r}: a number without a unit is a count of bytes, and this is "
                f"not a whole one; write a size with a unit such as '512M' or '20G'"
                + (f" ({fraction})" if fraction else ""))
        if size <= 0:
            raise ValueError(f"{who}: budget must be positive, got {value!r}")
        return size
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            raise ValueError(f"{who}: budget must be positive, got {value}")
        return value
    raise TypeError(f"{who}: budget must be {accepts}, not {value!r} ({type(value).__name__})")


def describe_config(conf: ConfLike = None) -> list[dict]:
    """Every option with its effective value, default, accepted values and doc.

    Raises ConfigError (a ValueError) naming the key when `conf` is invalid.
    """
    return _core.describe_config(conf_text(conf))


def effective_config(conf: ConfLike = None) -> dict[str, str]:
    """{option: effective value} for `conf` (default: $DTRALLOC_CONF)."""
    return {o["name"]: o["value"] for o in describe_config(conf)}


def format_config_table(conf: ConfLike = None) -> str:
    options = describe_config(conf)
    text = conf_text(conf)
    lines = [f"DTRALLOC_CONF={text!r}" if text else "DTRALLOC_CONF is not set (defaults)", ""]
    width = max(len(o["name"]) for o in options)
    for o in options:
        mark = "" if o["value"] == o["default"] else "   (default " + o["default"] + ")"
        lines.append(f"{o['name']:<{width}}  {o['value']}{mark}")
        lines.append(f"{'':<{width}}    {o['doc']}")
        lines.append(f"{'':<{width}}    accepts: {o['accepts']}")
    return "\n".join(lines)


def format_config_markdown() -> str:
    """The option table as markdown (the README's copy is checked against it)."""
    rows = ["| key | default | accepts | what it does |", "|---|---|---|---|"]
    for o in describe_config(""):
        rows.append(f"| `{o['name']}` | {o['default']} | {o['accepts']} | {o['doc']} |")
    return "\n".join(rows)
