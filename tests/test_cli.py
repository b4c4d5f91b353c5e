"""The lightning-snapshot command on a real tier, and on bad input: one line naming the problem and the fix, exit
status 2 (the command line is wrong) or 1 (the command failed), no traceback, nothing created by a read-only
command, no temporary file left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_bad_input import fit

from lightning_snapshot.backends import LocalTier
from lightning_snapshot.cli.main import main
from lightning_snapshot.dist.comm import LocalComm
from lightning_snapshot.persist.writer import SnapshotJob, write_snapshot
from lightning_snapshot.staging import stage


def cli(*args: str) -> tuple[int, str, str]:
    """Run the command in this process: (exit status, stdout, stderr). Usage errors exit through SystemExit."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(list(args))
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
    return rc, out.getvalue(), err.getvalue()


def one_line_error(err: str) -> str:
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {err!r}"
    return lines[0]


def tree(path: Path) -> list[str]:
    """Everything under ``path``, hidden files included (temporary files start with a dot)."""
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


@pytest.fixture
def snaps(tmp_path) -> Path:
    """A local tier with committed steps 3 and 6 (no training: written directly)."""
    root = tmp_path / "snaps"
    for step in (3, 6):
        state = {"state_dict": {"net.weight": torch.randn(4, 3), "net.bias": torch.randn(4)}}
        write_snapshot(LocalTier(root), LocalComm(), SnapshotJob(step, 0, stage(state), stage({}, "rank")), "r")
    return root


def test_list_inspect_verify(tmp_path, capsys):
    snaps = tmp_path / "snaps"
    fit(snaps, 6)
    assert main(["list", str(snaps)]) == 0
    out = capsys.readouterr().out
    assert "           6" in out and "           3" in out
    assert main(["inspect", str(snaps / "step-000000000006")]) == 0
    assert "state_dict/net.0.weight" in capsys.readouterr().out
    assert main(["verify", str(snaps), "--all"]) == 0
    assert capsys.readouterr().out.count(": OK") == 2

    manifest = json.loads((snaps / "step-000000000003" / "manifest.json").read_text())
    frag = manifest["tensors"][1]["fragments"][0]
    obj = snaps / "step-000000000003" / frag["object"]
    raw = bytearray(obj.read_bytes())
    raw[frag["offset"]] ^= 1
    obj.write_bytes(bytes(raw))
    assert main(["verify", str(snaps), "--all"]) == 1
    out = capsys.readouterr().out
    assert "step 6: OK" in out and "step 3: FAILED" in out and manifest["tensors"][1]["name"] in out


# ------------------------------------------------------------------------------------------------ paths and URLs
@pytest.mark.parametrize("command", [["list"], ["inspect"], ["verify"], ["export", "--quiet"]])
def test_a_path_that_does_not_exist_is_an_error_and_creates_nothing(tmp_path, command):
    missing = tmp_path / "mistyped" / "path"
    args = [command[0], str(missing), *(["out.safetensors"] if command[0] == "export" else []), *command[1:]]
    before = tree(tmp_path)
    rc, out, err = cli(*args)
    line = one_line_error(err)
    assert rc == 1
    assert line == (
        f"lightning-snapshot {command[0]}: error: no snapshot tier at {str(missing)!r}: the directory does"
        " not exist. Check the path (a tier root holds step-* directories)"
    )
    assert out == "" and tree(tmp_path) == before


def test_a_step_directory_under_a_missing_tier_is_an_error(tmp_path):
    rc, _, err = cli("inspect", str(tmp_path / "nothing" / "step-000000000003"))
    assert rc == 1 and "no snapshot tier at" in one_line_error(err)
    assert not (tmp_path / "nothing").exists()


def test_list_of_an_unknown_ram_tier_creates_no_directory(tmp_path, monkeypatch):
    base = tmp_path / "shm"  # the node's RAM-tier base directory (/dev/shm/lightning-snapshot-<uid> by default)
    monkeypatch.setenv("LIGHTNING_SNAPSHOT_SHM_DIR", str(base))
    rc, _, err = cli("list", "ram://run-42")
    assert rc == 1
    assert (
        f"error: no RAM tier named 'run-42' on this node ({base / 'run-42'} does not exist); this node holds no"
        f" RAM tier under {str(base)!r}. Name the run as ram://NAME, or set LIGHTNING_SNAPSHOT_SHM_DIR"
    ) in one_line_error(err)
    assert not base.exists(), "a read-only command created the RAM tier's directory"

    (base / "run-41" / "store").mkdir(parents=True)  # another run's RAM tier: named in the message
    before = tree(tmp_path)
    rc, _, err = cli("verify", "ram://run-42")
    assert rc == 1 and "RAM tiers on this node: ram://run-41 under" in one_line_error(err)
    assert tree(tmp_path) == before


