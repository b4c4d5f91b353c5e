"""Object-store tier: any fsspec URL (``s3://``, ``gs://``, ``az://``, ``memory://`` ...), s3fs for S3.

:class:`ObjectStoreTier` is made by registry.py (an fsspec URL) or by the user, and driven through the
:class:`~lightning_snapshot.backends.base.Backend` interface by the engine (writer.py, persist.py, restore.py,
loader.py), by the RAM tier's agent, and by session.py and ops.py (``gc``) for incomplete uploads.

Commit rule for a store with no rename: data objects first, the manifest last, written with a conditional create
(``If-None-Match: *``) where the store supports it, so a committed step is never overwritten; a step without a
manifest is invisible to the loader, and retention removes it. Large objects go up as concurrent multipart uploads
(aborted on failure) read straight from the staging buffer.
"""

from __future__ import annotations

import builtins
import ctypes
import datetime as _dt
import errno
import inspect
import logging
import os
import re
import time
import urllib.parse
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

from lightning_snapshot.backends.base import DEFAULT_KEEP_LAST, Backend
from lightning_snapshot.errors import (
    ConfigError,
    SnapshotNotFoundError,
    SnapshotWriteError,
    TierUnavailableError,
)
from lightning_snapshot.manifest import validate_key

__all__ = ["ObjectStoreTier", "redact", "unavailable_reason"]

log = logging.getLogger(__name__)

