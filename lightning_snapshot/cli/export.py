"""Consolidated export of a snapshot: safetensors (weights) or a torch file (the full training state).

Both stream: one tensor is read (and verified) at a time, so peak memory stays near the largest tensor, not the
whole model. The torch file is loadable with ``torch.load(path, weights_only=True)``.

Called by the CLI's ``export`` command (cli.py); it reads the snapshot through loader.py.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import struct
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from lightning_snapshot.backends.base import Backend
from lightning_snapshot.errors import ConfigError, SnapshotNotFoundError
from lightning_snapshot.format import tree as _tree
from lightning_snapshot.format.manifest import Manifest, TensorEntry, dtype_from_name
from lightning_snapshot.restore.loader import checkpoint_tree, open_snapshot, read_section
from lightning_snapshot.restore.progress import progress_bar
from lightning_snapshot.staging import tensor_bytes

__all__ = ["FORMATS", "export_snapshot"]

log = logging.getLogger(__name__)

FORMATS = ("safetensors", "torch")
_ST_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "uint16": "U16",
    "uint32": "U32",
    "uint64": "U64",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}


class _Progress:
    """Export progress in bytes: a ``tqdm`` bar on stderr when it is a terminal and ``enabled``; else silent."""

    def __init__(self, total_bytes: int, count: int, enabled: bool) -> None:
        self.total, self.count, self.enabled = total_bytes, count, enabled
        self.done_bytes = self.done = 0
        self.bar = progress_bar(total_bytes, "export", enabled=enabled)

    def step(self, nbytes: int) -> None:
        self.done += 1
        self.done_bytes += nbytes
        self.bar.update(nbytes)
        if self.done == self.count:
            self.bar.close()

    def close(self) -> None:
        self.bar.close()


@contextlib.contextmanager
def _replacing(out: Path) -> Iterator[Path]:
    """A temporary file next to ``out`` that atomically replaces ``out`` when the block succeeds and is removed when
    it fails (an error, Ctrl-C), so a failed export leaves nothing behind."""
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, out)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def _check_out(out: Path) -> None:
    """Refuse an output path that cannot be a file we write, before anything is read."""
    if out.is_dir():
        raise ConfigError(
            f"{str(out)!r} is a directory: give the path of the file to write, e.g. {str(out / 'model.safetensors')!r}"
        )
    if not out.parent.is_dir():
        raise ConfigError(
            f"cannot write {str(out)!r}: the directory {str(out.parent)!r} does not exist. Create it"
            " first or choose another path"
        )


def _nbytes(entry: TensorEntry) -> int:
    n = 1
    for d in entry.global_shape:
        n *= d
    return n * torch.empty((), dtype=dtype_from_name(entry.dtype)).element_size()


def _read_one(
    backend: Backend, manifest: Manifest, entry: TensorEntry, out: torch.Tensor | None = None
) -> torch.Tensor:
    """One tensor, read and verified (into ``out`` when given)."""
    targets = {entry.name: out} if out is not None else None
    return read_section(backend, manifest, [entry], {"$tensor": entry.name}, targets=targets)


def _weights(manifest: Manifest) -> list[tuple[str, TensorEntry]]:
    """(state_dict key, stored entry) for every model weight; tied weights appear under each of their keys."""
    entries = {t.name: t for t in manifest.tensors}
    tree = manifest.state.get("state_dict") if isinstance(manifest.state, dict) else None
    out = []
    for key, ref in (tree or {}).items() if isinstance(tree, dict) else []:
        if isinstance(ref, dict) and isinstance(ref.get("$tensor"), str) and ref["$tensor"] in entries:
            e = entries[ref["$tensor"]]
            out.append((key, entries[e.alias_of] if e.alias_of is not None else e))
    return sorted(out, key=lambda kv: kv[0])


def _export_safetensors(backend: Backend, manifest: Manifest, out: Path, progress: _Progress) -> None:
    weights = _weights(manifest)
    if not weights:
        raise SnapshotNotFoundError(f"step {manifest.step} holds no model weights (state_dict) to export")
    header: dict[str, Any] = {
        "__metadata__": {"format": "pt", "step": str(manifest.step), "exported_by": "lightning-snapshot"}
    }
    pos = 0
    for key, e in weights:
        if e.dtype not in _ST_DTYPES:
            raise ConfigError(
                f"tensor {e.name!r} has dtype {e.dtype}, which safetensors cannot store; export the"
                " torch format instead (--format torch)"
            )
        n = _nbytes(e)
        header[key] = {"dtype": _ST_DTYPES[e.dtype], "shape": list(e.global_shape), "data_offsets": [pos, pos + n]}
        pos += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with _replacing(out) as tmp, open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, e in weights:  # tied weights: stored once, written under each key
            t = _read_one(backend, manifest, e)
            f.write(tensor_bytes(t) if t.numel() else b"")
            progress.step(_nbytes(e))
            del t
        f.flush()
        os.fsync(f.fileno())


def _export_torch(backend: Backend, manifest: Manifest, out: Path, progress: _Progress) -> None:
    """The whole shared state as a torch file. Tensors live in file-backed memory while it is written, so the
    kernel can page them out: peak resident memory stays near the largest tensor."""
    with tempfile.TemporaryDirectory(prefix="lightning-snapshot-export-", dir=out.parent) as scratch:
        tensors: dict[str, torch.Tensor] = {}
        tree, entries = checkpoint_tree(manifest)
        for i, e in enumerate(t for t in entries if t.alias_of is None):
            n = _nbytes(e)
            dtype = dtype_from_name(e.dtype)
            if n:
                path = os.path.join(scratch, f"{i}.bin")
                with open(path, "wb") as f:
                    f.truncate(n)
                buf = torch.from_file(path, shared=True, size=n, dtype=torch.uint8)
                tensors[e.name] = _read_one(backend, manifest, e, buf.view(dtype).view(e.global_shape))
            else:
                tensors[e.name] = torch.empty(e.global_shape, dtype=dtype)
            progress.step(n)
        for e in entries:
            if e.alias_of is not None:
                tensors[e.name] = tensors[e.alias_of]
        state = _tree.decode(tree, tensors)
        with _replacing(out) as tmp:
            torch.save(state, tmp)


def export_snapshot(
    source: str | os.PathLike[str] | Backend,
    out: str | os.PathLike[str],
    *,
    fmt: str = "safetensors",
    step: int | None = None,
    progress: bool = True,
) -> Path:
    """Export one snapshot to a single file, streaming.

    Args:
        source: a tier URL/path (newest step), a ``step-*`` directory, or a backend.
        out: the file to write (replaced atomically; its directory must exist). Nothing is left behind when the
            export fails.
        fmt: ``"safetensors"`` (model weights, names as in the LightningModule's ``state_dict``) or ``"torch"`` (the
            full training state, loadable with ``torch.load(out, weights_only=True)``).
        step: the step; default the newest committed one (or the one ``source`` names).
        progress: show a progress bar on stderr (only when stderr is a terminal).

    Raises:
        ConfigError: unknown format, ``out`` is a directory or its directory does not exist, or a dtype
            safetensors cannot store.
        SnapshotNotFoundError, ManifestError, ChecksumError: as when loading.
    """
    if fmt not in FORMATS:
        raise ConfigError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    out = Path(os.path.expanduser(os.fspath(out))).absolute()
    _check_out(out)
    backend, manifest = open_snapshot(source, step)
    step = manifest.step
    if fmt == "torch":
        chosen = [t for t in manifest.tensors if t.alias_of is None]
    else:
        chosen = [e for _, e in _weights(manifest)]
    bar = _Progress(sum(_nbytes(t) for t in chosen), len(chosen), progress)
    exporter: Callable[[Backend, Manifest, Path, _Progress], None] = (
        _export_safetensors if fmt == "safetensors" else _export_torch
    )
    try:
        exporter(backend, manifest, out, bar)
    finally:
        bar.close()
    log.info("lightning-snapshot: exported step %d of %s to %s (%s)", step, backend.url, out, fmt)
    return out
