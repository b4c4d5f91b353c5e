"""The object-store tier's access to its store: this process's fsspec filesystem, keys as paths under the root,
failures translated at the boundary (credentials redacted), and everything that reads (``read``, ``read_into``,
``list``, ``exists``, ``modified``) or deletes.

:class:`StoreAccess` is a part that :class:`~lightning_snapshot.backends.object_store.ObjectStoreTier` holds (its
``access``) and delegates to; its uploads (:mod:`~lightning_snapshot.backends.object_store_uploads`) write through it.
"""

from __future__ import annotations

import datetime as _dt
import errno
import inspect
import os
import uuid
from typing import Any

from lightning_snapshot.backends.object_store_errors import exception_chain, redact, secret_values, unavailable_reason
from lightning_snapshot.errors import SnapshotNotFoundError, SnapshotWriteError, TierUnavailableError
from lightning_snapshot.format.manifest import validate_key

__all__ = ["StoreAccess", "unix_time"]


class StoreAccess:
    """Reads, listing and deletion in an fsspec filesystem, and the translation of its failures.

    Args:
        url: the tier's URL (for this process's filesystem object; never logged: :attr:`url` is the redacted form).
        options: the fsspec ``storage_options`` (credentials: never logged).
        fs: the filesystem made from them in this process.
        root: ``bucket/prefix`` under which the keys are.
    """

    def __init__(self, url: str, options: dict[str, Any], fs: Any, root: str) -> None:
        #: The URL's scheme (``s3``...).
        self.scheme = url.split("://", 1)[0].lower()
        self.options = options
        self.secrets = secret_values(options)
        self.fs_url = url
        #: The URL, credentials redacted: safe to log.
        self.url = redact(url, self.secrets)
        self.root = root
        self.init_process_state()
        self.set_fs(fs)

    # ------------------------------------------------------------------------------------------- process state
    def init_process_state(self) -> None:
        """This process's filesystem (made on first use) and read counter (made again where unpickled)."""
        self.fs_obj: Any = None
        self.fs_pid = -1
        #: The parameters of the filesystem's ``pipe_file`` (whether it takes ``mode``, ``chunksize``...).
        self.pipe_params: set[str] = set()
        #: bytes read with ranged reads in this process (a counter: resharding asserts each rank reads only what it
        #: needs)
        self.bytes_read = 0

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for name in ("fs_obj", "fs_pid", "pipe_params", "bytes_read"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.init_process_state()

    def set_fs(self, fs: Any) -> None:
        """Use ``fs`` in this process."""
        self.fs_obj, self.fs_pid = fs, os.getpid()
        self.pipe_params = set(inspect.signature(fs.pipe_file).parameters) | set(
            inspect.signature(getattr(fs, "_pipe_file", fs.pipe_file)).parameters
        )

    @property
    def fs(self) -> Any:
        """This process's fsspec filesystem: made again in a process that unpickled the tier (``ddp_spawn``) or
        was forked from the one that made it (``ddp_fork``; async clients such as s3fs are not fork-safe)."""
        if self.fs_obj is None or self.fs_pid != os.getpid():
            import fsspec

            self.set_fs(fsspec.core.url_to_fs(self.fs_url, **self.options)[0])
        return self.fs_obj

    def redact(self, text: str) -> str:
        """``text`` with this tier's credentials removed."""
        return redact(text, self.secrets)

    def path(self, key: str, *, allow_root: bool = False) -> str:
        if allow_root and key == "":
            return self.root
        return f"{self.root}/{validate_key(key)}"

    def error(self, what: str, key: str, e: BaseException) -> SnapshotWriteError:
        """``e`` translated: a :class:`TierUnavailableError` naming the fix when the store is missing, refuses the
        credentials or does not answer, else a :class:`SnapshotWriteError`. Credentials are redacted."""
        unavailable = self.unavailable(f"{what} {key!r}", e)
        if unavailable is not None:
            return unavailable
        return SnapshotWriteError(
            f"{what} {key!r} in the {self.scheme} tier {self.url!r} failed: {type(e).__name__}: {self.redact(str(e))}"
        )

    def unavailable(self, what: str, e: BaseException) -> TierUnavailableError | None:
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

    def read_error(self, what: str, key: str, e: BaseException) -> BaseException:
        """A read failure translated: the store unavailable, a missing object (a ``FileNotFoundError`` naming the key
        and the tier) or a range that starts past the object's end (``EOFError``); others unchanged."""
        if isinstance(e, FileNotFoundError) and unavailable_reason(e) != "bucket":
            return FileNotFoundError(errno.ENOENT, f"no object {key!r} in the {self.scheme} tier {self.url!r}")
        if any("InvalidRange" in str(x) or "not satisfiable" in str(x) for x in exception_chain(e)):  # HTTP 416
            return EOFError(f"{key!r} in {self.url!r} ends before the range asked for ({what})")
        return self.unavailable(f"{what} {key!r}", e) or e

    def check(self) -> None:
        """Write and delete a probe object (bucket exists, credentials accepted, endpoint answers); see
        :meth:`~lightning_snapshot.backends.base.Backend.check`."""
        key = f".lightning-snapshot-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        path = f"{self.root}/{key}"
        try:
            self.fs.pipe_file(path, b"lightning-snapshot probe")
            self.fs.rm(path)
        except Exception as e:  # translated: the tier is not usable
            raise (
                self.unavailable("writing a probe object", e)
                or TierUnavailableError(
                    f"the {self.scheme} tier {self.url!r} cannot be written (probe object {key!r}):"
                    f" {self.redact(f'{type(e).__name__}: {e}')}; check the URL and storage_options"
                )
            ) from e

    def read(self, key: str) -> bytes:
        path = self.path(key)
        try:
            data = self.fs.cat_file(path)
        except Exception as e:  # translated at the boundary
            raise self.read_error("reading", key, e) from e
        self.bytes_read += len(data)
        return data

    def read_into(self, key: str, offset: int, out: memoryview) -> None:
        view = memoryview(out).cast("B")
        path = self.path(key)
        if not view.nbytes:
            return  # (nothing to fill; a request for no bytes is refused by S3 as an unsatisfiable range)
        try:
            data = self.fs.cat_file(path, start=offset, end=offset + view.nbytes)
        except Exception as e:  # translated at the boundary
            raise self.read_error("reading", key, e) from e
        self.bytes_read += len(data)
        if len(data) != view.nbytes:
            raise EOFError(f"{key!r} in {self.url!r} ends before byte {offset + view.nbytes}")
        view[:] = data

    def list(self, prefix: str = "") -> list[str]:
        """A prefix that does not exist lists as empty; a missing bucket, refused credentials or an unreachable
        store raise :class:`TierUnavailableError`."""
        path = self.path(prefix, allow_root=True)
        try:
            self.fs.invalidate_cache(path)
            entries = self.fs.ls(path, detail=False)
        except (FileNotFoundError, NotADirectoryError) as e:
            if unavailable_reason(e) == "bucket":
                raise self.error("listing", prefix, e) from e
            return []
        except Exception as e:  # translated at the boundary
            raise self.error("listing", prefix, e) from e
        # (an object lists as itself: it has no children)
        names = sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries if e.rstrip("/") != path.rstrip("/")})
        return [n for n in names if n and not n.startswith(".")]

    def delete(self, key: str) -> None:
        path = self.path(key)
        try:
            self.fs.rm(path, recursive=True)
        except FileNotFoundError as e:
            if unavailable_reason(e) == "bucket":
                raise self.error("deleting", key, e) from e
        except Exception as e:  # translated at the boundary
            raise self.error("deleting", key, e) from e
        self.fs.invalidate_cache(path)

    def exists(self, key: str) -> bool:
        """Whether the object ``key`` exists (a prefix with objects under it is not an object)."""
        path = self.path(key)
        try:
            self.fs.invalidate_cache(path)
            return self.fs.info(path)["type"] == "file"
        except FileNotFoundError as e:
            if unavailable_reason(e) == "bucket":
                raise self.error("looking up", key, e) from e
            return False
        except Exception as e:  # translated at the boundary
            raise self.error("looking up", key, e) from e

    def modified(self, key: str) -> float | None:
        """The newest ``LastModified`` (or ``mtime``) of the object ``key`` or of the objects under the prefix."""
        path = self.path(key)
        try:
            self.fs.invalidate_cache(path)
            infos = self.fs.find(path, detail=True, withdirs=False)
        except FileNotFoundError:
            return None
        except Exception as e:  # translated at the boundary
            raise self.error("looking up", key, e) from e
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
            raise self.error("looking up", self.root, e) from None
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