@pytest.mark.parametrize(
    "url, fragment",
    [
        ("s4://bucket/run-42", "unknown tier URL scheme 's4' in 's4://bucket/run-42'; known: a plain path, abfs://"),
        ("s3:/bucket/run-42", "ObjectStoreTier needs a URL with a scheme such as s3://bucket/path"),
        ("ram://run/42", "RAM tier URL 'ram://run/42' has a path; write ram://NAME"),
        ("/snaps?evry=3", "unknown tier URL option 'evry' in '/snaps?evry=3'; accepted options: every, interval, keep"),
    ],
)
def test_a_mistyped_scheme_or_url_is_a_usage_error(url, fragment):
    rc, _, err = cli("list", url)
    assert rc == 2 and fragment in one_line_error(err)


def test_a_memory_url_with_nothing_under_it_is_an_error():
    rc, _, err = cli("list", "memory://no-such-bucket/run-42")
    assert rc == 1
    assert (
        "no snapshot tier at 'memory://no-such-bucket/run-42': the bucket (or path) does not exist"
        in one_line_error(err)
    )


@pytest.fixture
def s3_environment(monkeypatch):
    """Credentials and endpoint from the environment, as a user of the command gives them (it has no options for
    them). fsspec caches filesystems by their arguments, not the environment: none before, none left after."""
    s3fs = pytest.importorskip("s3fs")

    def use(endpoint: str) -> None:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing-key")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing-secret")
        monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        s3fs.S3FileSystem.clear_instance_cache()

    yield use
    s3fs.S3FileSystem.clear_instance_cache()


def test_a_missing_bucket_is_an_error(s3_server, bucket, s3_environment):
    s3_environment(s3_server.endpoint)
    rc, _, err = cli("list", "s3://no-such-bucket-here/run-42")
    assert rc == 1
    assert (
        "no snapshot tier at 's3://no-such-bucket-here/run-42': the bucket (or path) does not exist"
        in one_line_error(err)
    )
    rc, _, err = cli("verify", f"s3://{bucket}/run-42")
    assert rc == 1
    assert (
        f"no snapshot tier at 's3://{bucket}/run-42': bucket {bucket!r} holds nothing under that prefix"
        in one_line_error(err)
    )


def test_a_file_where_a_tier_directory_is_expected_is_a_usage_error(snaps):
    manifest = snaps / "step-000000000006" / "manifest.json"
    rc, _, err = cli("inspect", str(manifest))
    assert rc == 2
    assert f"LocalTier path {str(manifest)!r} exists and is not a directory: choose another path" in one_line_error(err)


def test_an_empty_tier_lists_nothing_but_cannot_be_inspected(tmp_path):
    (tmp_path / "empty").mkdir()
    rc, out, err = cli("list", str(tmp_path / "empty"))
    assert rc == 0 and out.strip() == f"no committed snapshots in {tmp_path / 'empty'}" and err == ""
    rc, _, err = cli("verify", str(tmp_path / "empty"))
    assert rc == 1 and f"{str(tmp_path / 'empty')!r} holds no committed snapshot" in one_line_error(err)


# ------------------------------------------------------------------------------------------------ option values
@pytest.mark.parametrize("command", ["inspect", "verify", "export"])
def test_a_step_that_is_not_committed_names_the_committed_ones(snaps, tmp_path, command):
    extra = [str(tmp_path / "out.safetensors"), "--quiet"] if command == "export" else []
    before = tree(tmp_path)
    rc, _, err = cli(command, str(snaps), *extra, "--step", "5")
    assert rc == 1
    assert one_line_error(err) == (
        f"lightning-snapshot {command}: error: no committed snapshot of step 5 in"
        f" {str(snaps)!r} (committed: [6, 3]); pick one of those, or see:"
        f" lightning-snapshot list {snaps}"
    )
    assert tree(tmp_path) == before


@pytest.mark.parametrize("value", ["-1", "abc", "1.5"])
def test_an_invalid_step_is_a_usage_error(snaps, value):
    rc, _, err = cli("inspect", str(snaps), "--step", value)
    assert rc == 2
    assert one_line_error(err) == (
        f"lightning-snapshot inspect: error: argument --step: expected a step number (an"
        f" integer >= 0), got {value!r} (see: lightning-snapshot inspect --help)"
    )


