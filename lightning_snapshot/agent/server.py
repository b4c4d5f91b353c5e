"""The snapshot agent process: one per node and run, it owns the RAM tier's memory and outlives the trainer.

One agent per node and run (a lock in its directory). It owns the node's RAM-tier memory (the directory
``RamTier.node_dir``: shared-memory files, mode 0600 in a 0700 directory) and frees it when it exits: after
``idle_timeout`` seconds with no trainer attached, or on ``lightning-snapshot agent --stop``. Then it leaves nothing
in shared memory: the snapshots, its socket, its lock and the directory itself go (and the base directory
``/dev/shm/lightning-snapshot-<uid>`` when no other run uses it). Its log is kept outside shared memory, in
``$XDG_STATE_HOME/lightning-snapshot/`` (default ``~/.local/state/lightning-snapshot/``; see
:func:`.protocol.agent_log_path`). The first local rank of a node starts it (in its own session, so a SIGKILL of
the trainer's process group does not reach it), or a job script starts it beforehand with
``lightning-snapshot agent --dir DIR``.

Trainers attach over a Unix socket (``agent.sock``, 0600) and pass it the file descriptors of their staging arena,
so the agent maps the very memory the trainer staged into: no copy. For every snapshot whose staging finished, the
trainer tells the agent where it lies and which durable tiers it is due in; when every tier committed it, the
trainer releases it. If the trainer goes away (SIGKILL, crash) with snapshots not released, the agent writes them to
their durable tiers itself, under the same commit rule: each rank's data objects and its part of the manifest, and
the agent of rank 0 merges the parts and commits the manifest once every rank's part is there. A snapshot so written
that was due in the RAM tier too is kept there (each rank's objects, and the durable manifest as a proposal that the
next restore commits once every rank's objects are held). Nothing is unpickled: messages are JSON, tensors are raw
bytes in shared memory.

Run by ``lightning-snapshot agent --dir DIR`` (the CLI parses the options and calls :func:`run_agent`), which
:func:`~lightning_snapshot.backends.ram.agent_client.ensure_agent` starts on the first local rank of a node. Its
message format is :mod:`.protocol`'s; it writes durable tiers under :mod:`lightning_snapshot.persist.commit`'s rule.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from lightning_snapshot.agent.writes import describe, flush, keep_in_ram, write_tier
from lightning_snapshot.backends.ram.agent_protocol import (
    HEARTBEAT_S,
    LOCK,
    SOCK,
    STATUS_VERSION,
    MessageReader,
    open_log,
    send_message,
    take_lock,
)

__all__ = ["Agent", "run_agent"]

log = logging.getLogger("lightning_snapshot.agent")


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
        reader = MessageReader(conn)
        arenas: dict[int, Any] = {}
        entries: dict[int, dict[str, Any]] = {}
        hello: dict[str, Any] | None = None
        send_lock = threading.Lock()
        queues: dict[int, Any] = {}
        workers: list[threading.Thread] = []

        def reply(msg: dict[str, Any]) -> bool:
            with send_lock:
                try:
                    send_message(conn, msg)
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
                    send_message(conn, {"op": "reply", "ok": True, "pid": os.getpid()})
                elif op == "status":
                    send_message(conn, {"op": "reply", "ok": True, **self.status()})
                elif op == "stop":
                    send_message(conn, {"op": "reply", "ok": True, "pid": os.getpid()})
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
        from lightning_snapshot.backends.ram.node import allocated_bytes
        from lightning_snapshot.format.manifest import parse_step_dirname

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
        flush(self.dir, hello, entry, arena)

    def _keep_in_ram(self, hello: dict[str, Any], entry: dict[str, Any], arena: Any, index: int) -> None:
        keep_in_ram(self.dir, hello, entry, arena, index)

    _describe = staticmethod(describe)
    _write_tier = staticmethod(write_tier)


def _remove_own_files(node_dir: Path) -> None:
    """Delete what the agent of ``node_dir`` owns there (it still does: see ``Agent.owner``), then the directory if
    that left it empty, then the base directory of the RAM tier's memory if no other run uses it."""
    from lightning_snapshot.backends.ram.node import default_shm_base

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
    fd = open_log(path)
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
    lock_fd = take_lock(node_dir, log_path)
    if lock_fd is None:
        return 3
    if log_path is not None:
        _log_to(log_path)
    # Import what the request handlers use (torch, the tiers: seconds on a busy node) before the socket answers, not
    # on a trainer's first request, which waits only a few seconds for its reply. (``import lightning_snapshot`` no
    # longer imports torch by itself.)
    import lightning_snapshot.backends  # noqa: F401
    import lightning_snapshot.persist.writer  # noqa: F401

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
