"""What every benchmark in ``benchmarks/`` shares: methods, baselines, noise, tables, targets, header and JSON.

A benchmark file keeps only what it measures (its model, its methods' runners, its targets) and uses:

* :class:`Methods`: the registry of the methods it compares (name -> runner + one-paragraph description). The
  method table of the module docstring is generated from it (:meth:`Methods.document` fills the ``{methods}``
  placeholder), ``--methods`` is parsed and checked by :meth:`Methods.select`, and :meth:`Methods.schedule` runs
  the baseline first and again last.
* :class:`Baselines`: the baseline runs of one benchmark; the quieter one is used, the spread of a figure over
  them is reported (how noisy the wall clock was).
* :class:`NoiseMeter` and :func:`run_quietest`: CPU time other processes used during a run (``/proc/stat``), as a
  share of the machine's CPUs, and the load average; a run above :data:`NOISY` is flagged unreliable (and run
  again, keeping the quietest, where the benchmark offers ``--retries``).
* :class:`Table`: aligned text or Markdown, and the rows as records for the JSON output.
* :class:`Targets`: the ``PASS``/``FAIL``/``WARN``/``info`` block with a machine-readable summary line
  (``TARGETS pass=N fail=N unjudged=N warn=N info=N verdict=...``) and the exit status of ``--strict``.
* :class:`Report`: the header (benchmark, torch and lightning versions, threads, CPUs, library git revision, load
  average), the tables and targets printed as they come, the noise of the whole run, and ``--json PATH``:
  everything as one JSON document; :func:`add_arguments` gives every benchmark ``--json``, ``--markdown`` and
  ``--strict``.
* Measuring helpers more than one benchmark needs: :class:`Timing` and :func:`repeat` (median, best and spread of
  repeats), :func:`timed`, :func:`memmove_into` (the "one memcpy" reference), :func:`evict` (cold reads),
  :func:`memory_logger` (logged metrics kept in memory), :func:`trim_memory`, :func:`free_port`.

Contracts: everything here runs in the benchmark's main thread (``NoiseMeter`` reads machine-wide counters, so
nested or concurrent meters are fine); nothing here changes what is measured.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import gc
import importlib.metadata
import json
import logging
import math
import os
import socket
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

__all__ = [
    "NOISY",
    "Baselines",
    "Column",
    "Method",
    "Methods",
    "Noise",
    "NoiseMeter",
    "Report",
    "Table",
    "Targets",
    "Timing",
    "add_arguments",
    "evict",
    "fmt",
    "free_port",
    "jsonable",
    "library_version",
    "machine",
    "memmove_into",
    "memory_logger",
    "quiet_median",
    "ratio",
    "repeat",
    "run_quietest",
    "timed",
    "trim_memory",
    "unreliable_line",
]

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
NOISY = 0.10  # a run during which other processes used more than this share of the CPUs is flagged (and retried)

R = TypeVar("R")


# ================================================================================================ methods
@dataclass(frozen=True)
class Method:
    """One method a benchmark compares: its name, its runner (``None`` where the benchmark dispatches itself) and
    the description its docstring's method table shows."""

    name: str
    runner: Callable[..., Any] | None
    doc: str


