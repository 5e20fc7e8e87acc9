"""Weights from the Hugging Face Hub: ``--weights owner/name`` (optionally ``owner/name@rev``).

Only what the tower needs is fetched: ``config.json`` and ``model.safetensors.index.json``
first, then just the shards the index names for ``vision.``/``aligner.`` tensors (a repository
without an index must hold a single ``model.safetensors``). Files land in the usual Hub cache
(``HF_HUB_CACHE`` / ``HF_HOME``), so a second run, or one with ``HF_HUB_OFFLINE=1``, reads
them from there. Needs the optional ``huggingface_hub`` package: ``pip install 'dsv4enc[hub]'``.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from .checkpoint import INDEX_NAME, is_tower_tensor
from .errors import WeightsError

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_TRUE = {"1", "true", "yes", "on"}


def is_hub_id(spec: str) -> bool:
    """True for ``owner/name`` (or ``owner/name@revision``) that is not a local path."""
    if Path(spec).exists() or spec.startswith((".", "/", "~")):
        return False
    repo = spec.split("@", 1)[0]
    return bool(_REPO_ID.match(repo)) and ".." not in repo


def offline() -> bool:
    """``HF_HUB_OFFLINE`` is set: use the local cache only."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


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


def _download(hub, repo: str, filename: str, revision: str | None) -> Path | None:
    """One file of ``repo`` (from the cache when offline); None if the repo has no such file
    (or, offline, if the index is not cached: the repo may have none)."""
    errors = _errors()
    local_missing = getattr(errors, "LocalEntryNotFoundError", ())
    kwargs = {"revision": revision, "local_files_only": offline()}
    cache = os.environ.get("HF_HUB_CACHE")
    if cache:
        kwargs["cache_dir"] = cache
    try:
        return Path(hub.hf_hub_download(repo, filename, **kwargs))
    except local_missing as exc:
        if offline():
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


def tower_files(index: dict) -> list[str]:
    """Shard names that hold tower tensors, per the index's ``weight_map`` (sorted)."""
    try:
        weight_map = index["weight_map"]
        return sorted({fname for name, fname in weight_map.items() if is_tower_tensor(name)})
    except (KeyError, TypeError, AttributeError) as exc:
        raise WeightsError(f"{INDEX_NAME}: not a safetensors index ({exc})") from None


def resolve_weights(spec: str | os.PathLike) -> Path:
    """A local checkpoint folder for ``spec``: the folder itself, or a Hub snapshot folder
    holding config.json, the index and the tower's shards (fetched if not cached)."""
    spec = os.fspath(spec)
    if not is_hub_id(spec):
        return Path(spec)
    try:
        return _fetch(spec)
    except WeightsError as exc:
        raise WeightsError(f"{exc} (and there is no local folder {spec})") from None


def _fetch(spec: str) -> Path:
    repo, _, revision = spec.partition("@")
    hub = _hub()
    config = _download(hub, repo, "config.json", revision or None)
    if config is None:
        raise WeightsError(f"{repo}: the repository has no config.json")
    index_path = _download(hub, repo, INDEX_NAME, revision or None)
    if index_path is not None:
        try:
            index = json.loads(index_path.read_text())
        except (OSError, ValueError) as exc:
            raise WeightsError(f"{index_path}: not a safetensors index ({exc})") from None
        files = tower_files(index)
        if not files:
            raise WeightsError(f"{repo}: {INDEX_NAME} names no vision./aligner. tensors")
    else:
        files = ["model.safetensors"]
    for fname in files:
        got = _download(hub, repo, fname, revision or None)
        if got is None:
            raise WeightsError(f"{repo}: the repository has no {fname}")
        if got != config.parent / fname:
            raise WeightsError(f"{repo}: {fname} did not land beside config.json ({got})")
    return config.parent
