from __future__ import annotations

import atexit
import contextlib
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest
import torch
from zygote import DISABLE_ENV as ZYGOTE_DISABLE_ENV
from zygote import Zygote

SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
#: this test process's environment before any test changed it: the scripts' fork server runs in it
BASE_ENV = dict(os.environ)
sys.path.insert(1, str(Path(__file__).parent.parent / "benchmarks"))  # (_s3: moto that counts what it serves)


_ZYGOTE: list[Zygote | None] = []


def _zygote() -> Zygote | None:
    """This test process's fork server for the scripts (tests/zygote.py), started at the first run; None when
    ``LS_TEST_ZYGOTE=0``."""
    if not _ZYGOTE:
        server = Zygote(BASE_ENV) if BASE_ENV.get(ZYGOTE_DISABLE_ENV, "1") != "0" else None
        if server is not None:
            atexit.register(server.close)
        _ZYGOTE.append(server)
    return _ZYGOTE[0]


def run_script(
    script: str, *args: str, expect_kill: bool = False, timeout: int = 300, expect_rc: int = 0
) -> subprocess.CompletedProcess[str]:
    """Run tests/scripts/SCRIPT in a fresh process; SIGKILL (rc -9) is expected when ``expect_kill``, else exit
    status ``expect_rc``."""
    cmd = [sys.executable, str(SCRIPTS / script), *args]
    env = {**os.environ, "PYTHONWARNINGS": "ignore::DeprecationWarning"}
    server = _zygote()
    if server is not None and server.serves(env):
        with tempfile.TemporaryDirectory(prefix="ls-run-") as tmp:
            proc = server.run(cmd, env, timeout, Path(tmp))
    else:
        if server is not None and os.environ.get("LS_TEST_ZYGOTE_DEBUG") == "1":  # why this run is not forked
            print(f"[fork server] {script}: fresh interpreter; differs: {server.differs(env)}", file=sys.stderr)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, start_new_session=True)
    if expect_kill:
        assert proc.returncode == -9, f"expected SIGKILL, got rc={proc.returncode}\n{proc.stderr[-3000:]}"
    else:
        assert proc.returncode == expect_rc, f"rc={proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-5000:]}"
    return proc


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def condensed_stacks(err: str, top: int = 6, bottom: int = 2) -> str:
    """The fault handler's dumps in ``err`` (each thread's frames most recent first) cut to each thread's ``top``
    most recent frames and its ``bottom`` outermost (which say whether it is a rank's training thread, a loader
    worker or a helper thread), so that every process of a job fits in the failure's message; the other lines of
    ``err`` are kept, the extension module lists dropped."""
    out: list[str] = []
    frames: list[str] = []

    def flush() -> None:
        if len(frames) > top + bottom:
            out.extend([*frames[:top], f"    ... {len(frames) - top - bottom} frames ...", *frames[-bottom:]])
        else:
            out.extend(frames)
        frames.clear()

    for line in err.splitlines():
        if re.match(r"\s+(File \"|\S.* \(.*\)$)", line):  # (a frame: the fault handler's, or py-spy's)
            frames.append(line)
            continue
        flush()
        if not line.lstrip().startswith("Extension modules:"):
            out.append(line)
    flush()
    return "\n".join(out)


def _py_spy() -> str | None:
    found = Path(sys.executable).with_name("py-spy")
    return str(found) if found.exists() else shutil.which("py-spy")


#: a thread stopped inside ``os.fork`` (py-spy's, gdb's or the fault handler's notation)
IN_FORK = re.compile(
    r"_launch \(multiprocessing/popen_fork\.py:66\)|^#\d+ (os_fork_impl|PyOS_AfterFork_Child) |"
    r"\(most recent call first\):\n\s+File \"[^\"]*popen_fork\.py\", line 66 in _launch",
    re.M,
)


