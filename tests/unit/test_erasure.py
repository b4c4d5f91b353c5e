"""zfec erasure coding of objects: any k of k + m shares rebuild the object, padding stays small."""

from __future__ import annotations

import itertools
import os

import pytest

from lightning_snapshot.backends import erasure as ec
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


@pytest.mark.parametrize("k,m,message", [(0, 1, "k must be an integer >= 1"), (2, -1, "m must be an integer >= 0"),
                                         (200, 100, "at most 256"), ("4", 2, "k must be an integer")])
def test_bad_parameters(k, m, message):
    with pytest.raises(ConfigError, match=message):
        ec.check_params(k, m)
