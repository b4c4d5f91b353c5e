"""The backend conformance suite (``tests/backend_conformance.py``) run on every tier: local files, an object store
(moto's real S3 server on 127.0.0.1) and the RAM tier (its node store, in a temporary directory)."""

from __future__ import annotations

import itertools
import os
import uuid
from pathlib import Path

import pytest
from backend_conformance import BackendTests
from train import s3_options

from lightning_snapshot.backends import Backend, LocalTier, ObjectStoreTier, RamTier
from lightning_snapshot.errors import UnsafePathError


def _files_under(root: Path) -> list[str]:
    """Every file under ``root`` (relative, '/'-separated, hidden ones too), sorted; [] when it does not exist."""
    return sorted(
        os.path.relpath(os.path.join(base, name), root).replace(os.sep, "/")
        for base, _dirs, files in os.walk(root)
        for name in files
    )


class TestLocalTier(BackendTests):
    @pytest.fixture
    def new_backend(self, tmp_path):
        counter = itertools.count()
        return lambda **options: LocalTier(tmp_path / f"tier{next(counter)}", **options)

    def raw_names(self, backend):
        return _files_under(backend.root)


@pytest.fixture(scope="module")
def conformance_bucket(s3_server):
    s3_server.create_bucket("conformance")
    return "conformance"


class TestObjectStoreTier(BackendTests):
    #: a conditional create (If-None-Match: *): a committed manifest is never overwritten
    replaces_committed = False

    @pytest.fixture
    def new_backend(self, s3_server, conformance_bucket):
        # one bucket for the class, a fresh prefix per backend (creating buckets costs more than the tests)
        return lambda **options: ObjectStoreTier(
            f"s3://{conformance_bucket}/{uuid.uuid4().hex[:12]}",
            storage_options=s3_options(s3_server.endpoint),
            **options,
        )

    def raw_names(self, backend):
        backend.fs.invalidate_cache()
        found = backend.fs.find(backend.root, withdirs=False) if backend.fs.exists(backend.root) else []
        return sorted(name[len(backend.root) + 1 :] for name in found)


class TestRamTier(BackendTests):
    #: the node's store is a directory in memory: a commit replaces the manifest with a rename, like local files
    replaces_committed = True
    #: it reports no modification times (the base class's None): ``gc`` never removes its leftovers
    tells_modified = False
    missing_root_message = "no RAM tier named"

    @pytest.fixture
    def new_backend(self, tmp_path):
        # one node, no erasure coding: the tier writes the node's store itself (the agent only holds the memory and
        # flushes to durable tiers; erasure-coded objects need the other nodes: tests/test_ram.py)
        counter = itertools.count()
        return lambda **options: RamTier(name=f"tier{next(counter)}", shm_dir=str(tmp_path / "shm"), **options)

    def raw_names(self, backend):
        return _files_under(backend.node_dir / "store")


class TestMemoryObjectStoreTier(TestObjectStoreTier):
    """The object-store tier on fsspec's in-process ``memory://`` filesystem (no rename, no conditional put)."""

    #: fsspec's memory filesystem records no modification time: ``modified`` says None (cannot tell)
    tells_modified = False

    @pytest.fixture
    def new_backend(self):
        return lambda **options: ObjectStoreTier(f"memory://conformance-{uuid.uuid4().hex[:12]}/run", **options)


def test_the_default_exists_tells_an_object_from_a_prefix(tmp_path):
    class DefaultExists(LocalTier):  # a tier that keeps Backend.exists, as a new tier may
        exists = Backend.exists

    tier = DefaultExists(tmp_path)
    tier.write("p/sub/a.bin", [b"x"])
    assert tier.exists("p/sub/a.bin") and not tier.exists("p/sub") and not tier.exists("p/missing.bin")
    with pytest.raises(UnsafePathError):
        tier.exists("../p")
