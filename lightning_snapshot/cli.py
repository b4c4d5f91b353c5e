"""The ``lightning-snapshot`` command: list, inspect, verify and export snapshots; run a node's snapshot agent.

    lightning-snapshot list /nvme/snap/run-42
    lightning-snapshot inspect /nvme/snap/run-42 [--step 1200]
    lightning-snapshot verify /nvme/snap/run-42 [--step 1200 | --all]
    lightning-snapshot export /nvme/snap/run-42 model.safetensors [--format safetensors|torch] [--step 1200]
    lightning-snapshot agent --dir /dev/shm/lightning-snapshot-$UID/NAME [--stop | --status [--json]] [--log FILE]
    lightning-snapshot plan [--nodes 1,64,4096] [--state-bytes 16GB] [--node-mtbf 6000h] [--metrics LOGDIR]

A tier is a path, file:///path, ram://NAME or an fsspec URL (s3://bucket/prefix, ...); list, inspect, verify and
export also take one step-* directory. These commands only read: they never create a directory or a file other
than export's output.

Exit status: 0 success; 1 the command failed (no tier or snapshot at that place, a snapshot that does not verify,
an I/O error); 2 the command line is wrong (unknown option or URL scheme, invalid value, a directory where a file is
expected); 3 (agent) another agent already serves the directory. ``agent --status`` exits 1 when no agent serves
it. Errors are one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

# Only light modules at import time: ``--help`` must answer without importing torch or Lightning. The commands import
# what they need when they run.
from lightning_snapshot.errors import ConfigError, SnapshotError, SnapshotNotFoundError

__all__ = ["main"]

PROG = "lightning-snapshot"
#: Set to 1 to see the full traceback of an unexpected error (bug reports).
DEBUG_ENV = "LIGHTNING_SNAPSHOT_DEBUG"


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line usage error (exit status 2) that points at ``--help``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see: {self.prog} --help)\n")


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


# ------------------------------------------------------------------------------------------------ sources
def _open_tier(source: str) -> tuple[Any, int | None]:
    """The tier ``source`` names (and the step, for a step-* directory); an error when the tier does not exist.

    Creates nothing (``RamTier``'s store is only touched once its directory is known to exist).
    """
    from lightning_snapshot.loader import resolve_source

    backend, step = resolve_source(source)
    backend.require_exists()
    return backend, step


def _steps(source: str, step: int | None, every: bool = False) -> tuple[Any, list[int]]:
    from lightning_snapshot.writer import committed_steps

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
def _cmd_list(args: argparse.Namespace) -> int:
    from lightning_snapshot.loader import read_manifest
    from lightning_snapshot.writer import committed_steps

    backend, _ = _open_tier(args.source)
    steps = committed_steps(backend)
    if not steps:
        print(f"no committed snapshots in {backend.url}")
        return 0
    print(f"{'step':>12}  {'epoch':>5}  {'ranks':>5}  {'MiB':>10}  {'health':<8}  created")
    for step in steps:
        try:
            m = read_manifest(backend, step)
        except SnapshotError as e:
            print(f"{step:>12}  unreadable manifest: {e}")
            continue
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m.created_unix))
        print(f"{step:>12}  {m.epoch:>5}  {m.world_size:>5}  {m.total_bytes / 2**20:>10.2f}  {m.health_text:<8}"
              f"  {created}")
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from lightning_snapshot.loader import read_manifest

    backend, steps = _steps(args.source, args.step)
    m = read_manifest(backend, steps[0])
    print(f"step {m.step}, epoch {m.epoch}, world size {m.world_size}, format v{m.format_version},"
          f" written by lightning-snapshot {m.library_version}")
    print(f"{len(m.objects)} objects, {m.total_bytes} bytes; {len(m.tensors)} shared tensors")
    print(f"health: {_health_line(m)}")
    for t in m.tensors:
        target = f" -> alias of {t.alias_of}" if t.alias_of else ""
        print(f"  {t.name:<60} {t.dtype:<10} {list(t.global_shape)}{target}")
    return 0


def _health_line(m: Any) -> str:
    """The health of a snapshot, per tensor group, for ``inspect``."""
    if m.health is None:
        return "unknown (written before lightning-snapshot recorded health; a resume treats it as healthy)"
    groups = [f"{g}: {'finite' if first is None else f'NaN/inf (first in {first!r})'}" for g, first in m.health.items()]
    return f"{m.health_text} ({'; '.join(groups) or 'no tensors'})"


def _cmd_verify(args: argparse.Namespace) -> int:
    from lightning_snapshot.loader import read_manifest, read_section

    backend, steps = _steps(args.source, args.step, every=args.all)
    bad = 0
    for step in steps:
        t0 = time.monotonic()
        try:
            m = read_manifest(backend, step)
            read_section(backend, m, m.tensors, m.state)
            for section in m.ranks:
                read_section(backend, m, section.tensors, section.state)
        except SnapshotError as e:
            bad += 1
            print(f"step {step}: FAILED: {e}")
            continue
        print(f"step {step}: OK ({m.total_bytes} bytes verified in {time.monotonic() - t0:.2f} s)")
    return 1 if bad else 0


def _cmd_export(args: argparse.Namespace) -> int:
    from lightning_snapshot.export import export_snapshot

    backend, steps = _steps(args.source, args.step)
    out = export_snapshot(backend, args.out, fmt=args.format, step=steps[0], progress=not args.quiet)
    print(f"wrote {out} ({out.stat().st_size} bytes)")
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from lightning_snapshot import plan

    plan.run(args)
    return 0


def _add_plan(sub: Any) -> None:
    from lightning_snapshot import plan

    p = sub.add_parser("plan", help="expected goodput, snapshot intervals and memory per tier set-up, 1-16384 nodes",
                       description=plan.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    plan.add_arguments(p)
    p.set_defaults(fn=_cmd_plan)


def _cmd_agent(args: argparse.Namespace) -> int:
    from lightning_snapshot import agent

    node_dir = Path(args.dir).expanduser().absolute()
    if node_dir.exists() and not node_dir.is_dir():
        raise ConfigError(f"--dir {str(node_dir)!r} is a file, not a directory: give the agent's directory"
                          " (RamTier.node_dir)")
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
            raise SnapshotNotFoundError(f"no agent serves {node_dir} (none is running for it); start one with:"
                                        f" {PROG} agent --dir {node_dir}")
        print(json.dumps(st, indent=2, sort_keys=True) if args.json else agent.format_status(st))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s lightning-snapshot agent: %(message)s")
    if args.nice:
        try:
            os.nice(args.nice)  # background work: the trainer's threads get the CPU first
        except OSError:
            pass
    log_path = None if args.log == "-" else Path(args.log).expanduser().absolute() if args.log else \
        agent.agent_log_path(node_dir)
    return agent.run_agent(node_dir, args.idle_timeout, log_path)


# ------------------------------------------------------------------------------------------------ parser
def _parser() -> _Parser:
    parser = _Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("list", help="committed snapshots of a tier")
    p.add_argument("source", help="tier path or URL")
    p.set_defaults(fn=_cmd_list)
    p = sub.add_parser("inspect", help="the manifest of one snapshot")
    p.add_argument("source", help="tier path/URL, or a step-* directory")
    p.add_argument("--step", type=_step_arg, default=None, help="step to inspect (default: newest)")
    p.set_defaults(fn=_cmd_inspect)
    p = sub.add_parser("verify", help="read back every chunk and check its checksum")
    p.add_argument("source", help="tier path/URL, or a step-* directory")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--step", type=_step_arg, default=None, help="step to verify (default: newest)")
    which.add_argument("--all", action="store_true", help="verify every committed snapshot")
    p.set_defaults(fn=_cmd_verify)
    p = sub.add_parser("export", help="one consolidated file: safetensors (weights) or torch (full state)")
    p.add_argument("source", help="tier path/URL, or a step-* directory")
    p.add_argument("out", help="file to write (its directory must exist; replaced atomically)")
    p.add_argument("--format", choices=["safetensors", "torch"], default="safetensors",
                   help="safetensors: model weights; torch: the full training state for torch.load(weights_only=True)")
    p.add_argument("--step", type=_step_arg, default=None, help="step to export (default: newest)")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(fn=_cmd_export)
    p = sub.add_parser("agent", help="run, stop or query a node's snapshot agent",
                       description="Run the snapshot agent of one node and run (it holds the RAM tier's memory),"
                                   " or stop or query the one that runs.")
    p.add_argument("--dir", required=True, help="the node's memory directory for this run (RamTier.node_dir)")
    p.add_argument("--idle-timeout", type=_seconds_arg, default=600.0,
                   help="seconds without an attached trainer after which the agent exits and frees the memory")
    p.add_argument("--nice", type=int, default=10,
                   help="CPU niceness added to the agent (default 10): its uploads and writes yield to training")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--stop", action="store_true", help="stop the agent serving --dir (frees its memory)")
    what.add_argument("--status", action="store_true",
                      help="print the agent's pid, uptime, attached trainers, memory held per snapshot, idle timeout"
                           " and log (exit status 1 when no agent serves --dir)")
    p.add_argument("--json", action="store_true",
                   help="with --status: the same as one JSON object (stable fields, documented in the README)")
    p.add_argument("--log", default=None, metavar="FILE",
                   help="where the agent logs (appended; '-': stderr). Default:"
                        " $XDG_STATE_HOME/lightning-snapshot/agent-<run>-<hash>.log (~/.local/state/...), outside"
                        " /dev/shm, kept after the agent exits")
    p.set_defaults(fn=_cmd_agent)
    _add_plan(sub)
    return parser


def _one_line(text: str) -> str:
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


def _run(fn: Callable[[argparse.Namespace], int], args: argparse.Namespace, prog: str) -> int:
    """Run a command; every error becomes one line on stderr and an exit status (see the module docstring)."""
    try:
        return int(fn(args))
    except ConfigError as e:
        print(f"{prog}: error: {_one_line(str(e))}", file=sys.stderr)
        return 2
    except SnapshotError as e:
        print(f"{prog}: error: {_one_line(str(e))}", file=sys.stderr)
        return 1
    except OSError as e:
        where = f": {e.filename}" if e.filename else ""
        print(f"{prog}: error: {e.strerror or e}{where}. Check the path and its permissions", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - never a traceback for the user; one line that says how to get it
        if os.environ.get(DEBUG_ENV) == "1":
            raise
        print(f"{prog}: error: unexpected {type(e).__name__}: {_one_line(str(e))}. This is a bug: rerun with"
              f" {DEBUG_ENV}=1 for the traceback and report it", file=sys.stderr)
        return 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    return _run(args.fn, args, f"{PROG} {args.command}")


if __name__ == "__main__":
    sys.exit(main())
