"""The operator commands on real tiers (a local directory, moto's S3 server on 127.0.0.1): ``gc`` prunes old
snapshots, crashed writes' leftovers and stale multipart uploads but never the newest valid snapshot nor a write in
progress, and ``--dry-run`` changes nothing; ``copy`` promotes a snapshot between tiers, verified, manifest last (a
copy SIGKILLed between its data and its manifest leaves no visible snapshot, and gc cleans what it left); ``--json``
documents; progress bars only on a terminal. Snapshots are written in-process with the library (no training)."""

from __future__ import annotations

import io
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_cli import cli, one_line_error, s3_environment, tree  # noqa: F401 - s3_environment is a fixture

from lightning_snapshot.backends import LocalTier
from lightning_snapshot.backends.object_store import ObjectStoreTier
from lightning_snapshot.cli.main import main
from lightning_snapshot.dist.comm import LocalComm
from lightning_snapshot.persist.writer import SnapshotJob, committed_steps, write_snapshot
from lightning_snapshot.restore.loader import load_snapshot
from lightning_snapshot.staging import stage

SCRIPTS = Path(__file__).parent / "scripts"
HOUR = 3600


def state_of(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"state_dict": {"net.weight": torch.randn(64, 64, generator=g), "net.bias": torch.randn(64, generator=g)}}


def write(tier, step: int) -> None:
    write_snapshot(tier, LocalComm(), SnapshotJob(step, 0, stage(state_of(step)), stage({}, "rank")), f"r{step}")


def run(*args: str) -> tuple[int, dict | None, str]:
    """The command with ``--json``: (exit status, parsed stdout or None, stderr)."""
    rc, out, err = cli(*args, "--json")
    return rc, (json.loads(out) if out.strip() else None), err


def age(path: Path, seconds: float) -> None:
    """Make everything under ``path`` look last changed ``seconds`` ago."""
    t = time.time() - seconds
    for p in [path, *path.rglob("*")]:
        os.utime(p, (t, t))


def set_created(tier_dir: Path, step: int, seconds_ago: float) -> None:
    path = tier_dir / f"step-{step:012d}" / "manifest.json"
    raw = json.loads(path.read_text())
    raw["created_unix"] = time.time() - seconds_ago
    path.write_text(json.dumps(raw))


def assert_state(source: str, step: int) -> None:
    """The snapshot of ``step`` at ``source`` loads (checksums checked) and equals what was written, bitwise."""
    state = load_snapshot(source, step=step)
    for k, v in state_of(step)["state_dict"].items():
        assert torch.equal(state["state_dict"][k].view(torch.uint8), v.view(torch.uint8)), k


