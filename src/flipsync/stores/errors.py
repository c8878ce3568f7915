"""What an object-store failure means: permanent (waiting does not heal it) or transient. obstore's error text
is read here and only here; callers above decide by exception type.
See docs/board.md ("Failures: refused at once, or retried within a bound").
"""

from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass

import obstore.exceptions as obx

PERMISSION = "permission"
CREDENTIALS = "credentials"
NO_BUCKET = "no_bucket"
BAD_REQUEST = "bad_request"
NO_SPACE = "no_space"
UNSUPPORTED = "unsupported"
BAD_PATH = "bad_path"
MISSING = "missing"
THROTTLED = "throttled"
SERVER = "server"
TIMEOUT = "timeout"
CONNECTION = "connection"
LOCAL_IO = "local_io"
UNKNOWN = "unknown"
PERMANENT_KINDS = frozenset({PERMISSION, CREDENTIALS, NO_BUCKET, BAD_REQUEST, NO_SPACE, UNSUPPORTED, BAD_PATH, MISSING})

# Store error codes (S3, Azure, GCS) that settle the kind whatever the status says.
_CODES: dict[str, str] = {
    code: kind
    for kind, codes in {
        CREDENTIALS: "InvalidAccessKeyId SignatureDoesNotMatch ExpiredToken InvalidToken TokenRefreshRequired "
        "RequestTimeTooSkewed AuthenticationFailed AuthorizationFailure InvalidAuthenticationInfo "
        "NoAuthenticationInformation AccountIsDisabled InvalidSecurity",
        PERMISSION: "AccessDenied AllAccessDisabled AuthorizationPermissionMismatch AuthorizationResourceTypeMismatch "
        "AuthorizationSourceIPMismatch InsufficientAccountPermissions forbidden",
        NO_BUCKET: "NoSuchBucket ContainerNotFound ContainerBeingDeleted ResourceNotFound",
        THROTTLED: "SlowDown Throttling ThrottlingException RequestLimitExceeded RequestThrottled TooManyRequests "
        "TooManyRequestsException ServerBusy rateLimitExceeded userRateLimitExceeded",
        SERVER: "InternalError ServiceUnavailable OperationTimedOut backendError InternalServerError",
        TIMEOUT: "RequestTimeout",
        BAD_REQUEST: "AuthorizationHeaderMalformed InvalidBucketName InvalidArgument InvalidRequest InvalidURI "
        "PermanentRedirect IllegalLocationConstraintException InvalidResourceName InvalidUri UnsupportedHeader",
        NO_SPACE: "QuotaExceeded",
    }.items()
    for code in codes.split()
}
_PERMANENT_ERRNO: dict[int, str] = {
    **dict.fromkeys((errno.EACCES, errno.EPERM, errno.EROFS), PERMISSION),
    **dict.fromkeys((errno.ENOSPC, errno.EDQUOT, errno.EFBIG), NO_SPACE),
    **dict.fromkeys(
        (errno.ENAMETOOLONG, errno.ENOTDIR, errno.EISDIR, errno.ELOOP, errno.EINVAL, errno.EXDEV, errno.EMLINK),
        BAD_PATH,
    ),
    **dict.fromkeys((errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENODEV, errno.ENXIO), UNSUPPORTED),
    errno.ENOENT: MISSING,
}
_CONNECT_ERRNO = frozenset(
    {errno.ECONNREFUSED, errno.ECONNRESET, errno.ECONNABORTED, errno.EPIPE, errno.EHOSTUNREACH, errno.ENETUNREACH}
)

_STATUS = re.compile(r"status code: (\d{3})|\bstatus: (\d{3})\b")
_CODE = re.compile(r"<Code>([^<]{1,80})</Code>|\"(?:code|reason)\":\s*\"([A-Za-z]{3,80})\"")
_MESSAGE = re.compile(r"<Message>([^<]{1,300})")
_ERRNO = re.compile(r"os error (\d+)|\bcode: (\d+),")
_RETRIES = re.compile(r"\bretries: (\d+)|after (\d+) retries")
_HTTP_KIND = re.compile(r"HttpError \{\s*kind: (\w+)")
_METADATA = ("169.254.169.254", "fd00:ec2::254", "metadata.google.internal", "/metadata/")


