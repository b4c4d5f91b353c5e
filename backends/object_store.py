"""Object-store tier: any fsspec URL (``s3://``, ``gs://``, ``az://``, ``memory://`` ...), s3fs for S3.

:class:`ObjectStoreTier` is made by registry.py (an fsspec URL) or by the user, and driven through the
:class:`~lightning_snapshot.backends.base.Backend` interface by the engine (writer.py, persist.py, restore.py,
loader.py), by the RAM tier's agent, and by session.py and ops.py (``gc``) for incomplete uploads.

Commit rule for a store with no rename: data objects first, the manifest last, written with a conditional create
(``If-None-Match: *``) where the store supports it, so a committed step is never overwritten; a step without a
manifest is invisible to the loader, and retention removes it. Large objects go up as concurrent multipart uploads
(aborted on failure) read straight from the staging buffer.

The tier is one class that holds two parts and delegates to them: its access to the store (``access``: its fsspec
filesystem, keys, failures translated and credentials redacted, reads and listing:
:class:`~lightning_snapshot.backends.object_store_access.StoreAccess`, with
:mod:`~lightning_snapshot.backends.object_store_errors`) and its writes (``uploads``: uploads, the conditional commit,
incomplete multipart uploads: :class:`~lightning_snapshot.backends.object_store_uploads.Uploads`). This module holds
its options and the delegation.
"""

from __future__ import annotations

import builtins
import urllib.parse
from collections.abc import Iterable, Mapping
from typing import Any

from typing_extensions import Unpack

from lightning_snapshot.backends.base import Backend, ScheduleOptionsKwargs
from lightning_snapshot.backends.object_store_access import StoreAccess
from lightning_snapshot.backends.object_store_errors import redact, secret_values, unavailable_reason
from lightning_snapshot.backends.object_store_uploads import Uploads
from lightning_snapshot.errors import ConfigError

__all__ = ["ObjectStoreTier", "redact", "unavailable_reason"]

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


