"""The snapshot agent's protocol: what the agent process (:mod:`.server`) and the trainer side (:mod:`.client`) share.

The wire format (length-prefixed JSON messages over the Unix socket ``agent.sock``, arena file descriptors passed
alongside; a staged state as JSON with its bytes in shared memory or inline), the lock file ``agent.lock`` (how an
agent takes it, what it writes there: its pid and log path, and how a trainer reads them), where the agent logs, and
the shared constants. Nothing is unpickled. Imported by the server and the client only.
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import json
import logging
import os
import socket
import struct
import sys
from pathlib import Path
from typing import Any

__all__ = [
    "HEARTBEAT_S",
    "LOCK",
    "PART_WAIT_S",
    "SILENCE_S",
    "SOCK",
    "STATUS_VERSION",
    "MessageReader",
    "agent_log_path",
    "describe_staged",
    "open_log",
    "pid_alive",
    "read_lock_file",
    "rebuild_staged",
    "send_message",
    "take_lock",
]

log = logging.getLogger("lightning_snapshot.agent")

SOCK, LOCK = "agent.sock", "agent.lock"
#: Version of the ``status`` reply (``lightning-snapshot agent --status --json``); fields are only ever added.
STATUS_VERSION = 1
_HEADER = struct.Struct("!I")
_MAX_MESSAGE = 256 << 20
#: How long (seconds) the agent of rank 0 waits for the other ranks' parts of a snapshot, and the others for its commit,
#: unless the trainer says otherwise (``SnapshotCallback(collective_timeout=...)``); a failure marker ends it at once.
PART_WAIT_S = 300.0
#: How often (seconds) the agent tells each attached trainer that it is alive. A trainer that hears nothing from its
#: agent for SILENCE_S seconds (a stopped, hung or wedged agent) stops waiting for it with
#: :class:`~lightning_snapshot.errors.AgentError`.
HEARTBEAT_S = 1.0
#: How long (seconds) a trainer waits for a word from its agent before it gives it up (or ``collective_timeout``
#: when that is shorter); a healthy agent says something every HEARTBEAT_S however long its writes take.
SILENCE_S = 60.0


# ----------------------------------------------------------------------------------------------- where the log goes
def agent_log_path(node_dir: str | os.PathLike[str]) -> Path:
    """Where the agent of ``node_dir`` writes its log unless told otherwise (``agent --log``).

    ``$XDG_STATE_HOME/lightning-snapshot/agent-<run>-<hash of node_dir>.log`` (``XDG_STATE_HOME`` defaults to
    ``~/.local/state``): outside shared memory, so that it survives the agent, which leaves nothing in ``/dev/shm``.
    Successive agents of the same directory append to the same file. Nothing deletes it.
    """
    node_dir = Path(node_dir).expanduser().absolute()
    state = os.environ.get("XDG_STATE_HOME", "")
    if not os.path.isabs(state):  # (the XDG spec: a relative value is ignored)
        state = os.path.join(os.path.expanduser("~"), ".local", "state")
    digest = hashlib.sha256(str(node_dir).encode()).hexdigest()[:12]
    return Path(state) / "lightning-snapshot" / f"agent-{node_dir.name}-{digest}.log"


def open_log(path: Path) -> int:
    """A file descriptor appending to ``path`` (its directory made, owner-only, if missing)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)


def read_lock_file(node_dir: Path) -> tuple[str, str]:
    """(pid, log path) as the agent of ``node_dir`` wrote them in its lock file; empty strings where unknown."""
    try:
        text = (node_dir / LOCK).read_text(errors="replace")
    except OSError:
        return "", ""
    if "\n" not in text:  # (emptied or being written by an agent taking the lock: nothing known yet)
        return "", ""
    lines = text.splitlines()
    return (lines[0].strip()[:20] if lines else ""), (lines[1].strip() if len(lines) > 1 else "")


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def take_lock(node_dir: Path, log_path: Path | None) -> int | None:
    """Take the directory's lock (writing this pid and the log path into it); None when another agent holds it.

    The lock file is deleted by the agent that exits: an agent that opened it just before and locks it just after
    would hold a lock on a file no longer in the directory, so the lock counts only if it is still the file there.
    """
    while True:
        try:
            fd = os.open(node_dir / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except FileNotFoundError:  # (the agent that exited just now removed the directory, empty then)
            node_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = os.pread(fd, 32, 0).decode(errors="replace").split("\n")[0].strip()
            os.close(fd)
            print(
                f"lightning-snapshot agent: another agent (pid {other or '?'}) already serves {node_dir}",
                file=sys.stderr,
            )
            return None
        try:
            if os.stat(node_dir / LOCK).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)  # (the agent that held it exited meanwhile and removed it: take the new one)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n{log_path or ''}\n".encode(), 0)
    return fd


