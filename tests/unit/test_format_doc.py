"""docs/format.md is enough to write a reader: a snapshot written by the callback is read here with json, numpy and
xxhash only, following the page step by step (no lightning_snapshot import for the reading), and every tensor comes
out bitwise equal to the trained model and to the library's own loader.

One in-process training of a tiny model (float32 weights, a bfloat16, an int64 and a 0-dim buffer, tied weights,
AdamW) is shared by all tests of this file.
"""

from __future__ import annotations

import base64
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import xxhash

# ------------------------------------------------------------------ the reader: only what docs/format.md says

STEP_DIR = re.compile(r"^step-(\d{12})$")
KEY_PART = re.compile(r"^[A-Za-z0-9._-]+$")
HEX16 = re.compile(r"^[0-9a-f]{16}$")
NUMPY_DTYPES = {  # name -> (numpy dtype of the stored bytes, little-endian)
    "float64": "<f8",
    "float32": "<f4",
    "float16": "<f2",
    "bfloat16": "<u2",
    "complex64": "<c8",
    "complex128": "<c16",
    "int64": "<i8",
    "int32": "<i4",
    "int16": "<i2",
    "int8": "i1",
    "uint8": "u1",
    "uint16": "<u2",
    "uint32": "<u4",
    "uint64": "<u8",
    "bool": "?",
}


class FormatError(Exception):
    pass


def newest_step_dir(root: Path) -> Path:
    """The newest committed step directory (a step-* directory holding a manifest)."""
    steps = sorted(
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := STEP_DIR.match(p.name)) and (p / "manifest.json").is_file()
    )
    if not steps:
        raise FormatError(f"no committed snapshot in {root}")
    return steps[-1][1]


def read_manifest(step_dir: Path) -> dict:
    def no_constants(name):
        raise FormatError(f"non-standard JSON constant {name}")

    def finite(text):
        if not math.isfinite(value := float(text)):
            raise FormatError(f"number {text} is past the range of a double")
        return value

    m = json.loads((step_dir / "manifest.json").read_text("utf-8"), parse_constant=no_constants, parse_float=finite)
    if m["format_version"] != 1:
        raise FormatError(f"format_version {m['format_version']} is not 1")
    if m["checksum"] != "xxh3_64":
        raise FormatError(m["checksum"])
    alignment = m["alignment"]
    if alignment < 1 or alignment & (alignment - 1):
        raise FormatError("alignment is not a power of two")
    return m


