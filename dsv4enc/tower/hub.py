"""Weights from the Hugging Face Hub (``--weights owner/name``, optionally ``@revision``):
only ``config.json``, the index and the shards it names for the tower's tensors are fetched,
into the usual Hub cache, which a second run or ``HF_HUB_OFFLINE=1`` reads them from."""

from __future__ import annotations

import logging
import os
import re
import socket
from pathlib import Path
from urllib.parse import urlsplit

from .checkpoint import INDEX_NAME, tower_index
from ..errors import WeightsError

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_TRUE = {"1", "true", "yes", "on"}
#: Seconds to wait for a TCP connection to the Hub before calling it unreachable.
CONNECT_TIMEOUT_S = 3.0


def is_hub_id(spec: str) -> bool:
    """True for ``owner/name`` (or ``owner/name@revision``) that is not a local path."""
    if Path(spec).exists() or spec.startswith((".", "/", "~")):
        return False
    repo = spec.split("@", 1)[0]
    return bool(_REPO_ID.match(repo)) and ".." not in repo


def offline() -> bool:
    """``HF_HUB_OFFLINE`` is set: use the local cache only."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def hub_endpoint() -> str:
    """The Hub's address (``HF_ENDPOINT``, else huggingface.co)."""
    return os.environ.get("HF_ENDPOINT", "").strip() or "https://huggingface.co"


def unreachable_reason(endpoint: str, timeout: float = CONNECT_TIMEOUT_S) -> str | None:
    """Why no TCP connection to ``endpoint`` (or the environment's proxy for it) is made within
    ``timeout`` seconds; None when one is. One quick check instead of huggingface_hub's
    retries, which take long and print a warning each."""
    import urllib.request

    parts = urlsplit(endpoint)
    if not parts.hostname or parts.scheme not in ("http", "https"):
        return f"bad endpoint {endpoint!r}"
    proxy = urllib.request.getproxies().get(parts.scheme)
    if proxy and not urllib.request.proxy_bypass(parts.hostname):
        parts = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    port = parts.port or (80 if parts.scheme == "http" else 443)
    try:
        with socket.create_connection((parts.hostname, port), timeout=timeout):
            return None
    except OSError as exc:
        return exc.strerror or type(exc).__name__


def _hub():
    try:
        import huggingface_hub
    except ImportError:
        raise WeightsError("weights from the Hub need huggingface_hub: "
                           "pip install 'dsv4enc[hub]'") from None
    return huggingface_hub


def _errors():
    """huggingface_hub's exception classes (``errors`` module; ``utils`` in old releases)."""
    import importlib

    try:
        return importlib.import_module("huggingface_hub.errors")
    except ImportError:
        return importlib.import_module("huggingface_hub.utils")


def _download(hub, repo: str, filename: str, revision: str | None,
              local_only: bool = False) -> Path | None:
    """One file of ``repo`` (from the cache when offline); None if the repo has no such file
    (or, offline, an uncached index: the repo may have none)."""
    errors = _errors()
    local_missing = getattr(errors, "LocalEntryNotFoundError", ())
    kwargs = {"revision": revision, "local_files_only": local_only or offline()}
    cache = os.environ.get("HF_HUB_CACHE")
    if cache:
        kwargs["cache_dir"] = cache
    try:
        return Path(hub.hf_hub_download(repo, filename, **kwargs))
    except local_missing as exc:
        if local_only or offline():
            if filename == INDEX_NAME:
                return None
            raise WeightsError(f"{repo}: {filename} is not in the local Hub cache and "
                               "HF_HUB_OFFLINE is set") from None
        raise WeightsError(f"{repo}: cannot download {filename} ({_one_line(exc)})") from None
    except errors.RepositoryNotFoundError as exc:
        raise WeightsError(f"{repo}: no such repository on the Hub, or no access to it "
                           f"({_one_line(exc)})") from None
    except errors.RevisionNotFoundError as exc:
        raise WeightsError(f"{repo}: no revision {revision!r} ({_one_line(exc)})") from None
    except errors.EntryNotFoundError:
        return None
    except Exception as exc:  # network, auth, disk: one line, never a traceback
        raise WeightsError(f"{repo}: cannot fetch {filename} ({_one_line(exc)})") from None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}"[:300]


def resolve_weights(spec: str | os.PathLike) -> Path:
    """A local checkpoint folder for ``spec``: the folder itself, or a Hub snapshot folder
    holding config.json, the index and the tower's shards (fetched if not cached)."""
    spec = os.fspath(spec)
    if not is_hub_id(spec):
        return Path(spec).expanduser()  # "~" that no shell expanded (an env var, --x=~/y)
    # huggingface_hub warns once per retry; dsv4enc reports one line (for this call only)
    hub_log = logging.getLogger("huggingface_hub")
    level = hub_log.level
    hub_log.setLevel(logging.ERROR)
    try:
        return _resolve_hub_weights(_hub(), spec)
    finally:
        hub_log.setLevel(level)


def _resolve_hub_weights(hub, spec: str) -> Path:
    local_only = False
    if not offline():
        reason = unreachable_reason(hub_endpoint())
        if reason is not None:
            local_only = True  # files cached by an earlier run still do
            unreachable = (f"{spec}: cannot reach the Hub at {hub_endpoint()} ({reason}), "
                           "and the local Hub cache does not hold it; pass a local checkpoint "
                           "folder, or set HF_HUB_OFFLINE=1 (and HF_HUB_CACHE) to use a "
                           "filled cache without the network")
    try:
        return _fetch(hub, spec, local_only)
    except WeightsError as exc:
        if local_only:
            raise WeightsError(unreachable) from None
        raise WeightsError(f"{exc} (and there is no local folder {spec})") from None


def _fetch(hub, spec: str, local_only: bool = False) -> Path:
    repo, _, revision = spec.partition("@")
    revision = revision or None
    config = _download(hub, repo, "config.json", revision, local_only)
    if config is None:
        raise WeightsError(f"{repo}: the repository has no config.json")
    index_path = _download(hub, repo, INDEX_NAME, revision, local_only)
    if index_path is not None:
        files = sorted(set(tower_index(index_path).values()))
        if not files:
            raise WeightsError(f"{repo}: {INDEX_NAME} names no vision./aligner. tensors")
    else:
        files = ["model.safetensors"]
    for fname in files:
        got = _download(hub, repo, fname, revision, local_only)
        if got is None:
            raise WeightsError(f"{repo}: the repository has no {fname}")
        if got != config.parent / fname:
            raise WeightsError(f"{repo}: {fname} did not land beside config.json ({got})")
    return config.parent