def job_stacks(launcher: int) -> tuple[str, bool]:
    """The thread stacks of every process of a hung job, one process after the other (ranks first, then their
    loader workers), and whether one of its threads is stopped inside ``os.fork``. The launcher is stopped first
    (SIGSTOP) so that it does not end its workers meanwhile. With py-spy (the test extra) each is dumped with its
    native frames, the process left running; where py-spy fails, gdb's native backtrace; without either, each gets
    SIGABRT in turn and Python's fault handler (``PYTHONFAULTHANDLER``) writes its stacks to the job's stderr (the
    caller looks there): one at a time, so that two dumps do not interleave."""
    from processes import job_processes  # (tests/scripts)

    with contextlib.suppress(ProcessLookupError):
        os.kill(launcher, signal.SIGSTOP)
    job = job_processes(launcher)[1:]
    ranks = [pid for pid in job if _parent(pid) == launcher]
    order = ranks + [pid for pid in job if pid not in ranks]
    spy = _py_spy()
    dumps = []
    in_fork = False
    for pid in order:
        what = "rank" if pid in ranks else f"child of {_parent(pid)}"
        text = None
        if spy is not None:
            try:
                got = subprocess.run(
                    [spy, "dump", "--native", "--pid", str(pid)], capture_output=True, text=True, timeout=60
                )
                text = got.stdout if got.returncode == 0 else None
                failed = got.stderr.strip()[-300:]
            except subprocess.TimeoutExpired:
                failed = "no answer in 60 s"
            if text is None:
                dumps.append(f"(py-spy failed on pid {pid}: {failed})")
        if text is None and shutil.which("gdb"):  # (native frames only, 12 per thread)
            with contextlib.suppress(subprocess.TimeoutExpired):
                got = subprocess.run(
                    ["gdb", "-p", str(pid), "-batch", "-nx", "-ex", "thread apply all bt 12"],
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
                text = "\n".join(line for line in got.stdout.splitlines() if line.startswith(("Thread ", "#")))
                text = (
                    re.sub(r"(?m)^(#\d+) +(?:0x[0-9a-f]+ in )?(\S+) .*?(?: (?:at|from) (\S+))?$", r"\1 \2 \3", text)
                    or None
                )  # (the frame's function and file, without its arguments)
        if text is not None:
            in_fork = in_fork or bool(IN_FORK.search(text))
            text = condensed_stacks(re.sub(r"(?m)^Python v.*\n", "", text), top=14, bottom=3)
            cap = 4500 if pid in ranks else 1200  # (the ranks in full, their workers' main threads)
            dumps.append(f"=== pid {pid} ({what}) ===\n{text[:cap]}")
        else:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGABRT)
            for _ in range(50):  # (its dump written before the next one starts)
                if not os.path.exists(f"/proc/{pid}") or _state(pid) in ("Z", "X"):
                    break
                time.sleep(0.1)
            dumps.append(f"=== pid {pid} ({what}): SIGABRT, its stacks in the job's stderr in this order ===")
    return "\n".join(dumps), in_fork


def _stat(pid: int) -> list[str]:
    """The fields of ``/proc/PID/stat`` after the command's name (state first, then the parent's pid); none when the
    process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _parent(pid: int) -> int:
    fields = _stat(pid)
    return int(fields[1]) if len(fields) > 1 else 0


def _state(pid: int) -> str:
    fields = _stat(pid)
    return fields[0] if fields else "X"


def run_job(
    cmd: list[str], timeout: float, env: dict[str, str], retry_fork_hang: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run a multi-process job (torchrun) in a session of its own; when it runs past ``timeout``, the failure says
    where each of its processes hangs (``job_stacks``), then they and the launcher are killed, so that nothing is
    left holding the output pipes.

    One hang is run again, once, unless ``retry_fork_hang`` is false: a process stopped inside ``os.fork`` (a loader
    worker being forked, the parent or the child side). The two causes found (docs/troubleshooting.md, 'Training
    hangs with its DataLoader workers alive') are fixed and tests/test_forksafe.py holds them, without the retry;
    one of another cause would be retried with a warning that carries every process's stacks, so that it shows in
    the run's summary. A second hang fails."""
    for attempt in (1, 2):
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**env, "PYTHONFAULTHANDLER": "1"},
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(timeout=timeout)
            return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
        except subprocess.TimeoutExpired:
            from processes import job_processes  # (tests/scripts)

            stacks, in_fork = job_stacks(proc.pid)
            _signal_all(job_processes(proc.pid), signal.SIGKILL)  # (nothing holds the pipes)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate(timeout=60)
        in_fork = in_fork or bool(IN_FORK.search(err))
        said = (
            f"{' '.join(cmd[:6])}... ran past {timeout:g} s; the stacks of its processes:\n{stacks[:14000]}\n"
            f"--- stderr ---\n{condensed_stacks(err)[-6000:]}\n--- stdout ---\n{out[-2000:]}"
        )
        if attempt == 1 and in_fork and retry_fork_hang:
            warnings.warn(f"a process of the job hung inside os.fork; the job is run again. {said}", stacklevel=2)
            continue
        raise AssertionError(said)
    raise AssertionError("unreachable")


