"""Object storage (``s3://``, ``gs://``, and what fsspec reaches) and local files behind one
small facade.

Every URL dsv4enc reads or writes goes through here, and every choice between a local path and
a URL is made here (``is_url``): what is at a location (``examine``, asked once), how it is
listed (``walk``: a folder by ``os.scandir``, a prefix by its store's pages), stamped
(``stamp``), read (``open_input``, memory-mapped where local; ``read_range``, ``open_range``,
``open_whole``; a local file only when regular) and written (``upload_written``); ``locate``
gives a reader one file system for either. The file systems are pyarrow's, or fsspec's in
``pyarrow.fs.PyFileSystem``; an ``s3://`` read is one ranged GET through botocore's client
where the options allow (``DIRECT_OPTIONS``). A store that stops answering fails loudly, within
a bound the retry policy sets (``StoreHealth``). Messages name the URL and the kind of
failure, never an option value."""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import re
import shutil
import sys
import threading
import time
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from stat import S_ISREG
from typing import IO, TYPE_CHECKING, BinaryIO, Callable, Iterable, Iterator, Mapping, TypeVar

from .errors import StorageError, UsageError

if TYPE_CHECKING:
    import pyarrow.fs as pafs

log = logging.getLogger("dsv4enc")
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_OPTIONS_ENV = "DSV4ENC_STORAGE_OPTIONS"
#: Schemes whose first path component is a bucket that must exist.
_BUCKET_SCHEMES = frozenset({"s3", "s3a", "gs", "gcs"})
#: Attempts at a read or write that fails for a transient reason (after the SDK's own retries).
ATTEMPTS = 4
#: First wait between attempts, doubled each time.
BACKOFF_S = 0.5
#: The SDK's own tries per request and its time limits on S3 (set unless ``--storage-option``
#: gives them): what one attempt can take when the store does not answer.
SDK_ATTEMPTS = 3
CONNECT_TIMEOUT_S = 1.0
REQUEST_TIMEOUT_S = 3.0
#: What the SDK spends between its tries and on its clocks' granularity, per try.
SDK_SLACK_S = 1.0
#: Default of ``--storage-outage-s``: how long every call to a store may fail before a run stops.
OUTAGE_S = 60.0
_OUTAGE_ENV = "DSV4ENC_STORAGE_OUTAGE_S"
#: What carries ``configure`` and ``set_outage_s`` to child processes (decode workers, Ray actors).
SETTINGS_ENV = (_OPTIONS_ENV, _OUTAGE_ENV)
#: The error of a row whose input could not be read because its store was not answering: a
#: transient error (``images/decode.TRANSIENT_ERRORS``), its part is encoded again on --resume.
UNAVAILABLE = "storage unavailable"
#: The chunk of a streamed copy to or from a store.
COPY_BYTES = 8 << 20

T = TypeVar("T")


def is_url(path: object) -> bool:
    """Whether ``path`` names an object store location (``scheme://...``, not ``file://``)."""
    match = _URL.match(path) if isinstance(path, str) else None
    return match is not None and match.group(1).lower() != "file"


def lies_within(location: str, prefix: str) -> bool:
    """Whether the URL ``location`` is the URL ``prefix`` or lies under it (a trailing slash
    aside); a local path lies within no URL, nor a URL within a local path."""
    if not (is_url(location) and is_url(prefix)):
        return False
    location, prefix = location.rstrip("/"), prefix.rstrip("/")
    return location == prefix or location.startswith(prefix + "/")


def local_path(location: str) -> str | None:
    """The local path ``location`` names (``file://`` taken off), None for a URL."""
    if is_url(location):
        return None
    return location[len("file://"):] if location.lower().startswith("file://") else location


def read_at(location: str) -> str:
    """Where ``location`` is read: the local path it names (``file://`` taken off), else the
    URL; the location as given stays its name (an input's key)."""
    local = local_path(location)
    return location if local is None else local


def reads_are_requests(location: str) -> bool:
    """Whether each read of ``location`` is a request to a store: bytes read once are then
    worth holding (and a file worth streaming once), rather than read again."""
    return is_url(location)


def scheme_of(url: str) -> str:
    return url.split("://", 1)[0].lower()


def join(url: str, name: str) -> str:
    """``name`` (a relative, posix key) under the prefix ``url``."""
    return f"{url.rstrip('/')}/{name}"


# ----------------------------------------------------------------------------- options

def parse_option(text: str) -> tuple[str, object]:
    """``key=value`` from ``--storage-option``: ``true``/``false`` and numbers converted."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise UsageError(f"--storage-option expects KEY=VALUE, got {key or text!r}"
                         if not sep else "--storage-option expects KEY=VALUE")
    lowered = value.strip().lower()
    if lowered in ("true", "false"):
        return key, lowered == "true"
    for kind in (int, float):
        with suppress(ValueError):
            return key, kind(value)
    return key, value


def configure(options: list[str] | tuple[str, ...] | None) -> None:
    """Set ``--storage-option`` (the file system's constructor's keys) for this process and,
    through ``DSV4ENC_STORAGE_OPTIONS`` (never printed), its children; drop what was learnt
    under other options. Credentials otherwise come from the SDK's places (``AWS_*``)."""
    parsed = options_of(options)
    if parsed:
        os.environ[_OPTIONS_ENV] = json.dumps(parsed)
    else:
        os.environ.pop(_OPTIONS_ENV, None)
    with _LOCK:
        _FILESYSTEMS.clear()
        _DIRECT.clear()
    reset_health()


def set_outage_s(seconds: float) -> None:
    """``--storage-outage-s`` (positive: ``options.validate``) for this process and its children."""
    if seconds > 0:
        os.environ[_OUTAGE_ENV] = repr(float(seconds))


def outage_s() -> float:
    """How long every call to a store may fail before the store counts as down."""
    try:
        return float(os.environ.get(_OUTAGE_ENV) or OUTAGE_S)
    except ValueError:
        return OUTAGE_S


def _options() -> dict:
    text = os.environ.get(_OPTIONS_ENV)
    if not text:
        return {}
    try:
        return dict(json.loads(text))
    except (ValueError, TypeError):
        raise UsageError(f"{_OPTIONS_ENV} is not a JSON object") from None


# ----------------------------------------------------------------------------- file systems

_LOCK = threading.Lock()
#: File systems by scheme, process and options (``configure``'s, or a ``locate`` call's own).
_FILESYSTEMS: dict[tuple[str, int, str], "pafs.FileSystem"] = {}


def _endpoint(options: dict) -> str | None:
    """The S3 endpoint the options name (botocore's or pyarrow's key), else the environment's."""
    return (options.get("endpoint_url") or options.get("endpoint_override")
            or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None)


def _env_region() -> str | None:
    return os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")


def _s3(url: str, options: dict) -> "pafs.FileSystem":
    import pyarrow.fs as pafs

    kwargs = {key: value for key, value in options.items() if key != "endpoint_url"}
    endpoint = _endpoint(options)
    if endpoint:
        kwargs["endpoint_override"] = endpoint
    if "region" not in kwargs:
        region = _env_region()
        if region:
            kwargs["region"] = region
        elif not endpoint:  # a real AWS bucket: ask where it lives
            with suppress(OSError, ValueError):  # else the SDK's default; a wrong one fails clearly
                kwargs["region"] = pafs.resolve_s3_region(_bucket(url))
    # The SDK's own tries (quick backoff) and default timeouts, set for ``stop_bound_s`` to know.
    kwargs.setdefault("retry_strategy", pafs.AwsStandardS3RetryStrategy(max_attempts=SDK_ATTEMPTS))
    kwargs.setdefault("connect_timeout", CONNECT_TIMEOUT_S)
    kwargs.setdefault("request_timeout", REQUEST_TIMEOUT_S)
    return pafs.S3FileSystem(**kwargs)


