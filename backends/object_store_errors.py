"""The object-store tier's failures, told apart and redacted: which ones are the store's side (the bucket missing,
credentials refused, no answer), and the text of an error with the credentials taken out.

Used by :mod:`~lightning_snapshot.backends.object_store_access` (which translates every failure at the boundary);
:func:`redact` and :func:`unavailable_reason` are importable from :mod:`~lightning_snapshot.backends.object_store` too.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["exception_chain", "redact", "secret_values", "unavailable_reason"]

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


def secret_values(options: Mapping[str, Any]) -> list[str]:
    """Values in ``storage_options`` (nested too) whose names look like credentials."""
    found: list[str] = []
    for name, value in options.items():
        if isinstance(value, Mapping):
            found += secret_values(value)
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


def exception_chain(e: BaseException) -> list[BaseException]:
    """``e`` and the exceptions it was raised from or during (s3fs re-raises botocore's as builtins)."""
    out: list[BaseException] = []
    while e is not None and e not in out and len(out) < 8:
        out.append(e)
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
    return out


def unavailable_reason(e: BaseException) -> str | None:
    """Why a store call failed, when it is the store's side: ``"bucket"`` (it does not exist), ``"credentials"``
    (missing or refused), ``"unreachable"`` (no answer); None for any other failure."""
    chain = exception_chain(e)
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
