"""The sub-commands of ``lightning-snapshot`` (:mod:`~lightning_snapshot.cli.main`): what each one does, and the
argument
types and parsers they share.

One job: the work of each command (list, inspect, verify, export, gc, copy, plan, agent), done through loader.py,
ops.py, export.py, plan.py and the RAM tier's agent; :mod:`~lightning_snapshot.cli.main` builds the parser, runs a
command and turns its errors into one line and an exit status.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

# Only light modules at import time: ``--help`` must answer without importing torch or Lightning. The commands import
# what they need when they run.
from lightning_snapshot.errors import ConfigError, SnapshotError, SnapshotNotFoundError

__all__ = ["PROG"]

PROG = "lightning-snapshot"


def _one_line(text: str) -> str:
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


# ------------------------------------------------------------------------------------------------ argument types
def _step_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a step number (an integer >= 0), got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a step number (an integer >= 0), got {text!r}")
    return value


def _seconds_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def _duration_arg(text: str) -> float:
    """``90s``, ``30m``, ``12h``, ``7d`` or ``2w`` as seconds (>= 0). The unit is required: ``gc --older-than 3``
    meant as days would delete nearly everything."""
    import re

    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text.lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"expected a duration such as 90s, 30m, 12h or 7d, got {text!r}")
    if not match.group(2):
        number = match.group(1)
        raise argparse.ArgumentTypeError(
            f"a duration needs a unit, got {text!r}: write {number}s, {number}m, {number}h, {number}d or {number}w"
        )
    return float(match.group(1)) * _UNITS[match.group(2)]


def _count_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _add_json(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON document on stdout, no progress bar (fields: docs/operations.md)",
    )


def _emit(document: Any) -> None:
    """One JSON document on stdout (``--json``)."""
    print(json.dumps(document, allow_nan=False))


# ------------------------------------------------------------------------------------------------ sources
def _open_tier(source: str) -> tuple[Any, int | None]:
    """The tier ``source`` names (and the step, for a step-* directory); an error when the tier does not exist.

    Creates nothing (``RamTier``'s store is only touched once its directory is known to exist).
    """
    from lightning_snapshot.restore.loader import resolve_source

    backend, step = resolve_source(source)
    backend.require_exists()
    return backend, step


def _steps(source: str, step: int | None, every: bool = False) -> tuple[Any, list[int]]:
    from lightning_snapshot.persist.commit import committed_steps

    backend, named = _open_tier(source)
    if step is None:
        step = named
    steps = committed_steps(backend)
    if step is not None:
        if step not in steps:
            raise SnapshotNotFoundError(
                f"no committed snapshot of step {step} in {backend.url!r} (committed: {steps or 'none'}); pick one"
                f" of those, or see: {PROG} list {backend.url}"
            )
        return backend, [step]
    if not steps:
        raise SnapshotNotFoundError(
            f"{backend.url!r} holds no committed snapshot (the tier exists but is empty, or a run has not committed"
            " one yet)"
        )
    return backend, steps if every else steps[:1]


# ------------------------------------------------------------------------------------------------ commands
def _list_rows(backend: Any) -> list[dict[str, Any]]:
    """The ``--json`` rows of ``list``: one per committed step, newest first."""
    from lightning_snapshot.persist.commit import committed_steps
    from lightning_snapshot.restore.loader import read_manifest

    rows: list[dict[str, Any]] = []
    now = time.time()
    for step in committed_steps(backend):
        try:
            m = read_manifest(backend, step)
        except SnapshotError as e:
            rows.append(
                {
                    "step": step,
                    "epoch": None,
                    "world_size": None,
                    "bytes": None,
                    "objects": None,
                    "created_unix": None,
                    "age_s": None,
                    "health": None,
                    "error": _one_line(str(e)),
                }
            )
            continue
        rows.append(
            {
                "step": step,
                "epoch": m.epoch,
                "world_size": m.world_size,
                "bytes": m.total_bytes,
                "objects": len(m.objects),
                "created_unix": m.created_unix,
                "age_s": max(0.0, now - m.created_unix),
                "health": m.health_text,
                "error": None,
            }
        )
    return rows


def _cmd_list(args: argparse.Namespace) -> int:
    from lightning_snapshot.restore.progress import human_age, human_bytes

    backend, _ = _open_tier(args.source)
    rows = _list_rows(backend)
    if args.json:
        _emit({"tier": backend.url, "snapshots": rows})
        return 0
    if not rows:
        print(f"no committed snapshots in {backend.url}")
        return 0
    print(f"{'step':>12}  {'epoch':>5}  {'ranks':>5}  {'size':>10}  {'health':<8}  {'created':<19}  age")
    for r in rows:
        if r["error"] is not None:
            print(f"{r['step']:>12}  unreadable manifest: {r['error']}")
            continue
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["created_unix"]))
        print(
            f"{r['step']:>12}  {r['epoch']:>5}  {r['world_size']:>5}  {human_bytes(r['bytes']):>10}"
            f"  {r['health']:<8}  {created}  {human_age(r['age_s'])}"
        )
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from lightning_snapshot.restore.loader import read_manifest
    from lightning_snapshot.restore.progress import human_age, human_bytes

    backend, steps = _steps(args.source, args.step)
    m = read_manifest(backend, steps[0])
    age = max(0.0, time.time() - m.created_unix)
    if args.json:
        _emit(
            {
                "tier": backend.url,
                "step": m.step,
                "epoch": m.epoch,
                "world_size": m.world_size,
                "format_version": m.format_version,
                "library_version": m.library_version,
                "created_unix": m.created_unix,
                "age_s": age,
                "bytes": m.total_bytes,
                "health": m.health_text,
                "health_groups": None if m.health is None else dict(m.health),
                "replicas": None
                if m.replicas is None
                else {
                    "checked": m.replicas.checked,
                    "disagree_count": m.replicas.disagree_count,
                    "disagree": [{"tensor": t, "ranks": list(r)} for t, r in m.replicas.disagree],
                },
                "objects": [{"key": o.key, "bytes": o.nbytes, "rank": o.rank} for o in m.objects],
                "tensors": [
                    {"name": t.name, "dtype": t.dtype, "shape": list(t.global_shape), "alias_of": t.alias_of}
                    for t in m.tensors
                ],
            }
        )
        return 0
    print(
        f"step {m.step}, epoch {m.epoch}, world size {m.world_size}, format v{m.format_version},"
        f" written by lightning-snapshot {m.library_version}, {human_age(age)} ago"
    )
    print(f"{len(m.objects)} objects, {human_bytes(m.total_bytes)}; {len(m.tensors)} shared tensors")
    print(f"health: {_health_line(m)}")
    print(f"replicas: {_replicas_line(m)}")
    for t in m.tensors:
        target = f" -> alias of {t.alias_of}" if t.alias_of else ""
        print(f"  {t.name:<60} {t.dtype:<10} {list(t.global_shape)}{target}")
    return 0


def _replicas_line(m: Any) -> str:
    """The replica check of a snapshot, for ``inspect``."""
    rep = m.replicas
    if rep is None:
        return "not checked (one process, not data parallel, or replica_check=None)"
    if rep.disagree_count == 0:
        return f"agree ({rep.checked} tensors compared across {m.world_size} ranks at this step)"
    named = "; ".join(
        f"{t!r} differs on rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}" for t, r in rep.disagree
    )
    more = rep.disagree_count - len(rep.disagree)
    return f"DISAGREE: {rep.disagree_count} of {rep.checked} tensors compared across {m.world_size} ranks: {named}" + (
        f" and {more} more" if more > 0 else ""
    )


def _health_line(m: Any) -> str:
    """The health of a snapshot, per tensor group, for ``inspect``."""
    if m.health is None:
        return "unknown (written before lightning-snapshot recorded health; a resume treats it as healthy)"
    groups = [f"{g}: {'finite' if first is None else f'NaN/inf (first in {first!r})'}" for g, first in m.health.items()]
    return f"{m.health_text} ({'; '.join(groups) or 'no tensors'})"


def _verify_step(backend: Any, step: int, bar: Any) -> dict[str, Any]:
    """Read back every chunk of ``step`` (checksums checked); its ``--json`` row. ``bar`` advances by the bytes of
    each section read."""
    from lightning_snapshot.restore.loader import read_manifest, read_section

    t0 = time.monotonic()
    row: dict[str, Any] = {"step": step, "ok": False, "bytes": None, "seconds": None, "error": None}
    try:
        m = read_manifest(backend, step)
        row["bytes"] = m.total_bytes
        bar.total = (bar.total or 0) + m.total_bytes
        bar.refresh()
        for tensors, state in [(m.tensors, m.state)] + [(r.tensors, r.state) for r in m.ranks]:
            read_section(backend, m, tensors, state)
            bar.update(sum(f.nbytes for t in tensors for f in t.fragments))
    except SnapshotError as e:
        row["error"] = _one_line(str(e))
    else:
        row["ok"] = True
    row["seconds"] = time.monotonic() - t0
    return row


def _cmd_verify(args: argparse.Namespace) -> int:
    from lightning_snapshot.restore.progress import human_bytes, progress_bar

    backend, steps = _steps(args.source, args.step, every=args.all)
    rows = []
    with progress_bar(0, "verify", enabled=not args.json) as bar:
        for step in steps:
            bar.set_description(f"verify step {step}")
            row = _verify_step(backend, step, bar)
            rows.append(row)
            if args.json:
                continue
            if row["ok"]:
                bar.write(
                    f"step {step}: OK ({human_bytes(row['bytes'])} verified in {row['seconds']:.2f} s)", file=sys.stdout
                )
            else:
                bar.write(f"step {step}: FAILED: {row['error']}", file=sys.stdout)
    ok = all(r["ok"] for r in rows)
    if args.json:
        _emit({"tier": backend.url, "ok": ok, "steps": rows})
    return 0 if ok else 1


def _cmd_export(args: argparse.Namespace) -> int:
    from lightning_snapshot.cli.export import export_snapshot

    backend, steps = _steps(args.source, args.step)
    out = export_snapshot(backend, args.out, fmt=args.format, step=steps[0], progress=not args.quiet)
    from lightning_snapshot.restore.progress import human_bytes

    print(f"wrote {out} ({human_bytes(out.stat().st_size)})")
    return 0


def _cmd_gc(args: argparse.Namespace) -> int:
    from lightning_snapshot.cli.ops import plan_gc, run_gc
    from lightning_snapshot.restore.progress import progress_bar

    backend, step = _open_tier(args.source)
    if step is not None:
        raise ConfigError(f"gc takes a tier, not one snapshot directory ({args.source!r}): give the tier's root")
    plan = plan_gc(backend, keep_last=args.keep_last, older_than=args.older_than, grace=args.grace)
    if not args.dry_run and plan.actions:
        with progress_bar(plan.actions, "gc", unit="item", enabled=not args.json) as bar:
            run_gc(backend, plan, on_action=lambda: bar.update(1))
    if args.json:
        _emit({"dry_run": args.dry_run, **plan.to_json()})
    else:
        _print_gc(plan, args.dry_run)
    return 0


def _print_gc(plan: Any, dry_run: bool) -> None:
    """What ``gc`` did (or would do), one line per removal, in human units."""
    from lightning_snapshot.restore.progress import human_age, human_bytes

    def age(seconds: float | None) -> str:
        return "age unknown" if seconds is None else human_age(seconds)

    verb = {True: ("would delete", "would remove", "would abort"), False: ("deleted", "removed", "aborted")}[dry_run]
    for e in plan.snapshots:
        size = "size unknown" if e["bytes"] is None else human_bytes(e["bytes"])
        print(f"{verb[0]} snapshot step {e['step']} ({e['reason']}; {size}, {age(e['age_s'])} old)")
    for e in plan.leftovers:
        print(f"{verb[1]} leftover {e['key']} ({e['reason']}, idle {age(e['age_s'])})")
    for e in plan.uploads:
        print(f"{verb[2]} multipart upload {e['key']} (idle {age(e['age_s'])})")
    for e in plan.in_progress:
        print(f"left alone {e['key']} (being written? changed {age(e['age_s'])} ago, within --grace)")
    kept = ", ".join(map(str, plan.kept)) or "none"
    newest = "none" if plan.protected is None else f"step {plan.protected}"
    print(
        f"{plan.tier}: {len(plan.kept)} snapshots kept ({kept}); newest valid snapshot: {newest}"
        + ("; dry run: nothing changed" if dry_run else "")
    )


def _cmd_copy(args: argparse.Namespace) -> int:
    from lightning_snapshot.backends.registry import parse_tier
    from lightning_snapshot.cli.ops import copy_step
    from lightning_snapshot.format.manifest import parse_step_dirname
    from lightning_snapshot.restore.loader import read_manifest
    from lightning_snapshot.restore.progress import human_bytes, progress_bar

    base = args.dest.partition("?")[0].rstrip("/")
    if parse_step_dirname(base.rpartition("/")[2]) is not None:
        raise ConfigError(
            f"the destination {args.dest!r} is a snapshot directory: give the tier's root (the"
            " snapshot keeps its step-* name there)"
        )
    dst = parse_tier(args.dest)
    src, steps = _steps(args.source, args.step)
    step = steps[0]
    t0 = time.monotonic()
    total = read_manifest(src, step).total_bytes
    with progress_bar(total, f"copy step {step}", enabled=not args.json) as bar:
        manifest = copy_step(src, dst, step, on_object=bar.update)
    seconds = time.monotonic() - t0
    if args.json:
        _emit(
            {
                "source": src.url,
                "destination": dst.url,
                "step": step,
                "bytes": manifest.total_bytes,
                "objects": len(manifest.objects),
                "seconds": seconds,
            }
        )
    else:
        print(
            f"copied step {step} ({human_bytes(manifest.total_bytes)}, {len(manifest.objects)} objects, verified)"
            f" from {src.url} to {dst.url} in {seconds:.2f} s"
        )
    return 0


def _add_operator_commands(sub: Any) -> None:
    """The ``gc`` and ``copy`` sub-commands."""
    p = sub.add_parser(
        "gc",
        help="prune a tier: old snapshots, leftovers of crashed writes, stale uploads",
        description="Delete committed snapshots beyond --keep-last or older than --older-than, remove"
        " what crashed writes left (uncommitted step directories, unreferenced objects)"
        " and abort stale multipart uploads (S3). The newest snapshot with a valid"
        " manifest is never deleted, nor anything that changed within --grace.",
    )
    p.add_argument("source", help="tier path or URL")
    p.add_argument(
        "--keep-last",
        type=_count_arg,
        default=None,
        metavar="N",
        help="keep the N newest committed snapshots (default: keep all)",
    )
    p.add_argument(
        "--older-than",
        type=_duration_arg,
        default=None,
        metavar="DURATION",
        help="delete committed snapshots created at least this long ago (90s, 30m, 12h, 7d, 2w)",
    )
    p.add_argument(
        "--grace",
        type=_duration_arg,
        default=3600.0,
        metavar="DURATION",  # ops.DEFAULT_GRACE_S
        help="an uncommitted write counts as crashed once nothing in it changed for this long"
        " (default 1h): a write in progress is never touched",
    )
    p.add_argument("--dry-run", action="store_true", help="print what would be done; change nothing")
    _add_json(p)
    p.set_defaults(fn=_cmd_gc)
    p = sub.add_parser(
        "copy",
        help="copy one snapshot to another tier, verified, manifest last",
        description="Copy a committed snapshot to another tier (local -> s3, s3 -> local, local ->"
        " local): every object is checked against the manifest's checksums as it is"
        " read, and the manifest is committed last, so the destination never shows a"
        " partial snapshot.",
    )
    p.add_argument("source", help="tier path/URL, or a step-* directory")
    p.add_argument("dest", help="destination tier path or URL (created if missing)")
    p.add_argument("--step", type=_step_arg, default=None, help="step to copy (default: newest)")
    _add_json(p)
    p.set_defaults(fn=_cmd_copy)


def _cmd_plan(args: argparse.Namespace) -> int:
    from lightning_snapshot.cli import plan

    plan.run(args)
    return 0


def _add_plan(sub: Any) -> None:
    from lightning_snapshot.cli import plan

    p = sub.add_parser(
        "plan",
        help="expected goodput, snapshot intervals and memory per tier set-up, 1-16384 nodes",
        description=plan.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    plan.add_arguments(p)
    p.set_defaults(fn=_cmd_plan)


def _cmd_agent(args: argparse.Namespace) -> int:
    from lightning_snapshot import agent

    node_dir = Path(args.dir).expanduser().absolute()
    if node_dir.exists() and not node_dir.is_dir():
        raise ConfigError(
            f"--dir {str(node_dir)!r} is a file, not a directory: give the agent's directory (RamTier.node_dir)"
        )
    if args.json and not args.status:
        raise ConfigError("--json goes with --status: lightning-snapshot agent --dir DIR --status --json")
    if args.stop or args.status:
        if not node_dir.is_dir():
            raise SnapshotNotFoundError(
                f"no agent directory {str(node_dir)!r}: check --dir (the RAM tier's base directory,"
                " $LIGHTNING_SNAPSHOT_SHM_DIR or /dev/shm/lightning-snapshot-<uid>, plus the run's name); an agent"
                " that stopped removed it"
            )
        if args.stop:
            stopped = agent.stop_agent(node_dir)
            print(f"stopped the agent of {node_dir}" if stopped else f"no agent serves {node_dir}")
            return 0
        st = agent.agent_status(node_dir)
        if not st:
            raise SnapshotNotFoundError(
                f"no agent serves {node_dir} (none is running for it); start one with: {PROG} agent --dir {node_dir}"
            )
        print(json.dumps(st, indent=2, sort_keys=True) if args.json else agent.format_status(st))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s lightning-snapshot agent: %(message)s")
    if args.nice:
        with contextlib.suppress(OSError):
            os.nice(args.nice)  # background work: the trainer's threads get the CPU first
    log_path = (
        None
        if args.log == "-"
        else Path(args.log).expanduser().absolute()
        if args.log
        else agent.agent_log_path(node_dir)
    )
    return agent.run_agent(node_dir, args.idle_timeout, log_path)
