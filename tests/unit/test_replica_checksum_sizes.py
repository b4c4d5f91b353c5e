"""The replica checksum at the sizes of a real model's tensors (megabytes), where every tensor of a CPU over
``SMALL_BYTES`` (64 KiB), and every tensor of a GPU over ``BATCH_BYTES / 8`` elements (4M), is checksummed by
``replicas._checksum`` (64-bit words, then the bytes past the last whole word), the smaller ones in batches.

For every dtype the check compares (floating point of 8, 4, 2 and 1 bytes, signed and unsigned integers, bool,
complex) and lengths whose byte size leaves every remainder modulo 8 that the dtype's width allows: a change of one
ulp (``torch.nextafter``; the next bit pattern for float8, +1 for integers, the other value for bool) at the first,
a middle and the last value, at the last value of the last whole 64-bit word and at the first value past it changes
the tensor's checksum; and the checksum is the one its definition gives, computed here apart from the library with
numpy (the wrapping sum of the bytes read as little-endian 64-bit words, plus the bytes past the last whole word read
as integers of the dtype's width; a batched tensor: the wrapping sum of its values read as integers of their width).
The same on a CUDA device under ``@pytest.mark.gpu``. The end-to-end check, under DDP with parameters of a megabyte,
is in tests/test_replicas.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lightning_snapshot.fit import replicas
from lightning_snapshot.fit.replicas import BATCH_BYTES, SMALL_BYTES, checksums

MB = 1 << 20

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")

#: floating point dtypes that ``torch.nextafter`` takes
NEXTAFTER = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
#: the float8 dtypes of this torch (one ulp: the next bit pattern)
FLOAT8 = tuple(
    getattr(torch, n)
    for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, n)
)
INTS = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8) + tuple(
    getattr(torch, n) for n in ("uint16", "uint32", "uint64") if hasattr(torch, n)
)
COMPLEX = (torch.complex128, torch.complex64, torch.complex32)
DTYPES = NEXTAFTER + FLOAT8 + INTS + (torch.bool,) + COMPLEX

_SIGNED = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _lengths(dtype: torch.dtype, base: int = MB) -> list[int]:
    """Element counts of about ``base`` bytes whose byte sizes leave every remainder modulo 8 a multiple of the
    width allows (0 only, for 8-byte elements)."""
    width = torch.empty(0, dtype=dtype).element_size()
    return [base // width + extra for extra in range(max(1, 8 // width))]


def _make(dtype: torch.dtype, n: int, seed: int = 0) -> torch.Tensor:
    """``n`` values of ``dtype`` as a model holds them: normal floats, integers of every bit pattern, both bools."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if dtype.is_complex:
        wide = torch.complex128 if dtype == torch.complex128 else torch.complex64
        return (torch.randn(n, dtype=wide, generator=g) * 10).to(dtype)
    if dtype in NEXTAFTER:
        return (torch.randn(n, dtype=torch.float64, generator=g) * 10).to(dtype)
    width = torch.empty(0, dtype=dtype).element_size()
    bits = torch.randint(-(2 ** (8 * width - 1)), 2 ** (8 * width - 1) - 1, (n,), dtype=_SIGNED[width], generator=g)
    return bits.view(dtype)