# ------------------------------------------------------------------------------------------------ gc, local tier
def test_gc_local_retention_leftovers_dry_run_and_the_newest_valid_snapshot(tmp_path):
    root = tmp_path / "snaps"
    for step in (3, 6, 9, 12):
        write(LocalTier(root), step)
    set_created(root, 3, 8 * 86400)  # eight days old
    crashed = root / "step-000000000015"  # a crashed write: data, no manifest, idle for 2 h
    LocalTier(root).write("step-000000000015/r15-rank-00000.bin", [b"x" * 100])
    age(crashed, 2 * HOUR)
    LocalTier(root).write("step-000000000012/old-shared-00000.bin", [b"y" * 10])  # an older write of step 12
    age(root / "step-000000000012" / "old-shared-00000.bin", 2 * HOUR)
    (root / "step-000000000012" / "restores.json").write_text("{}")  # not a data object: never a leftover
    age(root / "step-000000000012" / "restores.json", 2 * HOUR)
    LocalTier(root).write("step-000000000018/r18-rank-00000.bin", [b"z"])  # being written now

    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    rc, plan, err = run("gc", str(root), "--older-than", "7d", "--keep-last", "3", "--dry-run")
    assert rc == 0 and err == ""
    assert plan["dry_run"] is True and plan["tier"] == str(root)
    assert plan["protected"] == 12 and plan["kept"] == [12, 9, 6]
    assert plan["snapshots"] == [
        {
            "step": 3,
            "reason": "keep-last",
            "bytes": pytest.approx(16896, rel=0.1),
            "age_s": pytest.approx(8 * 86400, abs=60),
        }
    ]
    assert sorted((e["key"], e["reason"]) for e in plan["leftovers"]) == [
        ("step-000000000012/old-shared-00000.bin", "unreferenced"),
        ("step-000000000015", "uncommitted"),
    ]
    assert all(e["age_s"] == pytest.approx(2 * HOUR, abs=60) for e in plan["leftovers"])
    assert [e["key"] for e in plan["in_progress"]] == ["step-000000000018"] and plan["uploads"] == []
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == before, "--dry-run changed the tier"

    rc, out, err = cli("gc", str(root), "--older-than", "7d", "--dry-run")  # human units, nothing changed
    assert rc == 0 and err == ""
    assert re.search(r"would delete snapshot step 3 \(older-than; 1[0-9.]* KiB, 8d 0h old\)", out), out
    assert "would remove leftover step-000000000015 (uncommitted, idle 2h 0m)" in out
    assert "left alone step-000000000018 (being written? changed 0s ago, within --grace)" in out
    assert "dry run: nothing changed" in out
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == before

    rc, plan, _ = run("gc", str(root), "--keep-last", "2")
    assert rc == 0 and plan["dry_run"] is False and [e["step"] for e in plan["snapshots"]] == [6, 3]
    assert committed_steps(LocalTier(root)) == [12, 9]
    assert sorted(p.name for p in root.iterdir()) == ["step-000000000009", "step-000000000012", "step-000000000018"], (
        "the write in progress must stay"
    )
    assert not (root / "step-000000000012" / "old-shared-00000.bin").exists()
    assert (root / "step-000000000012" / "restores.json").exists()
    assert_state(str(root), 12)
    assert_state(str(root), 9)

    # the newest snapshot whose manifest is valid survives any --keep-last / --older-than
    (root / "step-000000000012" / "manifest.json").write_text("{not json")
    rc, plan, _ = run("gc", str(root), "--keep-last", "1", "--older-than", "0s")
    assert rc == 0 and plan["protected"] == 9 and plan["snapshots"] == [] and plan["kept"] == [12, 9]
    assert_state(str(root), 9)
    rc, out, _ = cli("gc", str(root), "--older-than", "0s")
    assert "newest valid snapshot: step 9" in out and committed_steps(LocalTier(root)) == [12, 9]


# ------------------------------------------------------------------------------------------------ S3
def s3_tier(s3_server, bucket: str, prefix: str = "run") -> ObjectStoreTier:
    return ObjectStoreTier(
        f"s3://{bucket}/{prefix}",
        storage_options={
            "key": "testing-key",
            "secret": "testing-secret",
            "client_kwargs": {"endpoint_url": s3_server.endpoint},
        },
    )


def s3_client(s3_server):
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=s3_server.endpoint,
        aws_access_key_id="testing-key",
        aws_secret_access_key="testing-secret",
        region_name="us-east-1",
    )


def test_gc_s3_aborts_stale_uploads_removes_leftovers_and_keeps_the_newest(s3_server, bucket, s3_environment):
    s3_environment(s3_server.endpoint)
    tier = s3_tier(s3_server, bucket)
    for step in (2, 4, 6):
        write(tier, step)
    tier.write("step-000000000008/r8-rank-00000.bin", [b"left by a crashed upload"])
    tier.write("step-000000000006/old-rank-00000.bin", [b"an older write of step 6"])
    client = s3_client(s3_server)
    upload = client.create_multipart_upload(Bucket=bucket, Key="run/step-000000000008/r8-shared-00000.bin")
    client.upload_part(
        Bucket=bucket,
        Key="run/step-000000000008/r8-shared-00000.bin",
        PartNumber=1,
        UploadId=upload["UploadId"],
        Body=b"p" * 1024,
    )
    url = f"s3://{bucket}/run"

    # everything is younger than the default grace (1 h): a write in progress, left alone
    rc, plan, err = run("gc", url, "--keep-last", "2")
    assert rc == 0 and err == "", err
    assert [e["step"] for e in plan["snapshots"]] == [2] and plan["kept"] == [6, 4] and plan["protected"] == 6
    assert plan["uploads"] == [] and plan["leftovers"] == []
    assert sorted(e["key"] for e in plan["in_progress"]) == [
        "step-000000000006/old-rank-00000.bin",
        "step-000000000008",
        "step-000000000008/r8-shared-00000.bin",
    ]
    assert len(client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])) == 1
    assert committed_steps(tier) == [6, 4] and tier.list("step-000000000008") == ["r8-rank-00000.bin"]

    rc, plan, _ = run("gc", url, "--grace", "0s", "--older-than", "0s", "--dry-run")
    assert rc == 0 and [e["step"] for e in plan["snapshots"]] == [4] and plan["protected"] == 6
    assert [(e["key"], e["upload_id"]) for e in plan["uploads"]] == [
        ("step-000000000008/r8-shared-00000.bin", upload["UploadId"])
    ]
    assert [(e["key"], e["reason"]) for e in plan["leftovers"]] == [
        ("step-000000000006/old-rank-00000.bin", "unreferenced"),
        ("step-000000000008", "uncommitted"),
    ]
    assert len(client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])) == 1, "--dry-run aborted"
    assert committed_steps(tier) == [6, 4]

    rc, out, err = cli("gc", url, "--grace", "0s", "--older-than", "0s")
    assert rc == 0 and err == ""
    assert "aborted multipart upload step-000000000008/r8-shared-00000.bin" in out
    assert "removed leftover step-000000000008 (uncommitted" in out and "deleted snapshot step 4" in out
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    assert tier.list("") == ["step-000000000006"] and "old-rank-00000.bin" not in tier.list("step-000000000006")
    assert_state(url, 6)


