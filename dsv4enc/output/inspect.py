"""``dsv4enc inspect``: what an output file (or dataset folder) holds, without loading it.

Reads the Parquet footers for row counts, sizes and the ``dsv4enc`` metadata, and streams
only the small columns (grid sizes, errors), never the embeddings."""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from .. import storage
from ..columns import OUTPUT_COLUMNS
from ..tower.config import MODEL_NAMES, model_type_of
from ..errors import StorageError, UsageError
from ..images.sources import TABLE_EXTENSIONS, TAR_EXTENSIONS
from .files import MANIFEST_NAME
from .lock import holder_text
from .read import (OutputFiles, embedding_format, find_output, interrupted_folder,
                   live_writer, metadata_of, readable_output)
from .update import STAMPS_KEY

#: Error messages shown, the commonest first (``inspect`` and a run's summary).
TOP_ERRORS = 5
_QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"")
#: A key under a container's key: ``/`` a member or named row, ``@`` a damaged part, ``#`` a
#: table row without a name (``images/sources``); greedy, so the longest container part.
_CONTAINED = re.compile(r"(.*(?:%s))[/@#]" % "|".join(
    re.escape(ext) for ext in TAR_EXTENSIONS + TABLE_EXTENSIONS), re.IGNORECASE | re.DOTALL)


@dataclass
class OutputSummary:
    """Facts about one output, for the table and for ``--json``."""

    path: str
    files: int = 0
    bytes_on_disk: int = 0
    rows: int = 0
    failed: int = 0
    embedding_rows: int = 0
    width: int | None = None
    dtype: str | None = None
    layout: str | None = None  # the embedding layout: binary or nested (docs/output-format.md)
    pooled: bool = False
    grid_h: dict[str, float] = field(default_factory=dict)
    grid_w: dict[str, float] = field(default_factory=dict)
    rows_per_image: dict[str, float] = field(default_factory=dict)
    top_grids: list[tuple[int, int, int]] = field(default_factory=list)  # (grid_h, grid_w, images)
    errors: list[tuple[str, int, str]] = field(default_factory=list)  # (kind, count, example path)
    metadata: dict[str, Any] = field(default_factory=dict)
    model: str | None = None  # the checkpoint variant, e.g. "DeepSeek-V4.1 (deepseek_v41)"
    # An interrupted run (``OUT.partial/``, or an unfinished folder): what its manifests record
    interrupted: bool = False
    parts: int | None = None  # committed parts
    images_done: int | None = None
    images_total: int | None = None  # None: not recorded (stopped before it planned a part)
    images_left: int | None = None
    # A live run holds its lock: {"pid", "host", "since"} (each None where its lock file
    # says nothing usable); words only in ``progress_text``, so that --json gives data.
    writing: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def error_group(message: str) -> str:
    """Messages that differ only in quoted names (paths) count as one kind of failure."""
    return _QUOTED.sub("'…'", message)


def model_of(metadata: dict[str, Any]) -> str | None:
    """The variant named by an output's metadata (its config's ``model_type``; outputs
    written before V4.1 support carry none and are V4)."""
    config = metadata.get("config")
    if not isinstance(config, dict):
        return None
    model_type = model_type_of(config)
    return f"{MODEL_NAMES[model_type]} ({model_type})"


def _stats(values: np.ndarray) -> dict[str, float]:
    if values.size == 0:
        return {}
    return {"min": int(values.min()), "median": float(np.median(values)),
            "mean": round(float(values.mean()), 2), "max": int(values.max())}


def _record_progress(out: OutputSummary, manifests: list[dict], unfinished: bool = False) -> None:
    """What the manifests say was committed, and how many images are left (``unfinished``:
    only when some are: a folder output whose run was stopped)."""
    parts = [part for manifest in manifests for part in manifest["parts"].values()]
    done = sum(int(part.get("rows") or 0) for part in parts)
    totals = [m["inputs"] for m in manifests if isinstance(m.get("inputs"), int)]
    if unfinished and not (totals and done < max(totals)):
        return
    out.interrupted, out.parts, out.images_done = True, len(parts), done
    if totals:
        out.images_total = max(totals)
        out.images_left = max(0, out.images_total - done)


def _summarize_interrupted(path: str, found: OutputFiles) -> OutputSummary:
    """An interrupted run's parts folder: what its manifests (their journals applied)
    committed, how many are left, and the usual figures over its committed part files
    (none for a growing file's ranges)."""
    if not found.manifests:
        raise UsageError(f"{found.location}: no dsv4enc manifest ({MANIFEST_NAME}) here: not "
                         "an interrupted dsv4enc run")
    settings = found.manifests[0].get("settings")
    out = OutputSummary(path=path, metadata=dict(settings) if isinstance(settings, dict) else {})
    _record_progress(out, found.manifests)
    out.bytes_on_disk = found.folder_bytes
    if found.paths:
        _scan_files(out, found)
        out.metadata = _metadata(found) or out.metadata
    out.model = model_of(out.metadata)
    return out