def _scalars(t: torch.Tensor) -> torch.Tensor:
    """``t`` flattened to its scalars (a view)."""
    return (torch.view_as_real(t) if t.is_complex() else t).reshape(-1)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s scalars as signed integers of their width (a view)."""
    s = _scalars(t)
    return (s.view(torch.uint8) if s.dtype == torch.bool else s).view(_SIGNED[s.element_size()])


def _one_ulp(t: torch.Tensor, index: int) -> torch.Tensor:
    """A copy of ``t`` with its scalar ``index`` (of :func:`_scalars`) moved by one ulp."""
    out = t.clone()
    s = _scalars(out)
    if s.dtype in NEXTAFTER:
        s[index] = torch.nextafter(s[index], torch.tensor(math.inf, dtype=s.dtype, device=s.device))
    elif s.dtype == torch.bool:
        s[index] = ~s[index]
    else:  # float8 (the next bit pattern) and integers (+1, wrapping)
        _bits(out)[index] += 1
    assert not torch.equal(_bits(out), _bits(t)), (t.dtype, index)
    return out


def _wrap(value: int) -> int:
    return (value + 2**63) % 2**64 - 2**63


def _reference(t: torch.Tensor) -> int:
    """The checksum :func:`~lightning_snapshot.fit.replicas.checksums` gives ``t`` by its definition, computed with numpy
    from ``t``'s bytes: over ``SMALL_BYTES`` on a CPU, or ``BATCH_BYTES / 8`` scalars on another device, the wrapping
    sum of the little-endian 64-bit words plus the bytes past the last whole word as integers of the scalar's width;
    else the wrapping sum of the scalars as integers of their width."""
    bits = _bits(t.detach().cpu().contiguous()).numpy()
    width = bits.itemsize
    raw = bits.tobytes()
    whole = len(raw) // 8 * 8
    words = len(raw) > SMALL_BYTES if t.device.type == "cpu" else bits.size * 8 > BATCH_BYTES
    if not words:
        return _wrap(int(bits.astype(np.int64).sum(dtype=np.int64)))
    head = int(np.frombuffer(raw[:whole], dtype="<i8").sum(dtype=np.int64))
    tail = int(np.frombuffer(raw[whole:], dtype=f"<i{width}").astype(np.int64).sum(dtype=np.int64))
    return _wrap(head + tail)


def _positions(t: torch.Tensor) -> dict[str, int]:
    """The scalars a change is tried at: the first, a middle one, the last; the last of the last whole 64-bit word
    and, when bytes are left after it, the first past it."""
    n = _scalars(t).numel()
    width = _scalars(t).element_size()
    whole = n * width // 8 * 8 // width  # scalars in whole 64-bit words
    out = {"first": 0, "middle": n // 2, "last": n - 1, "last of the words": whole - 1}
    if whole < n:
        out["first past the words"] = whole
    return out


def _assert_every_change_is_seen(t: torch.Tensor) -> None:
    """``t``'s checksum is its reference; a change of one ulp at each of :func:`_positions` changes it (to that
    change's reference), alone in a list and among other tensors."""
    [base] = checksums([t])
    assert base == _reference(t), (t.dtype, t.numel())
    for where, index in _positions(t).items():
        changed = _one_ulp(t, index)
        [got] = checksums([changed])
        assert got != base, f"{t.dtype}, {t.numel()} elements: one ulp at the {where} value (scalar {index})"
        assert got == _reference(changed), (t.dtype, t.numel(), where)


def _id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_one_ulp_anywhere_in_a_megabyte_tensor_changes_its_checksum(dtype):
    """About 1 MiB of each dtype, at every byte remainder modulo 8 its width allows (the words' path on a CPU)."""
    for n in _lengths(dtype):
        t = _make(dtype, n, seed=n)
        assert t.numel() * t.element_size() > SMALL_BYTES
        _assert_every_change_is_seen(t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8], ids=_id)
