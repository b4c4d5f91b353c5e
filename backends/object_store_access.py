"""The object-store tier's access to its store: this process's fsspec filesystem, keys as paths under the root,
failures translated at the boundary, and everything that reads (``read``, ``read_into``, ``list``, ``exists``,
``modified``) or deletes (:class:`ObjectStoreAccess`, a base class of
:class:`~lightning_snapshot.backends.object_store.ObjectStoreTier`).
"""

from __future__ import annotations

import datetime as _dt
import errno
import inspect
import os
import uuid
from typing import Any

from lightning_snapshot.backends.base import Backend
from lightning_snapshot.backends.object_store_errors import exception_chain, redact, unavailable_reason
from lightning_snapshot.errors import SnapshotNotFoundError, SnapshotWriteError, TierUnavailableError
from lightning_snapshot.format.manifest import validate_key

__all__ = ["ObjectStoreAccess", "unix_time"]


class ObjectStoreAccess(Backend):
    """Reads, listing and deletion in an fsspec filesystem (see
    :class:`~lightning_snapshot.backends.object_store.ObjectStoreTier`, which sets the attributes below)."""

    root: str
    bytes_read: int
    #: The URL's scheme (``s3``...).
    scheme: str
    _options: dict[str, Any]
    _secrets: list[str]
    _fs_url: str
    _url: str
    _fs: Any
    _fs_pid: int
    _pipe_params: set[str]

    def _set_fs(self, fs: Any) -> None:
        self._fs, self._fs_pid = fs, os.getpid()
        self._pipe_params = set(inspect.signature(fs.pipe_file).parameters) | set(
            inspect.signature(getattr(fs, "_pipe_file", fs.pipe_file)).parameters
        )

    @property
    def fs(self) -> Any:
        """This process's fsspec filesystem: made again in a process that unpickled the tier (``ddp_spawn``) or
        was forked from the one that made it (``ddp_fork``; async clients such as s3fs are not fork-safe)."""
        if self._fs is None or self._fs_pid != os.getpid():
            import fsspec

            self._set_fs(fsspec.core.url_to_fs(self._fs_url, **self._options)[0])
        return self._fs

    @property
    def url(self) -> str:
        return self._url

    def redact(self, text: str) -> str:
        """``text`` with this tier's credentials removed."""
        return redact(text, self._secrets)

    def _path(self, key: str, *, allow_root: bool = False) -> str:
        if allow_root and key == "":
            return self.root
        return f"{self.root}/{validate_key(key)}"

    def _error(self, what: str, key: str, e: BaseException) -> SnapshotWriteError:
        """``e`` translated: a :class:`TierUnavailableError` naming the fix when the store is missing, refuses the
        credentials or does not answer, else a :class:`SnapshotWriteError`. Credentials are redacted."""
        unavailable = self._unavailable(f"{what} {key!r}", e)
        if unavailable is not None:
            return unavailable
        return SnapshotWriteError(
            f"{what} {key!r} in the {self.scheme} tier {self.url!r} failed: {type(e).__name__}: {self.redact(str(e))}"
        )

    def _unavailable(self, what: str, e: BaseException) -> TierUnavailableError | None:
        reason = unavailable_reason(e)
        if reason is None:
            return None
        bucket = self.root.split("/", 1)[0]
        problem, fix = {
            "bucket": (
                f"bucket {bucket!r} does not exist",
                f"create it (for example `aws s3 mb {self.scheme}://{bucket}`) or correct the URL",
            ),
            "credentials": (
                "refused the credentials or has none",
                "check key/secret (or token) in storage_options, the environment or the provider chain,"
                " and that they may read, write and delete under the tier's prefix",
            ),
            "unreachable": (
                "endpoint does not answer",
                "check the endpoint (storage_options client_kwargs endpoint_url) and the network",
            ),
        }[reason]
        detail = self.redact(f"{type(e).__name__}: {e}")
        return TierUnavailableError(f"the {self.scheme} tier {self.url!r}: {problem} ({what}: {detail}); {fix}")

    def _read_error(self, what: str, key: str, e: BaseException) -> BaseException:
        """A read failure translated: the store unavailable, a missing object (a ``FileNotFoundError`` naming the key
        and the tier) or a range that starts past the object's end (``EOFError``); others unchanged."""
        if isinstance(e, FileNotFoundError) and unavailable_reason(e) != "bucket":
            return FileNotFoundError(errno.ENOENT, f"no object {key!r} in the {self.scheme} tier {self.url!r}")
        if any("InvalidRange" in str(x) or "not satisfiable" in str(x) for x in exception_chain(e)):  # HTTP 416
            return EOFError(f"{key!r} in {self.url!r} ends before the range asked for ({what})")
        return self._unavailable(f"{what} {key!r}", e) or e

    def check(self) -> None:
        """Write and delete a probe object (bucket exists, credentials accepted, endpoint answers); see
        :meth:`Backend.check`."""
        key = f".lightning-snapshot-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        path = f"{self.root}/{key}"
        try:
            self.fs.pipe_file(path, b"lightning-snapshot probe")
            self.fs.rm(path)
        except Exception as e:  # translated: the tier is not usable
            raise (
                self._unavailable("writing a probe object", e)
                or TierUnavailableError(
                    f"the {self.scheme} tier {self.url!r} cannot be written (probe object {key!r}):"
                    f" {self.redact(f'{type(e).__name__}: {e}')}; check the URL and storage_options"
                )
            ) from e

    def read(self, key: str) -> bytes:
        path = self._path(key)
        try:
            data = self.fs.cat_file(path)
        except Exception as e:  # translated at the boundary
            raise self._read_error("reading", key, e) from e
        self.bytes_read += len(data)
        return data

    def read_into(self, key: str, offset: int, out: memoryview) -> None:
        view = memoryview(out).cast("B")
        path = self._path(key)
        if not view.nbytes:
            return  # (nothing to fill; a request for no bytes is refused by S3 as an unsatisfiable range)
        try:
            data = self.fs.cat_file(path, start=offset, end=offset + view.nbytes)
        except Exception as e:  # translated at the boundary
            raise self._read_error("reading", key, e) from e
        self.bytes_read += len(data)
        if len(data) != view.nbytes:
            raise EOFError(f"{key!r} in {self.url!r} ends before byte {offset + view.nbytes}")
        view[:] = data

    def list(self, prefix: str = "") -> list[str]:
        """A prefix that does not exist lists as empty; a missing bucket, refused credentials or an unreachable
        store raise :class:`TierUnavailableError`."""
        path = self._path(prefix, allow_root=True)
        try:
            self.fs.invalidate_cache(path)
            entries = self.fs.ls(path, detail=False)
        except (FileNotFoundError, NotADirectoryError) as e:
            if unavailable_reason(e) == "bucket":
                raise self._error("listing", prefix, e) from e
            return []
        except Exception as e:  # translated at the boundary
            raise self._error("listing", prefix, e) from e
        # (an object lists as itself: it has no children)
        names = sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries if e.rstrip("/") != path.rstrip("/")})
        return [n for n in names if n and not n.startswith(".")]

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            self.fs.rm(path, recursive=True)
        except FileNotFoundError as e:
            if unavailable_reason(e) == "bucket":
                raise self._error("deleting", key, e) from e
        except Exception as e:  # translated at the boundary
            raise self._error("deleting", key, e) from e
        self.fs.invalidate_cache(path)

    def exists(self, key: str) -> bool:
        """Whether the object ``key`` exists (a prefix with objects under it is not an object)."""
        path = self._path(key)
        try:
            self.fs.invalidate_cache(path)
            return self.fs.info(path)["type"] == "file"
        except FileNotFoundError as e:
            if unavailable_reason(e) == "bucket":
                raise self._error("looking up", key, e) from e
            return False
        except Exception as e:  # translated at the boundary
            raise self._error("looking up", key, e) from e

    def modified(self, key: str) -> float | None:
        """The newest ``LastModified`` (or ``mtime``) of the object ``key`` or of the objects under the prefix."""
        path = self._path(key)
        try:
            self.fs.invalidate_cache(path)
            infos = self.fs.find(path, detail=True, withdirs=False)
        except FileNotFoundError:
            return None
        except Exception as e:  # translated at the boundary
            raise self._error("looking up", key, e) from e
        times = [unix_time(info.get("LastModified", info.get("mtime"))) for info in infos.values()]
        known = [t for t in times if t is not None]
        return max(known) if known and len(known) == len(times) else None

    def require_exists(self) -> None:
        try:
            self.fs.invalidate_cache(self.root)
            if self.fs.exists(self.root):
                return
            bucket, sep, _ = self.root.strip("/").partition("/")
            bucket_exists = bool(sep and bucket and self.fs.exists(bucket))
        except Exception as e:  # noqa: BLE001 - translated at the boundary (missing bucket, credentials, endpoint)
            raise self._error("looking up", self.root, e) from None
        if bucket_exists:
            raise SnapshotNotFoundError(
                f"no snapshot tier at {self.url!r}: bucket {bucket!r} holds nothing under that prefix. Check the path"
            )
        raise SnapshotNotFoundError(
            f"no snapshot tier at {self.url!r}: the bucket (or path) does not exist. Check the name, the endpoint and"
            " the credentials"
        )


def unix_time(value: Any) -> float | None:
    """A timestamp from a listing (a datetime, or a number of seconds) as Unix time; None when there is none."""
    if isinstance(value, _dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=_dt.timezone.utc)
        return value.timestamp()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None
