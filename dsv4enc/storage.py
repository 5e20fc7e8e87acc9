"""Object storage (``s3://``, ``gs://``, and what fsspec reaches) behind one small facade.

Everything dsv4enc reads from or writes to a URL goes through here: ``list_files`` (a prefix
listed like a folder), ``stat``, ``open_input`` (a seekable file that reads byte ranges),
``read_range``/``read_bytes``, ``upload`` (one complete object) and ``exists``. Local paths
never come here: ``is_url`` decides.

File systems are pyarrow's (``pyarrow.fs.S3FileSystem``; ``FileSystem.from_uri`` for ``gs://``
and ``hdfs://``) and, for any other scheme, fsspec's wrapped in ``pyarrow.fs.PyFileSystem``
(``pip install dsv4enc[gcs]`` for gcsfs, ``fsspec`` ships http, memory, ...). No HTTP is spoken
here.

Credentials and endpoints come from the standard places: the environment
(``AWS_ACCESS_KEY_ID``, ``AWS_PROFILE``, ``AWS_ENDPOINT_URL``, ...), the SDK's config files,
and ``--storage-option key=value`` (``configure``; passed to the file system's constructor).
Options reach decode worker processes through the environment variable ``DSV4ENC_STORAGE_OPTIONS``
(never printed). Error messages name the URL and the kind of failure, never an option value.

A file system is created once per process and scheme; worker processes make their own.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, TypeVar

from .errors import StorageError, UsageError

if TYPE_CHECKING:
    import pyarrow.fs as pafs

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_OPTIONS_ENV = "DSV4ENC_STORAGE_OPTIONS"
#: Schemes whose first path component is a bucket that must exist.
_BUCKET_SCHEMES = frozenset({"s3", "s3a", "gs", "gcs"})
#: Attempts at a read or write that fails for a transient reason (after the SDK's own retries).
ATTEMPTS = 4
#: First wait between attempts, doubled each time.
BACKOFF_S = 0.5

T = TypeVar("T")


def is_url(path: object) -> bool:
    """Whether ``path`` names an object store location (``scheme://...``, not ``file://``)."""
    if not isinstance(path, str):
        return False
    match = _URL.match(path)
    return match is not None and match.group(1).lower() != "file"


def scheme_of(url: str) -> str:
    return url.split("://", 1)[0].lower()


def join(url: str, name: str) -> str:
    """``name`` (a relative, posix key) under the prefix ``url``."""
    return f"{url.rstrip('/')}/{name}"


# ----------------------------------------------------------------------------- options

def parse_option(text: str) -> tuple[str, object]:
    """``key=value`` from ``--storage-option``: ``true``/``false`` become booleans, integers
    and decimals numbers, anything else stays text."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise UsageError(f"--storage-option expects KEY=VALUE, got {key or text!r}"
                         if not sep else "--storage-option expects KEY=VALUE")
    lowered = value.strip().lower()
    if lowered in ("true", "false"):
        return key, lowered == "true"
    for kind in (int, float):
        try:
            return key, kind(value)
        except ValueError:
            pass
    return key, value


def configure(options: list[str] | tuple[str, ...] | None) -> None:
    """Set this process's storage options (``--storage-option``) and pass them on to the
    processes it starts. Drops file systems made with other options."""
    parsed = dict(parse_option(text) for text in options or ())
    if parsed:
        os.environ[_OPTIONS_ENV] = json.dumps(parsed)
    else:
        os.environ.pop(_OPTIONS_ENV, None)
    with _LOCK:
        _FILESYSTEMS.clear()


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
_FILESYSTEMS: dict[tuple[str, int], "pafs.FileSystem"] = {}


def _endpoint(scheme: str) -> str | None:
    for name in (f"AWS_ENDPOINT_URL_{scheme.upper()}", "AWS_ENDPOINT_URL"):
        if os.environ.get(name):
            return os.environ[name]
    return None


def _s3(url: str, options: dict) -> "pafs.FileSystem":
    import pyarrow.fs as pafs

    kwargs = dict(options)
    endpoint = kwargs.pop("endpoint_url", None) or kwargs.get("endpoint_override") \
        or _endpoint("s3")
    if endpoint:
        kwargs["endpoint_override"] = endpoint
    if "region" not in kwargs:
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if region:
            kwargs["region"] = region
        elif not endpoint:  # a real AWS bucket: ask where it lives
            try:
                kwargs["region"] = pafs.resolve_s3_region(_bucket(url))
            except (OSError, ValueError):
                pass  # the SDK's default; a wrong one fails with a clear line later
    # The SDK retries each request (3 tries, quick backoff); ``retrying`` adds slower rounds.
    kwargs.setdefault("retry_strategy", pafs.AwsStandardS3RetryStrategy(max_attempts=3))
    return pafs.S3FileSystem(**kwargs)


def _bucket(url: str) -> str:
    return url.split("://", 1)[1].split("/", 1)[0]


def _make_filesystem(url: str) -> "pafs.FileSystem":
    import pyarrow.fs as pafs

    scheme, options = scheme_of(url), _options()
    try:
        if scheme in ("s3", "s3a"):
            try:
                return _s3(url, options)
            except ImportError:
                pass  # pyarrow built without S3: s3fs (dsv4enc[s3]) below
        if scheme in ("gs", "gcs") and not options:
            try:
                return pafs.FileSystem.from_uri(url)[0]
            except (OSError, ValueError, NotImplementedError, ImportError):
                pass  # pyarrow built without GCS: fsspec's gcsfs below
        import fsspec

        return pafs.PyFileSystem(pafs.FSSpecHandler(fsspec.filesystem(
            "s3" if scheme == "s3a" else scheme, **options)))
    except ImportError as exc:
        raise UsageError(f"{scheme}:// needs an optional package ({exc.name}): "
                         f"pip install 'dsv4enc[{'gcs' if scheme in ('gs', 'gcs') else 's3'}]'"
                         ) from None
    except (TypeError, ValueError) as exc:
        # The message names the option, never its value.
        raise UsageError(f"{scheme}:// storage options not accepted: "
                         f"{type(exc).__name__}: {_first_line(exc)}") from None


def filesystem(url: str) -> tuple["pafs.FileSystem", str]:
    """The file system for ``url`` (made once per process and scheme) and the path in it."""
    scheme = scheme_of(url)
    key = (scheme, os.getpid())
    with _LOCK:
        fs = _FILESYSTEMS.get(key)
        if fs is None:
            fs = _FILESYSTEMS[key] = _make_filesystem(url)
    return fs, url.split("://", 1)[1].rstrip("/")


# ----------------------------------------------------------------------------- errors

def _first_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return re.sub(r"\s*\(Request ID: [^)]*\)", "", text)[:300]


def setup_problem(exc: BaseException) -> str | None:
    """``"bucket not found"`` / ``"access denied"`` when ``exc`` says so: a setup error (one
    line, exit 1), not a transient one."""
    text = str(exc).upper()
    if "NO_SUCH_BUCKET" in text or "NOSUCHBUCKET" in text or "BUCKET DOES NOT EXIST" in text:
        return "bucket not found"
    if ("ACCESS_DENIED" in text or "ACCESSDENIED" in text or "FORBIDDEN" in text
            or "INVALIDACCESSKEYID" in text or "SIGNATUREDOESNOTMATCH" in text
            or isinstance(exc, PermissionError)):
        return "access denied (check the credentials and the bucket's permissions)"
    return None


def describe(url: str, exc: BaseException) -> str:
    """One line about a failed storage call: the URL and what went wrong (no option values)."""
    return f"{url}: {setup_problem(exc) or _first_line(exc)}"


def setup_error(url: str, exc: BaseException) -> StorageError:
    return StorageError(describe(url, exc))


def retrying(what: Callable[[], T], attempts: int | None = None,
             backoff_s: float | None = None) -> T:
    """``what()``, tried again with exponential backoff (``BACKOFF_S``, doubled each time, up
    to ``ATTEMPTS`` tries) when it fails with an ``OSError`` that is not a setup problem or
    a missing object (those are raised at once). The SDK retries each request first."""
    attempts = ATTEMPTS if attempts is None else attempts
    backoff_s = BACKOFF_S if backoff_s is None else backoff_s
    for attempt in range(attempts):
        try:
            return what()
        except FileNotFoundError:
            raise
        except OSError as exc:
            if setup_problem(exc) is not None or attempt == attempts - 1:
                raise
        time.sleep(backoff_s * 2 ** attempt)
    raise AssertionError("unreachable")


# ----------------------------------------------------------------------------- reading

@dataclass(frozen=True)
class ObjectInfo:
    """An object: its URL, its key relative to the listed prefix, size and modification time."""

    url: str
    key: str
    size: int
    mtime_ns: int | None


#: What listings saw, by URL: ``stamp`` then needs no request per object.
_SEEN: dict[str, ObjectInfo] = {}


def _info(url: str, info, key: str) -> ObjectInfo:
    mtime = getattr(info, "mtime_ns", None)
    found = ObjectInfo(url=url, key=key, size=int(info.size or 0), mtime_ns=mtime)
    _SEEN[url] = found
    return found


def kind(url: str) -> str:
    """``"file"``, ``"folder"`` (a prefix with objects under it, or a bucket) or
    ``"missing"``. A missing bucket or a denied permission is a ``StorageError``."""
    import pyarrow.fs as pafs

    fs, path = filesystem(url)
    try:
        info = retrying(lambda: fs.get_file_info(path))
        if info.type == pafs.FileType.File:
            _info(url, info, url)
            return "file"
        if info.type == pafs.FileType.Directory:
            return "folder"
        _check_bucket(url)
        if "/" not in path:  # a bucket that exists but lists as nothing
            return "missing"
        # Some stores report a prefix only through a listing.
        selector = pafs.FileSelector(path, recursive=False, allow_not_found=True)
        return "folder" if retrying(lambda: fs.get_file_info(selector)) else "missing"
    except OSError as exc:
        raise setup_error(url, exc) from None


def _check_bucket(url: str) -> None:
    """A ``StorageError`` when the bucket of ``url`` does not exist."""
    import pyarrow.fs as pafs

    if scheme_of(url) not in _BUCKET_SCHEMES:  # no buckets (memory://, ...): nothing to check
        return
    fs, _ = filesystem(url)
    bucket = _bucket(url)
    if retrying(lambda: fs.get_file_info(bucket)).type == pafs.FileType.NotFound:
        raise StorageError(f"{scheme_of(url)}://{bucket}: bucket not found")


def list_files(url: str) -> list[ObjectInfo]:
    """The objects under the prefix ``url``, recursively, sorted by key (a key is the object's
    path below the prefix, posix). A missing bucket or a denied permission is a
    ``StorageError``."""
    import pyarrow.fs as pafs

    fs, path = filesystem(url)
    selector = pafs.FileSelector(path, recursive=True, allow_not_found=True)
    try:
        infos = retrying(lambda: fs.get_file_info(selector))
        if not infos:
            _check_bucket(url)
    except OSError as exc:
        raise setup_error(url, exc) from None
    prefix = f"{path.strip('/')}/"  # fsspec's paths may start with a slash, pyarrow's do not
    found = []
    for info in infos:
        full = info.path.lstrip("/")
        if info.type == pafs.FileType.File and full.startswith(prefix):
            key = full[len(prefix):]
            found.append(_info(join(url, key), info, key))
    return sorted(found, key=lambda o: o.key)


def stat(url: str) -> ObjectInfo:
    """Size and modification time of the object ``url`` (from a listing when one saw it)."""
    seen = _SEEN.get(url)
    if seen is not None:
        return seen
    fs, path = filesystem(url)
    info = retrying(lambda: fs.get_file_info(path))
    if info.type.name != "File":
        raise FileNotFoundError(f"{url}: no such object")
    return _info(url, info, url)


def stamp(url: str) -> str:
    """What identifies this version of the object for ``--resume``: size and modification
    time (an object is replaced whole, so a new upload changes the time), or why it
    cannot be looked at."""
    try:
        info = stat(url)
    except OSError as exc:
        return f"unreadable {describe(url, exc)}"
    return f"{info.size} {info.mtime_ns}"


def open_input(url: str):
    """A seekable, read-only file over the object (``pyarrow.NativeFile``): each read is a
    ranged request, so a reader takes only the bytes it needs."""
    return retrying(lambda: _open(url))


def _open(url: str):
    fs, path = filesystem(url)
    return fs.open_input_file(path)


def read_range(url: str, offset: int, size: int) -> bytes:
    """``size`` bytes of the object from ``offset`` (one ranged request, retried)."""
    def attempt() -> bytes:
        with _open(url) as handle:
            return handle.read_at(size, offset)

    return retrying(attempt)


def read_bytes(url: str) -> bytes:
    """The whole object (retried)."""
    def attempt() -> bytes:
        with _open(url) as handle:
            return handle.read()

    return retrying(attempt)


def size_of(url: str) -> int:
    return stat(url).size


# ----------------------------------------------------------------------------- writing

def exists(url: str) -> bool:
    import pyarrow.fs as pafs

    fs, path = filesystem(url)
    try:
        return retrying(lambda: fs.get_file_info(path)).type != pafs.FileType.NotFound
    except OSError as exc:
        raise setup_error(url, exc) from None


def upload(url: str, data: bytes) -> None:
    """Write ``data`` as the complete object ``url``: it appears whole or not at all."""
    fs, path = filesystem(url)

    def attempt() -> None:
        with fs.open_output_stream(path) as out:
            out.write(data)

    retrying(attempt)
    _SEEN.pop(url, None)


def upload_file(path: "str | os.PathLike", url: str) -> None:
    """Copy the local file ``path`` to the object ``url``, streamed (a multipart upload for
    a large file): the object appears whole, when the upload completes, or not at all. No
    folder marker objects are made (``pyarrow.fs.copy_files`` would make them)."""
    import shutil

    fs, target = filesystem(url)

    def attempt() -> None:
        with open(path, "rb") as source, fs.open_output_stream(target) as out:
            shutil.copyfileobj(source, out, 8 << 20)

    retrying(attempt)
    _SEEN.pop(url, None)


def download(url: str, path: "str | os.PathLike") -> None:
    """Copy the object ``url`` to the local file ``path``, streamed."""
    import shutil

    fs, source = filesystem(url)

    def attempt() -> None:
        with fs.open_input_stream(source) as stream, open(path, "wb") as out:
            shutil.copyfileobj(stream, out, 8 << 20)

    retrying(attempt)


def delete(url: str) -> None:
    """Delete the object ``url`` (gone already is fine)."""
    fs, path = filesystem(url)
    try:
        retrying(lambda: fs.delete_file(path))
    except FileNotFoundError:
        pass


def remove_empty_prefix(url: str) -> None:
    """Remove the folder marker some clients leave at the prefix ``url`` (pyarrow keeps a
    ``prefix/`` object when the last object under it is deleted), when nothing is under it."""
    if list_files(url):
        return
    fs, path = filesystem(url)
    try:
        retrying(lambda: fs.delete_dir(path))
    except FileNotFoundError:
        pass
