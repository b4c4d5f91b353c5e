"""The per-node snapshot agent: a process that outlives the trainer.

One agent per node and run (a lock in its directory). It owns the node's RAM-tier memory (the directory
``RamTier.node_dir``: shared-memory files, mode 0600 in a 0700 directory) and frees it when it exits: after
``idle_timeout`` seconds with no trainer attached, or on ``lightning-snapshot agent --stop``. Then it leaves nothing
in shared memory: the snapshots, its socket, its lock and the directory itself go (and the base directory
``/dev/shm/lightning-snapshot-<uid>`` when no other run uses it). Its log is kept outside shared memory, in
``$XDG_STATE_HOME/lightning-snapshot/`` (default ``~/.local/state/lightning-snapshot/``; see :func:`agent_log_path`).
The first local rank of a node starts it (in its own session, so a SIGKILL of the trainer's process group does not
reach it), or a job script starts it beforehand with ``lightning-snapshot agent --dir DIR``.

Trainers attach over a Unix socket (``agent.sock``, 0600) and pass it the file descriptors of their staging arena,
so the agent maps the very memory the trainer staged into: no copy. For every snapshot whose staging finished, the
trainer tells the agent where it lies and which durable tiers it is due in; when every tier committed it, the
trainer releases it. If the trainer goes away (SIGKILL, crash) with snapshots not released, the agent writes them to
their durable tiers itself, under the same commit rule: each rank's data objects and its part of the manifest, and
the agent of rank 0 merges the parts and commits the manifest once every rank's part is there. Nothing is unpickled:
messages are JSON, tensors are raw bytes in shared memory.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from lightning_snapshot.errors import SnapshotError

__all__ = ["AgentClient", "agent_log_path", "agent_status", "ensure_agent", "format_status", "main", "stop_agent"]

log = logging.getLogger("lightning_snapshot.backends.ram.agent")

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


def _open_log(path: Path) -> int:
    """A file descriptor appending to ``path`` (its directory made, owner-only, if missing)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)


def _read_lock(node_dir: Path) -> tuple[str, str]:
    """(pid, log path) as the agent of ``node_dir`` wrote them in its lock file; empty strings where unknown."""
    try:
        text = (node_dir / LOCK).read_text(errors="replace")
    except OSError:
        return "", ""
    if "\n" not in text:  # (emptied or being written by an agent taking the lock: nothing known yet)
        return "", ""
    lines = text.splitlines()
    return (lines[0].strip()[:20] if lines else ""), (lines[1].strip() if len(lines) > 1 else "")


def _alive(pid: int) -> bool:
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


# ----------------------------------------------------------------------------------------------- framing
def _send(sock: socket.socket, msg: dict[str, Any], fds: list[int] | None = None) -> None:
    data = json.dumps(msg, separators=(",", ":")).encode()
    frame = _HEADER.pack(len(data)) + data
    if fds:
        socket.send_fds(sock, [frame[:4096]], fds)
        if len(frame) > 4096:
            sock.sendall(frame[4096:])
    else:
        sock.sendall(frame)


class _Reader:
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
    from lightning_snapshot.manifest import dtype_name
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

    from lightning_snapshot.manifest import DTYPES
    from lightning_snapshot.planner import plan_layout
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


def _verify(staged: Any) -> None:
    from lightning_snapshot.staging import chunk_digests, tensor_bytes

    if staged.checksums is None:
        return
    chunk = staged.chunk_bytes or (8 << 20)
    for name, t in staged.tensors.items():
        if chunk_digests(tensor_bytes(t), chunk) != staged.checksums[name]:
            raise SnapshotError(f"the staged bytes of {name!r} changed after staging (the slot was reused)")