def _bucket(url: str) -> str:
    return _bucket_key(url)[0]


def _bucket_key(url: str) -> tuple[str, str]:
    """A bucket URL's bucket and the key below it."""
    bucket, _, key = url.split("://", 1)[1].partition("/")
    return bucket, key


def _make_filesystem(url: str, options: dict) -> "pafs.FileSystem":
    import pyarrow.fs as pafs

    scheme = scheme_of(url)
    try:
        if scheme in ("s3", "s3a"):
            with suppress(ImportError):  # pyarrow built without S3: s3fs (dsv4enc[s3]) below
                return _s3(url, options)
        if scheme in ("gs", "gcs") and not options:
            # pyarrow built without GCS: fsspec's gcsfs below
            with suppress(OSError, ValueError, NotImplementedError, ImportError):
                return pafs.FileSystem.from_uri(url)[0]
        import fsspec

        return pafs.PyFileSystem(pafs.FSSpecHandler(fsspec.filesystem(
            "s3" if scheme == "s3a" else scheme, **options)))
    except ImportError as exc:
        extra = {"gs": "gcs", "gcs": "gcs", "s3": "s3", "s3a": "s3"}.get(scheme)
        raise UsageError(f"{scheme}:// needs an optional package ({exc.name or _first_line(exc)})"
                         + (f": pip install 'dsv4enc[{extra}]'" if extra else "")) from None
    except (TypeError, ValueError) as exc:
        # The message names the option, never its value.
        raise UsageError(f"{scheme}:// storage options not accepted: "
                         f"{type(exc).__name__}: {_first_line(exc)}") from None


def filesystem(url: str, options: dict | None = None) -> tuple["pafs.FileSystem", str]:
    """The file system for ``url`` (made once per process, scheme and options: ``options``,
    else ``configure``'s) and the path in it."""
    options = _options() if options is None else options
    key = (scheme_of(url), os.getpid(), json.dumps(options, sort_keys=True, default=str))
    with _LOCK:
        fs = _FILESYSTEMS.get(key)
        if fs is None:
            fs = _FILESYSTEMS[key] = _make_filesystem(url, options)
    return fs, url.split("://", 1)[1].rstrip("/")


def options_of(given: "Mapping[str, object] | Iterable[str] | None") -> dict | None:
    """Storage options as a dict: a mapping as it is, ``KEY=VALUE`` texts (``--storage-option``)
    parsed by ``parse_option``; None (or empty) for none given."""
    if not given:
        return None
    if isinstance(given, Mapping):
        return dict(given)
    return dict(parse_option(text) for text in given)


def locate(location: "str | os.PathLike",
           options: "Mapping[str, object] | Iterable[str] | None" = None
           ) -> tuple["pafs.FileSystem", str]:
    """The pyarrow file system that reads ``location`` and its path there: a URL's (``options``
    for this call, else ``configure``'s), or the local one, which memory-maps what it opens.
    A URL stays a string throughout (``pathlib`` would make ``s3://b`` into ``s3:/b``)."""
    import pyarrow.fs as pafs

    text = os.fspath(location)
    local = local_path(text)
    if local is not None:
        return pafs.LocalFileSystem(use_mmap=True), os.path.abspath(local)
    return filesystem(text, options_of(options))


# ----------------------------------------------------------------------------- errors

def _first_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return re.sub(r"\s*\(Request ID: [^)]*\)", "", text)[:300]


#: How a message names a client that found no credentials anywhere it looks.
NO_CREDENTIALS = ("no credentials found (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                  "AWS_PROFILE, or --storage-option access_key=... secret_key=...)")


def setup_problem(exc: BaseException) -> str | None:
    """``"bucket not found"`` / ``"access denied"`` / no credentials when ``exc`` says so
    (not transient)."""
    text = str(exc).upper()
    if re.search("NO_SUCH_BUCKET|NOSUCHBUCKET|NO SUCH BUCKET|BUCKET DOES NOT EXIST", text):
        return "bucket not found"
    if NO_CREDENTIALS.upper() in text:
        return NO_CREDENTIALS
    if isinstance(exc, PermissionError) or re.search(
            "ACCESS_DENIED|ACCESSDENIED|FORBIDDEN|INVALIDACCESSKEYID|SIGNATUREDOESNOTMATCH", text):
        return "access denied (check the credentials and the bucket's permissions)"
    return None


def describe(url: str, exc: BaseException) -> str:
    """One line about a failed storage call: the URL and what went wrong (no option values)."""
    cause = outage_cause(exc)
    if cause is not None:
        return f"{url}: the store is not answering ({cause})"
    return f"{url}: {setup_problem(exc) or _first_line(exc)}"


def setup_error(url: str, exc: BaseException) -> StorageError:
    return StorageError(describe(url, exc))


@contextmanager
def _setup_errors(url: str) -> Iterator[None]:
    """An ``OSError`` in the block raised as the ``StorageError`` of ``setup_error``; so is a
    ``ValueError``: pyarrow's refusal of a URL it cannot address (a key with ``//`` in it)."""
    try:
        yield
    except (OSError, ValueError) as exc:
        raise setup_error(url, exc) from None


def store_of(url: str) -> str:
    """The store a URL is in, as messages name it: ``s3://bucket`` (whatever the scheme)."""
    return f"{scheme_of(url)}://{_bucket(url)}"


#: errno values of a store that is not answering, by what a message calls them.
_OUTAGE_ERRNOS = {errno.ECONNREFUSED: "connection refused", errno.ETIMEDOUT: "timed out",
                  errno.ECONNRESET: "connection lost", errno.ECONNABORTED: "connection lost",
                  errno.EPIPE: "connection lost", errno.EHOSTUNREACH: "connection refused",
                  errno.ENETUNREACH: "connection refused"}
#: The built-in error of each outage cause, as pyarrow's client would raise it.
_OUTAGE_TYPES = {"connection refused": ConnectionRefusedError, "timed out": TimeoutError,
                 "connection lost": ConnectionError}
#: S3 error codes of a store that is busy or failing (botocore's ``Error.Code``).
_BUSY_CODES = {"SlowDown": "slow down", "Throttling": "throttling",
               "ThrottlingException": "throttling", "RequestLimitExceeded": "throttling",
               "ServiceUnavailable": "service unavailable", "InternalError": "internal failure"}


class ServerError(OSError):
    """A store answered that it is failing or busy (HTTP 5xx, a throttling code): an outage."""

    def __init__(self, message: str, cause: str) -> None:
        super().__init__(message)
        self.cause = cause


def outage_cause(exc: BaseException) -> str | None:
    """Why a store is not answering (``"timed out"``, ...), or None (a missing object, ...): by
    the errors' kinds along the ``__cause__`` chain, else by the message (``_message_cause``)."""
    if isinstance(exc, FileNotFoundError) or setup_problem(exc) is not None:
        return None
    seen: BaseException | None = exc
    for _ in range(8):  # a chain's first links; a cycle would not end
        if seen is None:
            break
        cause = _typed_cause(seen)
        if cause is not None:
            return cause
        seen = seen.__cause__ or seen.__context__
    return _message_cause(str(exc).upper())