# ------------------------------------------------------------------------------------------------ copy
def test_copy_between_local_and_s3_verified_and_never_over_a_committed_step(
    tmp_path, s3_server, bucket, s3_environment
):
    s3_environment(s3_server.endpoint)
    local = tmp_path / "local"
    for step in (5, 10):
        write(LocalTier(local), step)
    url = f"s3://{bucket}/promoted"

    rc, doc, err = run("copy", str(local), url)  # default: the newest step
    assert rc == 0 and err == "", err
    assert doc == {
        "source": str(local),
        "destination": url,
        "step": 10,
        "bytes": doc["bytes"],
        "objects": 2,
        "seconds": doc["seconds"],
    }
    assert (
        doc["bytes"]
        == json.loads((local / "step-000000000010" / "manifest.json").read_text())["objects"][0]["nbytes"]
        + json.loads((local / "step-000000000010" / "manifest.json").read_text())["objects"][1]["nbytes"]
    )
    rc, out, _ = cli("copy", str(local / "step-000000000005"), url)  # a step directory as the source
    assert rc == 0 and re.fullmatch(
        rf"copied step 5 \(1[0-9.]* KiB, 2 objects, verified\) from {local} to {url}"
        r" in [0-9.]+ s\n",
        out,
    ), out
    tier = s3_tier(s3_server, bucket, "promoted")
    assert tier.read("step-000000000010/manifest.json") == (local / "step-000000000010" / "manifest.json").read_bytes()
    rc, doc, _ = run("verify", url, "--all")
    assert rc == 0 and doc["ok"] is True and [(s["step"], s["ok"]) for s in doc["steps"]] == [(10, True), (5, True)]

    back = tmp_path / "back" / "nested"  # s3 -> local, into a directory that does not exist yet
    rc, doc, _ = run("copy", url, str(back), "--step", "5")
    assert rc == 0 and doc["step"] == 5 and committed_steps(LocalTier(back)) == [5]
    assert_state(str(back), 5)
    rc, doc, _ = run("copy", str(back), str(tmp_path / "third"))  # local -> local
    assert rc == 0 and committed_steps(LocalTier(tmp_path / "third")) == [5]

    # a destination that already holds the step: refused, nothing changed
    before = tree(back)
    rc, out, err = cli("copy", url, str(back), "--step", "5")
    assert rc == 1 and out == ""
    assert one_line_error(err) == (
        f"lightning-snapshot copy: error: the local tier {str(back)!r} already holds a committed snapshot of step 5;"
        " a committed snapshot is never overwritten: copy another --step, or remove it first (lightning-snapshot gc)"
    )
    assert tree(back) == before