def test_one_ulp_in_a_tensor_of_tens_of_megabytes_changes_its_checksum(dtype):
    """A tensor the size of a large model's embedding (about 24 MiB; one byte past whole words where the width
    allows)."""
    width = torch.empty(0, dtype=dtype).element_size()
    t = _make(dtype, 24 * MB // width + (1 if width < 8 else 0))
    _assert_every_change_is_seen(t)


def test_a_view_at_an_odd_offset_and_a_strided_view_checksum_as_their_values():
    """A megabyte view that starts inside a 64-bit word, and a transposed one, have the checksum of the same values
    contiguous and aligned, and one ulp at their last value changes it."""
    base = _make(torch.float32, MB // 4 + 3)
    view = base[1:]
    assert view.data_ptr() % 8
    assert checksums([view]) == checksums([view.clone()]) == [_reference(view)]
    assert checksums([_one_ulp(view.clone(), view.numel() - 1)]) != checksums([view])
    m = _make(torch.float16, 1023 * 515).view(1023, 515)
    assert checksums([m.t()]) == checksums([m.t().contiguous()]) == [_reference(m.t())]
    assert checksums([_one_ulp(m.t().contiguous(), m.numel() - 1)]) != checksums([m.t()])


@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_one_ulp_anywhere_in_a_batched_tensor_changes_its_checksum_alone(dtype):
    """On a CPU, tensors of at most ``SMALL_BYTES`` (64 KiB) are checksummed in batches: tensors of each dtype up to
    that size, at every byte remainder modulo 8 its width allows, checksummed in one call, each get their reference
    checksum, and one ulp at any of :func:`_positions` of one of them changes its checksum alone."""
    width = torch.empty(0, dtype=dtype).element_size()
    tensors = [_make(dtype, SMALL_BYTES // width - extra, seed=extra) for extra in range(max(1, 8 // width))]
    own = checksums(tensors)
    assert own == [_reference(t) for t in tensors]
    for k, t in enumerate(tensors):
        for where, index in _positions(t).items():
            changed = checksums(tensors[:k] + [_one_ulp(t, index)] + tensors[k + 1 :])
            assert [i for i, (a, b) in enumerate(zip(own, changed, strict=True)) if a != b] == [k], (k, where)


def test_tensors_either_side_of_small_bytes_each_get_their_own_checksum():
    """On a CPU, tensors of at most ``SMALL_BYTES`` are checksummed in batches (several: their running sums exceed
    ``BATCH_BYTES``) and larger ones alone, in one call: each gets its own reference checksum, and one ulp at the
    last value of any one of them changes that tensor's checksum alone."""
    tensors = []
    for k in range(80):  # 72 x 64 KiB of int8 or less: about 72 x 512 KiB of running sum, over BATCH_BYTES (32 MiB)
        dtype = torch.int8 if k % 10 else (torch.float32, torch.bfloat16, torch.bool, torch.complex64)[k // 10 % 4]
        width = _make(dtype, 1).element_size()
        n = SMALL_BYTES // width - (k % 3)  # 64 KiB (the largest batched), or a value or two less
        tensors.append(_make(dtype, n, seed=k))
    tensors += [_make(torch.int8, SMALL_BYTES + 1, seed=100), _make(torch.float32, SMALL_BYTES // 4 + 1, seed=101)]
    assert sum(t.numel() * 8 for t in tensors if t.dtype == torch.int8) > BATCH_BYTES
    own = checksums(tensors)
    assert own == [_reference(t) for t in tensors]
    for k in (0, 1, 10, 41, 69, 79, 80, 81):
        t = tensors[k]
        changed = checksums(tensors[:k] + [_one_ulp(t, _scalars(t).numel() - 1)] + tensors[k + 1 :])
        assert [i for i, (a, b) in enumerate(zip(own, changed, strict=True)) if a != b] == [k], k


def test_the_words_path_is_the_one_taken_over_small_bytes():
    """The tensors above go through ``_checksum`` (so a mutation of it is seen here), the small ones not."""
    calls = []
    real = replicas._checksum

    def spy(t):
        calls.append(t.numel())
        return real(t)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(replicas, "_checksum", spy)
        checksums([_make(torch.int8, SMALL_BYTES), _make(torch.int8, SMALL_BYTES + 1)])
    assert calls == [SMALL_BYTES + 1]


# ------------------------------------------------------------------------------------------------ CUDA
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_on_cuda_one_ulp_anywhere_changes_the_checksum_of_large_and_batched_tensors(dtype):
    """On a GPU, tensors of more than 4M scalars (``BATCH_BYTES / 8``) take the words' path, smaller ones are
    batched: either way each checksum is its reference and one ulp anywhere changes it (the changes are made on the
    CPU and copied to the device)."""
    limit = BATCH_BYTES // 8
    scalars_per = 2 if dtype.is_complex else 1
    for n in (limit // scalars_per + 1, limit // scalars_per + 3, MB // 2 + 1):
        cpu = _make(dtype, n, seed=n)
        t = cpu.to("cuda")
        assert torch.equal(_bits(t).cpu(), _bits(cpu))
        [base] = checksums([t])
        assert base == _reference(t), (dtype, n)
        for where, index in _positions(cpu).items():
            changed = _one_ulp(cpu, index).to("cuda")
            [got] = checksums([changed])
            assert got != base, f"{dtype}, {n} elements on cuda: one ulp at the {where} value"
            assert got == _reference(changed), (dtype, n, where)