def _typed_cause(exc: BaseException) -> str | None:
    if isinstance(exc, (StoreUnavailable, ServerError)):
        return exc.cause
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, OSError) and exc.errno in _OUTAGE_ERRNOS:
        return _OUTAGE_ERRNOS[exc.errno]
    if isinstance(exc, ConnectionError):
        return "connection lost"
    boto = sys.modules.get("botocore.exceptions")  # only where botocore is in use
    if boto is not None and isinstance(exc, boto.ClientError):
        return _answer_cause(exc.response)
    if boto is not None and isinstance(exc, (boto.ConnectTimeoutError, boto.ReadTimeoutError)):
        return "timed out"
    if boto is not None and isinstance(exc, boto.EndpointConnectionError):
        return "connection refused"
    if boto is not None and isinstance(exc, (boto.ConnectionError, boto.HTTPClientError)):
        return "connection lost"
    return None


def _answer_cause(response: dict) -> str | None:
    """The outage a store's error answer (botocore's ``response``) reports, or None."""
    code = str(response.get("Error", {}).get("Code", ""))
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    if code in _BUSY_CODES:
        return f"server error ({_BUSY_CODES[code]})"
    if isinstance(status, int) and status >= 500:
        return f"server error (HTTP {status})"
    return None


def _message_cause(text: str) -> str | None:
    """The cause in a message (pyarrow's ``OSError``): its AWS SDK's and libcurl's phrases
    (``curlCode: 7`` refused, ``28`` timed out, ``52/55/56`` lost) and S3 error names, checked
    against the messages of the installed pyarrow and earlier ones (test_storage_outage.py)."""
    if re.search(r"CURLCODE: 7,|COULD NOT CONNECT|COULDN'T CONNECT|CONNECTION REFUSED"
                 r"|FAILED TO CONNECT", text):
        return "connection refused"
    if re.search(r"CURLCODE: 28,|TIMEOUT WAS REACHED|TIMED OUT|REQUEST_TIMEOUT", text):
        return "timed out"
    status = re.search(r"HTTP (?:STATUS|RESPONSE CODE)[: ]*(5\d\d)", text)
    if status is not None:
        return f"server error (HTTP {status.group(1)})"
    for name in ("SERVICE_UNAVAILABLE", "INTERNAL_FAILURE", "SLOW_DOWN", "THROTTLING"):
        if name in text:
            return f"server error ({name.lower().replace('_', ' ')})"
    if re.search(r"NETWORK_CONNECTION|CURLCODE: (52|55|56),", text):
        return "connection lost"
    return None


class StoreUnavailable(OSError):
    """A call to a store that is not answering gave up (after its retries, or at once for a
    store that is down). Its message is an input row's error: ``UNAVAILABLE`` first."""

    def __init__(self, store: str, cause: str, since: float) -> None:
        super().__init__(f"{UNAVAILABLE}: {store}: {cause}")
        self.store, self.cause, self.since = store, cause, since


class StoreDown(StorageError):
    """A store failed every call for ``outage_s()``: the run stops (one line, exit 1)."""

    def __init__(self, store: str, cause: str, seconds: float) -> None:
        self.store, self.cause, self.seconds = store, cause, seconds
        self.again = "--resume"  # the flag that finishes the run (an --update's: --update)
        self.kept = "finished parts are kept"
        super().__init__(self._line())

    def _line(self) -> str:
        # --resume (or --update) also starts afresh where nothing was kept: it always works
        return (f"{self.store}: the store stopped answering ({self.cause}) for "
                f"{self.seconds:.0f} s; {self.kept}; rerun with {self.again} when it is back")

    def keep(self, parts: int | None, where: str, again: str | None = None) -> None:
        """Say what the run leaves: ``parts`` finished parts kept in ``where`` (None: not
        known here); ``again``: the flag that finishes the run (by default the one set before)."""
        self.again = again or self.again
        if parts is not None:
            self.kept = (f"{parts} finished part{'s are' if parts != 1 else ' is'} kept in "
                         f"{where}" if parts else "no part was finished")
        self.args = (self._line(),)

    def __reduce__(self):  # pickled between ranks with every field (``kept`` and its line)
        state = {**self.__dict__, "args": self.args}
        return StoreDown, (self.store, self.cause, self.seconds), state


def down_error(url: str, exc: BaseException) -> StoreDown | None:
    """The ``StoreDown`` for a call to ``url`` that failed on an outage (``exc``), or None."""
    cause = outage_cause(exc)
    if cause is None:
        return None
    record = health(store_of(url))
    if record.since is None:
        record.failed(cause)
    return record.error()


_wall = time.time  # not ``time.time``: tests replace this module's ``time`` to record sleeps


class StoreHealth:
    """Since when every call of this process to one store has failed, and why. Thread-safe.

    A call whose retries (``retrying``) are all spent on an outage (``outage_cause``) marks its
    store as failing since the first of those failures; any answer clears the mark. A store
    that has failed for ``outage_s()`` is down: calls fail at once (``StoreUnavailable``) and
    ``check_stores`` raises ``StoreDown``."""

    def __init__(self, store: str) -> None:
        self.store = store
        self.since: float | None = None  # wall time of the first failure of the outage
        self.cause = ""
        self.declared: float | None = None  # when it was found down
        self._probed = 0.0  # the last attempt let through while down
        self._given_up = False  # the run stops on this store's account: down already
        self._lock = threading.Lock()

    def answered(self) -> None:
        if self.since is not None:
            with self._lock:
                self.since = self.declared = None
                self._given_up = False

    def failed(self, cause: str, since: float | None = None) -> None:
        """A call gave up on an outage that began at ``since`` (wall time; default now)."""
        since = _wall() if since is None else since
        with self._lock:
            if self.since is None or since < self.since:
                self.since = since
            self.cause = cause

    def down(self) -> bool:
        """Whether the store has failed every call for ``outage_s()``."""
        since = self.since
        if since is None or (_wall() - since < outage_s() and not self._given_up):
            return False
        with self._lock:
            if self.declared is None:
                self.declared = self._probed = _wall()
        return True

    def fail_fast(self) -> None:
        """Raise ``StoreUnavailable`` at once when the store is down; once every
        ``outage_s()`` an attempt is let through, so that a store that is back is seen."""
        if not self.down():
            return
        with self._lock:
            if _wall() - self._probed >= outage_s():
                self._probed = _wall()
                return
        raise StoreUnavailable(self.store, self.cause, self.since or _wall())

    def error(self, give_up: bool = True) -> StoreDown:
        """The run's one line about this store. ``give_up``: the run stops on its account, so
        calls to it now fail at once (a quick clean-up), as for a store that is down."""
        with self._lock:
            if give_up and self.since is not None and not self._given_up:
                self._given_up = True
                self.declared = self._probed = _wall()
        return StoreDown(self.store, self.cause, _wall() - (self.since or _wall()))


_HEALTH: dict[str, StoreHealth] = {}


def health(store: str) -> StoreHealth:
    """The health record of ``store`` (``store_of``) in this process."""
    found = _HEALTH.get(store)
    if found is None:
        with _LOCK:
            found = _HEALTH.setdefault(store, StoreHealth(store))
    return found


def reset_health() -> None:
    """Forget what calls learnt about the stores (a new run)."""
    with _LOCK:
        _HEALTH.clear()


def note_row(location: str, error: str | None, since: float | None = None) -> bool:
    """What a decode worker found reading ``location``, for this process's health record of its
    store: an answer, or (``since``: when its outage began) a store not answering. Returns
    whether ``location`` is in a store (a local path is noted nowhere)."""
    if not is_url(location):
        return False
    record = health(store_of(location))
    if error is None:
        record.answered()
    elif since is not None and error.startswith(UNAVAILABLE):
        record.failed(error.rsplit(": ", 1)[-1], since)
    return True