def _metadata(found: OutputFiles) -> dict[str, Any]:
    return metadata_of(found.open(found.paths[0], rows=False).schema_arrow)


def summarize(path: str | os.PathLike, storage_options: Any = None) -> OutputSummary:
    """Summarize a dsv4enc output, local or at a URL: a Parquet file or a folder of part
    files (its committed parts); or what an interrupted run committed (``OUT.partial/``, or
    ``OUT`` when only that exists)."""
    text = os.fspath(path)
    partial = interrupted_folder(text, storage_options)
    if partial is not None:
        return _live(_summarize_interrupted(text, find_output(partial, storage_options)), partial)
    found = find_output(text, storage_options)
    if not found.paths and found.manifests and found.locked:  # stopped before its first commit
        return _live(_summarize_interrupted(text, found), text)
    if not found.paths and found.manifests:
        return _summarize_empty(text, found)
    if not found.paths:
        raise UsageError(f"{text}: no Parquet files found")
    out = OutputSummary(path=text, bytes_on_disk=sum(found.sizes), metadata=_metadata(found))
    out.model = model_of(out.metadata)
    _scan_files(out, found)
    if found.manifests:
        _record_progress(out, found.manifests, unfinished=True)
    return _live(out, text) if out.interrupted else out


def _summarize_empty(path: str, found: OutputFiles) -> OutputSummary:
    """A folder whose manifests list no part: a finished run given no images (its output
    has no rows, as the readers read it, and so no part file to take the figures from: they
    come from the manifest's settings), or one stopped before its first commit whose lock
    is gone (interrupted, as ``_record_progress`` finds)."""
    settings = found.manifests[0].get("settings")
    meta = dict(settings) if isinstance(settings, dict) else {}
    out = OutputSummary(path=path, bytes_on_disk=found.folder_bytes, metadata=meta,
                        model=model_of(meta), dtype=meta.get("out_dtype"),
                        layout=meta.get("layout"), pooled=meta.get("pool") == "mean")
    _record_progress(out, found.manifests, unfinished=True)
    return _live(out, path) if out.interrupted else out


def _live(out: OutputSummary, folder: str) -> OutputSummary:
    """``out``, with the live run that writes its parts ``folder`` (a local one) named."""
    out.writing = live_writer(folder)
    return out


def inspected(path: str | os.PathLike, storage_options: Any = None) -> OutputFiles:
    """The committed files whose rows ``--errors`` reads, as the readers find them
    (``readable_output``): an unfinished single file's parts, ranges of a growing file that
    read as no rows, are refused in one line, never listed as no failure."""
    return readable_output(path, storage_options)


def list_line(path: str) -> str | None:
    """``path`` as a line of a ``--files-from`` list (``./#name`` for a name starting with
    ``#``), or None where no line can hold it (a newline, or blanks at either end)."""
    if "\n" in path or "\r" in path or path != path.strip() or not path:
        return None
    return f"./{path}" if path.startswith("#") else path


def container_of(key: str) -> str | None:
    """The key of the container (a tar shard, a table) that the row keyed ``key`` comes from:
    the longest leading part that ends in a container's extension, followed by ``/``, ``@``
    or ``#`` (``sources.member_key``, ``sources.damaged_item``, a table row without a name);
    None for any other key."""
    found = _CONTAINED.match(key)
    return found.group(1) if found else None


def write_errors_list(rows: Iterator[tuple[str, str, bool]],
                      target: str) -> tuple[int, int, int, int]:
    """Write the paths of failed ``rows`` (``failed_rows``) to the new file ``target`` as a
    ``--files-from`` list; return how many were written, how many no line can hold, how many
    of those written are containers, and how many rows of a table keyed by ``--key-column``
    were left out. A container's row is listed as its container, once: its key is no file
    ``--files-from`` reads, and a container is read again whole. A keyed row's key is the
    table's id of it, which names neither a file nor its table (not recorded): no line can
    give it back. An existing file is refused (a UsageError): it may be someone else's.
    Where reading the rows fails (the output is no dsv4enc output, or damaged), the file
    this call made is removed."""
    written = unlisted = containers = keyed = 0
    seen: set[str] = set()  # the containers met so far
    try:
        handle = open(target, "x", encoding="utf-8", errors="surrogateescape")
    except FileExistsError:
        raise UsageError(f"--errors-list {target} exists: name a new file") from None
    except OSError as exc:
        raise UsageError(f"cannot write --errors-list {target}: {exc.strerror or exc}") from None
    try:
        with handle:
            for path, _, by_key in rows:
                if by_key:
                    keyed += 1
                    continue
                container = container_of(path)
                if container in seen:
                    continue
                if container is not None:
                    seen.add(container)
                line = list_line(container or path)
                if line is None:
                    unlisted += 1
                    continue
                handle.write(line + "\n")
                written += 1
                containers += container is not None
    except BaseException:
        Path(target).unlink(missing_ok=True)  # made above (exclusively): nothing half-listed
        raise
    return written, unlisted, containers, keyed