@dataclass(frozen=True)
class StoreFailure:
    """What one failed store call means (see the module doc)."""

    kind: str
    cause: str  # what the store said, short: "HTTP 403 AccessDenied: Access Denied", "No space left on device"
    retried: int  # retries obstore already made of the failing request (0 for local stores)

    @property
    def permanent(self) -> bool:
        return self.kind in PERMANENT_KINDS


def _first(pattern: re.Pattern[str], text: str) -> str | None:
    m = pattern.search(text)
    return None if m is None else next((g for g in m.groups() if g is not None), None)


def _int(text: str | None) -> int | None:
    return int(text) if text is not None else None


def _short(text: str) -> str:
    """obstore's first line without its prefixes (the store and the request are named by the caller)."""
    line = text.strip().split("\n", 1)[0] if text.strip() else ""
    line = re.sub(r"^Generic \w+ error: ", "", line)
    line = re.sub(r"^Error performing \S+ \S+ in [^-]+- ", "", line)
    return line[:300]


def describe_failure(e: BaseException, *, creates: bool, local: bool) -> StoreFailure:
    """Classify the exception an obstore call (or an fsync) raised. ``creates``: the call writes an object
    (a put), so nothing it names can be missing but its bucket; ``local``: the store is the local filesystem."""
    text = str(e)
    status = _int(_first(_STATUS, text))
    code = _first(_CODE, text)
    err = e.errno if isinstance(e, OSError) and e.errno else _int(_first(_ERRNO, text))
    retried = _int(_first(_RETRIES, text)) or 0
    http_kind = _first(_HTTP_KIND, text)
    message = _first(_MESSAGE, text)

    def out(kind: str, cause: str) -> StoreFailure:
        return StoreFailure(kind, cause, retried)

    if status is not None or code is not None:
        cause = " ".join(str(x) for x in (f"HTTP {status}" if status else None, code) if x)
        if message:
            cause += f": {message.strip().splitlines()[0]}"
        cause = cause or _short(text)
    elif err is not None:
        cause = os.strerror(err) + f" (os error {err})"
        if local:
            cause = _short(text) or cause
    else:
        cause = _short(text) or type(e).__name__

    if isinstance(e, obx.InvalidPathError):
        return out(BAD_PATH, cause)
    if isinstance(e, obx.NotSupportedError | NotImplementedError):
        return out(UNSUPPORTED, cause)
    if code in _CODES:
        return out(_CODES[code], cause)
    if isinstance(e, obx.UnauthenticatedError) or status == 401:
        return out(CREDENTIALS, cause)
    if isinstance(e, obx.PermissionDeniedError | PermissionError) or status == 403:
        return out(PERMISSION, cause)
    if isinstance(e, obx.NotFoundError | FileNotFoundError):
        # A put cannot miss its object: what is missing is the bucket or container. Any other call's 404 is
        # the object's, unless the store's code said otherwise above.
        return out(NO_BUCKET if creates and not local else MISSING, cause)
    if status is not None:
        kind = {404: NO_BUCKET, 408: TIMEOUT, 429: THROTTLED, 501: UNSUPPORTED}.get(status)
        if kind is None and status >= 300:
            kind = SERVER if status >= 500 else BAD_REQUEST
        if kind is not None:
            return out(kind, cause)
    if "redirect without LOCATION" in text:  # object_store: "normally indicates an incorrectly configured region"
        return out(BAD_REQUEST, "the store answered with a bare redirect (usually a wrong region)")
    if err is not None and err in _PERMANENT_ERRNO and http_kind is None:  # a filesystem's, not a socket's
        return out(_PERMANENT_ERRNO[err], cause)
    if http_kind == "Timeout" or isinstance(e, TimeoutError) or err == errno.ETIMEDOUT:
        return out(TIMEOUT, cause if cause != "HTTP error: error sending request" else "the request timed out")
    if http_kind in ("Connect", "Request", "Interrupted") or (err is not None and err in _CONNECT_ERRNO):
        if err is not None and not cause.startswith(os.strerror(err)):
            cause = f"{os.strerror(err)} (os error {err})"
        return out(CONNECTION, cause)
    if local and err is not None:
        return out(LOCAL_IO, cause)
    return out(UNKNOWN, cause)


def asks_metadata_service(e: BaseException) -> bool:
    """Whether obstore failed asking a cloud metadata service for credentials (none were configured)."""
    text = str(e)
    return any(m in text for m in _METADATA) or ("metadata" in text.lower() and "credential" in text.lower())
