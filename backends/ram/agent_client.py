"""The trainer's side of the snapshot agent: start it, query or stop it, and the link a trainer rank keeps to it.

:func:`ensure_agent` starts the node's agent (:mod:`.server`, through ``lightning-snapshot agent``) unless one
answers; :class:`AgentClient` passes it the staging arena and tells it which snapshots to write or flush (called by
the callback and the persist threads); :func:`agent_status`, :func:`format_status` and :func:`stop_agent` serve the
``agent --status`` and ``agent --stop`` commands and the tests. Speaks :mod:`.protocol`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_snapshot.backends.ram.agent_protocol import (
    HEARTBEAT_S,
    PART_WAIT_S,
    SILENCE_S,
    SOCK,
    MessageReader,
    agent_log_path,
    describe_staged,
    open_log,
    pid_alive,
    read_lock_file,
    send_message,
)
from lightning_snapshot.errors import SnapshotError

if TYPE_CHECKING:
    from lightning_snapshot.backends.base import AgentJob, Backend, SharedSlot

__all__ = ["AgentClient", "agent_status", "ensure_agent", "format_status", "stop_agent"]

log = logging.getLogger("lightning_snapshot.agent")


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
        send_message(s, {"op": op})
        return MessageReader(s).next()
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
    while time.monotonic() < deadline and (pid_alive(pid) if pid > 0 else (node_dir / SOCK).exists()):
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
        logfd = open_log(log_path)
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
            logfd = open_log(fallback)
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
        "import sys; from lightning_snapshot.cli.main import main; sys.exit(main(['agent', *sys.argv[1:]]))",
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
    """A trainer rank's link to its node's agent: passes arena memory and tells which snapshots need flushing. The
    RAM tier's :class:`~lightning_snapshot.backends.base.NodeAgent` (made by ``RamTier.connect_agent``); it reads a
    job through the typed :class:`~lightning_snapshot.backends.base.AgentJob`.

    Thread-safe: the persist threads and the training thread call it; one lock guards the socket.
    """

    def __init__(
        self,
        node_dir: str | os.PathLike[str],
        *,
        rank: int,
        world_size: int,
        run_id: str,
        tiers: Sequence[Backend],
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
        pid, logged = read_lock_file(self.node_dir)
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
        reader = MessageReader(sock)
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

    @property
    def linked(self) -> bool:
        """Whether the link to the agent still works (this rank; the ranks agree on it at each hand-over)."""
        return self._lost is None

    def handles(self, job: AgentJob, tier: Backend) -> bool:
        """Whether the agent writes ``job`` to ``tier`` (a durable tier, staged in shared memory it can map)."""
        slot = job.slot
        return self.linked and tier in self.tiers and slot is not None and slot.fd >= 0

    def persist(self, job: AgentJob, tier: Backend, stop: threading.Event) -> tuple[int, float]:
        """Have the agent write ``job`` to ``tier``; returns (bytes, seconds) once committed.

        Raises SnapshotWriteError when it failed (the caller retries), AgentError when the agent stopped answering
        (silent for SILENCE_S or ``collective_timeout``, or gone), ``TimeoutError`` when ``stop`` was set meanwhile
        (the agent finishes the write on its own).
        """
        from lightning_snapshot.errors import AgentError, SnapshotWriteError

        if job.slot is None:
            raise SnapshotWriteError(f"step {job.step} is not staged in shared memory the snapshot agent can map")
        sid = self._slot_id(job.slot)
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
                "shared": describe_staged(job.shared_state, inline=False),
                "private": describe_staged(job.private, inline=True),
                "replicas": job.replicas,
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
                send_message(self._sock, msg, fds)
            except TimeoutError:
                self._lose(f"{self._agent_name()} took no message for {self._limit:g} s: it is stopped or hung")
                self._sock.close()
                self._sock = None
            except OSError as e:
                self._lose(f"lost {self._agent_name()}: {e}")
                self._sock.close()
                self._sock = None

    def _slot_id(self, slot: SharedSlot) -> int | None:
        if slot.fd < 0:
            return None
        with self._slots_lock:  # (the persist threads and the agent-link thread)
            key = id(slot)
            if key not in self._sent_slots:
                self._sent_slots[key] = len(self._sent_slots)
                self._send({"op": "arena", "slot": self._sent_slots[key], "size": slot.capacity, "nfds": 1}, [slot.fd])
            return self._sent_slots[key]

    def staged(self, job: AgentJob) -> None:
        """The snapshot of ``job`` is staged (its copy finished): flush it if this trainer dies before releasing it."""
        tiers = [self.tiers.index(t) for t in job.tiers if t in self.tiers]
        shared = job.shared_state
        slot = job.slot
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
                # (due in the RAM tier too, the only tier that is not durable: the agent keeps it there if it has to
                # write it to the durable tiers itself)
                "ram": any(not t.durable for t in job.tiers),
                "shared": describe_staged(shared, inline=False),
                "private": describe_staged(job.private, inline=True),
                "replicas": job.replicas,
            }
        )

    def release(self, slot: SharedSlot, ok: bool) -> None:
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