# ----------------------------------------------------------------------------------------------- the agent
class Agent:
    """The agent process' state: attached trainers, the arenas they passed, snapshots not yet released."""

    def __init__(
        self, node_dir: Path, idle_timeout: float, owned: dict[str, int] | None = None, log_path: Path | None = None
    ) -> None:
        self.dir = node_dir
        #: where this agent logs (None: to the stderr of whoever started it)
        self.log_path = log_path
        self.started_unix = time.time()
        self.started = time.monotonic()
        #: one entry per attached trainer: its hello message and the snapshots it staged and has not released
        self.trainers: dict[int, tuple[dict[str, Any], dict[int, dict[str, Any]]]] = {}
        #: inode of each file the agent made (socket, lock): it stops, and deletes nothing, once they were removed
        #: or replaced (the node's memory directory was deleted, e.g. by a job that simulates losing the node)
        self.owned = owned or {}
        self.idle_timeout = idle_timeout
        self.lock = threading.Lock()
        self.attached = 0
        self.flushing = 0
        self.idle_since = time.monotonic()
        self.stop = threading.Event()
        #: seconds to wait before each durable write (LIGHTNING_SNAPSHOT_AGENT_WRITE_DELAY; a knob for tests that
        #: kill the trainer while the agent still has its snapshot to write)
        self.write_delay = float(os.environ.get("LIGHTNING_SNAPSHOT_AGENT_WRITE_DELAY", "0") or 0)

    def serve(self, server: socket.socket) -> None:
        server.settimeout(0.5)
        while not self.stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                if not self.owner():
                    log.warning("%s was removed or taken over: exiting without touching it", self.dir)
                    return
                with self.lock:
                    idle = self.attached == 0 and self.flushing == 0
                    if idle and time.monotonic() - self.idle_since > self.idle_timeout:
                        log.info("no trainer attached for %.0f s: exiting and freeing the memory", self.idle_timeout)
                        return
                continue
            threading.Thread(target=self._connection, args=(conn,), daemon=True).start()

    def owner(self) -> bool:
        """Whether the files this agent made are still the ones in its directory."""
        for name, ino in self.owned.items():
            try:
                if os.stat(self.dir / name).st_ino != ino:
                    return False
            except OSError:
                return False
        return True

    def _connection(self, conn: socket.socket) -> None:
        reader = _Reader(conn)
        arenas: dict[int, Any] = {}
        entries: dict[int, dict[str, Any]] = {}
        hello: dict[str, Any] | None = None
        send_lock = threading.Lock()
        queues: dict[int, Any] = {}
        workers: list[threading.Thread] = []

        def reply(msg: dict[str, Any]) -> bool:
            with send_lock:
                try:
                    _send(conn, msg)
                    return True
                except OSError:
                    return False  # the trainer is gone; the write itself went on

        closed = threading.Event()

        def heartbeat() -> None:  # (an agent that stops or hangs falls silent: its trainers stop waiting for it)
            while not closed.wait(HEARTBEAT_S):
                if not reply({"op": "alive"}):
                    return

        def tier_worker(q: Any) -> None:
            while True:
                msg = q.get()
                if msg is None:
                    return
                with self.lock:
                    self.flushing += 1
                t0 = time.monotonic()
                try:
                    if self.write_delay:
                        time.sleep(self.write_delay)
                    nbytes = self._write_tier(hello or {}, msg, arenas.get(int(msg["slot"])), int(msg["tier"]))
                    if not reply(
                        {
                            "op": "result",
                            "id": msg["id"],
                            "ok": True,
                            "nbytes": nbytes,
                            "seconds": time.monotonic() - t0,
                        }
                    ):
                        log.info(
                            "step %s reached tier %s after trainer rank %s was gone",
                            msg["step"],
                            msg["tier"],
                            (hello or {}).get("rank"),
                        )
                except Exception as e:  # noqa: BLE001 - sent to the trainer, which retries or reports it
                    reply({"op": "result", "id": msg["id"], "ok": False, "error": self._describe(hello, msg, e)})
                finally:
                    with self.lock:
                        self.flushing -= 1
                        self.idle_since = time.monotonic()

        try:
            while True:
                try:
                    msg = reader.next()
                except (ValueError, OSError) as e:
                    log.warning("dropping a connection: %s", e)
                    break
                if msg is None:
                    break
                op = msg["op"]
                if op == "ping":
                    _send(conn, {"op": "reply", "ok": True, "pid": os.getpid()})
                elif op == "status":
                    _send(conn, {"op": "reply", "ok": True, **self.status()})
                elif op == "stop":
                    _send(conn, {"op": "reply", "ok": True, "pid": os.getpid()})
                    self.stop.set()
                elif op == "hello":
                    hello = msg
                    with self.lock:
                        self.attached += 1
                        self.trainers[id(conn)] = (hello, entries)
                    threading.Thread(target=heartbeat, name="heartbeat", daemon=True).start()
                    log.info("trainer rank %s (pid %s) attached", msg.get("rank"), msg.get("pid"))
                elif op == "arena":
                    import mmap

                    for fd in msg["fds"]:
                        try:
                            arenas[int(msg["slot"])] = mmap.mmap(fd, int(msg["size"]))
                        finally:
                            os.close(fd)
                elif op == "staged":
                    entries[int(msg["slot"])] = msg
                elif op == "release":
                    if msg.get("ok", True):
                        entries.pop(int(msg["slot"]), None)
                elif op == "persist":
                    import queue

                    index = int(msg["tier"])
                    if index not in queues:  # one writer thread per tier: a slow tier never holds up another
                        queues[index] = queue.Queue()
                        workers.append(threading.Thread(target=tier_worker, args=(queues[index],), daemon=True))
                        workers[-1].start()
                    queues[index].put(msg)
                elif op == "bye":
                    break
        finally:
            closed.set()
            for q in queues.values():
                q.put(None)
            for w in workers:  # writes in progress finish, whether or not the trainer is still there
                w.join()
            with send_lock:
                conn.close()
            if hello is not None:
                with self.lock:
                    self.attached -= 1
                    self.flushing += 1
                    self.trainers.pop(id(conn), None)
                try:
                    for entry in sorted(entries.values(), key=lambda e: e["step"]):
                        self._flush(hello, entry, arenas.get(int(entry["slot"])))
                finally:
                    with self.lock:
                        self.flushing -= 1
                        self.idle_since = time.monotonic()
            for mm in arenas.values():
                with contextlib.suppress(BufferError):
                    mm.close()

    def status(self) -> dict[str, Any]:
        """What ``lightning-snapshot agent --status`` shows (the ``status`` reply; fields documented in the README).

        Thread-safe (any connection's thread calls it).
        """
        from lightning_snapshot.backends.ram.tier import allocated_bytes
        from lightning_snapshot.manifest import parse_step_dirname

        snapshots = []
        try:
            names = os.listdir(self.dir / "store")
        except OSError:
            names = []
        for name in names:
            step = parse_step_dirname(name)
            if step is not None:
                snapshots.append({"step": step, "bytes": allocated_bytes(self.dir / "store" / name)})
        snapshots.sort(key=lambda e: e["step"], reverse=True)
        now = time.monotonic()
        with self.lock:
            idle = self.attached == 0 and self.flushing == 0
            trainers = [
                {
                    "rank": h.get("rank"),
                    "pid": h.get("pid"),
                    "world_size": h.get("world_size"),
                    "run_id": h.get("run_id"),
                }
                for h, _entries in self.trainers.values()
            ]
            pending = sorted(
                (
                    {"step": int(e["step"]), "rank": h.get("rank"), "tiers": len(e.get("tiers", ()))}
                    for h, entries in self.trainers.values()
                    for e in list(entries.values())
                ),
                key=lambda e: (e["step"], e["rank"] if isinstance(e["rank"], int) else -1),
            )
            idle_since = self.idle_since
            flushing = self.flushing
        return {
            "version": STATUS_VERSION,
            "pid": os.getpid(),
            "dir": str(self.dir),
            "started_unix": self.started_unix,
            "uptime_s": now - self.started,
            "attached": len(trainers),
            "trainers": trainers,
            "held_bytes": allocated_bytes(self.dir / "store"),
            "snapshots": snapshots,
            "pending": pending,
            "flushing": flushing,
            "idle_timeout_s": self.idle_timeout,
            "idle_s": now - idle_since if idle else None,
            "exits_in_s": max(0.0, self.idle_timeout - (now - idle_since)) if idle else None,
            "log": str(self.log_path) if self.log_path is not None else None,
        }

    def _flush(self, hello: dict[str, Any], entry: dict[str, Any], arena: Any) -> None:
        """Write a snapshot the trainer staged but could not make durable to the tiers it was due in."""
        for index in entry["tiers"]:
            try:
                if self._write_tier(hello, entry, arena, int(index), after_death=True):
                    log.info("step %s committed to tier %d after rank %s died", entry["step"], index, hello["rank"])
            except Exception as e:  # noqa: BLE001 - logged; the other tiers still get it
                log.warning(
                    "flushing step %s of rank %s failed: %s",
                    entry["step"],
                    hello["rank"],
                    self._describe(hello, entry, e),
                )

    @staticmethod
    def _describe(hello: dict[str, Any] | None, msg: dict[str, Any], e: BaseException) -> str:
        text = f"{type(e).__name__}: {e}" if not isinstance(e, SnapshotError) else str(e)
        try:
            from lightning_snapshot.backends.base import Backend

            tier = Backend.from_spec((hello or {})["tiers"][int(msg.get("tier", msg.get("tiers", [0])[0]))])
            redact = getattr(tier, "redact", None)
            return redact(text) if redact is not None else text
        except Exception:  # noqa: BLE001 - cannot build the tier: say nothing that could hold a secret
            return type(e).__name__

    def _write_tier(
        self, hello: dict[str, Any], entry: dict[str, Any], arena: Any, index: int, *, after_death: bool = False
    ) -> int:
        """Write the staged snapshot ``entry`` to the trainer's tier ``index`` under the commit rule.

        Every rank's agent writes that rank's data objects and manifest part; the agent of rank 0 waits for every
        part, merges them, commits the manifest and applies retention; the others wait for the commit. A rank whose
        write failed leaves a ``failed`` marker so that rank 0 stops waiting. Returns the bytes committed (0 when
        the step was already committed).
        """
        from lightning_snapshot.backends.base import Backend
        from lightning_snapshot.commit import MarkerTransport
        from lightning_snapshot.writer import SnapshotJob, apply_retention, commit_job

        step, rank, world = int(entry["step"]), int(hello["rank"]), int(hello["world_size"])
        run_id = str(hello["run_id"])
        region = memoryview(arena) if arena is not None else None
        shared = rebuild_staged(entry["shared"], region)
        private = rebuild_staged(entry["private"], None)
        _verify(shared)
        tier = Backend.from_spec(hello["tiers"][index])
        job = SnapshotJob(step, int(entry["epoch"]), shared, private)
        transport = MarkerTransport(tier, step, run_id, rank, world, float(hello.get("part_wait") or PART_WAIT_S))

        def flushing() -> None:
            if after_death:
                log.info("rank %d died before step %d reached %s: flushing it", rank, step, tier.url)

        done = commit_job(
            tier,
            transport,
            job,
            run_id,
            alignment=shared.alignment,
            chunk_bytes=shared.chunk_bytes or (8 << 20),
            prepare=flushing,
            where="manifest of {prefix} written by the snapshot agent",
        )
        if not done.written:
            return 0
        if done.manifest is None:  # (a rank other than 0: rank 0 committed it)
            return shared.nbytes + private.nbytes
        try:
            apply_retention(tier, step, manifest=done.manifest)
        except Exception as e:  # noqa: BLE001 - the snapshot is committed; cleanup waits for the next one
            log.warning("retention in %s failed: %s", tier.url, self._describe(hello, {"tier": index}, e))
        return done.manifest.total_bytes