# ----------------------------------------------------------------------------------------------- framing
def send_message(sock: socket.socket, msg: dict[str, Any], fds: list[int] | None = None) -> None:
    data = json.dumps(msg, separators=(",", ":")).encode()
    frame = _HEADER.pack(len(data)) + data
    if fds:
        socket.send_fds(sock, [frame[:4096]], fds)
        if len(frame) > 4096:
            sock.sendall(frame[4096:])
    else:
        sock.sendall(frame)


class MessageReader:
    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buf = sock, bytearray()
        self.fds: list[int] = []

    def next(self) -> dict[str, Any] | None:
        """The next message (its passed fds in ``msg["fds"]``), or None at end of stream."""
        while True:
            if len(self.buf) >= 4:
                (n,) = _HEADER.unpack_from(self.buf)
                if n > _MAX_MESSAGE:
                    raise ValueError(f"message of {n} bytes is too long")
                if len(self.buf) >= 4 + n:
                    raw = bytes(self.buf[4 : 4 + n])
                    del self.buf[: 4 + n]
                    msg = json.loads(raw)
                    if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
                        raise ValueError("malformed message")
                    want = msg.get("nfds", 0)
                    if not isinstance(want, int) or want < 0 or want > len(self.fds):
                        raise ValueError("message names file descriptors that did not come")
                    msg["fds"], self.fds = self.fds[:want], self.fds[want:]
                    return msg
            data, fds, _flags, _addr = socket.recv_fds(self.sock, 1 << 20, 16)
            self.fds.extend(fds)
            if not data:
                return None
            self.buf += data


# ----------------------------------------------------------------------------------------------- staged state
def describe_staged(staged: Any, *, inline: bool) -> dict[str, Any]:
    """A StagedState as JSON: its layout (and its bytes, base64, when ``inline``: the small rank state)."""
    from lightning_snapshot.format.manifest import dtype_name
    from lightning_snapshot.staging import tensor_bytes

    meta: dict[str, Any] = {
        "tree": staged.tree,
        "tensors": [[n, dtype_name(t.dtype), list(t.shape)] for n, t in staged.tensors.items()],
        "aliases": staged.aliases,
        "alignment": staged.alignment,
        "chunk_bytes": staged.chunk_bytes,
        "checksums": staged.checksums,
        "packed": staged.packed is not None,
        "shards": {n: [list(g), list(o)] for n, (g, o) in staged.shards.items()},
    }
    if inline:
        meta["data"] = [base64.b64encode(bytes(tensor_bytes(t))).decode() for t in staged.tensors.values()]
    return meta


def rebuild_staged(meta: dict[str, Any], region: memoryview | None) -> Any:
    """The StagedState ``describe_staged`` described, over ``region`` (the arena slot) or its inline bytes."""
    import torch

    from lightning_snapshot.format.manifest import DTYPES
    from lightning_snapshot.plan.planner import plan_layout
    from lightning_snapshot.staging import StagedState

    tensors: dict[str, torch.Tensor] = {}
    specs = meta["tensors"]
    sizes = []
    for name, dtype, shape in specs:
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}")
        n = 1
        for d in shape:
            n *= int(d)
        sizes.append((name, n * torch.empty(0, dtype=DTYPES[dtype]).element_size()))
    if meta.get("data") is not None:
        for (name, dtype, shape), b64 in zip(specs, meta["data"], strict=True):
            raw = bytearray(base64.b64decode(b64))
            t = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
            tensors[name] = t.view(DTYPES[dtype]).reshape(shape)
        packed = None
    else:
        if region is None:
            raise ValueError("the staged state lies in an arena slot the agent does not have")
        placed, size = plan_layout(sizes, meta["alignment"])
        base = torch.frombuffer(region, dtype=torch.uint8) if region.nbytes else torch.empty(0, dtype=torch.uint8)
        for (name, dtype, shape), (_n, offset), (_m, nbytes) in zip(specs, placed, sizes, strict=True):
            tensors[name] = base[offset : offset + nbytes].view(DTYPES[dtype]).reshape(shape)
        packed = region[:size] if meta["packed"] else None
    return StagedState(
        tree=meta["tree"],
        tensors=tensors,
        aliases=dict(meta["aliases"]),
        packed=packed,
        alignment=meta["alignment"],
        checksums=meta["checksums"],
        chunk_bytes=meta["chunk_bytes"],
        shards={n: (tuple(g), tuple(o)) for n, (g, o) in meta["shards"].items()},
    )
