"""zfec erasure coding of objects: any k of k + m shares rebuild the object, padding stays small."""

from __future__ import annotations

import itertools
import os

import pytest

from lightning_snapshot.backends.ram import erasure as ec
from lightning_snapshot.errors import ChecksumError, ConfigError


@pytest.mark.parametrize("nbytes", [0, 1, 63, 1000, (2 << 20) + 100, (3 << 20) + 17])
@pytest.mark.parametrize("k,m", [(1, 0), (2, 1), (4, 2), (3, 3)])
def test_any_k_shares_rebuild_the_object(nbytes, k, m):
    data = os.urandom(nbytes)
    lay = ec.layout(nbytes, k, m, block=1 << 20)
    assert lay.share_nbytes * k - nbytes < 64 * k * max(1, lay.stripes)  # (k + m) / k memory, not more
    shares = [memoryview(bytearray(lay.share_nbytes)) for _ in range(k + m)]
    ec.encode(memoryview(data), lay, shares, threads=2)
    for subset in itertools.combinations(range(k + m), k):
        out = bytearray(nbytes)
        ec.decode({i: shares[i] for i in subset}, lay, memoryview(out), threads=2)
        assert bytes(out) == data, subset


def test_fewer_than_k_shares_is_an_error_naming_the_count():
    lay = ec.layout(1000, 4, 2)
    shares = [memoryview(bytearray(lay.share_nbytes)) for _ in range(6)]
    ec.encode(memoryview(os.urandom(1000)), lay, shares)
    with pytest.raises(ChecksumError, match="3 of the 4 shares"):
        ec.decode({0: shares[0], 1: shares[1], 5: shares[5]}, lay, memoryview(bytearray(1000)))


@pytest.mark.parametrize(
    "k,m,message",
    [
        (0, 1, "k must be an integer >= 1"),
        (2, -1, "m must be an integer >= 0"),
        (200, 100, "at most 256"),
        ("4", 2, "k must be an integer"),
    ],
)
def test_bad_parameters(k, m, message):
    with pytest.raises(ConfigError, match=message):
        ec.check_params(k, m)


def test_zfec_c_functions_are_bound():
    assert ec._NATIVE is not None, "zfec's fec_encode/fec_decode could not be loaded: the slower Python API is used"


@pytest.mark.parametrize("nbytes", [1, 1000, (3 << 20) + 17])
@pytest.mark.parametrize("k,m", [(1, 0), (2, 1), (4, 2), (3, 3)])
def test_c_functions_and_python_api_give_the_same_shares(monkeypatch, nbytes, k, m):
    data = os.urandom(nbytes)
    lay = ec.layout(nbytes, k, m, block=1 << 20)
    native = [memoryview(bytearray(lay.share_nbytes)) for _ in range(k + m)]
    ec.encode(memoryview(data), lay, native, threads=2)
    monkeypatch.setattr(ec, "_NATIVE", None)
    python = [memoryview(bytearray(lay.share_nbytes)) for _ in range(k + m)]
    ec.encode(memoryview(data), lay, python, threads=2)
    assert [bytes(s) for s in native] == [bytes(s) for s in python]
    for subset in itertools.combinations(range(k + m), k):  # the Python API rebuilds from the C function's shares
        out = bytearray(nbytes)
        ec.decode({i: native[i] for i in subset}, lay, memoryview(out), threads=2)
        assert bytes(out) == data, subset


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("k,m", [(2, 1), (4, 2), (3, 3)])
def test_rebuild_gives_back_the_lost_data_shares(monkeypatch, native, k, m):
    nbytes = (3 << 20) + 17
    data = os.urandom(nbytes)
    lay = ec.layout(nbytes, k, m, block=1 << 20)
    shares = [memoryview(bytearray(lay.share_nbytes)) for _ in range(k + m)]
    ec.encode(memoryview(data), lay, shares, threads=2)
    if not native:
        monkeypatch.setattr(ec, "_NATIVE", None)
    for subset in itertools.combinations(range(k + m), k):
        lost = [i for i in range(k) if i not in subset]
        out = {i: memoryview(bytearray(lay.share_nbytes)) for i in lost}
        ec.rebuild({i: shares[i] for i in subset}, lay, out, threads=2)
        assert all(bytes(out[i]) == bytes(shares[i]) for i in lost), subset
    with pytest.raises(ValueError, match="exactly the lost data shares"):
        ec.rebuild({i: shares[i] for i in range(1, k + 1)}, lay, {}, threads=2)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("nbytes", [65, 1000, (3 << 20) + 17])
def test_data_shares_are_contiguous_slices_of_the_object_and_need_no_copy(monkeypatch, native, nbytes):
    """Data share i is the object's bytes [i * S, (i + 1) * S), zeros past its end; the parity computed from the
    object where it lies (data shares not given) is the parity computed from copied data shares."""
    if not native:
        monkeypatch.setattr(ec, "_NATIVE", None)
    k, m = 4, 2
    data = os.urandom(nbytes)
    lay = ec.layout(nbytes, k, m, block=1 << 20)
    full = [memoryview(bytearray(lay.share_nbytes)) for _ in range(k + m)]
    ec.encode(memoryview(data), lay, full, threads=2)
    size = lay.share_nbytes
    for i in range(k):
        part = data[i * size : (i + 1) * size]
        assert bytes(full[i]) == part + bytes(size - len(part)), i
    parity = [memoryview(bytearray(lay.share_nbytes)) for _ in range(m)]
    ec.encode(memoryview(data), lay, [None] * k + parity, threads=2)
    assert [bytes(p) for p in parity] == [bytes(p) for p in full[k:]]
    with pytest.raises(ValueError, match="do not match the share layout"):
        ec.encode(memoryview(data), lay, [None] * (k + m), threads=2)  # parity shares must be given