def read_tensor(step_dir: Path, manifest: dict, entries: list[dict], name: str) -> np.ndarray:
    """One tensor of a section (aliases followed), assembled from its fragments, every chunk verified."""
    by_name = {e["name"]: e for e in entries}
    entry = by_name[name]
    if entry["type"] == "alias":
        target = by_name[entry["alias_of"]]
        if target["type"] != "tensor" or (target["dtype"], target["global_shape"]) != (
            entry["dtype"],
            entry["global_shape"],
        ):
            raise FormatError(f"bad alias {name}")
        entry = target
    dtype = np.dtype(NUMPY_DTYPES[entry["dtype"]])
    sizes = {o["key"]: o["nbytes"] for o in manifest["objects"]}
    out = np.zeros(entry["global_shape"], dtype=dtype)
    covered = 0
    cb = manifest["chunk_bytes"]
    for frag in entry["fragments"]:
        key = frag["object"]
        if key not in sizes or not all(KEY_PART.match(p) and p not in (".", "..") for p in key.split("/")):
            raise FormatError(f"bad object key {key!r}")
        offset, nbytes, local = frag["offset"], frag["nbytes"], frag["local_shape"]
        if offset % manifest["alignment"] or offset + nbytes > sizes[key]:
            raise FormatError("fragment outside its object or unaligned")
        if nbytes != math.prod(local) * dtype.itemsize:
            raise FormatError("nbytes does not match local_shape")
        with open(step_dir / key, "rb") as f:
            f.seek(offset)
            data = f.read(nbytes)
        chunks = [data[i : i + cb] for i in range(0, nbytes, cb)] or [b""]
        sums = frag["checksums"]
        if len(sums) != max(1, -(-nbytes // cb)) or not all(HEX16.match(s) for s in sums):
            raise FormatError("wrong number of checksums")
        for c, (chunk, want) in enumerate(zip(chunks, sums, strict=True)):
            if xxhash.xxh3_64_hexdigest(chunk) != want:
                raise FormatError(f"checksum mismatch in {name}, chunk {c}")
        box = tuple(slice(o, o + n) for o, n in zip(frag["global_offsets"], local, strict=True))
        out[box] = np.frombuffer(data, dtype=dtype).reshape(local)
        covered += math.prod(local)
    if covered != math.prod(entry["global_shape"]):
        raise FormatError(f"fragments of {name} do not cover the tensor")
    return out


def decode(tree, read):
    """The state tree: tags of the table in docs/format.md; ``read(name)`` gives a tensor of the section."""
    if isinstance(tree, list):
        return [decode(v, read) for v in tree]
    if not isinstance(tree, dict):
        return tree
    tags = [k for k in tree if k.startswith("$")]
    if not tags:
        return {k: decode(v, read) for k, v in tree.items()}
    if len(tree) != 1:
        raise FormatError(f"tagged object with extra keys: {sorted(tree)}")
    tag, val = next(iter(tree.items()))
    if tag == "$tensor":
        return read(val)
    if tag == "$tuple":
        return tuple(decode(v, read) for v in val)
    if tag == "$dict":
        return {decode(k, read): decode(v, read) for k, v in val}
    if tag == "$float":
        return float(val)
    if tag == "$ndarray":
        return read(val[0]).astype(val[1])
    if tag in ("$dtype", "$device"):
        return val
    if tag == "$bytes":
        return base64.b64decode(val, validate=True)
    raise FormatError(f"unknown tag {tag}")


# ------------------------------------------------------------------ one training shared by the tests


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_snapshot import SnapshotCallback
    from lightning_snapshot.backends import LocalTier

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.enc = nn.Linear(4, 4)
            self.dec = nn.Linear(4, 4)
            self.dec.weight = self.enc.weight  # tied
            self.register_buffer("bf16", torch.linspace(-2, 2, 6, dtype=torch.bfloat16).reshape(2, 3))
            self.register_buffer("count", torch.arange(5, dtype=torch.int64) * -3)
            self.register_buffer("scale", torch.tensor(0.75))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.dec(torch.relu(self.enc(x))) * self.scale, y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    root = tmp_path_factory.mktemp("format") / "snap"
    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(24, 4, generator=g), torch.randn(24, 4, generator=g))
    model = Tiny()
    trainer = L.Trainer(
        max_steps=4,
        callbacks=[SnapshotCallback(LocalTier(str(root), every_n_train_steps=2))],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=True,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, DataLoader(data, batch_size=8, shuffle=True))
    return root, model, trainer.optimizers[0]


def _as_numpy(t):
    import torch

    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view("<u2")
    return t.numpy()


def _bitwise_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype.itemsize == b.dtype.itemsize and a.tobytes() == b.tobytes()


def test_the_page_is_enough_to_read_every_tensor_bitwise(trained):
    from lightning_snapshot import load_snapshot

    root, model, optimizer = trained
    step_dir = newest_step_dir(root)
    assert step_dir.name == "step-000000000004"
    manifest = read_manifest(step_dir)
    state = decode(manifest["state"], lambda n: read_tensor(step_dir, manifest, manifest["tensors"], n))

    # the weights and buffers are the trained model's, bit for bit; the tied weight is one tensor under both names
    aliases = {e["name"]: e["alias_of"] for e in manifest["tensors"] if e["type"] == "alias"}
    assert aliases == {"state_dict/dec.weight": "state_dict/enc.weight"}
    live = model.state_dict()
    assert set(state["state_dict"]) == set(live)
    for key, value in live.items():
        assert _bitwise_equal(state["state_dict"][key], _as_numpy(value)), key
    assert state["state_dict"]["bf16"].dtype == np.dtype("<u2")  # bfloat16 read as its 16 bits
    bf16 = (state["state_dict"]["bf16"].astype(np.uint32) << 16).view(np.float32)
    assert np.array_equal(bf16, model.bf16.float().numpy())
    # the optimizer state: int-keyed ($dict), tuples ($tuple), AdamW's moments bitwise
    opt = state["optimizer_states"][0]
    assert opt["param_groups"][0]["betas"] == (0.9, 0.999)
    live_opt = optimizer.state_dict()
    assert set(opt["state"]) == set(live_opt["state"])
    for index, slots in live_opt["state"].items():
        for slot, value in slots.items():
            assert _bitwise_equal(opt["state"][index][slot], _as_numpy(value)), (index, slot)
    assert state["global_step"] == 4

    # every tensor of every section equals what the library's own loader reads
    ckpt = load_snapshot(str(root), rank=0)
    for key, value in ckpt["state_dict"].items():
        assert _bitwise_equal(state["state_dict"][key], _as_numpy(value)), key
    section = manifest["ranks"][0]
    rank_state = decode(section["state"], lambda n: read_tensor(step_dir, manifest, section["tensors"], n))
    torch_rng = rank_state["rng"]["torch"]
    assert _bitwise_equal(torch_rng, _as_numpy(ckpt["rank_state"]["rng"]["torch"]))
    numpy_rng = rank_state["rng"]["numpy"]  # ("MT19937", keys as uint32 via $ndarray, pos, ...)
    assert numpy_rng[0] == "MT19937"
    assert np.array_equal(numpy_rng[1], ckpt["rank_state"]["rng"]["numpy"][1])
    assert numpy_rng[1].dtype == np.uint32
    # health: recorded, and finite for this run
    assert manifest["health"] == {"state_dict": None, "optimizer_states/0": None}


def test_a_flipped_byte_is_caught_by_the_pages_checksum_rule(trained, tmp_path):
    import shutil

    root, _, _ = trained
    copy = tmp_path / "snap"
    shutil.copytree(root, copy)
    step_dir = newest_step_dir(copy)
    manifest = read_manifest(step_dir)
    entry = next(e for e in manifest["tensors"] if e["name"] == "state_dict/enc.bias")
    frag = entry["fragments"][0]
    path = step_dir / frag["object"]
    data = bytearray(path.read_bytes())
    data[frag["offset"] + 1] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(FormatError, match=r"checksum mismatch in state_dict/enc\.bias"):
        read_tensor(step_dir, manifest, manifest["tensors"], "state_dict/enc.bias")


def test_a_step_without_a_manifest_is_not_a_snapshot(trained, tmp_path):
    import shutil

    root, _, _ = trained
    copy = tmp_path / "snap"
    shutil.copytree(root, copy)
    newest = newest_step_dir(copy)
    (newest / "manifest.json").unlink()  # as a write killed before its commit leaves it
    assert newest_step_dir(copy).name < newest.name
