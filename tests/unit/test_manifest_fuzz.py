"""Manifest.from_json on hostile input: it must accept only valid manifests and fail only with the library's errors.

A manifest is read from storage that may be truncated, corrupted or tampered with; whatever the bytes, the loader
must get a ManifestError (FormatVersionError is one) or an UnsafePathError, never a KeyError/TypeError/crash.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_snapshot.backends.local import LocalTier
from lightning_snapshot.dist.comm import LocalComm
from lightning_snapshot.errors import FormatVersionError, ManifestError, SnapshotError, UnsafePathError
from lightning_snapshot.format.manifest import Manifest, step_dirname
from lightning_snapshot.persist.writer import SnapshotJob, write_snapshot
from lightning_snapshot.restore.loader import load_snapshot, read_manifest
from lightning_snapshot.staging import stage

# the module-scoped fixtures below are shared by this file's tests: under pytest-xdist they run in one worker
pytestmark = pytest.mark.xdist_group("test_manifest_fuzz")

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------------------------------- a real manifest


def _write_real_snapshot(root) -> Manifest:
    w = torch.randn(4, 3)
    shared = {
        # head is the same object as enc (one name); dec is another tensor over the same memory (an alias entry)
        "state_dict": {
            "enc.weight": w,
            "dec.weight": w.detach(),
            "head.weight": w,
            "bias": torch.zeros(3, dtype=torch.bfloat16),
            "empty": torch.empty(0, 2),
        },
        "optimizer_states": [{"state": {0: {"step": torch.tensor(5.0)}}, "param_groups": [{"lr": 0.1}]}],
        "loops": {"fit_loop": {"epoch": 1}},
        "extra": (1, float("nan"), b"xy", np.arange(3, dtype=np.uint32), torch.float16),
    }
    private = {"rng": {"torch": torch.ByteTensor(list(range(16))), "python": (3, (1, 2), None)}, "loaders": []}
    job = SnapshotJob(42, 1, shared=stage(shared), private=stage(private, "rank"))
    return write_snapshot(LocalTier(root), LocalComm(), job, run_id="abc", chunk_bytes=16)


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    root = tmp_path_factory.mktemp("tier")
    manifest = _write_real_snapshot(root)
    text = (root / step_dirname(42) / "manifest.json").read_text()
    return root, manifest, text


def parse_or_library_error(text):
    """from_json's result, or None when it raised one of the errors it is allowed to raise."""
    try:
        return Manifest.from_json(text, where="fuzzed manifest")
    except (ManifestError, UnsafePathError) as e:
        assert isinstance(e, SnapshotError)
        assert str(e), "errors must say what is wrong"
        return None


def assert_reparses_identically(m: Manifest) -> None:
    """Whatever from_json accepts can be written back and reads back as the same manifest."""
    assert Manifest.from_json(m.to_json()) == m


# ---------------------------------------------------------------------------------------------------- strategies

_edge_ints = st.sampled_from(
    [0, 1, -1, 63, 64, 65, 2**31, 2**62, 2**62 + 1, 2**63 - 1, 2**63, 2**64, -(2**63), 10**12 - 1, 10**12, 10**400]
)
json_leaves = (
    st.none()
    | st.booleans()
    | st.integers()
    | _edge_ints
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
    | st.sampled_from(
        [
            "tensor",
            "alias",
            "object",
            "float32",
            "xxh3_64",
            "$tensor",
            "../x",
            "/abs",
            "",
            "a" * 16,
            "0123456789abcdef",
            "abc-shared-00000.bin",
            "manifest.json",
        ]
    )
)
json_values = st.recursive(
    json_leaves,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)


def _paths(node, prefix=()):
    """Every path (tuple of keys/indices) in a JSON tree, the root included."""
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, prefix + (i,))


def _get(node, path):
    for p in path:
        node = node[p]
    return node


# ---------------------------------------------------------------------------------------------------- fuzz: garbage


@FUZZ
@given(st.text())
def test_arbitrary_text_never_crashes(text):
    parse_or_library_error(text)


@FUZZ
@given(st.binary())
def test_arbitrary_bytes_never_crash(data):
    parse_or_library_error(data)