def run_train(
    snapshot_dir: Path, out: Path, *args: str, expect_kill: bool = False, timeout: int = 300
) -> subprocess.CompletedProcess[str]:
    """Run tests/scripts/train.py in a fresh process; SIGKILL (rc -9) is expected when ``expect_kill``."""
    return run_script(
        "train.py", "--dir", str(snapshot_dir), "--out", str(out), *args, expect_kill=expect_kill, timeout=timeout
    )


def assert_bitwise_equal(ref_path: Path, got_path: Path, since: int | None = None) -> int:
    """Compare two result files of the test scripts (``fingerprint.capture``) with the one comparison helper,
    ``fingerprint.assert_same_run``: weights, every optimizer's state and param groups, every scheduler, loop
    progress, every callback's state_dict, the precision plugin, the torch, CUDA, numpy and python RNG, and the values
    logged (``since``: the step the compared run resumed from; it logged only from there). Returns the number of
    tensors compared."""
    from fingerprint import assert_same_run

    ref = torch.load(ref_path, weights_only=True)
    got = torch.load(got_path, weights_only=True)
    assert_same_run(ref, got, since)

    def count(obj) -> int:
        if isinstance(obj, torch.Tensor):
            return 1
        if isinstance(obj, dict):
            return sum(count(v) for v in obj.values())
        if isinstance(obj, list):
            return sum(count(v) for v in obj)
        return 0

    return count(ref)


# (not anchored to a line: another rank's output on the same pipe may run into it)
RESTORED = re.compile(r"RESTORED step=(\d+) from=(\S+) rank=(\d+)")


def restores(output: str) -> list[tuple[int, str, int]]:
    """The restores a run reported (``fingerprint.ReportRestore``), as (step, tier URL, rank)."""
    return [(int(s), url, int(r)) for s, url, r in RESTORED.findall(output)]


def assert_resumed(proc: subprocess.CompletedProcess[str], step: int, tier: str | Path, ranks: int = 1) -> None:
    """The run (finished or killed) reported, on each of its ``ranks`` ranks, that it resumed from ``step`` of the
    tier at ``tier`` (its URL or local path), and no other restore."""
    got = sorted(restores(proc.stdout))
    want = [(step, str(tier), r) for r in range(ranks)]
    assert got == want, (
        f"expected a resume from step {step} of {tier} on {ranks} rank(s), got {got}\n"
        f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    )


def assert_fresh(proc: subprocess.CompletedProcess[str]) -> None:
    """The run reported no restore: it started from the beginning."""
    assert not restores(proc.stdout), f"expected a fresh start, got {restores(proc.stdout)}"


CRASH_SEED_VAR = "LIGHTNING_SNAPSHOT_CRASH_SEED"