def read_outage(location: object, exc: BaseException) -> tuple[str, float | None] | None:
    """An input row's error for a read of ``location`` that failed with ``exc`` on an outage
    of its store (a transient ``UNAVAILABLE`` one), and when the outage began; None for any
    other failure, and for a local path. The store's health record learns of it."""
    if not isinstance(exc, OSError) or not is_url(location):
        return None
    cause = outage_cause(exc)
    if cause is None:
        return None
    store = store_of(location)
    record = health(store)
    record.failed(cause)
    return f"{UNAVAILABLE}: {store}: {cause}", record.since


def check_stores() -> None:
    """Raise ``StoreDown`` for a store that has been down for ``outage_s()``."""
    for record in list(_HEALTH.values()):
        if record.down():
            raise record.error()


def failing_store(give_up: bool = False) -> StoreDown | None:
    """The error of a store that failed its last calls (for however long), or None.
    ``give_up``: the run stops on its account (``StoreHealth.error``)."""
    for record in list(_HEALTH.values()):
        if record.since is not None:
            return record.error(give_up)
    return None


def attempt_bound_s(options: dict | None = None) -> float:
    """The longest one attempt (the SDK's tries of a request) takes when the store is silent."""
    options = _options() if options is None else options
    connect = float(options.get("connect_timeout") or CONNECT_TIMEOUT_S)
    request = float(options.get("request_timeout") or REQUEST_TIMEOUT_S)
    return SDK_ATTEMPTS * (connect + request + SDK_SLACK_S)


def stop_bound_s(outage: float | None = None, options: dict | None = None) -> float:
    """How long after a store's last answer a run that needs it ends: its first failure is seen
    within one attempt, the store is down ``outage`` s later, the attempts in flight end within
    one more, and the clean-up fails at once (one more at most), plus the batch in progress."""
    outage = outage_s() if outage is None else outage
    return outage + 3 * attempt_bound_s(options)


def retrying(what: Callable[[], T], *, store: str) -> T:
    """``what()``, tried again after ``BACKOFF_S`` (doubled, ``ATTEMPTS`` tries in all) on an
    ``OSError`` but a setup problem or a missing object (the SDK retries first). Spending them on
    an outage, or finding ``store`` down (between tries too), raises ``StoreUnavailable``; so
    does an outage that has lasted ``outage_s()`` within the call, so that a short
    ``--storage-outage-s`` is not outlasted by one call's tries (``stop_bound_s``)."""
    record = health(store)
    first_failure: float | None = None
    for attempt in range(ATTEMPTS):
        record.fail_fast()
        try:
            result = what()
        except OSError as exc:
            last = attempt == ATTEMPTS - 1
            cause = outage_cause(exc)
            if cause is None:
                record.answered()  # an answer, if not the one hoped for
                if last or isinstance(exc, (FileNotFoundError, FileExistsError)) \
                        or setup_problem(exc) is not None:
                    raise
            else:
                first_failure = first_failure or _wall()
                if last or _wall() - first_failure >= outage_s():
                    record.failed(cause, first_failure)
                    raise StoreUnavailable(store, cause, record.since or first_failure) from exc
        else:
            record.answered()
            return result
        time.sleep(BACKOFF_S * 2 ** attempt)
    raise AssertionError("unreachable")


# ----------------------------------------------------------------------------- reading

@dataclass(frozen=True)
class ObjectInfo:
    """A listed object or local file: where it is read (``url``), its key below the listed
    location, size (None for a local file), mtime and S3's ETag."""

    url: str
    key: str
    size: int | None
    mtime_ns: int | None
    etag: str | None = None


#: What listings saw, by URL: ``stamp`` then needs no request per object.
_SEEN: dict[str, ObjectInfo] = {}


def _seen(url: str, key: str, size: int | None, mtime_ns: int | None,
          etag: str | None = None) -> ObjectInfo:
    found = _SEEN[url] = ObjectInfo(url, key, int(size or 0), mtime_ns, etag)
    return found


@dataclass(frozen=True)
class Found:
    """What an input names, asked once: ``kind`` (``"file"``, ``"folder"`` or ``"missing"``);
    ``size``: an object's, from the store's answer (None for a local file: read when opened);
    ``regular``: a regular file or an object (a container is read only from one); ``link``: a
    local symbolic link; ``remote``: each read is a request to a store (bytes read once are
    worth holding, a file worth streaming once); ``posix``: the location as posix text without
    a trailing slash (a URL as given: ``pathlib`` would make ``s3://b`` into ``s3:/b``, and
    ``file:///x`` into ``file:/x``); ``path``: where it is read (``read_at``)."""

    location: str
    kind: str
    posix: str
    size: int | None = None
    regular: bool = False
    link: bool = False
    remote: bool = False

    @property
    def path(self) -> str:
        return read_at(self.location)


def examine(location: str) -> Found:
    """What is at ``location``: a local path is a folder, a file (links and special files
    included: their rows say what they are) or missing; a URL is asked (``kind``)."""
    local = local_path(location)
    if local is not None:
        from pathlib import Path

        # a ``file://`` location keeps its scheme as given (its keys are the input's text)
        posix = location[:len(location) - len(local)] + Path(local).as_posix().rstrip("/")
        if os.path.isdir(local):
            return Found(location, "folder", posix)
        return Found(location, "file" if os.path.lexists(local) else "missing", posix,
                     regular=os.path.isfile(local), link=os.path.islink(local))
    what, posix = kind(location), location.rstrip("/")
    size = stat(location).size if what == "file" else None
    return Found(location, what, posix, size, regular=what == "file", remote=True)


def kind(url: str) -> str:
    """``"file"``, ``"folder"`` (a prefix with objects under it, or a bucket) or
    ``"missing"``; ``url`` ending in ``/`` is a prefix, never the object of its name. A missing
    bucket or a denied permission is a ``StorageError``."""
    import pyarrow.fs as pafs

    fs, path = filesystem(url)
    with _setup_errors(url):
        info = retrying(lambda: fs.get_file_info(path), store=store_of(url))
        if info.type == pafs.FileType.File and not url.endswith("/"):
            _seen(url, url, info.size, info.mtime_ns)
            return "file"
        if info.type == pafs.FileType.Directory:
            return "folder"
        _check_bucket(url)
        if "/" not in path:  # a bucket that exists but lists as nothing
            return "missing"
        # Some stores report a prefix only through a listing.
        selector = pafs.FileSelector(path, recursive=False, allow_not_found=True)
        listed = retrying(lambda: fs.get_file_info(selector), store=store_of(url))
        return "folder" if listed else "missing"


def _check_bucket(url: str) -> None:
    """A ``StorageError`` when the bucket of ``url`` does not exist."""
    if scheme_of(url) not in _BUCKET_SCHEMES:  # no buckets (memory://, ...): nothing to check
        return
    fs, _ = filesystem(url)
    found = retrying(lambda: fs.get_file_info(_bucket(url)), store=store_of(url))
    if found.type.name == "NotFound":
        raise StorageError(f"{store_of(url)}: bucket not found")


def list_files(url: str) -> list[ObjectInfo]:
    """The objects under the prefix ``url``, recursively, sorted by key (its posix path below
    the prefix). A missing bucket or a denied permission is a ``StorageError``."""
    return list(iter_files(url))