def test_unknown_commands_options_and_formats_are_one_line_usage_errors(snaps, tmp_path):
    for args, fragment in [
        (["frob"], "argument COMMAND: invalid choice: 'frob'"),
        (["list"], "the following arguments are required: source"),
        (["list", str(snaps), "--al"], "unrecognized arguments: --al"),
        (["verify", str(snaps), "--all", "--step", "3"], "argument --step: not allowed with argument --all"),
        (["export", str(snaps), str(tmp_path / "w.onnx"), "--format", "onnx"], "argument --format: invalid choice"),
    ]:
        rc, _, err = cli(*args)
        assert rc == 2 and fragment in one_line_error(err), (args, err)
    assert not (tmp_path / "w.onnx").exists()


# ------------------------------------------------------------------------------------------------ export's output
def test_export_to_a_directory_is_a_usage_error_and_leaves_nothing_behind(snaps, tmp_path):
    out_dir = tmp_path / "exports"
    out_dir.mkdir()
    before = tree(tmp_path)
    for fmt in ("safetensors", "torch"):
        rc, out, err = cli("export", str(snaps), str(out_dir), "--format", fmt, "--quiet")
        assert rc == 2 and out == ""
        assert one_line_error(err) == (
            f"lightning-snapshot export: error: {str(out_dir)!r} is a directory: give the"
            f" path of the file to write, e.g. {str(out_dir / 'model.safetensors')!r}"
        )
        assert tree(tmp_path) == before, "export left a file behind"


def test_export_into_a_missing_directory_creates_nothing(snaps, tmp_path):
    target = tmp_path / "no" / "such" / "model.safetensors"
    rc, _, err = cli("export", str(snaps), str(target), "--quiet")
    assert rc == 2
    assert (
        f"cannot write {str(target)!r}: the directory {str(target.parent)!r} does not exist. Create it first"
    ) in one_line_error(err)
    assert not (tmp_path / "no").exists()


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_a_failed_export_leaves_no_temporary_file(snaps, tmp_path, fmt):
    manifest = json.loads((snaps / "step-000000000006" / "manifest.json").read_text())
    entry = next(t for t in manifest["tensors"] if t["name"].endswith("net.weight"))
    frag = entry["fragments"][0]
    obj = snaps / "step-000000000006" / frag["object"]
    raw = bytearray(obj.read_bytes())
    raw[frag["offset"]] ^= 1
    obj.write_bytes(bytes(raw))
    out_dir = tmp_path / "exports"
    out_dir.mkdir()
    (out_dir / "model.out").write_bytes(b"an earlier export")
    rc, _, err = cli("export", str(snaps), str(out_dir / "model.out"), "--format", fmt, "--quiet")
    assert rc == 1
    assert f"checksum mismatch in tensor {entry['name']!r}" in one_line_error(err)
    assert tree(out_dir) == ["model.out"], "a failed export must leave no temporary file"
    assert (out_dir / "model.out").read_bytes() == b"an earlier export", "a failed export must not touch OUT"


# ------------------------------------------------------------------------------------------------ manifests
def test_a_corrupted_dtype_names_the_file_the_tensor_and_the_field(snaps):
    path = snaps / "step-000000000006" / "manifest.json"
    raw = json.loads(path.read_text())
    index = next(i for i, t in enumerate(raw["tensors"]) if t["name"].endswith("net.bias"))
    name = raw["tensors"][index]["name"]
    raw["tensors"][index]["dtype"] = "flaot32"
    path.write_text(json.dumps(raw))
    rc, _, err = cli("inspect", str(snaps), "--step", "6")
    assert rc == 1
    line = one_line_error(err)
    assert (
        f"error: step-000000000006/manifest.json in the local tier {str(snaps)!r}: field tensors[{index}].dtype"
        f" (tensor {name!r}): unknown dtype 'flaot32'"
    ) in line
    assert "otherwise the manifest is corrupted: use another snapshot" in line
    rc, out, _ = cli("list", str(snaps))  # list shows the bad step and goes on
    assert rc == 0 and "unreadable manifest" in out and "           3" in out


# ------------------------------------------------------------------------------------------------ the agent
def test_agent_with_a_zero_idle_timeout_is_a_usage_error_without_traceback(tmp_path):
    """Through the installed console entry point's code path, in a real process."""
    node = tmp_path / "node"
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_snapshot.cli.main", "agent", "--dir", str(node), "--idle-timeout", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert one_line_error(proc.stderr) == (
        "lightning-snapshot agent: error: argument --idle-timeout: expected a number of seconds > 0, got '0'"
        " (see: lightning-snapshot agent --help)"
    )
    assert not node.exists()


@pytest.mark.parametrize("option", ["--status", "--stop"])
def test_agent_status_or_stop_of_a_missing_directory_is_an_error(tmp_path, option):
    rc, _, err = cli("agent", "--dir", str(tmp_path / "node"), option)
    assert rc == 1
    assert f"error: no agent directory {str(tmp_path / 'node')!r}: check --dir" in one_line_error(err)
    assert not (tmp_path / "node").exists()