def test_a_corrupted_source_is_not_copied_and_leaves_nothing_behind(tmp_path):
    src = tmp_path / "src"
    write(LocalTier(src), 4)
    manifest = json.loads((src / "step-000000000004" / "manifest.json").read_text())
    entry = next(t for t in manifest["tensors"] if t["name"].endswith("net.weight"))
    obj = src / "step-000000000004" / entry["fragments"][0]["object"]
    raw = bytearray(obj.read_bytes())
    raw[entry["fragments"][0]["offset"] + 5] ^= 1
    obj.write_bytes(bytes(raw))
    rc, out, err = cli("copy", str(src), str(tmp_path / "new" / "dst"))
    assert rc == 1 and out == ""
    line = one_line_error(err)
    assert f"checksum mismatch in tensor {entry['name']!r}, object {obj.name!r}" in line
    assert "the data is corrupted. Use an earlier snapshot" in line
    assert not (tmp_path / "new").exists(), "a failed copy left its destination behind"


@pytest.mark.parametrize(
    "args, rc, message",
    [
        (
            ["copy", "{tmp}/missing", "{tmp}/dst"],
            1,
            "no snapshot tier at '{tmp}/missing': the directory does not exist",
        ),
        (["copy", "{src}", "s4://bucket/x"], 2, "unknown tier URL scheme 's4' in 's4://bucket/x'"),
        (["copy", "{src}", "{tmp}/dst?evry=2"], 2, "unknown tier URL option 'evry'"),
        (
            ["copy", "{src}", "{tmp}/dst/step-000000000004"],
            2,
            "the destination '{tmp}/dst/step-000000000004' is a snapshot directory: give the tier's root",
        ),
        (["copy", "{src}", "{src}"], 2, "the source and the destination are the same tier '{src}'"),
        (
            ["copy", "{src}", "{tmp}/dst", "--step", "7"],
            1,
            "no committed snapshot of step 7 in '{src}' (committed: [4])",
        ),
        (["gc", "{src}/step-000000000004"], 2, "gc takes a tier, not one snapshot directory"),
        (
            ["gc", "{src}", "--older-than", "7days"],
            2,
            "argument --older-than: expected a duration such as 90s, 30m, 12h or 7d, got '7days'",
        ),
        (
            ["gc", "{src}", "--older-than", "3"],
            2,
            "argument --older-than: a duration needs a unit, got '3': write 3s, 3m, 3h, 3d or 3w",
        ),
        (["gc", "{src}", "--keep-last", "0"], 2, "argument --keep-last: expected an integer >= 1, got '0'"),
        (["gc", "{tmp}/missing"], 1, "no snapshot tier at '{tmp}/missing'"),
        (["copy", "{src}", "ram://run-1"], 2, "copy writes to a durable tier; the ram tier"),
        (["gc", "ram://run-1"], 2, "gc prunes durable tiers; the ram tier"),
    ],
)
def test_bad_input_is_one_line_and_creates_nothing(tmp_path, monkeypatch, args, rc, message):
    (tmp_path / "shm" / "run-1" / "store").mkdir(parents=True)  # this node's RAM tier of run-1
    monkeypatch.setenv("LIGHTNING_SNAPSHOT_SHM_DIR", str(tmp_path / "shm"))
    src = tmp_path / "src"
    write(LocalTier(src), 4)
    fill = {"tmp": str(tmp_path), "src": str(src)}
    before = tree(tmp_path)
    got_rc, out, err = cli(*[a.format(**fill) for a in args])
    assert got_rc == rc and out == ""
    assert message.format(**fill) in one_line_error(err)
    assert tree(tmp_path) == before