def iter_files(url: str) -> Iterator[ObjectInfo]:
    """``list_files`` as it is listed: on S3 (botocore's client) by pages of 1,000 in key order
    (UTF-8 bytes, as ``sorted``), a caller starting on the first; elsewhere all at once."""
    client = _direct(url)
    if client is not None:
        yield from _pages(client, url)
        return
    import pyarrow.fs as pafs

    fs, path = filesystem(url)
    selector = pafs.FileSelector(path, recursive=True, allow_not_found=True)
    with _setup_errors(url):
        infos = retrying(lambda: fs.get_file_info(selector), store=store_of(url))
        if not infos:
            _check_bucket(url)
    prefix = f"{path.strip('/')}/"  # fsspec's paths may start with a slash, pyarrow's do not
    found = []
    for info in infos:
        full = info.path.lstrip("/")
        if info.type == pafs.FileType.File and full.startswith(prefix):
            key = full[len(prefix):]
            found.append(_seen(join(url, key), key, info.size, info.mtime_ns))
    yield from sorted(found, key=lambda o: o.key)


def _pages(client, url: str) -> Iterator[ObjectInfo]:
    """The objects under the S3 prefix ``url`` by retried ListObjectsV2 pages, less ``dir/``."""
    bucket, path = _bucket_key(url)
    prefix = f"{path.strip('/')}/" if path.strip("/") else ""
    args = {"Bucket": bucket, "Prefix": prefix}
    while True:
        with _setup_errors(url):
            try:
                page = retrying(lambda: _boto(url, lambda: client.list_objects_v2(**args)),
                                store=store_of(url))
            except FileNotFoundError:  # no such bucket: the message of every other listing
                page = {}
            if "ContinuationToken" not in args and not page.get("Contents"):  # the first page
                _check_bucket(url)
        for entry in page.get("Contents", []):
            key = entry["Key"][len(prefix):]
            if key and not key.endswith("/"):
                modified = entry.get("LastModified")
                mtime = int(modified.timestamp() * 1e9) if modified is not None else None
                yield _seen(join(url, key), key, entry.get("Size"), mtime,
                            str(entry.get("ETag") or "") or None)
        if not page.get("IsTruncated"):
            return
        args["ContinuationToken"] = page["NextContinuationToken"]


def stat(url: str) -> ObjectInfo:
    """Size and modification time of the object ``url`` (from a listing when one saw it)."""
    seen = _SEEN.get(url)
    if seen is not None:
        return seen
    fs, path = filesystem(url)
    info = retrying(lambda: fs.get_file_info(path), store=store_of(url))
    if info.type.name != "File":
        raise FileNotFoundError(f"{url}: no such object")
    return _seen(url, url, info.size, info.mtime_ns)


def stamp(location: str) -> str:
    """What decides whether an input is the one encoded before (``--resume``), or why it cannot
    be looked at. A local file: size, mtime (ns), inode and mode (a file replaced, or made
    readable, differs; not the device, which a remount changes). An object: its size and the
    listing's ETag, else its modification time (a new upload changes both)."""
    if not is_url(location):
        try:
            st = os.stat(location)
        except OSError as exc:
            return f"unreadable {exc.errno}"
        except ValueError:  # a name no file can have (a NUL byte): its read says so as a row
            return "unreadable name"
        return f"{st.st_size} {st.st_mtime_ns} {st.st_ino} {st.st_mode:o}"
    try:
        info = stat(location)
    except OSError as exc:
        return f"unreadable {describe(location, exc)}"
    return f"{info.size} {info.etag or info.mtime_ns}"


def whole_if_stored(source: "str | bytes") -> "str | bytes":
    """What a decoder opens for ``source`` (a path, a URL or bytes): an object in a store read
    whole, in one request where the client allows; a local path (``file://`` taken off) or
    bytes as they are."""
    if not isinstance(source, str):
        return source
    return read_bytes(source) if is_url(source) else read_at(source)


def open_input(location: str):
    """A seekable file (``pyarrow.NativeFile``) over an object, each read a ranged request, or
    over a local regular file, memory-mapped (a map of a FIFO would wait in its open)."""
    path = local_path(location)
    if path is not None:
        import pyarrow as pa

        require_regular(path)
        return pa.memory_map(path, "r")
    fs, path = filesystem(location)
    return retrying(lambda: fs.open_input_file(path), store=store_of(location))


def read_range(location: str, offset: int, size: int) -> bytes:
    """``size`` bytes of a local regular file or an object from ``offset``: one read (one
    ranged request, retried), into the bytes returned. Zero bytes of an object (a tar's empty
    member) are no request: the caller has no use for the size that ``_read`` would ask."""
    if is_url(location):
        return b"" if size == 0 else _read(location, offset, size)[0]
    with open_regular(location) as handle:
        handle.seek(offset)
        return handle.read(size)


def read_head(url: str, size: int) -> tuple[bytes, int]:
    """The first ``size`` bytes (fewer if smaller) and the object's size: one GET where it can."""
    return _read(url, 0, size)


def read_object(url: str) -> bytes:
    """The whole object, in one request where the client allows (retried)."""
    return _read(url, 0, None)[0]


def read_bytes(url: str) -> bytes:
    """The whole object, through the file system (retried)."""
    return _read(url, 0, None, direct=False)[0]


def _read(url: str, offset: int, size: int | None, direct: bool = True) -> tuple[bytes, int]:
    """``size`` bytes from ``offset`` (None: to the end) and the object's size, retried: one
    GET through botocore's client (``_direct``) where it serves, else the file system's."""
    client = _direct(url) if direct else None
    if client is not None:
        return retrying(lambda: _get(client, url, offset, size), store=store_of(url))
    fs, path = filesystem(url)

    def attempt() -> tuple[bytes, int]:
        with fs.open_input_file(path) as handle:
            total = handle.size()
            if size is None:
                return handle.read(), total
            return handle.read_at(min(size, total), offset), total

    return retrying(attempt, store=store_of(url))


def open_stream(url: str):
    """A file over the object, ``read`` once in order (one streamed GET after pyarrow's HEAD)."""
    fs, path = filesystem(url)
    return retrying(lambda: fs.open_input_stream(path), store=store_of(url))


def open_whole(location: str) -> tuple[BinaryIO, int]:
    """A buffered file over all of a local regular file or an object, read in order, and its
    size: an object is read by one streamed request (``open_range``'s ``streamed``)."""
    if not is_url(location):
        handle = open_regular(location)
        return handle, os.fstat(handle.fileno()).st_size
    size = stat(location).size
    return open_range(location, 0, size, streamed=True, buffer_size=1 << 20), size


def open_range(location: str, start: int, size: int, head: bytes = b"",
               streamed: bool = False, buffer_size: int = 64 << 10) -> BinaryIO:
    """A buffered, seekable file over ``size`` bytes of ``location`` from ``start`` (``_Range``)."""
    return io.BufferedReader(_Range(location, start, size, head, streamed), buffer_size)


#: The last bytes a streamed ``_Range`` keeps: a tar's end-of-archive blocks (its last record,
#: 10 KiB as a rule) are read again from them, not by a request.
_TAIL_BYTES = 64 << 10


