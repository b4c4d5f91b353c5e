"""Progress bars of the ``lightning-snapshot`` command (tqdm), and the human units of its output.

Used by the CLI (cli.py) and export.py only.

A bar is drawn on stderr only when stderr is a terminal and the caller allows it (never with ``--json``): in a log,
a pipe or a test it writes nothing.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["human_age", "human_bytes", "progress_bar"]


def progress_bar(total: float, desc: str, *, unit: str = "B", enabled: bool = True) -> Any:
    """A ``tqdm`` bar on stderr for ``total`` units (bytes by default, shown in KiB/MiB/GiB), disabled unless
    ``enabled`` and stderr is a terminal. Use it as a context manager and call ``update(n)``."""
    from tqdm import tqdm

    scaled = unit == "B"
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=scaled,
        unit_divisor=1024 if scaled else 1000,
        file=sys.stderr,
        leave=False,
        dynamic_ncols=True,
        disable=not (enabled and sys.stderr.isatty()),
    )


def human_bytes(n: float) -> str:
    """``n`` bytes in binary units: ``512 B``, ``1.5 KiB``, ``12.0 MiB``, ``3.25 GiB``."""
    if n < 1024:
        return f"{int(n)} B"
    value = n / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if value < 1024:
            return _scaled(value, unit)
        value /= 1024
    return _scaled(value, "TiB")


def _scaled(value: float, unit: str) -> str:
    return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"


def human_age(seconds: float) -> str:
    """An age in the largest units that fit: ``45s``, ``12m``, ``3h 5m``, ``2d 4h``."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60}m"
    return f"{s // 86400}d {s % 86400 // 3600}h"
