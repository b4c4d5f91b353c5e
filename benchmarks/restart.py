"""Where a preemption's seconds go: the stop (from the signal to every process gone) and the restart (from launch to
the first trained step), for a fresh start and for a requeue of the same job, measured in one run.

The job is ``tests/scripts/train.py`` (a small MLP, DDP over gloo, shuffled augmented data, dropout), launched as a
cluster would: one torchrun launcher per simulated node (static rendezvous on 127.0.0.1, ``--nproc-per-node`` ranks
each), a RAM tier every step (erasure coded 1+1 across the nodes when there are several; its agents outlive the job)
and each node's own disk every 10 steps. ``--timeline`` makes every rank print when each phase ends; this script
finds each rank's process through its launcher and records when it is gone (polled every 10 ms).

* **stop**: SIGTERM to each launcher after step 8 (torchrun forwards it to its ranks). Per rank: signal -> durable
  (the preempted step committed: ``last_snapshot`` returned), durable -> ``fit`` raised (the library's and
  Lightning's teardown), and -> the process gone (the interpreter's exit: threads, loader workers, process groups).
* **restart**: a fresh start of the job and its requeue (which restores from node memory), from launch to the first
  trained step, in the phases every rank reports (the job's phase ends when its last rank's does): the launcher and
  the interpreter with its imports; Lightning's set-up up to the callback's ``setup`` (the process group's
  rendezvous); the library's session (its gloo groups, the agent link, the arena); up to the end of ``on_fit_start``
  (the strategy's set-up and the restore); the first step (the loaders' first batch and one step).

Usage: ``python benchmarks/restart.py [--nodes 2] [--per-node 4] [--stop-only] [--ranks-list 2,16]``.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "scripts"
sys.path.insert(0, str(SCRIPTS))
from processes import children  # noqa: E402 - the test scripts' own reading of /proc

TIMELINE = re.compile(r"TIMELINE (\w+) rank=(\d+) at=([\d.]+)")
EXITING = re.compile(r"EXITING status=(\d+) rank=(\d+) at=([\d.]+)")
SENT = re.compile(r"SIGNAL-SENT step=(\d+) to=\S+ at=([\d.]+)")


def _rank_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        return int(env[b"RANK"]) if b"RANK" in env else None
    except (OSError, ValueError):
        return None


def run_job(base: Path, nodes: int, per_node: int, *args: str, timeout: float = 600) -> dict[str, object]:
    """Launch the job (one torchrun per node), follow its ranks' processes, and return the launch time, the output
    and when each rank's process was gone."""
    base.mkdir(parents=True, exist_ok=True)
    port = random.SystemRandom().randint(20000, 30000)
    launched = time.time()
    procs = []
    for node in range(nodes):
        env = {
            **os.environ,
            "PYTHONWARNINGS": "ignore",
            "LIGHTNING_SNAPSHOT_SHM_DIR": str(base / "shm" / f"node{node}"),
        }
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--node-rank", str(node)]
        cmd += ["--nproc-per-node", str(per_node), "--master-addr", "127.0.0.1", "--master-port", str(port)]
        cmd += [str(SCRIPTS / "train.py"), "--dir", str(base / "local" / "node{node_rank}"), "--out"]
        cmd += [str(base / "out.pt"), "--devices", str(per_node), "--num-nodes", str(nodes), "--timeline", *args]
        log = open(base / f"node{node}.log", "w")  # noqa: SIM115 - closed below
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        procs.append((proc, log))
    ranks: dict[int, int] = {}  # pid -> rank
    gone: dict[int, float] = {}  # rank -> time its process was gone
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p, _ in procs):
        for p, _ in procs:
            for child in children(p.pid):
                if child not in ranks:
                    rank = _rank_of(child)
                    if rank is not None:
                        ranks[child] = rank
        for pid, rank in ranks.items():
            if rank not in gone and not os.path.exists(f"/proc/{pid}/stat"):
                gone[rank] = time.time()
            elif rank not in gone:
                try:
                    with open(f"/proc/{pid}/stat") as f:
                        if f.read().split(") ", 1)[1].startswith("Z"):  # (exited, not yet reaped by torchrun)
                            gone[rank] = time.time()
                except OSError:
                    gone[rank] = time.time()
        if time.monotonic() > deadline:
            for p, _ in procs:
                os.killpg(p.pid, signal.SIGKILL)
            raise TimeoutError(f"the job under {base} did not end within {timeout} s")
        time.sleep(0.01)
    output = ""
    for _, log in procs:
        log.close()
    for node in range(nodes):
        output += (base / f"node{node}.log").read_text()
    return {"launched": launched, "output": output, "gone": gone, "codes": [p.returncode for p, _ in procs]}


def _marks(output: str) -> dict[str, dict[int, float]]:
    marks: dict[str, dict[int, float]] = {}
    for phase, rank, at in TIMELINE.findall(output):
        marks.setdefault(phase, {})[int(rank)] = float(at)
    return marks


