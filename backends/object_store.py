"""Object-store tier: any fsspec URL (``s3://``, ``gs://``, ``az://``, ``memory://`` ...), s3fs for S3.

:class:`ObjectStoreTier` is made by registry.py (an fsspec URL) or by the user, and driven through the
:class:`~lightning_snapshot.backends.base.Backend` interface by the engine (writer.py, persist.py, restore.py,
loader.py), by the RAM tier's agent, and by session.py and ops.py (``gc``) for incomplete uploads.

Commit rule for a store with no rename: data objects first, the manifest last, written with a conditional create
(``If-None-Match: *``) where the store supports it, so a committed step is never overwritten; a step without a
manifest is invisible to the loader, and retention removes it. Large objects go up as concurrent multipart uploads
(aborted on failure) read straight from the staging buffer.

The tier is written in parts, each a base class of :class:`ObjectStoreTier`: the access to the store (its fsspec
filesystem, failures translated, reads and listing: :mod:`~lightning_snapshot.backends.object_store_access`, with
:mod:`~lightning_snapshot.backends.object_store_errors`) and the writes (uploads, the conditional commit, incomplete
multipart uploads: :mod:`~lightning_snapshot.backends.object_store_uploads`). This module holds its options.
"""

from __future__ import annotations

import datetime as _dt
import urllib.parse
from collections.abc import Mapping
from typing import Any

from lightning_snapshot.backends.base import DEFAULT_KEEP_LAST
from lightning_snapshot.backends.object_store_errors import redact, secret_values, unavailable_reason
from lightning_snapshot.backends.object_store_uploads import ObjectStoreUploads
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


class ObjectStoreTier(ObjectStoreUploads):
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
        self._secrets = secret_values(self._options)
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
        self._fs = None
        self._fs_pid = -1
        self._pipe_params = set()
        #: bytes read with ranged reads in this process (a counter: resharding asserts each rank reads only what it
        #: needs)
        self.bytes_read = 0