#: pip commands for the fsspec implementations users meet most
_INSTALL_HINTS = {
    "s3": 'pip install "lightning-snapshot[s3]"  (installs s3fs)',
    "s3a": 'pip install "lightning-snapshot[s3]"  (installs s3fs)',
    "gs": "pip install gcsfs",
    "gcs": "pip install gcsfs",
    "az": "pip install adlfs",
    "abfs": "pip install adlfs",
    "abfss": "pip install adlfs",
}
#: exception class names (botocore, aiohttp, fsspec) of a store that does not answer
_UNREACHABLE = {
    "EndpointConnectionError",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "ConnectionClosedError",
    "ClientConnectorError",
    "ClientConnectionError",
    "ServerDisconnectedError",
    "FSTimeoutError",
    "ConnectionError",
}
_NO_CREDENTIALS = {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"}
_REFUSED_CODES = (
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "AuthorizationHeaderMalformed",
    "Forbidden",
)
_SECRET_NAMES = re.compile(r"(secret|password|passwd|token|credential|key|signature|sas)", re.IGNORECASE)


def _secret_values(options: Mapping[str, Any]) -> list[str]:
    """Values in ``storage_options`` (nested too) whose names look like credentials."""
    found: list[str] = []
    for name, value in options.items():
        if isinstance(value, Mapping):
            found += _secret_values(value)
        elif isinstance(value, str) and _SECRET_NAMES.search(str(name)) and len(value) >= 4:
            found.append(value)
    return found


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with URL userinfo, credential-like query parameters and the given secret values replaced by ***."""
    text = re.sub(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s]+@", r"\g<scheme>***@", text)
    text = re.sub(
        r"(?i)([?&][^=&\s]*(?:secret|token|key|signature|sig|password|credential)[^=&\s]*=)[^&\s]+", r"\1***", text
    )
    for s in sorted(set(secrets), key=len, reverse=True):
        text = text.replace(s, "***")
    return text


def _chain(e: BaseException) -> list[BaseException]:
    """``e`` and the exceptions it was raised from or during (s3fs re-raises botocore's as builtins)."""
    out: list[BaseException] = []
    while e is not None and e not in out and len(out) < 8:
        out.append(e)
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
    return out


def unavailable_reason(e: BaseException) -> str | None:
    """Why a store call failed, when it is the store's side: ``"bucket"`` (it does not exist), ``"credentials"``
    (missing or refused), ``"unreachable"`` (no answer); None for any other failure."""
    chain = _chain(e)
    names = {k.__name__ for x in chain for k in type(x).__mro__}
    text = " ".join(str(x) for x in chain)
    if "NoSuchBucket" in names or "NoSuchBucket" in text or "bucket does not exist" in text.lower():
        return "bucket"
    if (
        names & _NO_CREDENTIALS
        or any(isinstance(x, PermissionError) for x in chain)
        or any(code in text for code in _REFUSED_CODES)
    ):
        return "credentials"
    if names & _UNREACHABLE or any(isinstance(x, (ConnectionError, TimeoutError)) for x in chain):
        return "unreachable"
    return None


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


class ObjectStoreTier(Backend):
    """Snapshots in an object store or any other fsspec filesystem.

    Args:
        url: where the tier lives, e.g. ``"s3://bucket/runs/run-42"``. Credentials never go in the URL: use
            ``storage_options``, the environment or the provider's usual chain.
        storage_options: passed to the fsspec filesystem (s3fs: ``key``, ``secret``, ``client_kwargs={"endpoint_url":
            ...}``, ...). Never logged, never written to a manifest, a metric or an error.
        every_n_train_steps, train_time_interval, keep_last, min_every, max_every: see
            :class:`~lightning_snapshot.backends.base.Backend`.
        part_size: multipart upload part size in bytes (>= 5 MiB, the S3 minimum).
        max_concurrency: parts uploaded at once.
        max_pending: snapshots that may wait for this tier at once (the one being uploaded included). When that many
            are pending, a newly scheduled snapshot is skipped for this tier and counted in
            ``snapshot/<tier>/skipped``: training never waits for a slow or unreachable store.
        retry_initial, retry_max: a failed upload is retried after ``retry_initial`` seconds, doubling up to
            ``retry_max``, until it succeeds; one warning per outage, one info line when the store is back.
        drain_timeout: at the end of ``fit``, how long to wait for this tier's pending uploads (seconds; None waits
            as long as it takes). Past it the uploads are abandoned with a warning; the other tiers hold the state.

    URL form (LightningCLI): ``"s3://bucket/run-42?every=1000&keep=5"``; pass ``storage_options`` with the object
    form when you need them.
    """

    tier = "object"
    durable = True
    root: str  # (the declared capabilities this tier always has, with their types here)
    bytes_read: int
    max_pending: int
    retry_initial: float
    retry_max: float

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        every_n_train_steps: int | str | None = None,
        train_time_interval: _dt.timedelta | float | None = None,
        keep_last: int | None = DEFAULT_KEEP_LAST,
        *,
        min_every: int | None = None,
        max_every: int | None = None,
        part_size: int = 16 << 20,
        max_concurrency: int = 8,
        max_pending: int = 1,
        retry_initial: float = 1.0,
        retry_max: float = 60.0,
        drain_timeout: float | None = 300.0,
    ) -> None:
        super().__init__(
            every_n_train_steps=every_n_train_steps,
            train_time_interval=train_time_interval,
            keep_last=keep_last,
            min_every=min_every,
            max_every=max_every,
        )
        import fsspec

        if not isinstance(url, str) or "://" not in url:
            raise ConfigError(f"ObjectStoreTier needs a URL with a scheme such as s3://bucket/path, got {url!r}")
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise ConfigError(f"storage_options must be a dict, got {type(storage_options).__name__}")
        for name, value, lo in (
            ("part_size", part_size, 5 << 20),
            ("max_concurrency", max_concurrency, 1),
            ("max_pending", max_pending, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise ConfigError(f"{name} must be an integer >= {lo}, got {value!r}")
        if not (
            isinstance(retry_initial, (int, float))
            and isinstance(retry_max, (int, float))
            and 0 < retry_initial <= retry_max
        ):
            raise ConfigError("retry_initial and retry_max must be numbers with 0 < retry_initial <= retry_max")
        self.scheme = url.split("://", 1)[0].lower()
        self._options = dict(storage_options or {})
        self._secrets = _secret_values(self._options)
        parsed = urllib.parse.urlsplit(url)
        if parsed.username or parsed.password or parsed.query:
            raise ConfigError(
                f"{redact(url)}: put credentials and options in storage_options, not in the URL"
                " (URL options every/interval/keep are only for tier URL strings)"
            )
        try:
            fs, root = fsspec.core.url_to_fs(url, **self._options)
        except ImportError as e:
            hint = _INSTALL_HINTS.get(self.scheme, f"install the fsspec implementation for {self.scheme}://")
            raise ConfigError(f"{self.scheme}:// needs a package that is not installed: {hint}") from e
        except (ValueError, TypeError) as e:
            raise ConfigError(f"cannot open {redact(url, self._secrets)}: {redact(str(e), self._secrets)}") from None
        if self.scheme in ("file", "local"):
            raise ConfigError("use LocalTier (or a plain path) for local files, not ObjectStoreTier")
        self.tier = self.scheme
        self._fs_url = url  # (for this process's filesystem object; never logged: ``url`` is the redacted form)
        self._init_process_state()
        self._set_fs(fs)
        self.root = root.rstrip("/")
        self._url = redact(url, self._secrets)
        self.part_size = part_size
        self.max_concurrency = max_concurrency
        self.max_pending = max_pending
        self.retry_initial = float(retry_initial)
        self.retry_max = float(retry_max)
        if drain_timeout is not None and (not isinstance(drain_timeout, (int, float)) or drain_timeout < 0):
            raise ConfigError(f"drain_timeout must be a number of seconds >= 0 or None, got {drain_timeout!r}")
        self.drain_timeout = drain_timeout

    # ------------------------------------------------------------------------------------------- process state
    _process_local = ("_fs", "_fs_pid", "_pipe_params", "bytes_read")

    def _init_process_state(self) -> None:
        super()._init_process_state()
        self._fs: Any = None
        self._fs_pid = -1
        self._pipe_params: set[str] = set()
        #: bytes read with ranged reads in this process (a counter: resharding asserts each rank reads only what it
        #: needs)
        self.bytes_read = 0

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
        if any("InvalidRange" in str(x) or "not satisfiable" in str(x) for x in _chain(e)):  # HTTP 416
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

    # ------------------------------------------------------------------------------------------- bytes
    def write(self, key: str, buffers: Iterable[bytes | bytearray | memoryview]) -> int:
        views = [memoryview(b).cast("B") for b in buffers]
        view = views[0] if len(views) == 1 else memoryview(b"".join(views))
        path = self._path(key)
        try:
            fs = self.fs  # (first: it sets _pipe_params)
            if "chunksize" in self._pipe_params and view.nbytes >= 2 * self.part_size:
                fs.pipe_file(path, _Parts(view), chunksize=self.part_size, max_concurrency=self.max_concurrency)
            else:
                fs.pipe_file(path, bytes(view))
        except Exception as e:  # any client error is a failed write, with credentials redacted
            raise self._error("uploading", key, e) from e
        return view.nbytes

    def commit(self, key: str, data: bytes) -> None:
        """Create ``key`` with a conditional put; a committed object is never overwritten. Committing the very bytes
        it already holds succeeds (a retried request whose first attempt landed).

        Raises:
            SnapshotWriteError: ``key`` is already committed with other bytes, or the put failed.
        """
        path = self._path(key)
        try:
            fs = self.fs  # (first: it sets _pipe_params)
            if "mode" in self._pipe_params:  # conditional create: never overwrite a committed manifest
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
                raise self._error("committing", key, e) from e
        if self.read(key) != bytes(data):
            raise SnapshotWriteError(
                f"{key!r} is already committed in the {self.scheme} tier {self.url!r};"
                " a committed snapshot is never overwritten"
            )

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
        times = [_unix_time(info.get("LastModified", info.get("mtime"))) for info in infos.values()]
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

    def incomplete_uploads(self) -> builtins.list[dict[str, Any]]:  # (``list`` here is the method above)
        """Multipart uploads under the tier root that were started and neither completed nor aborted (S3 only;
        empty for other stores), each ``{"key": key relative to the root, "upload_id": ..., "modified": Unix time
        of its newest part, or of its start when it has none}``."""
        call = getattr(self.fs, "call_s3", None)
        if call is None:
            return []
        bucket, _, prefix = self.root.partition("/")
        prefix = f"{prefix}/" if prefix else ""
        uploads: list[dict[str, Any]] = []
        markers: dict[str, str] = {}
        while True:
            listing = call("list_multipart_uploads", Bucket=bucket, Prefix=prefix, **markers)
            for upload in listing.get("Uploads", []):
                modified = _unix_time(upload.get("Initiated")) or 0.0
                parts = call("list_parts", Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
                for part in parts.get("Parts", []):
                    modified = max(modified, _unix_time(part.get("LastModified")) or 0.0)
                uploads.append(
                    {"key": upload["Key"][len(prefix) :], "upload_id": upload["UploadId"], "modified": modified}
                )
            if not listing.get("IsTruncated"):
                return uploads
            markers = {"KeyMarker": listing["NextKeyMarker"], "UploadIdMarker": listing["NextUploadIdMarker"]}

    def abort_upload(self, upload: dict[str, Any]) -> None:
        """Abort one upload of :meth:`incomplete_uploads` (its parts are freed; an upload still running fails)."""
        bucket, _, prefix = self.root.partition("/")
        key = f"{prefix}/{upload['key']}" if prefix else upload["key"]
        try:
            self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload["upload_id"])
        except Exception as e:  # translated at the boundary
            raise self._error("aborting the upload of", upload["key"], e) from e

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
            log.info("lightning-snapshot: could not list multipart uploads in %s: %s", self.url, self.redact(str(e)))
        return aborted


def _unix_time(value: Any) -> float | None:
    """A timestamp from a listing (a datetime, or a number of seconds) as Unix time; None when there is none."""
    if isinstance(value, _dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=_dt.timezone.utc)
        return value.timestamp()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None