class _Range(io.RawIOBase):
    """A read-only file over ``size`` bytes of a file or an object from ``start``, the first of
    them in ``head`` already. Each read past ``head`` is one ``read_range`` (in a store, one
    ranged request), unless ``streamed``: one request then streams the object
    (``open_stream``), a seek forward reads past the bytes between, and only a read behind its
    last ``_TAIL_BYTES`` is ranged."""

    def __init__(self, location: str, start: int, size: int, head: bytes = b"",
                 streamed: bool = False) -> None:
        self._location, self._start, self._size, self._pos = location, start, size, 0
        self._kept, self._kept_at = head, 0  # bytes read already, and where they start
        self._stream = open_stream(location) if streamed and is_url(location) else None
        self._at = 0  # where the stream is

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer) -> int:
        n = max(0, min(len(buffer), self._size - self._pos))
        if n == 0:
            return 0
        skip = self._pos - self._kept_at
        if 0 <= skip < len(self._kept):
            data = self._kept[skip:skip + n]
        elif self._stream is not None and self._pos >= self._at:
            data = self._read_on(n)
        else:
            data = read_range(self._location, self._start + self._pos, n)
        buffer[:len(data)] = data
        self._pos += len(data)
        return len(data)

    def _read_on(self, n: int) -> bytes:
        """``n`` bytes from the stream at the reader's position, past what it skips."""
        while self._at < self._pos:
            skipped = self._stream.read(min(1 << 20, self._pos - self._at))
            if not skipped:
                return b""
            self._keep(skipped)
        data = self._stream.read(n)
        self._keep(data)
        return data

    def _keep(self, data: bytes) -> None:
        self._at += len(data)
        if len(data) < _TAIL_BYTES:
            data = self._kept + data
        self._kept = data[-_TAIL_BYTES:]
        self._kept_at = self._at - len(self._kept)

    def close(self) -> None:
        if not self.closed and self._stream is not None:
            self._stream.close()
        super().close()


# ----------------------------------------------------------------------------- local files

NOT_REGULAR = "not a regular file (a folder, FIFO, socket or device)"


class NotRegularFile(OSError):
    """A local path that names a FIFO, socket or device: opening or reading it could wait
    forever, so a container there is an error row at once."""

    def __init__(self) -> None:
        super().__init__(errno.EINVAL, NOT_REGULAR)

    def __str__(self) -> str:
        return NOT_REGULAR


def require_regular(path: str) -> None:
    """Raise ``NotRegularFile`` unless the local ``path`` (links followed) is a regular file."""
    if not S_ISREG(os.stat(path).st_mode):
        raise NotRegularFile()


def open_regular(path: str) -> BinaryIO:
    """``open(path, "rb")`` of a regular file only (else ``NotRegularFile``): opened without
    blocking (a FIFO's open waits for a writer), checked on the open file (a path swapped
    meanwhile is seen), then made blocking again for plain reads."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        if not S_ISREG(os.fstat(fd).st_mode):
            raise NotRegularFile()
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def walk(location: str, skips: Callable[[str, str], bool], unlisted: list[tuple[str, str]],
         should_stop: Callable[[], bool] | None = None) -> Iterator[ObjectInfo]:
    """The files under a local folder or a prefix, as they are listed: a prefix's objects in
    its listing's order (``iter_files``), a folder's files and links (``_walk_folder``, whose
    ``size`` is None); ``url`` is where each is read, ``key`` its posix path below
    ``location``. What ``skips(name, path below location)`` holds for is left out, with every
    file under it. ``should_stop`` is polled once per entry: when it turns true, the walk ends."""
    listing = (_walk_folder(location, skips, unlisted) if not is_url(location)
               else (info for info in iter_files(location) if not _skips_key(skips, info.key)))
    for info in listing:
        if should_stop is not None and should_stop():
            return
        yield info


def _skips_key(skips: Callable[[str, str], bool], key: str) -> bool:
    """Whether ``skips`` leaves the object ``key`` out: it, or a folder on its way."""
    parts = key.split("/")
    return any(skips(part, "/".join(parts[:i + 1])) for i, part in enumerate(parts))


def _list_folder(folder: str) -> list[os.DirEntry]:
    """A folder's entries, sorted by name. Raises OSError when it cannot be listed."""
    with os.scandir(folder) as scan:
        return sorted(scan, key=lambda e: e.name)


def _walk_folder(root: str, skips: Callable[[str, str], bool],
                 unlisted: list[tuple[str, str]]) -> Iterator[ObjectInfo]:
    """``walk`` of a local folder: depth-first, entries sorted by name (keys in pathlib order:
    ``b/z.png`` before ``b-c.gif``), symlinked folders followed once each; iterative, holding
    only the folders on the walked path. A folder that cannot be listed (no permission, a path
    past PATH_MAX) is appended to ``unlisted`` as ``(path, reason)``."""
    seen_dirs: set[tuple[int, int]] = set()
    # Frames: a folder's remaining entries (reversed: pop() takes the next), its path in root.
    stack: list[tuple[list[os.DirEntry], str]] = []

    def enter(folder: str, rel: str) -> None:
        try:
            info = os.stat(folder)
            if (info.st_dev, info.st_ino) not in seen_dirs:
                seen_dirs.add((info.st_dev, info.st_ino))
                stack.append((_list_folder(folder)[::-1], rel))
        except OSError as exc:
            reason = exc.strerror or " ".join(str(exc).split()) or type(exc).__name__
            unlisted.append((folder, reason))

    enter(root, "")
    while stack:
        entries, rel = stack[-1]
        if not entries:
            stack.pop()
            continue
        entry = entries.pop()
        child_rel = f"{rel}/{entry.name}" if rel else entry.name
        if skips(entry.name, child_rel):
            continue
        try:
            is_dir = entry.is_dir(follow_symlinks=True)
            is_file = not is_dir and entry.is_file(follow_symlinks=True)
        except OSError:
            is_dir = is_file = False
        if is_dir:
            enter(entry.path, child_rel)
        elif is_file or entry.is_symlink():  # a dangling link still gets its (error) row
            yield ObjectInfo(entry.path, child_rel, None, None)


# ----------------------------------------------------------------------------- single GETs

#: ``--storage-option`` keys botocore takes as pyarrow does: with only these, an ``s3://`` read
#: is one ranged GET through botocore (pyarrow sends a HEAD before each), else pyarrow's.
DIRECT_OPTIONS = frozenset({"endpoint_url", "endpoint_override", "scheme", "region",
                            "access_key", "secret_key", "session_token", "anonymous",
                            "connect_timeout", "request_timeout"})
#: Connections botocore keeps open: above the header probes' 16 threads, so none reopens per read.
DIRECT_CONNECTIONS = 64
_DIRECT: dict[int, object] = {}  # by process: a botocore S3 client, or None (pyarrow reads)


def _direct(url: str):
    """This process's botocore S3 client for ``s3://`` reads, or None (then pyarrow reads)."""
    if scheme_of(url) not in ("s3", "s3a"):
        return None
    pid = os.getpid()
    if pid not in _DIRECT:
        with _LOCK:
            if pid not in _DIRECT:
                _DIRECT[pid] = _make_direct(_options())
    return _DIRECT[pid]


def _make_direct(options: dict):
    if not set(options) <= DIRECT_OPTIONS:
        return None
    try:
        import botocore.config
        import botocore.session
    except ImportError:
        return None
    endpoint = _endpoint(options)
    if endpoint and "://" not in endpoint:
        endpoint = f"{options.get('scheme', 'https')}://{endpoint}"
    config = botocore.config.Config(
        connect_timeout=float(options.get("connect_timeout") or CONNECT_TIMEOUT_S),
        read_timeout=float(options.get("request_timeout") or REQUEST_TIMEOUT_S),
        retries={"max_attempts": SDK_ATTEMPTS, "mode": "standard"},
        max_pool_connections=DIRECT_CONNECTIONS,
        signature_version=botocore.UNSIGNED if options.get("anonymous") else None)
    return botocore.session.get_session().create_client(
        "s3", endpoint_url=endpoint, region_name=options.get("region") or _env_region(),
        config=config, aws_access_key_id=options.get("access_key"),
        aws_secret_access_key=options.get("secret_key"),
        aws_session_token=options.get("session_token"))