def _open_output(found: OutputFiles, file: str):
    """A part of ``found``, checked to be dsv4enc output (a UsageError in one line if not)."""
    handle = found.open(file)
    missing = [c for c in ("grid_h", "grid_w", "embedding", "error")
               if c not in handle.schema_arrow.names]
    if missing:
        raise UsageError(f"{found.name(file)}: not dsv4enc output (no column {missing[0]!r})")
    return handle


@contextlib.contextmanager
def _reading(found: OutputFiles, file: str) -> Iterator[None]:
    """A failure to read a part's pages (a page damaged on the disk, a store not answering)
    named with that part file: in a folder of many, the output's name alone says not which."""
    try:
        yield
    except OSError as exc:
        raise StorageError(f"cannot read {storage.describe(found.name(file), exc)}") from None


def _batches(found: OutputFiles, file: str, handle) -> Iterator[Any]:
    """The small columns of part ``file`` (open as ``handle``), a batch at a time."""
    with _reading(found, file):
        yield from handle.iter_batches(batch_size=65536,
                                       columns=["path", "grid_h", "grid_w", "error"])


def failed_rows(found: OutputFiles) -> Iterator[tuple[str, str, bool]]:
    """``(path, error, keyed)`` of every failed row of the output, in its order (reads only
    those columns, and only the row groups that hold a failure); ``keyed``: the row is a
    table's, keyed by its ``--key-column`` value (that kept column is set)."""
    key = None
    for file in found.paths:
        handle = _open_output(found, file)
        key = key or key_column_of(found, handle)
        columns = ["path", "error"] + ([key] if key in handle.schema_arrow.names else [])
        for group in _groups_with_errors(handle):
            with _reading(found, file):
                table = handle.read_row_group(group, columns=columns)
            table = table.filter(table.column("error").is_valid())
            keyed = (table.column(2).is_valid().to_pylist() if len(columns) > 2
                     else [False] * table.num_rows)
            yield from zip(table.column("path").to_pylist(), table.column("error").to_pylist(),
                           keyed)


def key_column_of(found: OutputFiles, handle) -> str | None:
    """The ``--key-column`` the output's table rows are keyed by, as it recorded it (a
    folder's manifest settings, a single file's row stamps entry), or None. A key column of
    an output column's name (``path``) is not kept apart: its rows are not told apart."""
    recorded = [manifest.get("settings") for manifest in found.manifests]
    try:
        recorded.append(json.loads((handle.metadata.metadata or {})[STAMPS_KEY])["options"])
    except (KeyError, ValueError, TypeError):
        pass
    return next((settings["key_column"] for settings in recorded if isinstance(settings, dict)
                 and isinstance(settings.get("key_column"), str)
                 and settings["key_column"] not in OUTPUT_COLUMNS), None)


def _groups_with_errors(handle) -> list[int]:
    """The row groups whose ``error`` column is not all null (by their statistics, where the
    footer holds them)."""
    meta = handle.metadata
    index = handle.schema_arrow.get_field_index("error")
    groups = []
    for group in range(meta.num_row_groups):
        column = meta.row_group(group).column(index)
        stats = column.statistics
        if stats is None or not stats.has_null_count or stats.null_count < column.num_values:
            groups.append(group)
    return groups


def _scan_files(out: OutputSummary, found: OutputFiles) -> None:
    """Rows, failures, layout and grid figures of ``found``'s files into ``out`` (never the
    embeddings)."""
    out.files = len(found.paths)
    heights, widths = [], []
    grids: Counter = Counter()
    errors: Counter = Counter()
    examples: dict[str, str] = {}
    for file in found.paths:
        handle = _open_output(found, file)
        fmt = embedding_format(handle.schema_arrow, found.name(file))
        out.layout, out.pooled, out.width, out.dtype = fmt.layout, fmt.pooled, fmt.width, fmt.dtype
        out.rows += handle.metadata.num_rows
        for batch in _batches(found, file, handle):
            failed = batch.column("error").is_valid().to_numpy(zero_copy_only=False)
            ok = ~failed
            gh = batch.column("grid_h").fill_null(0).to_numpy(zero_copy_only=False)[ok]
            gw = batch.column("grid_w").fill_null(0).to_numpy(zero_copy_only=False)[ok]
            heights.append(gh.astype(np.int64))
            widths.append(gw.astype(np.int64))
            grids.update(zip(gh.tolist(), gw.tolist()))
            failures = batch.filter(batch.column("error").is_valid())
            for message, path in zip(failures.column("error").to_pylist(),
                                     failures.column("path").to_pylist()):
                kind = error_group(message)
                errors[kind] += 1
                examples.setdefault(kind, path)
            out.failed += int(failed.sum())
    h = np.concatenate(heights) if heights else np.zeros(0, np.int64)
    w = np.concatenate(widths) if widths else np.zeros(0, np.int64)
    out.grid_h, out.grid_w = _stats(h), _stats(w)
    # A pooled image is one embedding row, not the grid's cells its pool averaged.
    per_image = np.ones_like(h) if out.pooled else h * w
    out.rows_per_image = _stats(per_image)
    out.embedding_rows = int(per_image.sum())
    out.top_grids = [(gh, gw, n) for (gh, gw), n in grids.most_common(3)]
    out.errors = [(kind, n, examples[kind]) for kind, n in errors.most_common(TOP_ERRORS)]


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024