class Methods:
    """Registry of a benchmark's methods, in the order they run and are reported.

    Args:
        baseline: the name of the baseline method (run first and again last by :meth:`schedule`), if any.
    """

    def __init__(self, baseline: str | None = None) -> None:
        self.baseline = baseline
        self._methods: dict[str, Method] = {}

    def add(self, name: str, runner: Callable[..., Any] | None, doc: str) -> None:
        """Register ``name``; raises ``ValueError`` on a duplicate name or an empty description."""
        if name in self._methods:
            raise ValueError(f"method {name!r} is registered twice")
        if not doc.strip():
            raise ValueError(f"method {name!r} needs a description (it fills the docstring's method table)")
        self._methods[name] = Method(name, runner, " ".join(doc.split()))

    @property
    def names(self) -> list[str]:
        return list(self._methods)

    def __contains__(self, name: object) -> bool:
        return name in self._methods

    def __getitem__(self, name: str) -> Method:
        return self._methods[name]

    def run(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Call the runner of ``name`` with the given arguments."""
        runner = self._methods[name].runner
        if runner is None:
            raise TypeError(f"method {name!r} has no runner: the benchmark dispatches it itself")
        return runner(*args, **kwargs)

    def table(self, width: int = 115) -> str:
        """The methods as a reStructuredText simple table (name in double back-quotes, description wrapped)."""
        import textwrap

        names = [f"``{m.name}``" for m in self._methods.values()]
        left = max(len(n) for n in names) + 1
        right = width - left - 2
        rule = f"{'=' * left}  {'=' * right}"
        lines = [rule]
        for name, method in zip(names, self._methods.values(), strict=True):
            wrapped = textwrap.wrap(method.doc, right) or [""]
            lines.append(f"{name:<{left}}  {wrapped[0]}".rstrip())
            lines += [f"{'':<{left}}  {more}" for more in wrapped[1:]]
        lines.append(rule)
        return "\n".join(lines)

    def document(self, doc: str | None, *more: Methods) -> str:
        """``doc`` with its ``{methods}`` line replaced by :meth:`table` (and the tables of the registries ``more``,
        a blank line apart); raises ``ValueError`` where ``doc`` has no such line."""
        if not doc or "{methods}" not in doc:
            raise ValueError("the docstring has no {methods} placeholder for the method table")
        return doc.replace("{methods}", "\n\n".join(m.table() for m in (self, *more)))

    def select(self, spec: str, parser: argparse.ArgumentParser | None = None) -> list[str]:
        """The methods named in the comma-separated ``spec``, in registry order; an unknown name is an error
        (``parser.error`` where a parser is given, else ``ValueError``) that lists the known ones."""
        wanted = [m.strip() for m in spec.split(",") if m.strip()]
        unknown = [m for m in wanted if m not in self._methods]
        if unknown:
            message = f"unknown method(s) {unknown}; choose from {','.join(self.names)}"
            if parser is not None:
                parser.error(message)
            raise ValueError(message)
        return [m for m in self.names if m in wanted]

    def schedule(self, selected: Iterable[str]) -> list[str]:
        """The run order: the baseline first, the selected methods, and the baseline again last (the spread of the
        two shows how noisy the wall clock was); the baseline runs even where it is not selected."""
        rest = [m for m in selected if m != self.baseline]
        if self.baseline is None:
            return rest
        return [self.baseline, *rest, self.baseline] if rest else [self.baseline]


# ================================================================================================ noise
def _busy_seconds() -> float:
    """CPU seconds the whole machine spent busy since boot (all but idle and iowait), from ``/proc/stat``."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def _own_seconds(pids: Sequence[int] = ()) -> float:
    """CPU seconds this process (and its waited-for children) used, plus those of the processes ``pids`` (helpers
    the benchmark started and counts as its own, e.g. a server; one that has exited counts 0)."""
    t = os.times()
    total = t[0] + t[1] + t[2] + t[3]
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # utime stime cutime cstime
    return total


@dataclass(frozen=True)
class Noise:
    """What other processes did to a run: their CPU seconds, as a share of the machine's CPUs, and the load."""

    wall_s: float
    foreign_cpu_s: float
    cores: int
    load_before: float
    load_after: float

    @property
    def share(self) -> float:
        """Share of the machine's CPU time other processes used during the run (0 .. 1)."""
        return self.foreign_cpu_s / (self.wall_s * self.cores) if self.wall_s > 0 else 0.0

    @property
    def unreliable(self) -> bool:
        return self.share > NOISY

    def flag(self) -> str | None:
        """The NOISE line for a run above :data:`NOISY`, else ``None``."""
        if not self.unreliable:
            return None
        return unreliable_line(self.foreign_cpu_s, self.share)


def unreliable_line(foreign_cpu_s: float, share: float) -> str:
    return (
        f"NOISE: other processes used {foreign_cpu_s:.1f} CPU-s ({share:.0%} of the CPUs) during this run:"
        " its wall-clock figures are unreliable"
    )


class NoiseMeter:
    """Context manager: CPU seconds other processes used while it was open (machine-wide busy CPU time from
    ``/proc/stat`` minus this process's, its waited-for children's and those of ``pids``, the helper processes the
    benchmark counts as its own), and the load average before and after.

    ``mark()`` gives the (wall, machine busy, own) counters at any moment, for the noise of a stretch inside a run.
    """

    busy_seconds = staticmethod(_busy_seconds)
    own_seconds = staticmethod(_own_seconds)

    def __init__(self, cores: int | None = None, pids: Sequence[int] = ()) -> None:
        self.cores = cores or os.cpu_count() or 1
        self.pids = list(pids)
        self.noise: Noise | None = None

    @staticmethod
    def mark(pids: Sequence[int] = ()) -> tuple[float, float, float]:
        """(wall clock, machine-wide busy CPU s, own CPU s) now."""
        return time.perf_counter(), _busy_seconds(), _own_seconds(pids)

    @classmethod
    def between(
        cls, a: tuple[float, float, float], b: tuple[float, float, float], cores: int | None = None
    ) -> tuple[float, float]:
        """(wall seconds, share of the CPUs other processes used) between two :meth:`mark` readings."""
        wall = b[0] - a[0]
        foreign = max(0.0, (b[1] - a[1]) - (b[2] - a[2]))
        return wall, (foreign / (wall * (cores or os.cpu_count() or 1)) if wall > 0 else 0.0)

    def __enter__(self) -> NoiseMeter:
        self._load0 = os.getloadavg()[0]
        self._t0, self._b0, self._o0 = self.mark(self.pids)
        return self

    def __exit__(self, *exc: object) -> None:
        t1, b1, o1 = self.mark(self.pids)
        self.wall = t1 - self._t0
        self.foreign = max(0.0, (b1 - self._b0) - (o1 - self._o0))
        self.noise = Noise(self.wall, self.foreign, self.cores, self._load0, os.getloadavg()[0])


def quiet_median(periods: Sequence[tuple[float, float]], threshold: float = NOISY) -> tuple[float | None, int]:
    """Median of the values whose noise share is at most ``threshold`` (all of them if fewer than 3 are), and how
    many were used. ``periods``: (value, noise share) pairs."""
    quiet = [w for w, n in periods if n <= threshold]
    if len(quiet) < 3:
        quiet = [w for w, _ in periods]
    return (statistics.median(quiet) if quiet else None), len(quiet)


def trim_memory() -> None:
    """Return freed memory to the OS, so that RSS before the next run starts from what is really in use."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def run_quietest(
    name: str,
    attempt: Callable[[], R],
    *,
    retries: int,
    noise: Callable[[R], float],
    failed: Callable[[R], bool],
    on_error: Callable[[Exception], R],
    describe: Callable[[R], str] = lambda r: "",
    after: Callable[[], None] | None = trim_memory,
) -> R:
    """Run ``attempt`` (one run of method ``name``); again, up to ``retries`` times, while other processes used
    more than :data:`NOISY` of the CPUs during it, keeping the quietest run that did not fail.

    An exception is printed and turned into a (failed) result by ``on_error``, so one method failing never hides
    the others. Prints one progress line per attempt (``describe`` adds to it). ``after`` runs after each
    attempt (default: :func:`trim_memory`, so that the next run's memory figures start from what is in use).
    """
    kept: R | None = None
    for n in range(retries + 1):
        t0 = time.perf_counter()
        try:
            result = attempt()
        except Exception as e:
            traceback.print_exc()
            result = on_error(e)
        if after is not None:
            after()
        extra = describe(result)
        print(
            f"  {name:<16} {time.perf_counter() - t0:6.1f} s  ({extra + ', ' if extra else ''}other processes"
            f" {noise(result):.0%} of the CPUs)",
            flush=True,
        )
        if kept is None or (not failed(result) and (failed(kept) or noise(result) < noise(kept))):
            kept = result
        if failed(result) or noise(result) <= NOISY or n == retries:
            break
        print(f"  {name:<16} disturbed by other processes: running it again", flush=True)
    if kept is None:  # retries >= 0: the loop ran at least once
        raise RuntimeError("run_quietest ran nothing")
    return kept


# ================================================================================================ baselines
class Baselines(Generic[R]):
    """The baseline runs of a benchmark (first and last): the quieter is used, the spread shows the noise.

    Args:
        runs: the baseline results that did not fail.
        noise: a result's noise share.
    """

    def __init__(self, runs: Sequence[R], noise: Callable[[R], float]) -> None:
        self.runs = list(runs)
        self._noise = noise

    @property
    def quieter(self) -> R | None:
        return min(self.runs, key=self._noise, default=None)

    def values(self, value: Callable[[R], float | None]) -> list[float]:
        return [v for v in (value(r) for r in self.runs) if v is not None]

    def spread(self, value: Callable[[R], float | None]) -> float:
        """``max - min`` of a figure over the baseline runs (0 with fewer than two)."""
        vs = self.values(value)
        return max(vs) - min(vs) if len(vs) > 1 else 0.0

    def smallest(self, value: Callable[[R], float | None]) -> float | None:
        return min(self.values(value), default=None)

    def describe(
        self,
        value: Callable[[R], float | None],
        spec: str = ".2f",
        unit: str = "s",
        per: float = 1.0,
        per_unit: str = "",
    ) -> str:
        """``"1.23 s (4% noise), 1.31 s (2% noise); the quieter one is used (spread 0.080 s)"``; ``per`` divides
        the spread (e.g. per snapshot, with ``per_unit=" per snapshot"``)."""
        runs = [(value(r), self._noise(r)) for r in self.runs]
        listed = ", ".join(f"{format(v, spec)} {unit} ({n:.0%} noise)" for v, n in runs if v is not None)
        spread = self.spread(value) / per if per else 0.0
        return f"{listed}; the quieter one is used (spread {spread:.3f} {unit}{per_unit})"


# ================================================================================================ timing
@dataclass(frozen=True)
class Timing:
    """Seconds of each repeat of one measurement."""

    runs: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.runs)

    @property
    def best(self) -> float:
        return min(self.runs)

    @property
    def spread(self) -> float:
        """``(max - min) / median``: other processes on the machine show up here."""
        return (max(self.runs) - min(self.runs)) / self.median if self.median > 0 else 0.0


def timed(fn: Callable[[], R]) -> tuple[R, float]:
    """``fn()`` and the seconds it took."""
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def repeat(fn: Callable[[], Any], repeats: int, before: Callable[[], Any] | None = None) -> Timing:
    """Time ``fn`` ``repeats`` times (``before`` runs untimed ahead of each)."""
    runs = []
    for _ in range(repeats):
        if before is not None:
            before()
        runs.append(timed(fn)[1])
    return Timing(runs)


# ================================================================================================ formatting
def fmt(x: float | None, spec: str, missing: str = "-") -> str:
    """``format(x, spec)``, or ``missing`` for ``None``."""
    return missing if x is None else format(x, spec)


def ratio(a: float | None, b: float | None, floor: float = 0.0) -> str:
    """``a / b`` as ``0.42x``/``3.1x``/``120x``; ``"ref~0"`` where the reference ``b`` is within the noise
    (``|b| <= floor``) or not positive; ``"-"`` where either is missing."""
    if a is None or b is None:
        return "-"
    if b <= 0 or abs(b) <= floor:
        return "ref~0"
    r = a / b
    return f"{r:.2f}x" if abs(r) < 1 else (f"{r:.1f}x" if abs(r) < 100 else f"{r:.0f}x")


@dataclass(frozen=True)
class Column:
    """A table column: its header, alignment (``"<"`` or ``">"``) and minimum width in the text form."""

    header: str
    align: str = ">"
    width: int = 0


@dataclass
class _Row:
    cells: list[str]
    data: dict[str, Any] | None
    span: str | None = None  # a row that is only a label and a text (an error)


class Table:
    """A table printed as aligned text or Markdown, kept as records for the JSON output.

    Args:
        title: printed above the table.
        columns: the columns; a ``str`` is a right-aligned column with that header, except the first (left-aligned).
        notes: lines printed under the table.
        key: the table's name in the JSON output (default: ``title``); a stable one where the title has figures.
    """

    def __init__(
        self, title: str, columns: Sequence[Column | str], notes: Sequence[str] = (), key: str | None = None
    ) -> None:
        self.title = title
        self.key = key or title
        self.columns = [
            c if isinstance(c, Column) else Column(c, "<" if i == 0 else ">") for i, c in enumerate(columns)
        ]
        self.notes = list(notes)
        self.rows: list[_Row] = []

    def add(self, *cells: Any, data: dict[str, Any] | None = None) -> None:
        """One row of already formatted cells (``str()`` is applied); ``data`` the raw figures for the JSON
        output (default: the cells by column header). Raises ``ValueError`` on the wrong number of cells."""
        if len(cells) != len(self.columns):
            raise ValueError(f"table {self.title!r}: {len(cells)} cells for {len(self.columns)} columns")
        self.rows.append(_Row([str(c) for c in cells], data))

    def add_span(self, label: str, text: str, data: dict[str, Any] | None = None) -> None:
        """A row with only its first cell and a text across the others (a method that failed)."""
        self.rows.append(_Row([label], data, span=text))

    def _widths(self) -> list[int]:
        widths = [max(c.width, len(c.header)) for c in self.columns]
        for row in self.rows:
            if row.span is None:
                widths = [max(w, len(cell)) for w, cell in zip(widths, row.cells, strict=True)]
            else:
                widths[0] = max(widths[0], len(row.cells[0]))
        return widths

    def text(self) -> str:
        """Aligned text: a header line, a rule, the rows (cells padded to the widest, one space apart)."""
        widths = self._widths()

        def line(cells: Sequence[str]) -> str:
            padded = (f"{cell:{col.align}{w}}" for cell, col, w in zip(cells, self.columns, widths, strict=True))
            return " ".join(padded).rstrip()

        head = line([c.header for c in self.columns])
        out = [head, "-" * len(head)]
        for row in self.rows:
            out.append(line(row.cells) if row.span is None else f"{row.cells[0]:<{widths[0]}} {row.span}")
        return "\n".join(out + self.notes)

    def markdown(self) -> str:
        """A GitHub-flavoured Markdown table (``|`` in cells escaped), notes as lines after it."""

        def line(cells: Sequence[str]) -> str:
            return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

        rule = "|" + "|".join("---:" if c.align == ">" else "---" for c in self.columns) + "|"
        out = [line([c.header for c in self.columns]), rule]
        for row in self.rows:
            cells = row.cells if row.span is None else [row.cells[0], row.span] + [""] * (len(self.columns) - 2)
            out.append(line(cells))
        return "\n".join(out + (["", *self.notes] if self.notes else []))

    def render(self, markdown: bool) -> str:
        return self.markdown() if markdown else self.text()

    def records(self) -> list[dict[str, Any]]:
        """Every row as a dict: its ``data`` if given, else header -> cell (a span row: first header + ``note``)."""
        out = []
        for row in self.rows:
            if row.data is not None:
                out.append(jsonable(row.data))
            elif row.span is not None:
                out.append({self.columns[0].header: row.cells[0], "note": row.span})
            else:
                out.append({c.header: cell for c, cell in zip(self.columns, row.cells, strict=True)})
        return out


# ================================================================================================ targets
@dataclass(frozen=True)
class Target:
    """One line of the targets block: ``PASS``, ``FAIL``, ``--`` (not judged) or ``info``."""

    status: str
    text: str
    value: float | None = None
    limit: float | None = None


class Targets:
    """The targets block: each check a ``PASS``/``FAIL`` line (``--`` where it cannot be judged), figures as
    ``info`` lines, unmet assumptions as ``WARN`` lines, then one machine-readable line
    ``TARGETS pass=N fail=N unjudged=N warn=N info=N verdict=PASS|FAIL|NONE``."""

    def __init__(self, title: str = "targets") -> None:
        self.title = title
        self.lines: list[Target] = []

    def check(self, ok: bool | None, text: str, value: float | None = None, limit: float | None = None) -> bool | None:
        """Record a target: ``ok`` True -> PASS, False -> FAIL, None -> not judged. Returns ``ok``."""
        status = "--" if ok is None else ("PASS" if ok else "FAIL")
        self.lines.append(Target(status, text, value, limit))
        return ok

    def info(self, text: str, value: float | None = None) -> None:
        """A figure that is reported next to the targets but is not one."""
        self.lines.append(Target("info", text, value))

    def warn(self, text: str, value: float | None = None) -> None:
        """A condition the targets assume that this run did not meet (not a target: the verdict ignores it)."""
        self.lines.append(Target("WARN", text, value))

    def count(self, status: str) -> int:
        return sum(1 for t in self.lines if t.status == status)

    @property
    def verdict(self) -> str:
        """``FAIL`` if any target failed, ``PASS`` if at least one passed, else ``NONE``."""
        if self.count("FAIL"):
            return "FAIL"
        return "PASS" if self.count("PASS") else "NONE"

    def summary(self) -> dict[str, Any]:
        return {
            "pass": self.count("PASS"),
            "fail": self.count("FAIL"),
            "unjudged": self.count("--"),
            "warn": self.count("WARN"),
            "info": self.count("info"),
            "verdict": self.verdict,
        }

    def summary_line(self) -> str:
        s = self.summary()
        return (
            f"TARGETS pass={s['pass']} fail={s['fail']} unjudged={s['unjudged']} warn={s['warn']}"
            f" info={s['info']} verdict={s['verdict']}"
        )

    def text(self) -> str:
        out = [self.title]
        out += [f"  {t.status if t.status != '--' else ' -- ':<4}  {t.text}" for t in self.lines]
        out.append(self.summary_line())
        return "\n".join(out)

    def exit_status(self) -> int:
        """1 if a target failed, else 0."""
        return 1 if self.count("FAIL") else 0

    def records(self) -> list[dict[str, Any]]:
        return [asdict(t) for t in self.lines]


# ================================================================================================ header, report
def library_version() -> str:
    """The commit the library was imported from, and whether its files had uncommitted changes."""
    try:
        head = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--", "lightning_snapshot", "backends"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    changed = [line[3:] for line in dirty if line.strip()]
    return (head or "unknown") + (f" + uncommitted changes in {', '.join(changed)}" if changed else "")


def machine() -> dict[str, Any]:
    """torch and lightning versions, torch threads, CPUs, library revision, load average, Python, time (UTC)."""
    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "load_average": round(os.getloadavg()[0], 2),
        "library": library_version(),
        "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    for package in ("torch", "lightning"):
        try:
            info[package] = importlib.metadata.version(package)  # (without importing it)
        except importlib.metadata.PackageNotFoundError:
            info[package] = None
    torch = sys.modules.get("torch")  # the benchmark's threads, where it uses torch
    info["threads"] = torch.get_num_threads() if torch is not None else None
    return info


def add_arguments(
    parser: argparse.ArgumentParser, *, strict: bool = False, markdown: bool = False, json_help: str | None = None
) -> None:
    """The options every benchmark has: ``--json PATH``, ``--markdown/--no-markdown`` and ``--strict/--no-strict``
    (``strict`` and ``markdown``: their defaults)."""
    parser.add_argument(
        "--json",
        default=None,
        metavar="PATH",
        help=json_help or "also write the header, every table's rows and the targets here as JSON",
    )
    parser.add_argument(
        "--markdown",
        action=argparse.BooleanOptionalAction,
        default=markdown,
        help="print the tables as Markdown, else as aligned text (default: %(default)s)",
    )
    parser.add_argument(
        "--strict",
        action=argparse.BooleanOptionalAction,
        default=strict,
        help="exit with status 1 when a target FAILs (default: %(default)s)",
    )


def jsonable(obj: Any) -> Any:
    """``obj`` with dataclasses as dicts, tuples as lists, paths as strings and non-finite floats as ``None``."""
    if is_dataclass(obj) and not isinstance(obj, type):
        return jsonable(asdict(obj))
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)


class Report:
    """One benchmark run's output: header, tables and targets, printed as they come and written as JSON, and the
    noise of the whole run (from its creation to :meth:`finish`) in the footer.

    Args:
        name: the benchmark (``"stall"``, ...).
        args: the parsed options of :func:`add_arguments` (``json``, ``markdown``, ``strict``); ``None``: defaults.
    """

    def __init__(self, name: str, args: argparse.Namespace | None = None) -> None:
        self.name = name
        self.json_path = getattr(args, "json", None)
        self.markdown = bool(getattr(args, "markdown", False))
        self.strict = bool(getattr(args, "strict", False))
        self.machine = machine()
        self.settings: dict[str, Any] = {}
        self.tables: list[Table] = []
        self.targets = Targets()
        self.data: dict[str, Any] = {}
        self.fields: dict[str, Any] = {}  # top-level keys a benchmark's JSON already had (its established format)
        self.lines: list[str] = []
        self._meter = NoiseMeter().__enter__()  # the whole benchmark: how much other processes disturbed it

    def header(self, **settings: Any) -> str:
        """Print (and return) the header: the machine and the benchmark's ``settings`` (kept for the JSON)."""
        self.settings.update(settings)
        m = self.machine
        threads = f" {m['threads']} threads," if m["threads"] else ""
        text = (
            f"lightning-snapshot {self.name} benchmark: torch {m['torch']}, lightning {m['lightning']},{threads}"
            f" {m['cpus']} CPUs; load average {m['load_average']:.2f}\nlibrary at {m['library']}"
        )
        if settings:
            text += "\n" + "; ".join(f"{k.replace('_', ' ')} {v}" for k, v in settings.items())
        print(text, flush=True)
        return text

    def say(self, text: str = "") -> None:
        """Print a line that belongs to the report (kept as ``lines`` in the JSON)."""
        self.lines.append(text)
        print(text, flush=True)

    def table(self, table: Table) -> Table:
        """Print ``table`` (title, rows, notes) and keep it for the JSON."""
        self.tables.append(table)
        print(f"\n{table.title}\n{table.render(self.markdown)}", flush=True)
        return table

    def finish(self, **data: Any) -> int:
        """Print the targets block (if any) and the footer, write the JSON (if ``--json``); the exit status:
        1 with ``--strict`` when a target failed, else 0. ``data``: raw figures added to the JSON."""
        self.data.update(data)
        if self.targets.lines:
            print(f"\n{self.targets.text()}", flush=True)
        self._meter.__exit__(None, None, None)
        noise = self._meter.noise
        if noise is None:  # (set by __exit__)
            raise RuntimeError("the noise meter did not stop")
        print(
            f"\n{self.name}: {noise.wall_s:.0f} s in all; load average {noise.load_before:.2f} ->"
            f" {noise.load_after:.2f}; other processes used {noise.foreign_cpu_s:.0f} CPU-s ({noise.share:.0%} of"
            " the CPUs)" + (" (NOISE: wall-clock figures unreliable)" if noise.unreliable else ""),
            flush=True,
        )
        self.machine.update(
            load_average_end=round(noise.load_after, 2),
            noise_share=noise.share,
            foreign_cpu_s=noise.foreign_cpu_s,
            wall_s=noise.wall_s,
        )
        if self.json_path:
            Path(self.json_path).write_text(json.dumps(self.document(), indent=1) + "\n")
            print(f"json: {self.json_path}")
        return self.targets.exit_status() if self.strict else 0

    def document(self) -> dict[str, Any]:
        """The JSON document: benchmark, machine, settings, lines, tables (key -> title and rows), targets, summary
        and the benchmark's own data."""
        return jsonable(
            {
                **self.fields,
                "benchmark": self.name,
                "machine": self.machine,
                "settings": self.settings,
                "lines": self.lines,
                "tables": {t.key: {"title": t.title, "rows": t.records()} for t in self.tables},
                "targets": self.targets.records(),
                "summary": self.targets.summary(),
                "data": self.data,
            }
        )


# ================================================================================================ small helpers
def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def memmove_into(tensors: Iterable[Any], address: int) -> int:
    """Copy ``tensors`` (contiguous) back to back to memory at ``address`` with ``ctypes.memmove`` on one thread
    (the "one memcpy of the state" reference); returns the bytes copied. The caller owns a large enough buffer."""
    pos = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        ctypes.memmove(address + pos, t.data_ptr(), n)
        pos += n
    return pos


def memory_logger() -> Any:
    """A Lightning ``Logger`` that keeps every logged metric in memory: ``records`` (step, metrics) in order and
    ``values(key)``, every value of one metric. Lightning is imported on the first call."""
    return _memory_logger_class()()


@functools.cache
def _memory_logger_class() -> type:
    from lightning.pytorch.loggers import Logger

    class MemoryLogger(Logger):
        def __init__(self) -> None:
            super().__init__()
            self.records: list[tuple[int, dict[str, float]]] = []

        @property
        def name(self) -> str:
            return "memory"

        @property
        def version(self) -> str:
            return "0"

        def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
            pass

        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            self.records.append((step or 0, dict(metrics)))

        def values(self, key: str) -> list[float]:
            return [m[key] for _, m in self.records if key in m]

    return MemoryLogger


def _files(path: Path) -> list[Path]:
    return [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]


def evict(*paths: str | Path) -> None:
    """Drop the files under ``paths`` from the page cache (fsynced first: dirty pages are not dropped), so that
    the next read comes from the disk."""
    for path in paths:
        for p in _files(Path(path)):
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