def stop(nodes: int, per_node: int, common: list[str], work: Path) -> dict[str, object]:
    """Preempt the job after step 8 (SIGTERM to each launcher); per-rank times from the signal to durable, durable to
    ``fit`` raised, and to the process gone."""
    job = run_job(work, nodes, per_node, *common, "--signal-at", "8", "--signal-to", "launchers")
    out = str(job["output"])
    sent = min(float(t) for _, t in SENT.findall(out))
    durable = _marks(out).get("durable", {})
    raised = {int(r): float(t) for _, r, t in EXITING.findall(out)}
    gone = job["gone"]
    assert isinstance(gone, dict)
    world = nodes * per_node
    missing = [r for r in range(world) if r not in durable or r not in raised or r not in gone]
    if missing:
        raise RuntimeError(f"ranks {missing} did not report a stop; see {work}/node*.log")
    rows = {
        "signal -> durable": [durable[r] - sent for r in range(world)],
        "durable -> fit raised": [raised[r] - durable[r] for r in range(world)],
        "fit raised -> process gone": [gone[r] - raised[r] for r in range(world)],
        "durable -> process gone": [gone[r] - durable[r] for r in range(world)],
    }
    return {"world": world, "rows": rows, "codes": job["codes"]}


def restart(nodes: int, per_node: int, common: list[str], work: Path) -> dict[str, dict[str, float]]:
    """A fresh start, then (after a preemption of a second run) its requeue: the job's phases from launch to the
    first trained step."""
    result = {}
    fresh = run_job(work / "fresh", nodes, per_node, *common)
    result["fresh start"] = _phases(fresh)
    run_job(work / "requeue", nodes, per_node, *common, "--signal-at", "8", "--signal-to", "launchers")
    requeue = run_job(work / "requeue", nodes, per_node, *common)
    if "RESTORED" not in str(requeue["output"]):
        raise RuntimeError(f"the requeue did not restore; see {work}/requeue/node*.log")
    result["requeue"] = _phases(requeue)
    return result


PHASES = [
    ("imports", "launcher, interpreter, imports"),
    ("rendezvous", "Lightning set-up, rendezvous"),
    ("session", "library session (groups, agent, arena)"),
    ("restore", "strategy set-up + restore (on_fit_start)"),
    ("first_step", "first batch and step"),
]


def _phases(job: dict[str, object]) -> dict[str, float]:
    marks = _marks(str(job["output"]))
    out: dict[str, float] = {}
    previous = float(job["launched"])  # type: ignore[arg-type]
    for key, label in PHASES:
        end = max(marks[key].values())
        out[label] = end - previous
        previous = end
    out["launch -> first step"] = previous - float(job["launched"])  # type: ignore[arg-type]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=2, help="simulated nodes of the restart timeline")
    p.add_argument("--per-node", type=int, default=4, help="ranks per node of the restart timeline")
    p.add_argument("--ranks-list", default="2,16", help="world sizes of the stop measurement (4 per node from 8 on)")
    p.add_argument("--stop-only", action="store_true")
    a = p.parse_args()
    common = ["--max-steps", "12", "--every", "10", "--shuffle", "--dropout", "0.1", "--augment", "--ram-every", "1"]
    with tempfile.TemporaryDirectory(prefix="ls-restart-") as tmp:
        work = Path(tmp)
        print(f"# stop: SIGTERM to each node's torchrun after step 8 ({os.cpu_count()} CPU cores)")
        print("| ranks (nodes x per node) | phase | median s | max s |")
        print("|---|---|---|---|")
        for world in (int(w) for w in a.ranks_list.split(",")):
            nodes = 1 if world < 8 else world // 4
            per = world // nodes
            erasure = ["--ram-erasure", "1+1"] if nodes > 1 else []
            r = stop(nodes, per, common + erasure, work / f"stop{world}")
            rows = r["rows"]
            assert isinstance(rows, dict)
            for name, values in rows.items():
                print(f"| {world} ({nodes} x {per}) | {name} | {statistics.median(values):.2f} | {max(values):.2f} |")
            _stop_agents(work)
        if a.stop_only:
            return
        erasure = ["--ram-erasure", "1+1"] if a.nodes > 1 else []
        t = restart(a.nodes, a.per_node, common + erasure, work / "restart")
        _stop_agents(work)
        print(f"\n# restart: {a.nodes} nodes x {a.per_node} ranks, from launch to the first trained step (s)")
        print("| phase | fresh start | requeue |")
        print("|---|---|---|")
        for label in [label for _, label in PHASES] + ["launch -> first step"]:
            print(f"| {label} | {t['fresh start'][label]:.2f} | {t['requeue'][label]:.2f} |")


def _stop_agents(work: Path) -> None:
    sys.path.insert(0, str(ROOT))
    from lightning_snapshot.agent import stop_agent

    for sock in list(work.glob("**/agent.sock")):
        stop_agent(sock.parent)


if __name__ == "__main__":
    main()