def test_agent_dir_that_is_a_file_is_a_usage_error(tmp_path):
    (tmp_path / "f").write_text("x")
    rc, _, err = cli("agent", "--dir", str(tmp_path / "f"))
    assert rc == 2 and "is a file, not a directory" in one_line_error(err)


def test_agent_status_without_an_agent_says_how_to_start_one(tmp_path):
    (tmp_path / "node").mkdir()
    rc, _, err = cli("agent", "--dir", str(tmp_path / "node"), "--status")
    assert rc == 1
    assert (
        f"no agent serves {tmp_path / 'node'} (none is running for it); start one with: lightning-snapshot agent"
        in one_line_error(err)
    )


# ------------------------------------------------------------------------------------------------ --help
_HELP = """
import sys
from lightning_snapshot.cli.main import main
try:
    main(sys.argv[1:])
except SystemExit as e:
    assert e.code == 0, e.code
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"torch", "lightning", "pytorch_lightning", "numpy"})
print("HEAVY", heavy)
"""


@pytest.mark.parametrize("command", ["", "list", "inspect", "verify", "export", "copy", "gc", "agent"])
def test_help_does_not_import_torch_or_lightning(command):
    args = [command, "--help"] if command else ["--help"]
    proc = subprocess.run(
        [sys.executable, "-c", _HELP, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert proc.returncode == 0, proc.stderr
    assert "usage: lightning-snapshot" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1] == "HEAVY []"


def test_help_says_what_the_command_does_and_lists_the_commands_without_internals():
    """``lightning-snapshot --help`` is for users: what the command does, every sub-command with its one-line help,
    examples, what a tier is, the exit statuses and where each command's options are; nothing of the code (module
    names, console-script wiring, reST markup), which stays in cli/main.py's docstring for developers."""
    import argparse

    from lightning_snapshot.cli import main as cli_module

    rc, out, err = cli("--help")
    assert rc == 0 and not err
    assert out.startswith("usage: lightning-snapshot [-h] COMMAND ...")
    assert "Manage the snapshots that lightning-snapshot's SnapshotCallback writes" in out
    sub = next(a for a in cli_module._parser()._actions if isinstance(a, argparse._SubParsersAction))
    commands = [c.dest for c in sub._choices_actions]
    assert commands == ["list", "inspect", "verify", "export", "gc", "copy", "agent", "plan"]
    listed = out.split("positional arguments:", 1)[1].split("options:", 1)[0]
    for command in commands:
        assert f"\n    {command} " in listed, (command, listed)
        assert f"lightning-snapshot {command} " in out, f"no example of {command}"  # (in the examples)
    assert "exit status: 0 success; 1 the command failed" in out
    assert "Run 'lightning-snapshot COMMAND --help' for the options of a command." in out
    for internal in (
        ".py",
        "``",
        ":func:",
        ":data:",
        "console script",
        "project.scripts",
        "Nothing in the library",
        "pyproject",
    ):
        assert internal not in out, f"--help shows {internal!r}:\n{out}"
    text = f"{cli_module.DESCRIPTION}\n{cli_module.EPILOG}"
    assert max(map(len, text.splitlines())) <= 80, "a line of --help wider than a terminal (argparse keeps them)"
    # the developer's account stays in the code
    assert cli_module.__doc__ and "Nothing in the library calls it" in cli_module.__doc__
    assert "loader.py, ops.py, export.py and plan.py" in cli_module.__doc__


@pytest.mark.slow
def test_an_endpoint_that_refuses_connections_is_an_error(s3_environment):
    """A closed port on 127.0.0.1 (s3fs retries a few times first: some seconds)."""
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    s3_environment(f"http://127.0.0.1:{port}")
    rc, _, err = cli("list", "s3://bucket/run-42")
    assert rc == 1
    line = one_line_error(err)
    assert line.startswith(
        "lightning-snapshot list: error: the s3 tier 's3://bucket/run-42': endpoint does not"
        " answer (looking up 'bucket/run-42': EndpointConnectionError"
    )
    assert "testing-secret" not in line
    assert line.endswith("check the endpoint (storage_options client_kwargs endpoint_url) and the network")


def test_output_piped_into_head_ends_quietly(snaps):
    """``lightning-snapshot inspect TIER | head -1``: the reader closes the pipe early; the command exits 0 with
    nothing on stderr (no 'Broken pipe' error, no traceback)."""
    import subprocess
    import sys

    script = "import sys; from lightning_snapshot.cli.main import main; sys.exit(main())"
    proc = subprocess.Popen(
        [sys.executable, "-c", script, "inspect", str(snaps)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0
    )
    proc.stdout.close()  # the reader is gone before the command writes: every write hits a closed pipe
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 0, err
    assert err == ""