# ------------------------------------------------------------------------------------------------ crash in copy
@pytest.mark.slow
@pytest.mark.parametrize("dest", ["local", "s3"])
def test_copy_sigkilled_between_data_and_manifest_shows_no_snapshot_and_gc_cleans(tmp_path, dest, request):
    """A real ``lightning-snapshot copy`` process, made slow to commit, is SIGKILLed once its data is written."""
    src = tmp_path / "src"
    write(LocalTier(src), 7)
    if dest == "s3":
        s3_server, bucket = request.getfixturevalue("s3_server"), request.getfixturevalue("bucket")
        request.getfixturevalue("s3_environment")(s3_server.endpoint)
        url, dst = f"s3://{bucket}/copy", s3_tier(s3_server, bucket, "copy")
    else:
        url = str(tmp_path / "dst")
        dst = LocalTier(url)
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "slow_copy.py"), "copy", str(src), url],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    try:
        ready, _, _ = select.select([proc.stderr], [], [], 120)
        line = proc.stderr.readline() if ready else ""
        assert line.startswith("DATA WRITTEN, committing step-000000000007/manifest.json"), line
        assert sorted(dst.list("step-000000000007")) == sorted(
            o["key"] for o in json.loads((src / "step-000000000007" / "manifest.json").read_text())["objects"]
        )
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        proc.kill()
        proc.communicate()

    rc, doc, _ = run("list", url)
    assert rc == 0 and doc == {"tier": url, "snapshots": []}, "the destination shows a partial snapshot"
    rc, plan, _ = run("gc", url)  # just written: within the grace period, left alone
    assert rc == 0 and plan["leftovers"] == [] and [e["key"] for e in plan["in_progress"]] == ["step-000000000007"]
    rc, plan, _ = run("gc", url, "--grace", "0s")
    assert rc == 0 and [(e["key"], e["reason"]) for e in plan["leftovers"]] == [("step-000000000007", "uncommitted")]
    assert dst.list("") == []
    rc, doc, _ = run("copy", str(src), url)  # the copy done again succeeds
    assert rc == 0 and doc["step"] == 7
    assert_state(url, 7)


# ------------------------------------------------------------------------------------------------ --json, units
def test_list_inspect_verify_json_and_human_units(tmp_path):
    root = tmp_path / "snaps"
    for step in (1, 2):
        write(LocalTier(root), step)
    set_created(root, 1, 3 * HOUR + 60)
    m2 = json.loads((root / "step-000000000002" / "manifest.json").read_text())
    size2 = sum(o["nbytes"] for o in m2["objects"])

    rc, doc, err = run("list", str(root))
    assert rc == 0 and err == "" and doc["tier"] == str(root)
    rows = doc["snapshots"]
    assert [r["step"] for r in rows] == [2, 1]
    assert rows[0] == {
        "step": 2,
        "epoch": 0,
        "world_size": 1,
        "bytes": size2,
        "objects": 2,
        "created_unix": m2["created_unix"],
        "age_s": rows[0]["age_s"],
        "health": "healthy",
        "error": None,
    }
    assert rows[0]["age_s"] < 600 and rows[1]["age_s"] == pytest.approx(3 * HOUR + 60, abs=60)
    rc, out, _ = cli("list", str(root))
    assert re.search(r"^ +2 +0 +1 +1[0-9.]* KiB +healthy +\d{4}-\d\d-\d\d \d\d:\d\d:\d\d +\d+s$", out, re.M), out
    assert re.search(r"^ +1 .* 3h 1m$", out, re.M), out

    rc, doc, _ = run("inspect", str(root), "--step", "2")
    assert rc == 0 and doc["step"] == 2 and doc["bytes"] == size2 and doc["format_version"] == 1
    assert doc["health"] == "healthy" and doc["health_groups"] == {"state_dict": None}
    assert {t["name"]: (t["dtype"], t["shape"], t["alias_of"]) for t in doc["tensors"]} == {
        "state_dict/net.weight": ("float32", [64, 64], None),
        "state_dict/net.bias": ("float32", [64], None),
    }
    assert [(o["key"], o["bytes"], o["rank"]) for o in doc["objects"]] == [
        (o["key"], o["nbytes"], o["rank"]) for o in m2["objects"]
    ]
    rc, out, _ = cli("inspect", str(root))
    assert re.search(r"2 objects, 1[0-9.]* KiB; 2 shared tensors", out) and " ago" in out, out

    shared = max(m2["objects"], key=lambda o: o["nbytes"])["key"]
    obj = root / "step-000000000001" / shared.replace("r2", "r1")
    obj.write_bytes(obj.read_bytes()[:-8])  # truncated
    rc, doc, _ = run("verify", str(root), "--all")
    assert rc == 1 and doc["ok"] is False and doc["tier"] == str(root)
    assert [(s["step"], s["ok"], s["bytes"]) for s in doc["steps"]] == [(2, True, size2), (1, False, size2)]
    assert doc["steps"][0]["error"] is None and "is missing or truncated" in doc["steps"][1]["error"]
    rc, out, err = cli("verify", str(root), "--step", "2")
    assert rc == 0 and err == "" and re.fullmatch(r"step 2: OK \(1[0-9.]* KiB verified in [0-9.]+ s\)\n", out), out