@FUZZ
@given(st.text(alphabet='{}[]",:0123456789.-+eE truefalsnNaIiy\\/u', max_size=80))
def test_json_like_garbage_never_crashes(text):
    parse_or_library_error(text)


@FUZZ
@given(json_values)
def test_arbitrary_json_values_never_crash(value):
    m = parse_or_library_error(json.dumps(value))
    if m is not None:
        assert_reparses_identically(m)


_TOP_KEYS = [
    "format_version",
    "step",
    "epoch",
    "world_size",
    "created_unix",
    "library_version",
    "checksum",
    "chunk_bytes",
    "alignment",
    "objects",
    "tensors",
    "state",
    "ranks",
]


@FUZZ
@given(st.fixed_dictionaries({k: json_values for k in _TOP_KEYS}))
def test_manifest_shaped_objects_with_random_fields_never_crash(raw):
    m = parse_or_library_error(json.dumps(raw))
    if m is not None:
        assert_reparses_identically(m)


# ---------------------------------------------------------------------------------------------------- fuzz: mutations


@FUZZ
@given(data=st.data())
def test_replacing_any_field_of_a_real_manifest(real, data):
    _, _, text = real
    raw = json.loads(text)
    path = data.draw(st.sampled_from(list(_paths(raw))[1:]), label="path")
    parent = _get(raw, path[:-1])
    parent[path[-1]] = data.draw(json_values, label="value")
    m = parse_or_library_error(json.dumps(raw))
    if m is not None:
        assert_reparses_identically(m)


@FUZZ
@given(data=st.data())
def test_deleting_any_key_or_item_of_a_real_manifest(real, data):
    _, _, text = real
    raw = json.loads(text)
    path = data.draw(st.sampled_from(list(_paths(raw))[1:]), label="path")
    del _get(raw, path[:-1])[path[-1]]
    m = parse_or_library_error(json.dumps(raw))
    if m is not None:
        assert_reparses_identically(m)


@FUZZ
@given(data=st.data())
def test_adding_a_key_to_any_object_of_a_real_manifest(real, data):
    _, _, text = real
    raw = json.loads(text)
    objects = [p for p in _paths(raw) if isinstance(_get(raw, p), dict)]
    path = data.draw(st.sampled_from(objects), label="path")
    _get(raw, path)[data.draw(st.text(max_size=10), label="key")] = data.draw(json_values, label="value")
    m = parse_or_library_error(json.dumps(raw))
    if m is not None:
        assert_reparses_identically(m)


@FUZZ
@given(data=st.data())
def test_numeric_fields_of_a_real_manifest_off_by_a_little(real, data):
    # small changes to offsets/sizes/shapes are the corruptions most likely to slip through a lax parser
    _, _, text = real
    raw = json.loads(text)
    ints = [p for p in list(_paths(raw))[1:] if isinstance(_get(raw, p), int) and not isinstance(_get(raw, p), bool)]
    path = data.draw(st.sampled_from(ints), label="path")
    parent = _get(raw, path[:-1])
    parent[path[-1]] += data.draw(st.sampled_from([-64, -2, -1, 1, 2, 63, 64, 1 << 20]), label="delta")
    m = parse_or_library_error(json.dumps(raw))
    if m is not None:
        assert_reparses_identically(m)


@FUZZ
@given(data=st.data())
def test_truncating_or_flipping_bytes_of_a_real_manifest(real, data):
    _, _, text = real
    blob = bytearray(text.encode())
    if data.draw(st.booleans(), label="truncate"):
        blob = blob[: data.draw(st.integers(0, len(blob) - 1), label="length")]
    else:
        for _ in range(data.draw(st.integers(1, 3), label="flips")):
            i = data.draw(st.integers(0, len(blob) - 1), label="index")
            blob[i] = data.draw(st.integers(0, 255), label="byte")
    m = parse_or_library_error(bytes(blob))
    if m is not None:
        assert_reparses_identically(m)


