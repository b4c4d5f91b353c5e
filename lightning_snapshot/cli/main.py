"""The ``lightning-snapshot`` command: list, inspect, verify, export, copy and prune snapshots; run a node's
snapshot agent; plan tiers and intervals.

Nothing in the library calls it: :func:`main` is the ``lightning-snapshot`` console script (``[project.scripts]`` in
pyproject.toml), also entered by the RAM tier's agent process (started by ``ensure_agent`` of
backends/ram/agent_client.py). The work is done by loader.py, ops.py, export.py and plan.py, called by the
sub-commands of :mod:`~lightning_snapshot.cli.commands`; this module is the top-level parser (the sub-commands' come
from :func:`~lightning_snapshot.cli.commands.add_commands`), :func:`main` and the errors' exit statuses.

What a user reads, ``--help``: :data:`DESCRIPTION` (what the command does; argparse lists the sub-commands after it)
and :data:`EPILOG` (examples, what a tier is, the exit statuses). Each sub-command's ``--help`` has its options.
The exit statuses: 0 success; 1 the command failed (no tier or snapshot at that place, a snapshot that does not
verify, an I/O error); 2 the command line is wrong (unknown option or URL scheme, invalid value, a directory where a
file is expected); 3 (agent) another agent already serves the directory. ``agent --status`` exits 1 when no agent
serves it. Errors are one line on stderr (:func:`_run`). list, inspect and verify never create a directory or a
file. ``--json`` prints one JSON document on stdout (fields: docs/operations.md) and no progress bar; a progress bar
is drawn on stderr only when it is a terminal.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

# Only light modules at import time: ``--help`` must answer without importing torch or Lightning. The commands import
# what they need when they run.
from lightning_snapshot.cli.commands import PROG, add_commands, one_line
from lightning_snapshot.errors import ConfigError, SnapshotError

__all__ = ["main"]

#: ``--help``: what the command does, for users (the sub-commands follow, listed by argparse)
DESCRIPTION = """\
Manage the snapshots that lightning-snapshot's SnapshotCallback writes: list
them, show one, check it, export it to one file, copy it to another tier and
prune a tier; run a node's snapshot agent (it holds the RAM tier's memory); and
plan snapshot intervals and tiers for a cluster."""
#: ``--help``: after the list of sub-commands
EPILOG = """\
examples:
  lightning-snapshot list /nvme/snap/run-42
  lightning-snapshot inspect /nvme/snap/run-42 --step 1200
  lightning-snapshot verify /nvme/snap/run-42 --all
  lightning-snapshot export /nvme/snap/run-42 model.safetensors
  lightning-snapshot copy /nvme/snap/run-42 s3://bucket/run-42
  lightning-snapshot gc s3://bucket/run-42 --keep-last 5 --dry-run
  lightning-snapshot agent --dir /dev/shm/lightning-snapshot-$UID/NAME --status
  lightning-snapshot plan --nodes 1,64,4096 --state-bytes 16GB

A tier is a directory, file:///path, ram://NAME or an fsspec URL
(s3://bucket/prefix, ...); list, inspect, verify, export and copy also take one
step-* directory. list, inspect and verify only read, never write. --json
prints one JSON document on stdout.

exit status: 0 success; 1 the command failed (no snapshot there, a snapshot that
does not verify, an I/O error); 2 the command line is wrong; 3 (agent) another
agent already serves the directory.

Run 'lightning-snapshot COMMAND --help' for the options of a command."""
#: Set to 1 to see the full traceback of an unexpected error (bug reports).
DEBUG_ENV = "LIGHTNING_SNAPSHOT_DEBUG"


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line usage error (exit status 2) that points at ``--help``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see: {self.prog} --help)\n")


# ------------------------------------------------------------------------------------------------ parser
def _parser() -> _Parser:
    parser = _Parser(
        prog=PROG, description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_commands(sub)
    return parser


def _run(fn: Callable[[argparse.Namespace], int], args: argparse.Namespace, prog: str) -> int:
    """Run a command; every error becomes one line on stderr and an exit status (see the module docstring)."""
    try:
        return int(fn(args))
    except ConfigError as e:
        print(f"{prog}: error: {one_line(str(e))}", file=sys.stderr)
        return 2
    except SnapshotError as e:
        print(f"{prog}: error: {one_line(str(e))}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # the reader went away (``| head``): stop quietly, as other command-line tools do
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as e:
        where = f": {e.filename}" if e.filename else ""
        print(f"{prog}: error: {e.strerror or e}{where}. Check the path and its permissions", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # never a traceback for the user; one line that says how to get it
        if os.environ.get(DEBUG_ENV) == "1":
            raise
        print(
            f"{prog}: error: unexpected {type(e).__name__}: {one_line(str(e))}. This is a bug: rerun with"
            f" {DEBUG_ENV}=1 for the traceback and report it",
            file=sys.stderr,
        )
        return 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    return _run(args.fn, args, f"{PROG} {args.command}")


if __name__ == "__main__":
    sys.exit(main())
