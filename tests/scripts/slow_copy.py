"""``lightning-snapshot copy`` whose destination is slow to commit: once every data object is written it says so on
stderr (``DATA WRITTEN``) and sleeps before committing the manifest, so a test can SIGKILL it right there."""

from __future__ import annotations

import sys
import time

from lightning_snapshot.backends.local import LocalTier
from lightning_snapshot.backends.object_store import ObjectStoreTier
from lightning_snapshot.cli.main import main


def slow(commit):
    def commit_later(self, key, data):
        print(f"DATA WRITTEN, committing {key}", file=sys.stderr, flush=True)
        time.sleep(600)
        return commit(self, key, data)

    return commit_later


for cls in (LocalTier, ObjectStoreTier):
    cls.commit = slow(cls.commit)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