class ObjectStoreTier(Backend):
    """Snapshots in an object store or any other fsspec filesystem.

    Args:
        url: where the tier lives, e.g. ``"s3://bucket/runs/run-42"``. Credentials never go in the URL: use
            ``storage_options``, the environment or the provider's usual chain.
        storage_options: passed to the fsspec filesystem (s3fs: ``key``, ``secret``, ``client_kwargs={"endpoint_url":
            ...}``, ...). Never logged, never written to a manifest, a metric or an error.
        **schedule: the schedule options every tier takes (``every_n_train_steps``, ``train_time_interval``,
            ``keep_last``, ``min_every``, ``max_every``):
            :class:`~lightning_snapshot.backends.base.ScheduleOptionsKwargs`.
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
    max_pending: int
    retry_initial: float
    retry_max: float

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        *,
        part_size: int = 16 << 20,
        max_concurrency: int = 8,
        max_pending: int = 1,
        retry_initial: float = 1.0,
        retry_max: float = 60.0,
        drain_timeout: float | None = 300.0,
        **schedule: Unpack[ScheduleOptionsKwargs],
    ) -> None:
        super().__init__(**schedule)
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
        scheme = url.split("://", 1)[0].lower()
        options = dict(storage_options or {})
        secrets = secret_values(options)
        parsed = urllib.parse.urlsplit(url)
        if parsed.username or parsed.password or parsed.query:
            raise ConfigError(
                f"{redact(url)}: put credentials and options in storage_options, not in the URL"
                " (URL options every/interval/keep are only for tier URL strings)"
            )
        try:
            fs, root = fsspec.core.url_to_fs(url, **options)
        except ImportError as e:
            hint = _INSTALL_HINTS.get(scheme, f"install the fsspec implementation for {scheme}://")
            raise ConfigError(f"{scheme}:// needs a package that is not installed: {hint}") from e
        except (ValueError, TypeError) as e:
            raise ConfigError(f"cannot open {redact(url, secrets)}: {redact(str(e), secrets)}") from None
        if scheme in ("file", "local"):
            raise ConfigError("use LocalTier (or a plain path) for local files, not ObjectStoreTier")
        self.tier = scheme
        #: The store: this process's filesystem, keys, reads, listing, failures translated.
        self.access = StoreAccess(url, options, fs, root.rstrip("/"))
        #: The writes: uploads, the conditional commit, incomplete multipart uploads.
        self.uploads = Uploads(self.access, part_size, max_concurrency)
        self.max_pending = max_pending
        self.retry_initial = float(retry_initial)
        self.retry_max = float(retry_max)
        if drain_timeout is not None and (not isinstance(drain_timeout, (int, float)) or drain_timeout < 0):
            raise ConfigError(f"drain_timeout must be a number of seconds >= 0 or None, got {drain_timeout!r}")
        self.drain_timeout = drain_timeout

    # ------------------------------------------------------------------------------------------- identity, parts
    @property
    def url(self) -> str:
        return self.access.url

    @property
    def scheme(self) -> str:
        """The URL's scheme (``s3``...)."""
        return self.access.scheme

    @property
    def root(self) -> str:  # type: ignore[override]  # (``bucket/prefix``, the access's)
        return self.access.root

    @property
    def bytes_read(self) -> int:  # type: ignore[override]  # (counted by the access)
        return self.access.bytes_read

    @property
    def fs(self) -> Any:
        """This process's fsspec filesystem (see :attr:`StoreAccess.fs
        <lightning_snapshot.backends.object_store_access.StoreAccess.fs>`)."""
        return self.access.fs

    @property
    def part_size(self) -> int:
        """Multipart upload part size in bytes."""
        return self.uploads.part_size

    @property
    def max_concurrency(self) -> int:
        """Parts uploaded at once."""
        return self.uploads.max_concurrency

    def redact(self, text: str) -> str:
        """``text`` with this tier's credentials removed."""
        return self.access.redact(text)

    # ------------------------------------------------------------------------------------------- bytes
    def write(self, key: str, buffers: Iterable[bytes | bytearray | memoryview]) -> int:
        return self.uploads.write(key, buffers)

    def commit(self, key: str, data: bytes) -> None:
        """Create ``key`` with a conditional put; a committed object is never overwritten (see
        :meth:`Uploads.commit <lightning_snapshot.backends.object_store_uploads.Uploads.commit>`)."""
        self.uploads.commit(key, data)

    def read(self, key: str) -> bytes:
        return self.access.read(key)

    def read_into(self, key: str, offset: int, out: memoryview) -> None:
        self.access.read_into(key, offset, out)

    def list(self, prefix: str = "") -> builtins.list[str]:
        """A prefix that does not exist lists as empty; a missing bucket, refused credentials or an unreachable
        store raise :class:`~lightning_snapshot.errors.TierUnavailableError`."""
        return self.access.list(prefix)

    def delete(self, key: str) -> None:
        self.access.delete(key)

    def exists(self, key: str) -> bool:
        """Whether the object ``key`` exists (a prefix with objects under it is not an object)."""
        return self.access.exists(key)

    def modified(self, key: str) -> float | None:
        """The newest ``LastModified`` (or ``mtime``) of the object ``key`` or of the objects under the prefix."""
        return self.access.modified(key)

    def require_exists(self) -> None:
        self.access.require_exists()

    def check(self) -> None:
        """Write and delete a probe object (bucket exists, credentials accepted, endpoint answers); see
        :meth:`Backend.check`."""
        self.access.check()

    # ------------------------------------------------------------------------------------------- uploads
    def incomplete_uploads(self) -> builtins.list[dict[str, Any]]:
        """Multipart uploads under the tier root started and neither completed nor aborted (S3 only)."""
        return self.uploads.incomplete_uploads()

    def abort_upload(self, upload: dict[str, Any]) -> None:
        self.uploads.abort_upload(upload)

    def abort_incomplete_uploads(self, older_than: float | None = None) -> int:
        return self.uploads.abort_incomplete_uploads(older_than)