def _boto(url: str, call: Callable[[], T]) -> T:
    """``call()`` of botocore's client, its errors as the ``OSError`` that pyarrow's client
    would raise; an InvalidRange answer is left as botocore's ClientError."""
    from botocore import exceptions as boto

    try:
        return call()
    except boto.ClientError as exc:
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        if code == "InvalidRange":
            raise
        if code in ("NoSuchKey", "404", "NoSuchBucket"):
            what = "bucket" if code == "NoSuchBucket" else "object"
            raise FileNotFoundError(f"{url}: no such {what}") from None
        if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            raise PermissionError(f"{url}: {code}") from None
        busy = _answer_cause(exc.response)
        if busy is not None:
            raise ServerError(f"{url}: {busy}: {code}", busy) from None
        raise OSError(f"{url}: {code}: {error.get('Message', '')}") from None
    except (boto.ConnectionError, boto.HTTPClientError, boto.IncompleteReadError) as exc:
        cause = _typed_cause(exc) or "connection lost"
        raise _OUTAGE_TYPES[cause](f"{url}: {cause} ({exc})") from None
    except boto.NoCredentialsError:
        raise PermissionError(f"{url}: {NO_CREDENTIALS}") from None
    except boto.BotoCoreError as exc:  # a setup the client refuses (partial credentials, ...)
        raise OSError(f"{url}: {exc}") from None


def _get(client, url: str, offset: int, size: int | None) -> tuple[bytes, int]:
    """One GET of ``size`` bytes from ``offset`` (None: to the end), and the object's size;
    zero bytes are one HEAD, since no range names zero bytes (S3 answers an invalid one with
    the whole object) and the size is still the object's."""
    from botocore import exceptions as boto

    bucket, key = _bucket_key(url)
    end = "" if size is None else offset + size - 1
    if size == 0:
        answer = _boto(url, lambda: client.head_object(Bucket=bucket, Key=key))
        return b"", int(answer["ContentLength"])

    def ranged() -> tuple[dict, bytes]:
        answer = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={offset}-{end}")
        return answer, answer["Body"].read()

    try:
        answer, data = _boto(url, ranged)
    except boto.ClientError as exc:  # from past the end (an empty object's every range)
        return b"", int(exc.response.get("Error", {}).get("ActualObjectSize") or 0)
    span = answer.get("ContentRange") or ""
    total = int(span.rsplit("/", 1)[1]) if "/" in span else offset + len(data)
    return data, total


# ----------------------------------------------------------------------------- writing

def exists(url: str) -> bool:
    fs, path = filesystem(url)
    with _setup_errors(url):
        return retrying(lambda: fs.get_file_info(path), store=store_of(url)).type.name != "NotFound"


def upload(url: str, data: bytes) -> None:
    """Write ``data`` as the complete object ``url``: it appears whole or not at all."""
    _put(url, lambda: io.BytesIO(data))


def upload_file(path: "str | os.PathLike", url: str) -> None:
    """Copy the local file ``path`` to the object ``url``, streamed (multipart when large): it
    appears whole or not at all, with no folder markers (``pyarrow.fs.copy_files`` makes them)."""
    _put(url, lambda: open(path, "rb"))


def upload_written(folder: "str | os.PathLike", name: str,
                   write: Callable[[str], None]) -> int | None:
    """When ``folder`` is a URL: ``write(path)`` fills a hidden local temporary file, uploaded
    whole as the object ``folder/name`` (read once, then removed); returns its size. The upload
    is tried again until the store is down (``outage_s()``): a store that is back sooner loses
    the run nothing. A local ``folder`` gets None: its caller writes the file in place."""
    if not is_url(folder):
        return None
    import tempfile

    handle, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp")
    os.close(handle)
    try:
        write(tmp)
        size = os.path.getsize(tmp)
        while True:
            try:
                upload_file(tmp, join(str(folder), name))
                break
            except StoreUnavailable:
                if health(store_of(str(folder))).down():
                    raise
    finally:
        with suppress(FileNotFoundError):
            os.unlink(tmp)
    return size


#: Up to this size an ``s3://`` object is written in one PUT; a larger one in a multipart
#: upload of parts this size (or larger: S3 takes at most ``MAX_PARTS``), ``PUT_THREADS`` of
#: them in flight (as many as pyarrow's stream sends at once), fewer where they would hold
#: more than ``PUT_HELD_BYTES``.
PUT_BYTES = 16 << 20
MAX_PARTS = 10_000
PUT_THREADS = 8
PUT_HELD_BYTES = 256 << 20


def _put(url: str, source: Callable[[], IO[bytes]]) -> None:
    """Write ``source()`` (a seekable binary file) as the object ``url``, whole or not at all:
    a failed write leaves the object as it was. pyarrow's output stream publishes what it
    holds when an error closes it (apache/arrow#40502), so ``s3://`` goes through botocore's
    client where it serves (``_put_direct``); elsewhere the source is opened first, so that
    only a failure on the way to the store can close a stream short."""
    client = _direct(url)
    if client is not None:
        retrying(lambda: _boto(url, lambda: _put_direct(client, url, source)), store=store_of(url))
    else:
        fs, target = filesystem(url)
        _copy(url, source, lambda: fs.open_output_stream(target))
    _SEEN.pop(url, None)


