"""benchmarks/_harness.py, what every benchmark shares: methods registry, baselines, noise, tables, targets, JSON."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import _harness as harness


def test_methods_registry_docstring_selection_and_schedule():
    methods = harness.Methods(baseline="none")
    methods.add("none", lambda x: ("none", x), "no snapshots (the baseline)")
    methods.add("ours-local", lambda x: ("ours", x), "lightning-snapshot with a ``LocalTier`` " + "word " * 40)
    methods.add("dcp", None, "torch.distributed.checkpoint")
    with pytest.raises(ValueError, match="registered twice"):
        methods.add("dcp", None, "again")
    with pytest.raises(ValueError, match="needs a description"):
        methods.add("empty", None, "  ")

    assert methods.names == ["none", "ours-local", "dcp"]
    assert methods.run("ours-local", 3) == ("ours", 3)
    with pytest.raises(TypeError, match="dispatches it itself"):
        methods.run("dcp")
    doc = methods.document("Methods:\n\n{methods}\n\nMore.")
    lines = doc.splitlines()
    assert lines[2].startswith("=") and lines[2] == lines[-3]  # a simple table's top and bottom rules
    assert [line.split()[0] for line in lines[3:-3] if line.startswith("``")] == [
        "``none``",
        "``ours-local``",
        "``dcp``",
    ]
    assert max(len(line) for line in lines) <= 115 and "word word" in lines[5]  # wrapped under its column
    with pytest.raises(ValueError, match="placeholder"):
        methods.document("no table here")

    assert methods.select("dcp,none") == ["none", "dcp"]  # registry order
    with pytest.raises(ValueError, match=r"unknown method\(s\) \['torch'\]; choose from none,ours-local,dcp"):
        methods.select("torch,dcp")
    assert methods.schedule(["dcp"]) == ["none", "dcp", "none"]  # baseline first and again last
    assert methods.schedule(["none"]) == ["none"]
    assert harness.Methods().schedule(["a", "b"]) == ["a", "b"]


def test_noise_bookkeeping_flags_unreliable_runs():
    # marks: (wall, machine busy CPU s, this process's CPU s); 2 cores for 2 s, 3 busy, 1 ours: 2 foreign = 50%
    wall, share = harness.NoiseMeter.between((10.0, 100.0, 50.0), (12.0, 103.0, 51.0), cores=2)
    assert (wall, share) == (2.0, 0.5)
    assert harness.NoiseMeter.between((0.0, 5.0, 5.0), (1.0, 5.0, 6.0), cores=2)[1] == 0.0  # never negative

    quiet = harness.Noise(wall_s=10.0, foreign_cpu_s=1.0, cores=2, load_before=1.0, load_after=1.0)
    noisy = harness.Noise(wall_s=10.0, foreign_cpu_s=5.0, cores=2, load_before=1.0, load_after=3.0)
    assert quiet.share == pytest.approx(0.05) and not quiet.unreliable and quiet.flag() is None
    assert noisy.share == pytest.approx(0.25) and noisy.unreliable
    assert noisy.flag() == (
        "NOISE: other processes used 5.0 CPU-s (25% of the CPUs) during this run: its wall-clock figures are unreliable"
    )

    # the median over the quiet periods only, or over all where fewer than 3 are quiet
    assert harness.quiet_median([(1.0, 0.0), (2.0, 0.0), (3.0, 0.05), (100.0, 0.9)]) == (2.0, 3)
    assert harness.quiet_median([(1.0, 0.0), (5.0, 0.5), (9.0, 0.9)]) == (5.0, 3)
    assert harness.quiet_median([]) == (None, 0)

    # helper processes the benchmark counts as its own (a server): their CPU is not "other processes"
    alone = harness.NoiseMeter.mark()[2]
    twice = harness.NoiseMeter.mark(pids=[os.getpid()])[2]
    assert twice >= 2 * alone - 0.05
    assert harness.NoiseMeter.mark(pids=[4_194_999])[2] >= alone  # a process that is gone counts 0

    with harness.NoiseMeter() as meter:  # real /proc/stat readings
        sum(range(10_000))
    assert meter.noise is not None and meter.noise.share >= 0.0 and meter.noise.cores >= 1


def test_run_quietest_retries_noisy_runs_and_keeps_the_quietest(capsys):
    noises = iter([0.5, 0.3, 0.4])
    calls = []

    def attempt():
        calls.append(1)
        return {"noise": next(noises), "error": None}

    kept = harness.run_quietest(
        "m",
        attempt,
        retries=2,
        noise=lambda r: r["noise"],
        failed=lambda r: r["error"],
        on_error=lambda e: {"noise": 0.0, "error": str(e)},
        after=None,
    )
    assert len(calls) == 3 and kept["noise"] == 0.3
    assert capsys.readouterr().out.count("disturbed by other processes: running it again") == 2

    def boom():
        raise RuntimeError("disk full")

    failed = harness.run_quietest(
        "m",
        boom,
        retries=3,
        noise=lambda r: r["noise"],
        failed=lambda r: r["error"],
        on_error=lambda e: {"noise": 0.0, "error": f"ERROR {e}"},
        after=None,
    )
    assert failed == {"noise": 0.0, "error": "ERROR disk full"}  # a failure is not retried


def test_baselines_use_the_quieter_run_and_report_the_spread():
    runs = [{"wall": 10.0, "noise": 0.20}, {"wall": 10.6, "noise": 0.02}]
    base = harness.Baselines(runs, noise=lambda r: r["noise"])
    assert base.quieter == runs[1]
    assert base.spread(lambda r: r["wall"]) == pytest.approx(0.6)
    assert base.smallest(lambda r: r["wall"]) == 10.0
    assert base.describe(lambda r: r["wall"], per=3, per_unit=" per snapshot") == (
        "10.00 s (20% noise), 10.60 s (2% noise); the quieter one is used (spread 0.200 s per snapshot)"
    )
    empty = harness.Baselines([], noise=lambda r: 0.0)
    assert empty.quieter is None and empty.spread(lambda r: 1.0) == 0.0


def test_table_text_markdown_and_records():
    table = harness.Table("t", ["method", "stall ms", harness.Column("note", "<")], notes=["+: fsynced by us"])
    table.add("ours-local", "2.9", "ok", data={"method": "ours-local", "stall_ms": 2.9})
    table.add("torch-save", "1234.5", "")
    table.add_span("torchsnapshot", "ERROR ImportError: no module")
    with pytest.raises(ValueError, match="2 cells for 3 columns"):
        table.add("x", "y")
    assert table.text().splitlines() == [
        "method        stall ms note",
        "---------------------------",
        "ours-local         2.9 ok",
        "torch-save      1234.5",
        "torchsnapshot ERROR ImportError: no module",
        "+: fsynced by us",
    ]
    assert table.markdown().splitlines() == [
        "| method | stall ms | note |",
        "|---|---:|---|",
        "| ours-local | 2.9 | ok |",
        "| torch-save | 1234.5 |  |",
        "| torchsnapshot | ERROR ImportError: no module |  |",
        "",
        "+: fsynced by us",
    ]
    assert table.records() == [
        {"method": "ours-local", "stall_ms": 2.9},
        {"method": "torch-save", "stall ms": "1234.5", "note": ""},
        {"method": "torchsnapshot", "note": "ERROR ImportError: no module"},
    ]
    assert harness.ratio(1.0, 4.0) == "0.25x" and harness.ratio(30.0, 2.0) == "15.0x"
    assert harness.ratio(1.0, 0.01, floor=0.05) == "ref~0" and harness.ratio(None, 1.0) == "-"
    assert harness.fmt(None, ".1f") == "-" and harness.fmt(2.345, ".2f") == "2.35"


def test_targets_block_summary_and_exit_status():
    targets = harness.Targets()
    assert targets.verdict == "NONE" and targets.exit_status() == 0
    targets.check(True, "median stall 2.9 ms <= 5 ms", 2.9, 5.0)
    targets.check(None, "restore: not measured")
    targets.info("CPU per snapshot 0.09 s", 0.09)
    assert targets.verdict == "PASS" and targets.exit_status() == 0
    targets.warn(">= 5 failures per method: no: mc-yd")
    assert targets.verdict == "PASS"  # a warning is not a target
    targets.check(False, "durable 3.1 s <= 0.5 x 4.0 s", 3.1, 2.0)
    assert targets.text().splitlines() == [
        "targets",
        "  PASS  median stall 2.9 ms <= 5 ms",
        "   --   restore: not measured",
        "  info  CPU per snapshot 0.09 s",
        "  WARN  >= 5 failures per method: no: mc-yd",
        "  FAIL  durable 3.1 s <= 0.5 x 4.0 s",
        "TARGETS pass=1 fail=1 unjudged=1 warn=1 info=1 verdict=FAIL",
    ]
    assert targets.summary() == {"pass": 1, "fail": 1, "unjudged": 1, "warn": 1, "info": 1, "verdict": "FAIL"}
    assert targets.exit_status() == 1


def test_report_prints_and_writes_json_and_strict_exit_status(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    harness.add_arguments(parser)
    path = tmp_path / "out.json"
    args = parser.parse_args(["--json", str(path), "--markdown", "--strict"])
    out = harness.Report("demo", args)
    out.header(model="tiny", steps=4)
    table = harness.Table("results of 1 run", ["method", "s"], key="results")
    table.add("a", "1.00", data={"method": "a", "s": 1.0, "bad": float("nan")})
    out.table(table)
    out.targets.check(False, "a: 1.00 s <= 0.5 s", 1.0, 0.5)
    assert out.finish(runs=[harness.Timing([1.0, 2.0])]) == 1  # --strict and a FAIL
    printed = capsys.readouterr().out
    assert "lightning-snapshot demo benchmark: torch " in printed and "model tiny; steps 4" in printed
    assert "| a | 1.00 |" in printed and "TARGETS pass=0 fail=1" in printed
    doc = json.loads(path.read_text())
    assert doc["benchmark"] == "demo" and doc["settings"] == {"model": "tiny", "steps": 4}
    assert doc["tables"] == {"results": {"title": "results of 1 run", "rows": [{"method": "a", "s": 1.0, "bad": None}]}}
    assert doc["targets"] == [{"status": "FAIL", "text": "a: 1.00 s <= 0.5 s", "value": 1.0, "limit": 0.5}]
    assert doc["summary"]["verdict"] == "FAIL" and doc["data"] == {"runs": [{"runs": [1.0, 2.0]}]}
    assert {"torch", "lightning", "cpus", "library", "load_average", "noise_share"} <= doc["machine"].keys()
    assert "demo: 0 s in all; load average" in printed and "of the CPUs)" in printed

    lenient = harness.Report("demo", parser.parse_args([]))
    lenient.targets.check(False, "fails")
    assert lenient.finish() == 0 and not lenient.markdown  # without --strict the exit status stays 0