def _stat_text(stats: dict[str, float]) -> str:
    if not stats:
        return "-"
    return f"{stats['min']} / {stats['median']:g} / {stats['max']} (mean {stats['mean']:g})"


def progress_text(summary: OutputSummary) -> str:
    """An interrupted run's committed parts and images, and how many are left."""
    parts = f"{summary.parts} part{'s' if summary.parts != 1 else ''}"
    done = f"{summary.images_done} image{'s' if summary.images_done != 1 else ''} done"
    left = ("how many are left is not recorded" if summary.images_total is None
            else f"{summary.images_left} of {summary.images_total} left")
    if summary.writing is not None:
        return f"{parts}, {done}, {left}; a run is writing it now{holder_text(summary.writing)}"
    # The manifest does not record --overwrite, which --resume contradicts: name both.
    return (f"{parts}, {done}, {left}; rerun the same command with --resume to finish "
            "(in place of --overwrite, if it had one)")


def render(summary: OutputSummary, console=None) -> None:
    """Print the summary as rich tables."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console(emoji=False)  # paths: ":name:" is text
    meta = summary.metadata
    title = f"dsv4enc output: {summary.path}"
    if summary.interrupted:
        title += (" (an interrupted run: not finished)" if summary.writing is None
                  else " (being written: not finished)")
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    if summary.interrupted:
        table.add_row("committed", progress_text(summary))
    if summary.files:
        ok = summary.rows - summary.failed
        table.add_row("rows", f"{summary.rows} ({ok} encoded, {summary.failed} failed)")
        layout = "pooled: one vector per image" if summary.pooled else (
            f"{summary.embedding_rows} embedding rows")
        table.add_row("embedding", f"width {summary.width}, {summary.dtype}, "
                      f"{summary.layout} layout; {layout}")
        table.add_row("grid_h min/median/max", _stat_text(summary.grid_h))
        table.add_row("grid_w min/median/max", _stat_text(summary.grid_w))
        table.add_row("rows per image", _stat_text(summary.rows_per_image))
    elif not summary.interrupted:  # a finished output of no images: no part file
        table.add_row("rows", "0")
    if summary.top_grids:
        table.add_row("commonest grids", ", ".join(f"{gh}x{gw} ({n})"
                                                   for gh, gw, n in summary.top_grids))
    table.add_row("features", f"{meta.get('features', '?')} (pool {meta.get('pool', 'none')})")
    table.add_row("dtypes", f"compute {meta.get('compute_dtype', '?')}, "
                  f"stored {meta.get('out_dtype', summary.dtype)}")
    table.add_row("weights fingerprint", str(meta.get("weights_fingerprint", "?")))
    table.add_row("tool", f"{meta.get('tool', '?')} {meta.get('version', '')}".strip())
    config = meta.get("config") or {}
    if config:
        table.add_row("model", f"{summary.model}, vision_max_n_token "
                      f"{config.get('vision_max_n_token')}")
        table.add_row("tower", f"{config.get('vision_n_layers')} layers, dim "
                      f"{config.get('vision_dim')}, {config.get('vision_n_heads')} heads, patch "
                      f"{config.get('vision_patch_size')}, merge "
                      f"{config.get('vision_downsample_ratio')}, hidden "
                      f"{config.get('hidden_size')}")
    files = f"{summary.files} file{'s' if summary.files != 1 else ''}"
    if summary.interrupted and not summary.files:  # one growing file's committed ranges
        files = "the parts folder"
    table.add_row("on disk", f"{_size(summary.bytes_on_disk)} in {files}")
    console.print(table)
    if summary.errors:
        errs = Table(title="top errors", title_justify="left")
        errs.add_column("count", justify="right")
        errs.add_column("error")
        for kind, count, example in summary.errors:
            errs.add_row(str(count), f"{kind}\n  e.g. {example}")
        console.print(errs)
