"""The error tree of lightning-snapshot.

Every error the library raises on purpose is a :class:`SnapshotError`. Most also derive from the builtin
exception a caller would naturally catch (``ValueError``, ``OSError``, ``FileNotFoundError``), so either works.
Messages name the problem and the fix.

Raised throughout the library and its backends (reporting.py raises them to the user under ``on_error="raise"``);
users catch them, and the CLI (cli.py) turns them into one line on stderr and an exit status.
"""

from __future__ import annotations

__all__ = [
    "AgentError",
    "CaptureError",
    "ChecksumError",
    "ConfigError",
    "FormatVersionError",
    "ManifestError",
    "NotDurableError",
    "Preempted",
    "ReplicaMismatchError",
    "SnapshotError",
    "SnapshotNotFoundError",
    "SnapshotWriteError",
    "StateMismatchError",
    "StorageFullError",
    "TierUnavailableError",
    "TornSnapshotError",
    "UnsafePathError",
]


class SnapshotError(Exception):
    """Base class of every error raised by lightning-snapshot."""


class ConfigError(SnapshotError, ValueError):
    """An option, URL or argument given by the user is invalid."""


class ManifestError(SnapshotError, ValueError):
    """A manifest is malformed, truncated or inconsistent."""


class FormatVersionError(ManifestError):
    """A manifest was written by a newer format than this library reads."""


class ChecksumError(SnapshotError):
    """Data read back from a tier does not match the checksum recorded in the manifest."""


class SnapshotNotFoundError(SnapshotError, FileNotFoundError):
    """No committed snapshot matches the request."""


class StateMismatchError(SnapshotError, RuntimeError):
    """A snapshot does not fit the model/optimizers/trainer it is being restored into."""


class UnsafePathError(SnapshotError, ValueError):
    """A key or path would escape the root of its tier."""


class CaptureError(SnapshotError, TypeError):
    """Training state contains a value that the snapshot format cannot store."""


class SnapshotWriteError(SnapshotError, OSError):
    """Writing a snapshot to a tier failed; earlier snapshots are untouched."""


class StorageFullError(SnapshotWriteError):
    """The tier ran out of space while writing a snapshot; earlier snapshots are untouched."""


class TierUnavailableError(SnapshotWriteError):
    """A tier cannot be used: its bucket does not exist, its credentials are refused, its endpoint does not answer,
    or its directory cannot be written or listed. The message names the tier (never its credentials) and the fix."""


class NotDurableError(SnapshotWriteError):
    """At the end of ``fit``, the last snapshot is held by no durable tier; the message says which tier failed and
    why."""


class TornSnapshotError(SnapshotError, RuntimeError):
    """A snapshot was not committed because a tensor it copied while training went on was changed in place before
    the next ``optimizer.step`` (user code in ``training_step``): its copy could hold either value. Training goes on
    and that tensor is copied at once from then on; the callback warns and counts the snapshot as skipped."""


class AgentError(SnapshotError, RuntimeError):
    """The node's snapshot agent stopped answering (stopped, hung, or gone) while it had a snapshot to write; the
    message names the agent's process and its log. Not retried: the agent may still be writing."""


class ReplicaMismatchError(SnapshotError, RuntimeError):
    """Under data parallelism, the ranks' replicas of the parameters or optimizer state disagree
    (``on_replica_mismatch="raise"``); the message names the tensors and the ranks."""


class Preempted(SystemExit):
    """The fit was stopped by a preemption signal (``preemption_signals``), on every rank at the same step, after
    that step was snapshotted: a ``SystemExit`` whose status is 128 + the signal number (143 for SIGTERM), so that a
    process that does not catch it exits as a signalled one would, and a supervisor restarts it. Not a
    :class:`SnapshotError`: nothing failed."""

    def __init__(self, signum: int, step: int, durable: bool) -> None:
        super().__init__(128 + signum)
        #: the signal number, the step snapshotted, and whether a durable tier held it within ``sigterm_grace``
        self.signum = signum
        self.step = step
        self.durable = durable

    def __str__(self) -> str:
        return (
            f"preempted by signal {self.signum} at step {self.step}"
            f" ({'durable' if self.durable else 'not durable within sigterm_grace'}); exit status {self.code}"
        )