def _lock(node_dir: Path, log_path: Path | None) -> int | None:
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


def _remove_own_files(node_dir: Path) -> None:
    """Delete what the agent of ``node_dir`` owns there (it still does: see ``Agent.owner``), then the directory if
    that left it empty, then the base directory of the RAM tier's memory if no other run uses it."""
    from lightning_snapshot.backends.ram.tier import default_shm_base

    for name in ("store", SOCK, LOCK):  # (the socket before the lock: a new agent waits for the lock)
        p = node_dir / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
    for d in (node_dir, node_dir.parent):
        if d == node_dir.parent and os.path.abspath(default_shm_base()) != str(d):
            break  # (a directory this library did not make for RAM tiers is not ours to remove)
        try:
            os.rmdir(d)  # only when empty: files someone else put there, or a new agent's, stay
        except OSError:
            break


def _log_to(path: Path) -> None:
    """Send this process' stdout and stderr (its log, and any crash) to the end of ``path``."""
    fd = _open_log(path)
    try:
        if os.path.sameopenfile(fd, 2):
            return  # (started by ensure_agent: already there)
        print(f"lightning-snapshot agent: pid {os.getpid()} logs to {path}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    finally:
        os.close(fd)


def run_agent(node_dir: Path, idle_timeout: float, log_path: Path | None = None) -> int:
    """The agent's main loop (in its own process). Returns the exit status.

    ``log_path``: where its log goes (stdout and stderr are sent there once it holds the lock; None: they stay),
    reported by ``status`` and in the lock file, where a trainer that lost its agent finds it.
    """
    node_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(node_dir, 0o700)
    lock_fd = _lock(node_dir, log_path)
    if lock_fd is None:
        return 3
    if log_path is not None:
        _log_to(log_path)
    # Import what the request handlers use (torch, the tiers: seconds on a busy node) before the socket answers, not
    # on a trainer's first request, which waits only a few seconds for its reply. (``import lightning_snapshot`` no
    # longer imports torch by itself.)
    import lightning_snapshot.backends
    import lightning_snapshot.writer  # noqa: F401

    sock_path = node_dir / SOCK
    with contextlib.suppress(FileNotFoundError):
        sock_path.unlink()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        server.bind(str(sock_path))
    finally:
        os.umask(old)
    os.chmod(sock_path, 0o600)
    server.listen(64)
    agent = Agent(
        node_dir, idle_timeout, {SOCK: os.stat(sock_path).st_ino, LOCK: os.fstat(lock_fd).st_ino}, log_path=log_path
    )
    log.info("agent pid %d serving %s (idle timeout %.0f s)", os.getpid(), node_dir, idle_timeout)
    try:
        agent.serve(server)
    finally:
        server.close()
        # wait for flushes in progress, then free the memory
        while agent.flushing:
            time.sleep(0.1)
        if agent.owner():
            _remove_own_files(node_dir)
            log.info("agent pid %d stopped; memory freed, %s removed", os.getpid(), node_dir)
        else:
            log.info("agent pid %d stopped; %s was not its own any more: left as it is", os.getpid(), node_dir)
        os.close(lock_fd)
    return 0


# ----------------------------------------------------------------------------------------------- trainer side
def _connect(node_dir: Path, timeout: float = 5.0) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(str(node_dir / SOCK))
    except OSError:
        s.close()
        raise
    return s


def _request(node_dir: Path, op: str) -> dict[str, Any] | None:
    """One request/answer with the agent of ``node_dir``; None when no agent answers."""
    try:
        s = _connect(node_dir)
    except OSError:
        return None
    try:
        _send(s, {"op": op})
        return _Reader(s).next()
    except (OSError, ValueError):
        return None
    finally:
        s.close()


def agent_status(node_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The state of the agent serving ``node_dir`` (the fields of ``agent --status --json``, see the README), or
    None when none answers."""
    answer = _request(Path(node_dir), "status")
    if answer is not None:
        answer.pop("op", None)
        answer.pop("ok", None)
        answer.pop("fds", None)
    return answer


def _bytes(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _duration(seconds: float) -> str:
    s = int(seconds)
    if s < 120:
        return f"{s} s"
    if s < 7200:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def format_status(st: dict[str, Any]) -> str:
    """The readable form of :func:`agent_status`'s answer (what ``agent --status`` prints)."""
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(st["started_unix"]))
    lines = [f"agent pid {st['pid']} serving {st['dir']}", f"  up {_duration(st['uptime_s'])} (since {started})"]
    trainers = st.get("trainers") or []
    who = ", ".join(f"rank {t['rank']} pid {t['pid']}" for t in trainers)
    lines.append(f"  trainers attached: {len(trainers)}{f' ({who})' if who else ''}")
    snaps = st.get("snapshots") or []
    lines.append(
        f"  memory held: {_bytes(st['held_bytes'])}"
        + (f" in {len(snaps)} snapshot{'s' if len(snaps) != 1 else ''}" if snaps else "")
    )
    lines += [f"    step {e['step']}: {_bytes(e['bytes'])}" for e in snaps]
    pending = st.get("pending") or []
    if pending:
        lines.append(
            "  staged, not yet in every durable tier (written by the agent if the trainer dies): "
            + ", ".join(f"step {e['step']} (rank {e['rank']})" for e in pending)
        )
    if st.get("flushing"):
        lines.append(f"  writing now: {st['flushing']} snapshot write(s) to durable tiers")
    timeout = _duration(st["idle_timeout_s"])
    if st.get("exits_in_s") is None:
        lines.append(f"  idle timeout: {timeout} (counts once no trainer is attached and nothing is being written)")
    else:
        lines.append(
            f"  idle timeout: {timeout}; idle for {_duration(st['idle_s'])}, exits in"
            f" {_duration(st['exits_in_s'])} unless a trainer attaches"
        )
    lines.append(f"  log: {st['log'] or 'stderr of the process that started it (agent --log -)'}")
    return "\n".join(lines)


def stop_agent(node_dir: str | os.PathLike[str], timeout: float = 30.0) -> bool:
    """Ask the agent of ``node_dir`` to exit and free its memory; True once it is gone (False: none was running).

    Once it returns True within ``timeout``, the agent has exited: it wrote what it had to write and removed its
    files and ``node_dir`` (unless someone else's files are in it).
    """
    node_dir = Path(node_dir)
    answer = _request(node_dir, "stop")
    if answer is None:
        return False
    pid = int(answer.get("pid", 0))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (_alive(pid) if pid > 0 else (node_dir / SOCK).exists()):
        time.sleep(0.05)
    return True


def ensure_agent(node_dir: str | os.PathLike[str], *, idle_timeout: float = 600.0, timeout: float = 60.0) -> int:
    """Start the agent of ``node_dir`` unless one answers already; returns its pid."""
    node_dir = Path(node_dir)
    answer = _request(node_dir, "ping")
    if answer is not None:
        return int(answer["pid"])
    node_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    import lightning_snapshot

    src = os.path.dirname(os.path.dirname(os.path.abspath(lightning_snapshot.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    for var in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "MASTER_PORT", "MASTER_ADDR"):
        env.pop(var, None)  # the agent is no rank of the job
    log_path = agent_log_path(node_dir)
    try:
        logfd = _open_log(log_path)
    except OSError as e:  # (a read-only home: the temporary directory, still outside shared memory)
        fallback = Path(tempfile.gettempdir()) / f"lightning-snapshot-{os.getuid()}-logs" / log_path.name
        log.warning(
            "lightning-snapshot: cannot write the agent's log %s (%s); it goes to %s. Set XDG_STATE_HOME to"
            " a directory this user may write",
            log_path,
            e,
            fallback,
        )
        try:
            logfd = _open_log(fallback)
        except OSError as e2:
            raise SnapshotError(
                f"could not start the snapshot agent for {node_dir}: cannot write its log {log_path} ({e}) nor"
                f" {fallback} ({e2}). Set XDG_STATE_HOME to a directory this user may write"
            ) from e2
        log_path = fallback
    logf = os.fdopen(logfd, "ab")  # (handed to the child)
    agent_cmd = [
        sys.executable,
        "-c",
        "import sys; from lightning_snapshot.backends.ram.agent import main; sys.exit(main())",
        "--dir",
        str(node_dir),
        "--idle-timeout",
        str(idle_timeout),
        "--log",
        str(log_path),
    ]
    try:
        # through a short-lived intermediate process, so that the agent is nobody's child (no zombie when it exits
        # before the trainer) and runs in a session of its own (a SIGKILL of the trainer's group does not reach it)
        subprocess.run(
            [
                sys.executable,
                "-c",
                "import subprocess, sys; subprocess.Popen(sys.argv[1:], start_new_session=True,"
                " stdin=subprocess.DEVNULL, close_fds=True)",
                *agent_cmd,
            ],
            stdin=subprocess.DEVNULL,
            stdout=logf,
            stderr=logf,
            close_fds=True,
            env=env,
            cwd="/",
            check=True,
            timeout=timeout,
        )
    except (subprocess.SubprocessError, OSError) as e:
        raise SnapshotError(f"could not start the snapshot agent for {node_dir}: {e}") from e
    finally:
        logf.close()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        answer = _request(node_dir, "ping")
        if answer is not None:
            return int(answer["pid"])
        time.sleep(0.05)
    tail = log_path.read_text(errors="replace")[-2000:] if log_path.exists() else ""
    raise SnapshotError(
        f"the snapshot agent for {node_dir} did not answer within {timeout:.0f} s; its log ({log_path}):\n{tail}"
    )


class AgentClient:
    """A trainer rank's link to its node's agent: passes arena memory and tells which snapshots need flushing.

    Thread-safe: the persist threads and the training thread call it; one lock guards the socket.
    """

    def __init__(
        self,
        node_dir: str | os.PathLike[str],
        *,
        rank: int,
        world_size: int,
        run_id: str,
        tiers: list[Any],
        part_wait: float = PART_WAIT_S,
    ) -> None:
        self.node_dir = Path(node_dir)
        self.tiers = list(tiers)
        self._lock = threading.Lock()
        self._slots_lock = threading.Lock()
        self._sent_slots: dict[int, int] = {}
        self._sock: socket.socket | None = _connect(self.node_dir)
        #: the agent says it is alive every HEARTBEAT_S: a read or a send that waits longer than this means it is
        #: stuck (stopped, hung); then every wait for it ends (bounded like every other wait across processes)
        self._limit = max(min(float(part_wait), SILENCE_S), 5 * HEARTBEAT_S)
        self._sock.settimeout(self._limit)
        #: why the link to the agent ended (None while it works); set once, by the thread that noticed
        self._lost: str | None = None
        self._gone = threading.Event()
        self._closing = False
        self._waiting: dict[int, tuple[threading.Event, list[dict[str, Any]]]] = {}
        self._ids = iter(range(1, 1 << 62))
        self._send(
            {
                "op": "hello",
                "pid": os.getpid(),
                "rank": rank,
                "world_size": world_size,
                "run_id": run_id,
                "tiers": [t.spec() for t in self.tiers],
                "part_wait": float(part_wait),
            }
        )
        self._reader = threading.Thread(
            target=self._read_replies, args=(self._sock,), name="lightning-snapshot-agent-replies", daemon=True
        )
        self._reader.start()

    def _agent_name(self) -> str:
        pid, logged = _read_lock(self.node_dir)
        where = logged or agent_log_path(self.node_dir)
        return f"the snapshot agent{f' (pid {pid})' if pid else ''} of {self.node_dir} (its log: {where})"

    def _lose(self, why: str) -> None:
        if self._lost is None and not self._closing:
            self._lost = why
            log.warning(
                "lightning-snapshot: %s; this rank writes its durable tiers itself from now on, and its"
                " snapshots are no longer flushed after a crash",
                why,
            )

    def _read_replies(self, sock: socket.socket) -> None:
        reader = _Reader(sock)
        while True:
            try:
                msg = reader.next()
            except TimeoutError:
                self._lose(f"{self._agent_name()} sent nothing for {self._limit:g} s: it is stopped or hung")
                msg = None
            except (OSError, ValueError) as e:
                if self._sock is not None:
                    self._lose(f"lost {self._agent_name()}: {e}")
                msg = None
            if msg is None:
                if self._sock is not None:
                    self._lose(f"{self._agent_name()} closed the connection (it exited or was killed)")
                break
            request = msg.get("id")
            waiting = self._waiting.pop(request, None) if isinstance(request, int) else None
            if waiting is not None:
                waiting[1].append(msg)
                waiting[0].set()
        self._gone.set()
        for ev, _box in list(self._waiting.values()):  # the agent is gone: nobody answers these
            ev.set()

    def handles(self, job: Any, tier: Any) -> bool:
        """Whether the agent writes ``job`` to ``tier`` (a durable tier, staged in shared memory it can map)."""
        slot = getattr(job.shared, "slot", None)
        return self._lost is None and tier in self.tiers and slot is not None and slot.fd >= 0

    def persist(self, job: Any, tier: Any, stop: threading.Event) -> tuple[int, float]:
        """Have the agent write ``job`` to ``tier``; returns (bytes, seconds) once committed.

        Raises SnapshotWriteError when it failed (the caller retries), AgentError when the agent stopped answering
        (silent for SILENCE_S or ``collective_timeout``, or gone), ``TimeoutError`` when ``stop`` was set meanwhile
        (the agent finishes the write on its own).
        """
        from lightning_snapshot.errors import AgentError, SnapshotWriteError

        sid = self._slot_id(job.shared.slot)
        request = next(self._ids)
        ev = threading.Event()
        box: list[dict[str, Any]] = []
        self._waiting[request] = (ev, box)
        self._send(
            {
                "op": "persist",
                "id": request,
                "slot": sid,
                "step": job.step,
                "epoch": job.epoch,
                "tier": self.tiers.index(tier),
                "shared": describe_staged(job.shared.state, inline=False),
                "private": describe_staged(job.private, inline=True),
            }
        )
        while not ev.wait(0.2):
            if stop.is_set():
                self._waiting.pop(request, None)
                raise TimeoutError("left to the snapshot agent")
            if self._gone.is_set() or self._lost is not None:
                break
        self._waiting.pop(request, None)
        if not box:
            raise AgentError(
                f"step {job.step} was not written to the {tier.tier} tier {tier.url}:"
                f" {self._lost or 'lost the snapshot agent'}"
            )
        answer = box[0]
        if not answer.get("ok"):
            raise SnapshotWriteError(str(answer.get("error", "the snapshot agent failed to write it")))
        return int(answer.get("nbytes", 0)), float(answer.get("seconds", 0.0))

    def _send(self, msg: dict[str, Any], fds: list[int] | None = None) -> None:
        with self._lock:
            if self._sock is None:
                return
            try:
                _send(self._sock, msg, fds)
            except TimeoutError:
                self._lose(f"{self._agent_name()} took no message for {self._limit:g} s: it is stopped or hung")
                self._sock.close()
                self._sock = None
            except OSError as e:
                self._lose(f"lost {self._agent_name()}: {e}")
                self._sock.close()
                self._sock = None

    def _slot_id(self, slot: Any) -> int | None:
        if slot.fd < 0:
            return None
        with self._slots_lock:  # (the persist threads and the agent-link thread)
            key = id(slot)
            if key not in self._sent_slots:
                self._sent_slots[key] = len(self._sent_slots)
                self._send({"op": "arena", "slot": self._sent_slots[key], "size": slot.capacity, "nfds": 1}, [slot.fd])
            return self._sent_slots[key]

    def staged(self, job: Any) -> None:
        """The snapshot of ``job`` is staged (its copy finished): flush it if this trainer dies before releasing it."""
        tiers = [self.tiers.index(t) for t in job.tiers if t in self.tiers]
        shared = getattr(job.shared, "state", job.shared)
        slot = getattr(job.shared, "slot", None)
        if not tiers or slot is None:
            return
        sid = self._slot_id(slot)
        if sid is None:
            return
        self._send(
            {
                "op": "staged",
                "slot": sid,
                "step": job.step,
                "epoch": job.epoch,
                "tiers": tiers,
                "shared": describe_staged(shared, inline=False),
                "private": describe_staged(job.private, inline=True),
            }
        )

    def release(self, slot: Any, ok: bool) -> None:
        """Every tier is done with ``slot`` (``ok``: all committed it)."""
        sid = self._sent_slots.get(id(slot))
        if sid is not None:
            self._send({"op": "release", "slot": sid, "ok": bool(ok)})

    def close(self) -> None:
        self._closing = True
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.settimeout(min(self._limit, 5.0))  # (a stuck agent does not hold up the end of training)
        self._send({"op": "bye"})
        with self._lock:
            if self._sock is not None:
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_RDWR)
                self._sock.close()
                self._sock = None
        self._reader.join(timeout=10)


# ----------------------------------------------------------------------------------------------- entry point
def main(argv: list[str] | None = None) -> int:
    """``lightning-snapshot agent ARGS``; the options are defined with the other commands in the ``cli`` module."""
    from lightning_snapshot.cli import main as cli_main

    return cli_main(["agent", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
