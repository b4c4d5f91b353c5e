"""Select a tier by URL: ``"/path?every=100&keep=3"``, ``"file:///path?..."``.

:func:`parse_tier` is called by config.py (the tier URLs of ``SnapshotCallback(tiers=...)``), loader.py (a source
given as a URL or a step directory) and the CLI (cli.py: ``copy``'s destination).

The scheme picks the backend class lazily (as fsspec's registry does), so a LightningCLI YAML can list tiers as
strings. Query options: ``every`` (``every_n_train_steps``: steps, or ``auto``), ``min_every``/``max_every`` (the
bounds of ``every=auto``), ``interval`` (``train_time_interval``: seconds, or a
number with an ``s``/``m``/``h`` suffix) and ``keep`` (``keep_last``; ``all`` keeps every snapshot); a local path
also ``node_local`` (``auto``, ``true``, ``false``) and ``mode`` (octal file permissions, ``0600``), a RAM tier
``erasure``, ``idle`` and ``threads``.
"""

from __future__ import annotations

import datetime as _dt
import importlib
import re
import urllib.parse
from typing import Any

from lightning_snapshot.backends.base import Backend
from lightning_snapshot.errors import ConfigError
from lightning_snapshot.schedule.interval import AUTO

__all__ = ["KNOWN_SCHEMES", "parse_tier"]

#: scheme -> (module, class). Schemes of later tiers are listed with the release that brings them.
_OBJECT = ("lightning_snapshot.backends.object_store", "ObjectStoreTier")
KNOWN_SCHEMES: dict[str, tuple[str, str]] = {
    "": ("lightning_snapshot.backends.local", "LocalTier"),
    "file": ("lightning_snapshot.backends.local", "LocalTier"),
    **{scheme: _OBJECT for scheme in ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "memory")},
    "ram": ("lightning_snapshot.backends.ram", "RamTier"),
}
_PLANNED: dict[str, str] = {}
_OPTIONS = {
    "every": "every_n_train_steps",
    "interval": "train_time_interval",
    "keep": "keep_last",
    "min_every": "min_every",
    "max_every": "max_every",
}
#: options only the RAM tier takes (``ram://NAME?erasure=4+2&idle=600``)
_RAM_OPTIONS = {"erasure": "erasure", "idle": "idle_timeout", "threads": "threads"}
#: options only the local tier takes (``/nvme/snap?node_local=auto|true|false&mode=0600``)
_LOCAL_OPTIONS = {"node_local": "node_local", "mode": "mode"}
_NODE_LOCAL = {"auto": None, "true": True, "false": False}
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smh]?)$")


def _int_option(name: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"tier URL option {name}={value!r} must be an integer") from None


def _options(query: str, url: str, extra: dict[str, str] | None = None) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    extra = extra or {}
    try:
        pairs = urllib.parse.parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError as e:
        raise ConfigError(f"tier URL {url!r} has a malformed query {query!r}: {e}") from None
    for name, value in pairs:
        if name in extra:
            if extra[name] in kwargs:
                raise ConfigError(f"tier URL option {name!r} is given twice in {url!r}")
            if name == "erasure":
                kwargs["erasure"] = value
            elif name == "node_local":
                if value.lower() not in _NODE_LOCAL:
                    raise ConfigError(f"tier URL option node_local={value!r} must be auto, true or false")
                kwargs["node_local"] = _NODE_LOCAL[value.lower()]
            elif name == "mode":
                from lightning_snapshot.backends.local import parse_mode

                kwargs["mode"] = parse_mode(value, "tier URL option mode")
            elif name == "idle":
                m = _DURATION.match(value)
                if not m:
                    raise ConfigError(f"tier URL option idle={value!r} must be seconds or a number with s/m/h")
                kwargs["idle_timeout"] = float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]
            else:
                kwargs[extra[name]] = _int_option(name, value)
            continue
        if name not in _OPTIONS:
            raise ConfigError(
                f"unknown tier URL option {name!r} in {url!r}; accepted options:"
                f" {', '.join(sorted([*_OPTIONS, *extra]))}"
                " (every=<steps or auto>, min_every=<steps>, max_every=<steps>, interval=<seconds or 10m/2h>,"
                " keep=<count or all>"
                + (", erasure=<k+m or none>, idle=<seconds>, threads=<count>" if "erasure" in extra else "")
                + (
                    ", node_local=<auto, true or false>, mode=<octal permissions, e.g. 0600>"
                    if "node_local" in extra
                    else ""
                )
                + ")"
            )
        if _OPTIONS[name] in kwargs:
            raise ConfigError(f"tier URL option {name!r} is given twice in {url!r}")
        if name == "every":
            if value != AUTO and not value.lstrip("-").isdigit():
                raise ConfigError(f"tier URL option every={value!r} must be a number of steps or auto")
            kwargs["every_n_train_steps"] = AUTO if value == AUTO else int(value)
        elif name in ("min_every", "max_every"):
            kwargs[name] = _int_option(name, value)
        elif name == "keep":
            kwargs["keep_last"] = None if value == "all" else _int_option(name, value)
        else:
            m = _DURATION.match(value)
            if not m:
                raise ConfigError(
                    f"tier URL option interval={value!r} must be seconds or a number with s/m/h, e.g. 600 or 10m"
                )
            scale = {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]
            kwargs["train_time_interval"] = _dt.timedelta(seconds=float(m.group(1)) * scale)
    return kwargs


def parse_tier(spec: str | Backend) -> Backend:
    """Turn a tier URL into a backend (a backend is returned unchanged).

    Raises:
        ConfigError: unknown scheme or option, or an invalid option value; the message lists what is accepted.
    """
    if isinstance(spec, Backend):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"a tier must be a Backend or a URL string, got {spec!r}")
    parsed = urllib.parse.urlsplit(spec)
    scheme = parsed.scheme.lower()
    if len(scheme) == 1:  # a Windows drive letter, not a scheme
        scheme = ""
    if scheme not in KNOWN_SCHEMES:
        if scheme in _PLANNED:
            raise ConfigError(f"{scheme}:// ({_PLANNED[scheme]}) is not available in this release; use a local path")
        raise ConfigError(
            f"unknown tier URL scheme {scheme!r} in {spec!r}; known: a plain path, "
            + ", ".join(f"{k}://" for k in sorted(KNOWN_SCHEMES) if k)
        )
    module, cls_name = KNOWN_SCHEMES[scheme]
    cls = getattr(importlib.import_module(module), cls_name)
    if scheme == "file" and parsed.netloc not in ("", "localhost"):
        raise ConfigError(f"file:// URL {spec!r} names host {parsed.netloc!r}; use file:///absolute/path")
    base, _, query = spec.partition("?")
    if (module, cls_name) == _OBJECT:
        return cls(base, **_options(query, spec))
    if scheme == "ram":
        if parsed.path not in ("", "/"):
            raise ConfigError(f"RAM tier URL {spec!r} has a path; write ram://NAME?every=10&erasure=4+2")
        return cls(name=parsed.netloc or None, **_options(query, spec, _RAM_OPTIONS))
    path = urllib.parse.unquote(parsed.path) if scheme else base
    return cls(path, **_options(query, spec, _LOCAL_OPTIONS))
