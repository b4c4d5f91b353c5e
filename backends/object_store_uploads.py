"""The object-store tier's writes: uploads (concurrent multipart ones read straight from the staging buffer), the
manifest's conditional create (the commit rule), and the multipart uploads a crashed writer left
(:class:`Uploads`, a part that :class:`~lightning_snapshot.backends.object_store.ObjectStoreTier` holds, its
``uploads``, writing through its :class:`~lightning_snapshot.backends.object_store_access.StoreAccess`).
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Iterable
from typing import Any

from lightning_snapshot.backends.object_store_access import StoreAccess, unix_time
from lightning_snapshot.errors import SnapshotWriteError

__all__ = ["Uploads"]

log = logging.getLogger(__name__)


class _Parts:
    """A buffer that s3fs can slice into upload parts without a whole-object copy.

    Each slice is copied into a fresh ``bytearray`` with ``memmove``, which releases the GIL, so uploading never
    holds the training thread up for the length of a part copy.
    """

    def __init__(self, view: memoryview) -> None:
        self.view = view
        import numpy as np

        self.address = int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if view.nbytes else None

    def __len__(self) -> int:
        return self.view.nbytes

    def __getitem__(self, item: slice) -> bytes | bytearray:
        start, stop, _ = item.indices(self.view.nbytes)
        if self.address is None or stop <= start:
            return bytes(self.view[item])
        out = bytearray(stop - start)
        ctypes.memmove((ctypes.c_char * len(out)).from_buffer(out), self.address + start, len(out))
        return out


class Uploads:
    """Writes and uploads into the store :attr:`access` reaches.

    Args:
        access: the store.
        part_size: multipart upload part size in bytes.
        max_concurrency: parts uploaded at once.
    """

    def __init__(self, access: StoreAccess, part_size: int, max_concurrency: int) -> None:
        self.access = access
        #: multipart upload part size in bytes
        self.part_size = part_size
        #: parts uploaded at once
        self.max_concurrency = max_concurrency

    # ------------------------------------------------------------------------------------------- bytes
    def write(self, key: str, buffers: Iterable[bytes | bytearray | memoryview]) -> int:
        views = [memoryview(b).cast("B") for b in buffers]
        view = views[0] if len(views) == 1 else memoryview(b"".join(views))
        path = self.access.path(key)
        try:
            fs = self.access.fs  # (first: it sets pipe_params)
            if "chunksize" in self.access.pipe_params and view.nbytes >= 2 * self.part_size:
                fs.pipe_file(path, _Parts(view), chunksize=self.part_size, max_concurrency=self.max_concurrency)
            else:
                fs.pipe_file(path, bytes(view))
        except Exception as e:  # any client error is a failed write, with credentials redacted
            raise self.access.error("uploading", key, e) from e
        return view.nbytes

    def commit(self, key: str, data: bytes) -> None:
        """Create ``key`` with a conditional put; a committed object is never overwritten. Committing the very bytes
        it already holds succeeds (a retried request whose first attempt landed).

        Raises:
            SnapshotWriteError: ``key`` is already committed with other bytes, or the put failed.
        """
        path = self.access.path(key)
        try:
            fs = self.access.fs  # (first: it sets pipe_params)
            if "mode" in self.access.pipe_params:  # conditional create: never overwrite a committed manifest
                fs.pipe_file(path, bytes(data), mode="create")
            else:
                if fs.exists(path):
                    raise FileExistsError(path)
                fs.pipe_file(path, bytes(data))
            return
        except FileExistsError:
            pass
        except Exception as e:
            if "PreconditionFailed" not in str(e) and "412" not in str(e):
                raise self.access.error("committing", key, e) from e
        if self.access.read(key) != bytes(data):
            raise SnapshotWriteError(
                f"{key!r} is already committed in the {self.access.scheme} tier {self.access.url!r};"
                " a committed snapshot is never overwritten"
            )

    def incomplete_uploads(self) -> list[dict[str, Any]]:
        """Multipart uploads under the tier root that were started and neither completed nor aborted (S3 only;
        empty for other stores), each ``{"key": key relative to the root, "upload_id": ..., "modified": Unix time
        of its newest part, or of its start when it has none}``."""
        call = getattr(self.access.fs, "call_s3", None)
        if call is None:
            return []
        bucket, _, prefix = self.access.root.partition("/")
        prefix = f"{prefix}/" if prefix else ""
        uploads: list[dict[str, Any]] = []
        markers: dict[str, str] = {}
        while True:
            listing = call("list_multipart_uploads", Bucket=bucket, Prefix=prefix, **markers)
            for upload in listing.get("Uploads", []):
                modified = unix_time(upload.get("Initiated")) or 0.0
                parts = call("list_parts", Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
                for part in parts.get("Parts", []):
                    modified = max(modified, unix_time(part.get("LastModified")) or 0.0)
                uploads.append(
                    {"key": upload["Key"][len(prefix) :], "upload_id": upload["UploadId"], "modified": modified}
                )
            if not listing.get("IsTruncated"):
                return uploads
            markers = {"KeyMarker": listing["NextKeyMarker"], "UploadIdMarker": listing["NextUploadIdMarker"]}

    def abort_upload(self, upload: dict[str, Any]) -> None:
        """Abort one upload of :meth:`incomplete_uploads` (its parts are freed; an upload still running fails)."""
        bucket, _, prefix = self.access.root.partition("/")
        key = f"{prefix}/{upload['key']}" if prefix else upload["key"]
        try:
            self.access.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload["upload_id"])
        except Exception as e:  # translated at the boundary
            raise self.access.error("aborting the upload of", upload["key"], e) from e

    def abort_incomplete_uploads(self, older_than: float | None = None) -> int:
        """Abort multipart uploads left under the tier root by a crashed writer (S3 only); returns how many.

        Args:
            older_than: only those whose newest part is at least this many seconds old (None: all of them).
        """
        aborted = 0
        try:
            now = time.time()
            for upload in self.incomplete_uploads():
                if older_than is None or now - upload["modified"] >= older_than:
                    self.abort_upload(upload)
                    aborted += 1
        except Exception as e:  # noqa: BLE001 - cleanup is best effort
            log.info(
                "lightning-snapshot: could not list multipart uploads in %s: %s",
                self.access.url,
                self.access.redact(str(e)),
            )
        return aborted
