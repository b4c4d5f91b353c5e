"""Read once, share, end to end: DDP with 4 ranks (2 simulated nodes of 2, real processes, gloo, real SIGKILL)
restores from moto's S3 server and from a local tier reading each byte of the snapshot once per job, as counted by
the server (bytes of the GET answers, tests/conftest.py ``CountingApp``) and by an instrumented filesystem
(tests/scripts/io_count.py: reads at the OS interface), and ends bitwise equal to an uninterrupted run; the same
resharded to 2 ranks; a flipped byte in one rank's part makes every rank fall back to the previous snapshot."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import assert_bitwise_equal, launch_nodes, run_script

from lightning_snapshot.backends import LocalTier, ObjectStoreTier
from lightning_snapshot.format.manifest import step_dirname
from lightning_snapshot.persist.writer import committed_steps
from lightning_snapshot.restore.loader import read_manifest

pytestmark = pytest.mark.xdist_group("test_read_once")

NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE
#: a model of about 0.7 MB of weights and optimizer state (the ranks' own state, RNG and data position, is small
#: beside it); snapshots at steps 4 and 8, killed at 10
ARGS = (
    "--max-steps",
    "12",
    "--every",
    "4",
    "--shuffle",
    "--num-nodes",
    str(NODES),
    "--devices",
    str(PER_NODE),
    "--hidden",
    "4096",
)
MAX_AMPLIFICATION = 1.05
STATS = re.compile(r"RESTORE_STATS rank=(\d+) needed=(\d+) read=(\d+) received=(\d+) tier=(\S+) job=(\d+)")


def _options(endpoint: str) -> dict:
    return {
        "key": "testing-key",
        "secret": "testing-secret",
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
    }


def _run(base: Path, *extra: str, kill: bool = False, nodes: int = NODES, per_node: int = PER_NODE):
    procs = launch_nodes("train.py", nodes, "--out", str(base / "out.pt"), *extra, timeout=600, ranks_per_node=per_node)
    assert [p.returncode for p in procs] == [-9 if kill else 0] * len(procs), _tails(procs)
    return procs


def _tails(procs) -> str:
    return "\n".join(
        f"--- rank {i}: rc={p.returncode}\n{p.stdout[-1500:]}\n{p.stderr[-3000:]}" for i, p in enumerate(procs)
    )


def _stats(procs) -> dict[int, dict[str, int]]:
    out = {}
    for m in STATS.finditer("".join(p.stdout for p in procs)):
        rank, needed, read, received, _tier, job = m.groups()
        out[int(rank)] = {"needed": int(needed), "read": int(read), "received": int(received), "job": int(job)}
    return out


def _restored(procs) -> set[tuple[int, int]]:
    return {
        (int(s), int(r))
        for s, r in re.findall(r"RESTORED step=(\d+) from=\S+ rank=(\d+)", "".join(p.stdout for p in procs))
    }


def _object_bytes(backend, step: int) -> int:
    """The bytes of every data object of a snapshot (the shared state and every rank's own)."""
    return sum(o.nbytes for o in read_manifest(backend, step).objects)


def _assert_read_once(procs, world: int) -> None:
    """Every rank reports the same job-wide figure, the sum of what the ranks read; each rank read a part and got
    the rest from the others."""
    stats = _stats(procs)
    assert sorted(stats) == list(range(world)), stats
    job = sum(s["read"] for s in stats.values())
    assert {s["job"] for s in stats.values()} == {job}, stats
    for rank, s in stats.items():
        assert 0 < s["read"] < s["needed"] and s["read"] + s["received"] >= s["needed"], (rank, s)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One uninterrupted run of 2 nodes of 2 ranks (local tier only: the tiers do not change the training)."""
    base = tmp_path_factory.mktemp("ref")
    _run(base, *ARGS, "--dir", str(base / "local"))
    return base / "out.pt"


def _same_as_reference(reference: Path, base: Path) -> None:
    for suffix in [""] + [f".rank{r}" for r in range(1, WORLD)]:
        assert assert_bitwise_equal(Path(f"{reference}{suffix}"), Path(f"{base / 'out.pt'}{suffix}")) > 0


@pytest.mark.slow
def test_ddp_restore_from_the_object_store_reads_the_state_once(tmp_path, reference, s3_server, bucket):
    url = f"s3://{bucket}/run"
    s3 = ("--dir", str(tmp_path / "unused"), "--no-local", "--s3", url, "--endpoint", s3_server.endpoint)
    _run(tmp_path, *ARGS, *s3, "--crash-at", "10", "--crash-after-newest", kill=True)
    tier = ObjectStoreTier(url, storage_options=_options(s3_server.endpoint))
    step = committed_steps(tier)[0]  # (8; or 4 where the upload of 4 was still running at 8, which was skipped)
    state = _object_bytes(tier, step)  # (before the resumed run, whose retention may delete it)
    before = s3_server.counter.bytes_served(f"{bucket}/run/", ".bin")
    procs = _run(tmp_path, *ARGS, *s3)
    served = s3_server.counter.bytes_served(f"{bucket}/run/{step_dirname(step)}/", ".bin")
    assert _restored(procs) == {(step, r) for r in range(WORLD)}, _tails(procs)
    _same_as_reference(reference, tmp_path)
    print(
        f"bucket bytes served for the restore: {served} for a snapshot of {state} bytes"
        f" ({served / state:.3f}x; before the restore {before} bytes of data objects were served)"
    )
    assert before == 0  # (the bytes counted are the restore's)
    assert served <= MAX_AMPLIFICATION * state, f"the job read {served / state:.2f}x the snapshot from the bucket"
    _assert_read_once(procs, WORLD)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["shared", "node-local"])
def test_ddp_restore_from_a_local_tier_reads_the_state_once(tmp_path, reference, layout):
    where = str(tmp_path / "local") if layout == "shared" else str(tmp_path / "local" / "node{node_rank}")
    tier = ("--dir", where, "--node-local", "true" if layout == "node-local" else "false")
    _run(tmp_path, *ARGS, *tier, "--crash-at", "10", "--crash-after-newest", kill=True)
    procs = _run(tmp_path, *ARGS, *tier, "--count-reads", str(tmp_path / "reads"))
    assert _restored(procs) == {(8, r) for r in range(WORLD)}, _tails(procs)
    _same_as_reference(reference, tmp_path)
    read = sum(int((tmp_path / f"reads.rank{r}").read_text()) for r in range(WORLD))
    state = _object_bytes(LocalTier(tmp_path / "local" / ("node0" if layout == "node-local" else "")), 8)
    # node-local: each node first gets the objects it lacks from the node that holds them (each node's copy is
    # read once to send it), then the job reads the state once: once per node
    copies = 1 if layout == "shared" else NODES
    print(f"{layout}: {read} bytes read from the tier's files for a snapshot of {state} bytes ({read / state:.3f}x)")
    assert read <= MAX_AMPLIFICATION * copies * state, f"the job read {read / state:.2f}x the snapshot"
    _assert_read_once(procs, WORLD)


RESHARD_BUCKET = "read-once-resharded-2x2-b"
#: the resharding runs (reshard_train.py): DDP, 64 KiB checksum chunks, a snapshot every 3 steps
RESHARD_ARGS = ("--strategy", "ddp", "--chunk-bytes", "65536", "--every", "3")


@pytest.fixture(scope="module")
def saved_2x2(tmp_path_factory, s3_server) -> dict:
    """One saving run for both resharded restores: DDP(4) as 2 simulated nodes of 2 ranks, 9 steps, snapshotting to
    a bucket and to a local tier in a directory both nodes share (snapshots at 3, 6 and 9), the consolidated state at
    step 9 dumped."""
    base = tmp_path_factory.mktemp("saved-2x2")
    s3_server.create_bucket(RESHARD_BUCKET)
    url = f"s3://{RESHARD_BUCKET}/run"
    (base / "dumps").mkdir()
    procs = launch_nodes(
        "reshard_train.py",
        NODES,
        "--dir",
        str(base / "local"),
        "--out",
        str(base / "out.pt"),
        *RESHARD_ARGS,
        "--s3",
        url,
        "--endpoint",
        s3_server.endpoint,
        "--also-dir",
        "--num-nodes",
        str(NODES),
        "--devices",
        str(PER_NODE),
        "--max-steps",
        "9",
        "--dump-steps",
        "9",
        "--dump-dir",
        str(base / "dumps"),
        timeout=600,
        ranks_per_node=PER_NODE,
    )
    assert [p.returncode for p in procs] == [0] * WORLD, _tails(procs)
    bucket_tier = ObjectStoreTier(url, storage_options=_options(s3_server.endpoint))
    local_tier = LocalTier(base / "local")
    assert 9 in committed_steps(bucket_tier) and 9 in committed_steps(local_tier), _tails(procs)
    return {
        "url": url,
        "local": base / "local",
        "dump": base / "dumps" / "step-9.pt",
        "state": {"bucket": _object_bytes(bucket_tier, 9), "local-dir": _object_bytes(local_tier, 9)},
    }


@pytest.mark.slow
@pytest.mark.parametrize("source", ["bucket", "local-dir"])
def test_ddp_restore_resharded_to_two_ranks_reads_the_state_once(tmp_path, s3_server, saved_2x2, source):
    """A DDP(4) snapshot of 2 simulated nodes of 2 ranks restored by DDP(2), from the bucket (bytes counted by the
    server) and from the local tier in the shared directory (bytes counted at the OS interface, io_count.py): every
    rank resumed from step 9, the state at the start of the resumed run is bitwise the state the saving run had at
    that step, and the job read the state once."""
    if source == "bucket":
        tier = ("--s3", saved_2x2["url"], "--endpoint", s3_server.endpoint, "--dir", str(tmp_path / "unused"))
        prefix = f"{RESHARD_BUCKET}/run/{step_dirname(9)}/"
        before = s3_server.counter.bytes_served(prefix, ".bin")
    else:
        tier = ("--dir", str(saved_2x2["local"]), "--count-reads", str(tmp_path / "reads"))
    proc = run_script(
        "reshard_train.py",
        "--out",
        str(tmp_path / "out.pt"),
        *tier,
        *RESHARD_ARGS,
        "--devices",
        "2",
        "--max-steps",
        "10",
        "--resume",
        "9",
        "--dump-at-start",
        str(tmp_path / "start.pt"),
        timeout=600,
    )
    if source == "bucket":
        read = s3_server.counter.bytes_served(prefix, ".bin") - before
    else:
        read = sum(int((tmp_path / f"reads.rank{r}").read_text()) for r in range(2))
    restored = {(int(s), int(r)) for s, r in re.findall(r"RESTORED step=(\d+) rank=(\d+)", proc.stdout)}
    assert restored == {(9, 0), (9, 1)}, proc.stdout
    from test_reshard import assert_state_equal, restore_stats

    assert assert_state_equal(saved_2x2["dump"], tmp_path / "start.pt") > 0
    state = saved_2x2["state"][source]
    print(
        f"DDP({NODES}x{PER_NODE}) -> DDP(2), {source}: {read} bytes read for a snapshot of {state} bytes"
        f" ({read / state:.3f}x)"
    )
    assert read <= MAX_AMPLIFICATION * state, f"the job read {read / state:.2f}x the snapshot from the {source}"
    stats = restore_stats(proc)
    assert sorted(stats) == [0, 1], proc.stdout
    for rank, s in stats.items():  # each rank read a part (as the tier counted it) and got the rest from the other
        assert s["tier"] == s["planned"] < s["needed"], (rank, s)


@pytest.mark.slow
def test_a_flipped_byte_in_one_ranks_part_falls_back_on_every_rank(tmp_path, reference):
    """The newest snapshot (step 8) has one flipped byte in the part one rank reads: that rank finds it, every rank
    skips the snapshot with the same line and resumes from step 4, and the run still ends bitwise equal."""
    where = str(tmp_path / "local")
    _run(tmp_path, *ARGS, "--dir", where, "--crash-at", "10", "--crash-after-newest", kill=True)
    tier = LocalTier(where)
    manifest = read_manifest(tier, 8)
    entry = max(manifest.tensors, key=lambda t: sum(f.nbytes for f in t.fragments))  # (a weight's Adam state)
    frag = entry.fragments[0]
    path = Path(where) / step_dirname(8) / frag.object
    data = bytearray(path.read_bytes())
    data[frag.offset + frag.nbytes // 2] ^= 0x01
    path.write_bytes(bytes(data))
    procs = _run(tmp_path, *ARGS, "--dir", where)
    assert _restored(procs) == {(4, r) for r in range(WORLD)}, _tails(procs)
    _same_as_reference(reference, tmp_path)
    lines = [line for p in procs for line in p.stderr.splitlines() if "skipping the snapshot of step 8" in line]
    assert len(lines) == WORLD and len(set(lines)) == 1, lines  # one line per rank, the same on every rank
    assert "checksum mismatch" in lines[0] and entry.name in lines[0], lines[0]
