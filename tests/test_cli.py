"""The lightning-snapshot command on a real tier."""

from __future__ import annotations

import json

from test_bad_input import fit

from lightning_snapshot.cli import main


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


def test_missing_tier_is_a_clear_error(tmp_path, capsys):
    assert main(["verify", str(tmp_path / "nothing")]) == 2
    assert "holds no committed snapshot" in capsys.readouterr().err