@pytest.fixture
def crash_rng(request) -> random.Random:
    """The random source of a test's crash steps: seeded from $LIGHTNING_SNAPSHOT_CRASH_SEED when set, else from a
    fresh random seed; the seed is printed (pytest shows it with a failure) and named in the test's report, so a
    failing draw is rerun with ``LIGHTNING_SNAPSHOT_CRASH_SEED=<seed> pytest ...``."""
    seed = int(os.environ[CRASH_SEED_VAR]) if os.environ.get(CRASH_SEED_VAR) else random.SystemRandom().randrange(2**32)
    print(f"crash steps drawn with seed {seed}: rerun with {CRASH_SEED_VAR}={seed}")
    request.node.user_properties.append(("crash_seed", seed))
    return random.Random(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    seed = dict(item.user_properties).get("crash_seed")
    if seed is not None and report.when == "call" and report.failed:
        report.sections.append(("crash seed", f"{CRASH_SEED_VAR}={seed}"))


@pytest.fixture(scope="session")
def reference_runs(tmp_path_factory: pytest.TempPathFactory):
    """Uninterrupted reference runs of train.py, cached per argument list for the session."""
    cache: dict[tuple[str, ...], Path] = {}
    root = tmp_path_factory.mktemp("reference")

    def get(*args: str) -> Path:
        if args not in cache:
            d = root / f"run{len(cache)}"
            run_train(d / "snaps", d / "out.pt", *args)
            cache[args] = d / "out.pt"
        return cache[args]

    return get


@pytest.fixture(scope="session", autouse=True)
def _agent_logs_in_a_temporary_state_dir(tmp_path_factory: pytest.TempPathFactory):
    """Snapshot agents started by the tests log under a temporary $XDG_STATE_HOME, not the user's home."""
    old = os.environ.get("XDG_STATE_HOME")
    os.environ["XDG_STATE_HOME"] = str(tmp_path_factory.mktemp("state"))
    yield
    if old is None:
        os.environ.pop("XDG_STATE_HOME", None)
    else:
        os.environ["XDG_STATE_HOME"] = old


def wait_until(predicate, timeout: float = 60.0) -> bool:
    """Poll ``predicate`` every 0.1 s until it holds (True) or ``timeout`` seconds passed (False)."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


@pytest.fixture
def shm(tmp_path, monkeypatch):
    """A memory base directory for this test's agents; every agent started under it is stopped at the end."""
    from lightning_snapshot.agent import stop_agent

    base = tmp_path / "shm"
    monkeypatch.setenv("LIGHTNING_SNAPSHOT_SHM_DIR", str(base))
    yield base
    for sock in list(base.glob("**/agent.sock")):  # (listed first: a stopped agent removes its directory)
        stop_agent(sock.parent)


def check_flush_after_death(
    tmp_path: Path, shm: Path, reference_runs, monkeypatch, *extra: str, before_kill=None, after_kill=None
) -> subprocess.CompletedProcess[str]:
    """A trainer (train.py ``extra``) with a RAM tier every 2 steps and a local tier every 4 is SIGKILLed at step 9,
    while step 8 is staged and held by the node's agent but not yet in the local tier; the agent must make it
    durable on its own, and a run resumed from the local tier alone must end bitwise equal to an uninterrupted one.

    ``before_kill()`` runs after the reference run, before the run that is killed; ``after_kill(killed run)`` right
    after the kill. Returns the killed run.
    """
    from lightning_snapshot.agent import agent_log_path, stop_agent
    from lightning_snapshot.backends import LocalTier
    from lightning_snapshot.persist.writer import committed_steps

    args = ("--max-steps", "12", "--every", "4", "--shuffle", *extra)
    ref = reference_runs(*args)
    if before_kill is not None:
        before_kill()
    out, local = tmp_path / "out.pt", tmp_path / "local"
    # the agent writes the durable tiers; made to wait 3 s before each write, it still has step 8 to write when the
    # trainer is SIGKILLed at step 9 (as soon as step 8 is in the RAM tier, so its agent has it): only the agent can
    # make it durable now
    monkeypatch.setenv("LIGHTNING_SNAPSHOT_AGENT_WRITE_DELAY", "3")
    killed = run_train(local, out, *args, "--ram-every", "2", "--kill-at", "9", expect_kill=True)
    if after_kill is not None:
        after_kill(killed)
    assert 8 not in committed_steps(LocalTier(local)), "the kill came too late to test anything"
    log = agent_log_path(shm / "test")
    assert wait_until(lambda: 8 in committed_steps(LocalTier(local)), timeout=120), log.read_text()
    # (either the write the trainer had asked for, finished after its death, or the staged snapshot the agent
    # flushed on its own when the trainer's connection dropped before it was even asked)
    assert wait_until(
        lambda: (
            "step 8 reached tier 0 after trainer rank 0 was gone" in log.read_text()
            or "step 8 committed to tier 0 after rank 0 died" in log.read_text()
        )
    ), log.read_text()
    assert stop_agent(shm / "test") and not (shm / "test").exists(), "the stopped agent left files in its directory"
    monkeypatch.delenv("LIGHTNING_SNAPSHOT_AGENT_WRITE_DELAY")
    proc = run_train(local, out, *args)  # no RAM tier, no agent: the local tier alone
    assert "RESTORED step=8 from=" in proc.stdout, proc.stdout + proc.stderr
    assert assert_bitwise_equal(ref, out) > 0
    return killed


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def no_leaked_threads_or_shm():
    """Like Lightning's own suite: a test must not leave our background threads or shared memory behind."""
    import threading

    yield
    leaked = [t.name for t in threading.enumerate() if t.name.startswith("lightning-snapshot") and t.is_alive()]
    assert not leaked, f"background threads left running: {leaked}"
    if os.path.isdir("/dev/shm"):
        shm = [n for n in os.listdir("/dev/shm") if n.startswith(f"lightning-snapshot-{os.getpid()}-")]
        assert not shm, f"shared-memory files left behind: {shm}"


class S3Server:
    """moto's S3 server on 127.0.0.1 (port 0 first, then the same port after a restart), which counts the bytes it
    serves (:attr:`counter`, benchmarks/_s3.py ``CountingApp``)."""

    def __init__(self) -> None:
        from _s3 import CountingApp, counting_server_class

        self.counter = CountingApp()
        self._cls = counting_server_class(self.counter)
        self.port = 0
        self.server = None
        self.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.server = self._cls(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()
        self.port = self.server._server.server_port

    def stop(self) -> None:
        self.server.stop()

    def create_bucket(self, name: str) -> None:
        import boto3

        boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id="testing-key",
            aws_secret_access_key="testing-secret",
            region_name="us-east-1",
        ).create_bucket(Bucket=name)


@pytest.fixture(scope="session")
def s3_server():
    pytest.importorskip("moto")
    pytest.importorskip("s3fs")
    server = S3Server()
    yield server
    server.stop()


@pytest.fixture
def bucket(s3_server, request):
    import re

    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-") + "-b"
    s3_server.create_bucket(name)
    return name


def rendezvous_port() -> int:
    """A free port on 127.0.0.1 for a rendezvous store, chosen at random below the kernel's ephemeral range.

    Binding port 0 and closing it (the usual trick) hands out an ephemeral port, and in the seconds before rank 0's
    store binds it the kernel can give that same port to any outgoing connection or gloo listener of the tests
    running beside us: rank 0 then cannot bind, and the other ranks wait for a store that never comes. Ports below
    the ephemeral range are only ever taken by an explicit bind."""
    import socket

    pick = random.SystemRandom()  # (the tests seed the module's generator: two workers would pick the same ports)
    low = 20000
    try:
        ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    high = max(low + 1000, ephemeral)
    for _ in range(200):
        port = pick.randrange(low, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port on 127.0.0.1 in [{low}, {high})")


def launch_nodes(
    script: str, nodes: int, *args: str, timeout: int = 300, env: dict[str, str] | None = None, ranks_per_node: int = 1
) -> list[subprocess.CompletedProcess[str]]:
    """Run tests/scripts/SCRIPT as ``nodes`` simulated nodes of ``ranks_per_node`` processes each (NODE_RANK,
    LOCAL_RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1, a free MASTER_PORT; the script passes ``--devices``
    ``ranks_per_node`` to its Trainer), with LIGHTNING_SNAPSHOT_SHM_DIR pointing each node at its own memory directory
    when ``env`` gives ``LIGHTNING_SNAPSHOT_SHM_DIR`` as a format string with ``{node}``. Returns the processes in
    global rank order."""
    port = rendezvous_port()
    procs = []
    for node, local in ((n, lr) for n in range(nodes) for lr in range(ranks_per_node)):
        e = {
            **os.environ,
            "PYTHONWARNINGS": "ignore::DeprecationWarning",
            "NODE_RANK": str(node),
            "LOCAL_RANK": str(local),
            "WORLD_SIZE": str(nodes * ranks_per_node),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        for k, v in (env or {}).items():
            e[k] = v.format(node=node)
        procs.append(
            subprocess.Popen(
                [sys.executable, str(SCRIPTS / script), *args],
                env=e,
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        )
    out = []
    for p in procs:
        try:
            so, se = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        out.append(subprocess.CompletedProcess(p.args, p.returncode, so, se))
    return out


def slurm_job(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """The environment of a one-task SLURM job (id 4242) whose ``scontrol`` is a stand-in on PATH that records its
    arguments; returns that environment (to add to the process's) and the file the arguments go to."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    record = tmp_path / "scontrol.args"
    (bindir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {record}\n')
    (bindir / "scontrol").chmod(0o755)
    env = {
        "PATH": f"{bindir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "4242",
        "SLURM_NTASKS": "1",
        "SLURM_NTASKS_PER_NODE": "1",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
        "SLURM_JOB_NAME": "train",
        "SLURM_NODELIST": "127.0.0.1",
    }
    return env, record