def _put_direct(client, url: str, source: Callable[[], IO[bytes]]) -> None:
    """One PUT of ``source()``, or a multipart upload completed only once every part was sent
    (aborted on any failure, a signal's included)."""
    bucket, key = _bucket_key(url)
    with source() as data:
        size = data.seek(0, io.SEEK_END)
        data.seek(0)
        if size <= PUT_BYTES:
            client.put_object(Bucket=bucket, Key=key, Body=data.read())
            return
        upload = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
        try:
            parts = _send_parts(client, bucket, key, upload, data,
                                max(PUT_BYTES, -(-size // MAX_PARTS)))
            client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload,
                                              MultipartUpload={"Parts": parts})
        except BaseException:
            with suppress(Exception):  # else the store's lifecycle rule drops the parts
                client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload)
            raise


def _send_parts(client, bucket: str, key: str, upload: str, data: IO[bytes],
                part_bytes: int) -> list[dict]:
    """Upload ``data`` as the parts of multipart upload ``upload``, a few at a time (at most
    ``PUT_THREADS``, nor ``PUT_HELD_BYTES`` held); their entries for completing it, in order."""
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    def send(number: int, chunk: bytes) -> dict:
        sent = client.upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=number,
                                  Body=chunk)
        # A part's checksums go back with it: a store that keeps them requires them
        return {"PartNumber": number, **{name: value for name, value in sent.items()
                                         if name == "ETag" or name.startswith("Checksum")}}

    parts, in_flight = [], deque()
    at_once = max(1, min(PUT_THREADS, PUT_HELD_BYTES // part_bytes))
    with ThreadPoolExecutor(at_once, thread_name_prefix="dsv4enc-put") as pool:
        try:
            for number, chunk in enumerate(iter(lambda: data.read(part_bytes), b""), 1):
                if len(in_flight) == at_once:
                    parts.append(in_flight.popleft().result())
                in_flight.append(pool.submit(send, number, chunk))
            parts.extend(future.result() for future in in_flight)
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    return parts


def download(url: str, path: "str | os.PathLike") -> None:
    """Copy the object ``url`` to the local file ``path``, streamed."""
    fs, source = filesystem(url)
    _copy(url, lambda: fs.open_input_stream(source), lambda: open(path, "wb"))


def _copy(url: str, source: Callable[[], IO[bytes]], target: Callable[[], IO[bytes]]) -> None:
    """Stream ``source()`` into ``target()`` (opened in that order), retried on ``url``'s store."""

    def attempt() -> None:
        with source() as data, target() as out:
            shutil.copyfileobj(data, out, COPY_BYTES)

    retrying(attempt, store=store_of(url))


class Changed(FileExistsError):
    """A conditional write found the object other than the condition said (``put_if``)."""


def put_if(url: str, data: bytes, etag: str | None = None) -> str | None:
    """Write ``data`` as the object ``url`` only if there is none (``etag`` None) or it is
    still the one with ``etag``, as one atomic request (S3's conditional writes); returns the
    new object's ETag. Raises ``Changed`` when the condition fails. None: the store cannot
    make the write conditional (a scheme or options botocore's client does not serve, or a
    store that refuses the condition), and nothing was written."""
    client = _direct(url)
    if client is None:
        return None
    from botocore import exceptions as boto

    bucket, key = _bucket_key(url)
    condition = {"IfMatch": etag} if etag else {"IfNoneMatch": "*"}

    def put() -> str | None:
        try:
            return client.put_object(Bucket=bucket, Key=key, Body=data, **condition)["ETag"]
        except boto.ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code in ("PreconditionFailed", "ConditionalRequestConflict"):
                raise Changed(f"{url}: changed by another writer") from None
            if code in ("NotImplemented", "InvalidArgument", "InvalidRequest"):
                return None  # a store without conditional writes (some S3-compatible ones)
            raise

    found = retrying(lambda: _boto(url, put), store=store_of(url))
    _SEEN.pop(url, None)
    return found


def read_tagged(url: str) -> tuple[bytes, str | None]:
    """The whole object and its ETag (None where ``put_if`` cannot write there)."""
    client = _direct(url)
    if client is None:
        return read_bytes(url), None
    bucket, key = _bucket_key(url)

    def get() -> tuple[bytes, str]:
        answer = client.get_object(Bucket=bucket, Key=key)
        return answer["Body"].read(), answer["ETag"]

    return retrying(lambda: _boto(url, get), store=store_of(url))


def delete(url: str) -> None:
    """Delete the object ``url`` (gone already is fine). On ``s3://`` botocore's client
    leaves no ``prefix/`` marker, as pyarrow's does where the prefix empties: a marker
    makes ``OUT`` of a single file (a refused ``OUT/`` run's lock removed) a folder."""
    client, store = _direct(url), store_of(url)
    with suppress(FileNotFoundError):
        if client is not None:
            bucket, key = _bucket_key(url)
            retrying(lambda: _boto(url, lambda: client.delete_object(Bucket=bucket, Key=key)),
                     store=store)
        else:
            fs, path = filesystem(url)
            retrying(lambda: fs.delete_file(path), store=store)


def remove_empty_prefix(url: str) -> None:
    """Remove the ``prefix/`` marker pyarrow leaves at ``url`` once nothing is under it."""
    if list_files(url):
        return
    fs, path = filesystem(url)
    with suppress(FileNotFoundError):
        retrying(lambda: fs.delete_dir(path), store=store_of(url))


# ----------------------------------------------------------------------------- whole objects

#: The largest S3 object, which botocore's client writes in parts of up to 5 GiB.
S3_MAX_BYTES = 5 << 40
#: pyarrow's S3 output stream uploads parts of 10 MiB whatever it is given, and a multipart
#: upload has at most 10,000 parts (apache/arrow#40420): the largest object it can write.
S3_STREAM_MAX_BYTES = MAX_PARTS * (10 << 20)


def max_object_bytes(url: str) -> int | None:
    """The largest object one upload can write at ``url`` (None: no limit known)."""
    if scheme_of(url) not in ("s3", "s3a"):
        return None
    return S3_MAX_BYTES if _direct(url) is not None else S3_STREAM_MAX_BYTES


def upload_file_whole(path: "str | os.PathLike", url: str) -> None:
    """``upload_file`` for an object that must never be seen short (a single-file output),
    also when a signal stops this process: a child process uploads it (``upload_child``), and
    a signal here kills the child before it completes the upload, so ``url`` keeps no object
    (or the one it held) and the open upload is aborted (``abort_uploads``). Schemes without
    buckets (fsspec's) are written here: a child would not share ``memory://``."""
    import subprocess

    if scheme_of(url) not in _BUCKET_SCHEMES:
        upload_file(path, url)
        return

    def attempt() -> None:
        child = subprocess.Popen(
            [sys.executable, "-c", "from dsv4enc.storage import upload_child; upload_child()",
             os.fspath(path), url], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE)
        try:
            _, err = child.communicate()
        except BaseException:
            child.kill()  # before it could close the stream: no object
            child.wait()
            abort_uploads(url)
            raise
        if child.returncode != 0:
            abort_uploads(url)
            lines = err.decode("utf-8", "replace").strip().splitlines()
            raise OSError(lines[-1] if lines else f"the upload stopped ({child.returncode})")

    retrying(attempt, store=store_of(url))
    _SEEN.pop(url, None)


def abort_uploads(url: str) -> None:
    """Abort the multipart uploads an ``upload_file_whole`` child left open at ``url`` (the
    output's lock keeps other runs off it): on ``s3://`` only, elsewhere a lifecycle rule must."""
    client = _direct(url)
    if client is None:
        return
    bucket, key = _bucket_key(url)
    try:
        listed = client.list_multipart_uploads(Bucket=bucket, Prefix=key)
        for upload in listed.get("Uploads", []):
            if upload["Key"] == key:
                client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload["UploadId"])
    except Exception as exc:  # noqa: BLE001 (the object is absent either way)
        log.warning("could not abort the unfinished upload to %s: %s", url, _first_line(exc))


def upload_child() -> None:
    """The child of ``upload_file_whole`` (argv: the file, the URL): a signal ends it at
    once; an error before the last byte exits without completing the upload (botocore's
    multipart upload is completed only at the end; pyarrow's stream, which completes it when
    closed, is never closed then)."""
    import signal

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_DFL)  # die where it is: the upload stays open
    path, url = sys.argv[1], sys.argv[2]
    try:
        client = _direct(url)
        with _Reported(open(path, "rb", buffering=0), url) as source:
            if client is not None:
                _boto(url, lambda: _put_direct(client, url, lambda: source))
            else:
                fs, target = filesystem(url)
                out = fs.open_output_stream(target)
                while chunk := source.read(COPY_BYTES):
                    out.write(chunk)
                out.close()
    except BaseException as exc:
        sys.stderr.write(f"{type(exc).__name__}: {_first_line(exc)}\n")
        sys.stderr.flush()
        os._exit(1)  # never close pyarrow's stream: its upload is not completed


class _Reported(io.BufferedReader):
    """A file whose reads reach the ``upload`` pause point with the bytes read so far, and
    raise once they show that it changed size (before the upload can be completed)."""

    def __init__(self, raw: io.FileIO, url: str) -> None:
        super().__init__(raw)
        self.url, self.sent = url, 0
        self.size = os.fstat(raw.fileno()).st_size

    def read(self, size: int | None = -1) -> bytes:
        from .pausepoints import pause

        chunk = super().read(size)
        self.sent += len(chunk)
        to_the_end = size is None or size < 0 or not chunk
        if self.sent > self.size or (to_the_end and self.sent != self.size):
            raise OSError(f"{self.raw.name} changed while it was uploaded")
        if chunk:
            pause("upload", url=self.url, sent=self.sent, size=self.size, pid=os.getpid())
        return chunk