def test_every_strict_prefix_of_a_real_manifest_is_rejected(real):
    _, _, text = real
    for n in range(0, len(text), max(1, len(text) // 400)):
        with pytest.raises(ManifestError):
            Manifest.from_json(text[:n])


# ---------------------------------------------------------------------------------------------------- plain cases


def test_real_manifest_survives_to_json_and_back(real):
    _, manifest, text = real
    assert Manifest.from_json(text) == manifest
    assert Manifest.from_json(manifest.to_json()) == manifest
    assert Manifest.from_json(text.encode()) == manifest
    assert manifest.step == 42 and manifest.epoch == 1 and manifest.world_size == 1
    assert any(t.alias_of is not None for t in manifest.tensors)


def test_truncated_manifest_says_it_is_not_valid_json(real):
    _, _, text = real
    with pytest.raises(ManifestError, match="not valid JSON"):
        Manifest.from_json(text[: len(text) // 2])


def test_newer_format_version_asks_for_an_upgrade(real):
    _, _, text = real
    raw = json.loads(text)
    raw["format_version"] = 2
    raw["some_future_field"] = {"x": 1}  # a newer format may have fields this one does not know
    with pytest.raises(FormatVersionError) as info:
        Manifest.from_json(json.dumps(raw))
    assert "newer" in str(info.value)
    assert "pip install -U lightning-snapshot" in str(info.value)
    assert isinstance(info.value, ManifestError)


@pytest.mark.parametrize("version", [0, -1, "1", 1.0, None, True])
def test_invalid_format_versions_are_manifest_errors_but_not_version_errors(real, version):
    _, _, text = real
    raw = json.loads(text)
    raw["format_version"] = version
    with pytest.raises(ManifestError) as info:
        Manifest.from_json(json.dumps(raw))
    assert not isinstance(info.value, FormatVersionError)


@pytest.mark.parametrize("key", ["../../etc/passwd", "/abs", "a/../../b", "a\\..\\b", "./x", "a//b", ""])
def test_unsafe_object_keys_are_refused(real, key):
    _, _, text = real
    raw = json.loads(text)
    old = raw["objects"][0]["key"]
    raw["objects"][0]["key"] = key
    for section in [raw["tensors"]] + [r["tensors"] for r in raw["ranks"]]:
        for entry in section:
            for frag in entry.get("fragments", []):
                if frag["object"] == old:
                    frag["object"] = key
    with pytest.raises(UnsafePathError):
        Manifest.from_json(json.dumps(raw))


def test_unknown_entry_type_in_tensors(real):
    _, _, text = real
    raw = json.loads(text)
    raw["tensors"][0]["type"] = "sharded_tensor"
    with pytest.raises(ManifestError, match="unknown entry type"):
        Manifest.from_json(json.dumps(raw))


def test_fragment_past_the_end_of_its_object(real):
    _, _, text = real
    raw = json.loads(text)
    entry = next(t for t in raw["tensors"] if t["type"] == "tensor" and t["fragments"][0]["nbytes"] > 0)
    frag = entry["fragments"][0]
    size = next(o["nbytes"] for o in raw["objects"] if o["key"] == frag["object"])
    frag["offset"] = ((size - frag["nbytes"]) // 64 + 1) * 64  # aligned, but the bytes run past the end
    with pytest.raises(ManifestError, match="outside object"):
        Manifest.from_json(json.dumps(raw))


def test_object_size_smaller_than_its_fragments(real):
    _, _, text = real
    raw = json.loads(text)
    raw["objects"][0]["nbytes"] = 1
    with pytest.raises(ManifestError):
        Manifest.from_json(json.dumps(raw))


def test_fragment_naming_an_unlisted_object(real):
    _, _, text = real
    raw = json.loads(text)
    next(t for t in raw["tensors"] if t["type"] == "tensor")["fragments"][0]["object"] = "other.bin"
    with pytest.raises(ManifestError, match="does not list"):
        Manifest.from_json(json.dumps(raw))


def test_state_reference_to_a_missing_tensor(real):
    _, _, text = real
    raw = json.loads(text)
    raw["state"]["ghost"] = {"$tensor": "nope"}
    with pytest.raises(ManifestError, match="nope"):
        Manifest.from_json(json.dumps(raw))


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity", "1e999", "-2.5E+400"])
def test_non_standard_json_constants_and_numbers_past_a_double_are_refused(real, constant):
    """(Python reads 1e999 as infinity: such a manifest could not be written back, and none is ever written.)"""
    _, _, text = real
    tampered = text.replace('"created_unix":', f'"created_unix":{constant},"x":', 1)
    with pytest.raises(ManifestError, match="tier 0 step 42: manifest holds the .* use another snapshot"):
        Manifest.from_json(tampered, where="tier 0 step 42")
    in_state = text.replace('"loops":', f'"lr":{constant},"loops":', 1)
    assert in_state != text
    with pytest.raises(ManifestError, match="use another snapshot"):
        Manifest.from_json(in_state)


def test_loader_reports_a_tampered_manifest_as_manifest_error(real, tmp_path):
    _write_real_snapshot(tmp_path)
    path = tmp_path / step_dirname(42) / "manifest.json"
    raw = json.loads(path.read_text())
    raw["step"] = 41
    path.write_text(json.dumps(raw))
    with pytest.raises(ManifestError, match="step 41"):
        read_manifest(LocalTier(tmp_path), 42)
    path.write_text(path.read_text()[:100])
    with pytest.raises(ManifestError, match="not valid JSON"):
        load_snapshot(str(tmp_path))


@pytest.mark.parametrize(
    "tagged",
    [
        {"$float": "NaN"},
        {"$bytes": "!!"},
        {"$device": "nonsense"},
        {"$dict": [[[1], 2]]},
        {"$tuple": 3},
        {"$unknown": 1},
        {"$tensor": "state_dict/bias", "extra": 1},
        {"$ndarray": [["x"], "float32"]},
        {"$ndarray": ["state_dict/bias", "complex256"]},
        {"$dtype": "float99"},
        # regressions: these used to escape tree.decode as TypeError/ValueError
        {"$dtype": []},
        {"$dtype": {"a": 1}},
        {"$ndarray": ["state_dict/bias", "float32"]},  # numpy has no bfloat16
        {"$ndarray": ["optimizer_states/0/state/0/step", "uint64"]},  # 4 bytes cannot be one uint64
    ],
    ids=lambda v: json.dumps(v)[:40],
)
def test_tampered_tagged_values_in_state_fail_loading_with_manifest_error(tmp_path, tagged):
    # Manifest.from_json checks only $tensor refs in the state; every other malformed tag must still fail the load
    # with ManifestError (the callback falls back to an earlier snapshot only on SnapshotError/OSError)
    manifest = _write_real_snapshot(tmp_path)
    assert {"state_dict/bias", "optimizer_states/0/state/0/step"} <= {t.name for t in manifest.tensors}
    path = tmp_path / step_dirname(42) / "manifest.json"
    raw = json.loads(path.read_text())
    raw["state"]["tampered"] = tagged
    path.write_text(json.dumps(raw))
    with pytest.raises(ManifestError):
        load_snapshot(str(tmp_path))


# ------------------------------------------------------------------------------------- errors name file, tensor, field


def _set(entry, field, value):
    """Set ``field`` ('dtype', 'fragments[0].offset', ...) of a tensor entry."""
    node, _, last = (entry, None, field)
    if "." in field:
        head, last = field.split(".", 1)
        node = entry["fragments"][int(head[len("fragments[") : -1])]
    if value is _DELETE:
        del node[last]
    else:
        node[last] = value


_DELETE = object()


@pytest.mark.parametrize("section", ["tensors", "ranks[0].tensors"])
@pytest.mark.parametrize(
    "field, value, field_path, problem",
    [
        ("dtype", "flaot32", "dtype", "unknown dtype 'flaot32'"),
        ("dtype", 32, "dtype", "expected a string, got int"),
        ("global_shape", [-3], "global_shape[-1]", "-3 is outside"),  # (the last dim; path set below)
        ("global_shape", "4x3", "global_shape", "expected a list, got str"),
        ("fragments", {}, "fragments", "expected a list, got dict"),
        ("fragments[0].object", "other.bin", "fragments[0].object", "does not list"),
        ("fragments[0].object", "../x", "fragments[0].object", "would escape the tier root"),
        ("fragments[0].offset", 3, "fragments[0]", "is not aligned"),
        ("fragments[0].offset", "0", "fragments[0].offset", "expected an integer"),
        ("fragments[0].nbytes", 7, "fragments[0]", "does not match local_shape"),
        ("fragments[0].global_offsets", [9], "fragments[0]", "lies outside global_shape"),
        ("fragments[0].local_shape", [1, 1, 1, 1], "fragments[0]", "do not have the rank of global_shape"),
        ("fragments[0].checksums", ["xyz"], "fragments[0].checksums", "16-digit hex"),
        ("fragments[0].extra", 1, "fragments[0]", "unknown field(s) ['extra']"),
        ("fragments[0].nbytes", _DELETE, "fragments[0]", "missing field(s) ['nbytes']"),
    ],
)
def test_a_bad_tensor_field_names_the_file_the_tensor_and_the_field(real, section, field, value, field_path, problem):
    _, _, text = real
    raw = json.loads(text)
    entries = raw["tensors"] if section == "tensors" else raw["ranks"][0]["tensors"]
    index, entry = next(
        (i, t)
        for i, t in enumerate(entries)
        if t["type"] == "tensor" and t["fragments"] and t["fragments"][0]["nbytes"] > 0
    )
    ndim = len(entry["global_shape"])
    if field == "fragments[0].global_offsets":
        value = [9] * ndim
    elif field == "global_shape" and isinstance(value, list):
        value, field_path = [*entry["global_shape"][:-1], -3], f"global_shape[{ndim - 1}]"
    _set(entry, field, value)
    with pytest.raises((ManifestError, UnsafePathError)) as info:
        Manifest.from_json(json.dumps(raw), where="step-000000000042/manifest.json in the local tier '/t'")
    msg = str(info.value)
    assert msg.startswith(
        f"step-000000000042/manifest.json in the local tier '/t': field {section}[{index}]."
        f"{field_path} (tensor {entry['name']!r}): "
    ), msg
    assert problem in msg


# ------------------------------------------------------------------------------------ the column check of whole tensors


def _outcome(text: str) -> object:
    try:
        return Manifest.from_json(text, where="fuzzed manifest")
    except (ManifestError, UnsafePathError) as e:
        return f"{type(e).__name__}: {e}"


# values that compare equal to a valid field's but are not valid (Python: True == 1, 0.0 == 0, 1.0 == 1)
_LOOKALIKES = st.sampled_from([True, False, 0.0, 1.0, -0.0, 1e300, "0", None, [], [0], [True], [1.0], 2**63])


@FUZZ
@given(data=st.data())
def test_the_fast_path_of_whole_tensors_accepts_and_refuses_exactly_what_the_full_parser_does(real, data):
    """The tensor entries stored whole in one fragment are checked in C-level passes over their columns (the common
    case): for any field of any entry replaced by a look-alike or an arbitrary value, the manifest parses to the same
    result, or fails with the same message, as with that check turned off."""
    _, _, text = real
    raw = json.loads(text)
    entries = [p for p in _paths(raw) if (len(p) > 1 and p[-2] == "tensors") or "fragments" in p]
    path = data.draw(st.sampled_from(entries), label="path")
    target = _get(raw, path)
    if isinstance(target, (dict, list)) and target:
        key = data.draw(st.sampled_from(list(target) if isinstance(target, dict) else range(len(target))), label="key")
        target[key] = data.draw(st.one_of(_LOOKALIKES, json_values), label="value")
    mutated = json.dumps(raw)
    assert _outcome(mutated) == _entry_by_entry(mutated)


def _entry_by_entry(text: str) -> object:
    """:func:`_outcome` with the column check of whole tensors turned off (every entry parsed one by one)."""
    from lightning_snapshot.format import decode as manifest_module

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(manifest_module, "whole_tensor_columns", lambda *args: None)
        return _outcome(text)


# ---------------------------------------------------------------------------------------------------- column check


@pytest.fixture(scope="module")
def many(tmp_path_factory):
    """A manifest whose sections are whole tensors only (no alias): the case the column check takes."""
    root = tmp_path_factory.mktemp("many")
    shared = {
        "state_dict": {f"layer{i}.weight": torch.full((2, i % 3 + 1), float(i)) for i in range(12)},
        "scalars": [torch.tensor(float(i)) for i in range(3)],
        "empty": torch.empty(0, 4),
    }
    job = SnapshotJob(7, 0, shared=stage(shared), private=stage({"rng": torch.arange(5)}, "rank"))
    write_snapshot(LocalTier(root), LocalComm(), job, run_id="abc", chunk_bytes=16)
    return json.loads((root / step_dirname(7) / "manifest.json").read_text())


_MUTATIONS = {
    "bool-dim": lambda e, f: e.__setitem__("global_shape", [True, *e["global_shape"][1:]]),
    "float-offset": lambda e, f: f.__setitem__("offset", float(f["offset"])),
    "negative-dim": lambda e, f: e.__setitem__("global_shape", [-1]),
    "misaligned": lambda e, f: f.__setitem__("offset", f["offset"] + 4),
    "checksum-count": lambda e, f: f.__setitem__("checksums", f["checksums"] + ["0123456789abcdef"]),
    "checksum-hex": lambda e, f: f.__setitem__("checksums", ["0123456789ABCDEF"] * len(f["checksums"])),
    "checksum-newline": lambda e, f: f.__setitem__("checksums", ["0123456789abcdef\n"] * len(f["checksums"])),
    "unknown-dtype": lambda e, f: e.__setitem__("dtype", "float128"),
    "dtype-not-str": lambda e, f: e.__setitem__("dtype", ["float32"]),
    "unlisted-object": lambda e, f: f.__setitem__("object", "other.bin"),
    "unsafe-object": lambda e, f: f.__setitem__("object", "../abc-shared-00000.bin"),
    "extra-field": lambda e, f: e.__setitem__("extra", 1),
    "missing-field": lambda e, f: f.pop("nbytes"),
    "local-differs": lambda e, f: f.__setitem__("local_shape", [1] * len(f["local_shape"])),
    "offsets-nonzero": lambda e, f: f.__setitem__("global_offsets", [1] * len(f["global_offsets"])),
    "offsets-float": lambda e, f: f.__setitem__("global_offsets", [0.0] * len(f["global_offsets"])),
    "nbytes": lambda e, f: f.__setitem__("nbytes", f["nbytes"] + 4),
    "past-object": lambda e, f: f.__setitem__("offset", 1 << 40),
    "two-fragments": lambda e, f: e.__setitem__("fragments", [f, dict(f)]),
    "alias": lambda e, f: e.update(type="alias"),
    "type-unhashable": lambda e, f: e.__setitem__("type", []),
    "name-not-str": lambda e, f: e.__setitem__("name", 3),
    "too-many-dims": lambda e, f: e.__setitem__("global_shape", [1] * 65),
    "huge-dim": lambda e, f: e.__setitem__("global_shape", [2**62 + 1]),
}


@pytest.mark.parametrize("mutation", [None, "duplicate-name", *_MUTATIONS])
@pytest.mark.parametrize("section", ["tensors", "rank"])
def test_the_column_check_accepts_and_refuses_exactly_what_the_entry_by_entry_parse_does(many, mutation, section):
    raw = json.loads(json.dumps(many))
    entries = raw["tensors"] if section == "tensors" else raw["ranks"][0]["tensors"]
    victim = entries[len(entries) // 2]
    if mutation == "duplicate-name":
        victim["name"] = entries[0]["name"]
    elif mutation is not None:
        _MUTATIONS[mutation](victim, victim["fragments"][0])
    text = json.dumps(raw)
    from lightning_snapshot.format import decode as manifest_module

    taken = []
    real_check = manifest_module.whole_tensor_columns
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(manifest_module, "whole_tensor_columns", lambda *a: taken.append(real_check(*a)) or taken[-1])
        got = _outcome(text)
    assert got == _entry_by_entry(text)
    if mutation is None:
        assert isinstance(got, Manifest)
        assert len(taken) == 2 and all(c is not None for c in taken)  # (both sections through the column check)