_TTY = """
import fcntl, json, os, pty, struct, subprocess, sys, termios
master, slave = pty.openpty()
fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a new pty is 0 columns wide
proc = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE, stderr=slave)
os.close(slave)
seen = b""
while True:
    try:
        chunk = os.read(master, 65536)
    except OSError:
        break
    if not chunk:
        break
    seen += chunk
proc.wait(timeout=120)
print(json.dumps({"rc": proc.returncode, "stderr": seen.decode(errors="replace")}))
"""


@pytest.mark.slow
def test_a_progress_bar_on_a_real_terminal(tmp_path):
    """``verify`` in a real process whose stderr is a pseudo-terminal draws a tqdm bar; stdout keeps the result."""
    root = tmp_path / "snaps"
    write(LocalTier(root), 1)
    proc = subprocess.run(
        [sys.executable, "-c", _TTY, sys.executable, "-m", "lightning_snapshot.cli.main", "verify", str(root)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    got = json.loads(proc.stdout)
    assert got["rc"] == 0, proc.stdout + proc.stderr
    assert "verify step 1" in got["stderr"] and "|" in got["stderr"], got


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("command", ["verify", "copy", "gc"])
def test_progress_bars_on_a_terminal_never_with_json_nor_in_a_pipe(tmp_path, monkeypatch, command):
    root = tmp_path / "snaps"
    for step in (1, 2):
        write(LocalTier(root), step)
    args = {
        "verify": ["verify", str(root)],
        "copy": ["copy", str(root), str(tmp_path / "c{}")],
        "gc": ["gc", str(root), "--keep-last", "1{}"],
    }[command]
    outputs = []
    for i, (stderr, json_flag) in enumerate([(_Terminal(), []), (_Terminal(), ["--json"]), (io.StringIO(), [])]):
        monkeypatch.setattr(sys, "stderr", stderr)
        if command == "gc":
            write(LocalTier(root), 1)  # something to delete each time
        rc = main([a.format(i) if command == "copy" else a.replace("{}", "") for a in args] + json_flag)
        assert rc == 0
        outputs.append(stderr.getvalue())
    monkeypatch.undo()
    bar, with_json, in_pipe = outputs
    assert re.search(rf"{command}( step 2)?: +\d+%\|", bar), bar  # a tqdm bar (erased when done)
    assert with_json == "" and in_pipe == ""


def test_a_step_committed_while_gc_runs_is_kept(tmp_path):
    """gc plans first and removes after: an uncommitted step that gets its manifest meanwhile is not removed."""
    from lightning_snapshot.cli.ops import plan_gc, run_gc

    root = tmp_path / "snaps"
    for step in (1, 2):
        write(LocalTier(root), step)
    manifest = (root / "step-000000000002" / "manifest.json").read_bytes()
    (root / "step-000000000002" / "manifest.json").unlink()  # step 2: data written, manifest not yet
    plan = plan_gc(LocalTier(root), grace=0)
    assert [(e["key"], e["reason"]) for e in plan.leftovers] == [("step-000000000002", "uncommitted")]
    LocalTier(root).commit("step-000000000002/manifest.json", manifest)
    run_gc(LocalTier(root), plan)
    assert committed_steps(LocalTier(root)) == [2, 1]


def test_gc_keeps_the_newest_healthy_snapshot(tmp_path):
    """As training's retention: a newer snapshot holding a NaN does not push the newest healthy one out."""
    root = tmp_path / "snaps"
    for step in (1, 2):
        write(LocalTier(root), step)
    sick = state_of(3)
    sick["state_dict"]["net.weight"][0, 0] = float("nan")
    write_snapshot(LocalTier(root), LocalComm(), SnapshotJob(3, 0, stage(sick), stage({}, "rank")), "r3")
    rc, doc, _ = run("list", str(root))
    assert [r["health"] for r in doc["snapshots"]] == ["NaN/inf", "healthy", "healthy"]
    rc, plan, _ = run("gc", str(root), "--keep-last", "1")
    assert rc == 0 and plan["protected"] == 3 and [e["step"] for e in plan["snapshots"]] == [1]
    assert committed_steps(LocalTier(root)) == [3, 2]
