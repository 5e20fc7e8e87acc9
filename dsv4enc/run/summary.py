"""What a run did (``RunSummary``), and its end-of-run report: a small table on stderr, and
``--summary-json`` for pipelines.

Rates have the progress display's definitions (``progress`` module docstring); the whole
run's wall time is shown beside them, so that start-up is visible without muddying the rates."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .. import storage
from ..errors import UsageError
from ..output.files import PARTIAL, temp_path
from ..output.inspect import TOP_ERRORS, error_group
from .progress import stderr_console


#: The summary table's width in a log: wider than any row, so that none wraps.
LOG_WIDTH = 10_000

#: The fields that add up over ranks and encoder actors (``RunSummary.add``): the work's
#: counts, and the time an encoder spent (each actor's own, summed).
COUNT, TIME = {"adds": "count"}, {"adds": "time"}


@dataclass
class RunSummary:
    """What a run did, for the summary line and for callers."""

    out: str
    encoded: int = field(default=0, metadata=COUNT)
    failed: int = field(default=0, metadata=COUNT)
    skipped: int = 0
    unlisted: int = 0  # folders that could not be listed (their images are missing)
    misnamed: int = 0  # images whose name says another format (read as what they are)
    misnamed_example: str = ""  # the first of them, e.g. "a.png is JPEG"
    reused: int = 0
    dropped: int = 0  # --update: rows of inputs that are gone
    dropped_paths: list[str] = field(default_factory=list)  # the first few of them
    reused_failed: int = 0  # error rows reused as they were (among ``reused``)
    already_complete: bool = False  # --resume found the output finished (not only committed)
    update: bool = False  # an --update of an existing output (``reused``: its rows kept)
    dry_run: bool = False  # --dry-run: ``encoded``, ``reused``, ``dropped`` would be; none was
    needs_prune: bool = False  # --dry-run: the update would be refused without --prune
    seconds: float = 0.0
    tokens: int = field(default=0, metadata=COUNT)
    padded_tokens: int = 0
    merge_pad_tokens: int = field(default=0, metadata=COUNT)
    decode_wait_s: float = field(default=0.0, metadata=TIME)
    h2d_s: float = 0.0
    model_s: float = field(default=0.0, metadata=TIME)
    write_s: float = 0.0
    encode_s: float = 0.0  # the encoding loop alone: no start-up, header reading or capture
    errors: dict[str, int] = field(default_factory=dict)  # message (paths elided) -> count
    error_examples: dict[str, str] = field(default_factory=dict)  # message -> first path
    rank_loads: list[float] = field(default_factory=list)

    @property
    def images_per_s(self) -> float:
        """Images finished (encoded or failed) per second of the encoding loop; 0 when none
        was encoded (failures alone are no rate)."""
        if not self.encode_s or not self.encoded:
            return 0.0
        return (self.encoded + self.failed) / self.encode_s

    @property
    def tokens_per_s(self) -> float:
        """ViT tokens encoded per second of the encoding loop."""
        return self.tokens / self.encode_s if self.encode_s else 0.0

    def count_misnamed(self, planned) -> None:
        """Count one window's planned images whose name says another format than their content."""
        odd = [entry for entry in planned if entry.misnamed and entry.error is None]
        self.misnamed += len(odd)
        if odd and not self.misnamed_example:
            self.misnamed_example = f"{odd[0].item.key} is {odd[0].misnamed}"

    def count_rows(self, rows) -> None:
        """Count finished rows (``output.parts.Row``) as encoded (with their ViT tokens) or
        failed (under its message). Rows are counted as they are kept, not as their batch is
        handed to the engine: a stopped run's summary holds what it kept, as its progress does."""
        for row in rows:
            if row.error is None:
                self.encoded += 1
                self.tokens += row.vit_h * row.vit_w
            else:
                self.failed += 1
                self.add_error(row.error, row.path)

    def add(self, other: "RunSummary", times: bool = True) -> None:
        """Add the work ``other`` counted (another rank's or actor's) to this summary:
        its counts, its errors, and (``times``) its encoding times."""
        for name in fields(self):
            if name.metadata.get("adds") == "count" or times and name.metadata.get("adds"):
                setattr(self, name.name, getattr(self, name.name) + getattr(other, name.name))
        for message, count in other.errors.items():
            self.add_error(message, other.error_examples[message], count)

    def add_error(self, message: str, path: str, count: int = 1) -> None:
        """Count a failed image under its message, the paths in it elided."""
        group = error_group(message)
        self.errors[group] = self.errors.get(group, 0) + count
        self.error_examples.setdefault(group, path)

    @property
    def padding_waste(self) -> float:
        """Padded tokens (graph budgets and merge padding) per real token."""
        return (self.padded_tokens + self.merge_pad_tokens) / max(self.tokens, 1)


def top_errors(summary, limit: int | None = TOP_ERRORS) -> list[tuple[str, int, str]]:
    """(message, count, example path), the commonest first."""
    ranked = sorted(summary.errors.items(), key=lambda kv: (-kv[1], kv[0]))
    return [(message, count, summary.error_examples.get(message, ""))
            for message, count in ranked[:limit]]


def print_summary(summary) -> None:
    """Print a RunSummary as a small table."""
    s = summary
    table = Table(show_header=False)
    table.add_column(style="bold")
    table.add_column()
    for label, count in (("encoded", s.encoded), ("failed", s.failed),
                         ("skipped (not images)", s.skipped)):
        table.add_row(label, str(count))
    if s.unlisted:
        table.add_row("folders not listed", f"{s.unlisted} (their images are missing; see the "
                      "lines above)")
    if s.misnamed:
        table.add_row("misnamed", escape(
            f"{s.misnamed} image{'s' if s.misnamed != 1 else ''} whose name says another "
            f"format, read as what {'they are' if s.misnamed != 1 else 'it is'} "
            f"(e.g. {s.misnamed_example})"))
    failed = f" ({failed_images(s.reused_failed)} among them)" if s.reused_failed else ""
    if s.update:
        table.add_row("reused from the output", f"{s.reused}{failed}")
        table.add_row("dropped (inputs gone)", escape(f"{s.dropped}{dropped_shown(s)}"))
    elif s.reused:
        table.add_row("reused from earlier run", f"{s.reused}{failed}")
    table.add_row("wall time", f"{s.seconds:.1f}s (the whole run, start-up included)")
    if s.encode_s and not s.encoded:
        table.add_row("encoding loop", f"{s.encode_s:.1f}s: nothing was encoded")
    elif s.encode_s:
        busy = min(1.0, s.model_s / s.encode_s)
        table.add_row("encoding loop", f"{s.encode_s:.1f}s: {s.images_per_s:.1f} img/s, "
                      f"{s.tokens_per_s:,.0f} tokens/s (model busy {100 * busy:.0f}%)")
    table.add_row("time split", f"decode wait {s.decode_wait_s:.1f}s / H2D {s.h2d_s:.1f}s / "
                  f"model {s.model_s:.1f}s / write {s.write_s:.1f}s")
    table.add_row("padding waste", f"{100 * s.padding_waste:.1f}% of real tokens")
    if len(s.rank_loads) > 1:
        mean = sum(s.rank_loads) / len(s.rank_loads)
        imbalance = max(s.rank_loads) / mean if mean else 1
        loads = ", ".join(f"{load:,.0f}" for load in s.rank_loads)
        table.add_row("rank loads", f"{loads} (imbalance {imbalance:.3f})")
    for message, count, example in top_errors(s):
        table.add_row("error", escape(f"{count} x {message} (e.g. {example})"))
    more = len(s.errors) - TOP_ERRORS
    if more > 0:
        rest = sum(sorted(s.errors.values(), reverse=True)[TOP_ERRORS:])
        table.add_row("", f"and {more} more kind{'s' if more != 1 else ''} of error "
                      f"({rest} image{'s' if rest != 1 else ''}); --summary-json lists them all")
    # The output's path on a line of its own; in a log (stderr redirected) every row is one
    # line too, so that neither a path nor a message is cut where a script or grep reads it
    stderr_console.print(f"dsv4enc: {escape(s.out)}", highlight=False, soft_wrap=True)
    console = stderr_console if stderr_console.is_terminal else Console(
        stderr=True, width=LOG_WIDTH, emoji=False)
    console.print(table)


def dropped_shown(summary) -> str:
    """`` (a.png, b.png and 19 more)``: the first dropped rows' paths, or "" for none."""
    if not summary.dropped_paths:
        return ""
    more = summary.dropped - len(summary.dropped_paths)
    return f" ({', '.join(summary.dropped_paths)}{f' and {more:,} more' if more > 0 else ''})"


def failed_images(count: int) -> str:
    return f"{count:,} failed image{'s' if count != 1 else ''}"


def dry_run_line(summary) -> str:
    """What ``--dry-run`` prints: the three counts, and the first dropped paths."""
    s = summary
    return (f"dry run for {s.out}: {s.encoded:,} to encode, {s.reused:,} reused"
            f"{f' ({failed_images(s.reused_failed)})' if s.reused_failed else ''}, "
            f"{s.dropped:,} dropped{dropped_shown(s)}; nothing was written"
            f"{' (the update needs --prune to drop them)' if s.needs_prune else ''}")


def summary_dict(summary, status: str = "completed", exit_code: int = 0,
                 error: str | None = None) -> dict:
    """What ``--summary-json`` holds: counts, failures by type and message (with an example
    path each), timings and the output path; ``error``: the line a run that failed ended
    with (status ``"error"``)."""
    s = summary
    messages = [{"message": m, "count": n, "example": e} for m, n, e in top_errors(s, None)]
    by_type: dict[str, dict] = {}
    for m in messages:
        entry = by_type.setdefault(m["message"].split(":", 1)[0],
                                   {"count": 0, "example": m["example"]})
        entry["count"] += m["count"]
    return {
        "status": status, "exit_code": exit_code, "output": s.out,
        **({"error": error} if error is not None else {}),
        "images": {"encoded": s.encoded, "failed": s.failed, "skipped_not_images": s.skipped,
                   "reused": s.reused, "reused_failed": s.reused_failed, "dropped": s.dropped,
                   "folders_not_listed": s.unlisted, "misnamed": s.misnamed},
        "dropped_examples": s.dropped_paths,
        "dry_run": s.dry_run,
        "misnamed_example": s.misnamed_example,
        "tokens": s.tokens,
        "failures": {"by_type": by_type, "messages": messages},
        "seconds": {"wall": s.seconds, "encoding": s.encode_s, "decode_wait": s.decode_wait_s,
                    "h2d": s.h2d_s, "model": s.model_s, "write": s.write_s},
        "rates": {"images_per_s": s.images_per_s, "tokens_per_s": s.tokens_per_s},
        "padding_waste": s.padding_waste,
        "rank_loads": s.rank_loads,
    }


def write_summary_json(path: str | os.PathLike, summary, status: str = "completed",
                       exit_code: int = 0, error: str | None = None) -> None:
    """Write ``summary_dict`` to ``path`` (atomically: a reader never sees half a file)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(target)
    try:
        tmp.write_text(json.dumps(summary_dict(summary, status, exit_code, error), indent=1)
                       + "\n")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


#: The most bytes a summary file of an earlier run is read for (one is a few kB).
SUMMARY_MAX_BYTES = 1 << 20


def check_summary_path(path: str, out: str) -> None:
    """Refuse, before the run, a ``--summary-json`` path that the run may not write: not a local
    path, ``-``, the output ``out`` or a path inside it (links followed on both sides), a path
    whose folder is a file or cannot be written, or a file that is there and is not a summary of an
    earlier run (dsv4enc replaces only what it wrote)."""
    local, out_path = storage.local_path(path), storage.local_path(out)
    if local is None:
        raise UsageError(f"--summary-json {path}: give a local path")
    if path == "-":  # read as standard output, which holds the output path under --quiet
        raise UsageError("--summary-json -: give a file (standard output is not one)")
    given = Path(local)
    # the file itself is replaced, never followed: its folder's real place is where it lands
    target = Path(os.path.realpath(given.parent)) / given.name
    if out_path is not None:
        output = Path(os.path.realpath(out_path))
        for taken in (output, output.with_name(output.name + PARTIAL)):
            if target == taken or taken in target.parents:
                raise UsageError(f"--summary-json {path} is the output --out {out} or lies "
                                 "in it; choose another path")
    _check_summary_folder(path, given.parent)
    try:
        os.lstat(given)
    except (FileNotFoundError, NotADirectoryError):
        return
    except OSError as exc:  # a name too long for the file system
        raise UsageError(f"--summary-json {path}: {exc.strerror or exc}") from None
    if not _is_summary(given):
        raise UsageError(f"--summary-json {path} exists and is not a dsv4enc summary (dsv4enc "
                         "replaces only a summary it wrote); choose another path")


def _check_summary_folder(path: str, folder: Path) -> None:
    """Refuse a summary whose folder ``folder`` cannot be made (the nearest name on its way
    that is there is a file, or a link to nothing) or may not be written in by this process:
    the run would end without its summary."""
    existing = folder.absolute()
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"--summary-json {path}: {existing} is not a folder; choose another "
                         "path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"--summary-json {path}: the folder {existing} cannot be written; "
                         "choose another path")


def _is_summary(path: Path) -> bool:
    """Whether ``path`` is a regular file holding a summary of an earlier run."""
    try:
        if not path.is_file() or path.stat().st_size > SUMMARY_MAX_BYTES:
            return False
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and {"status", "exit_code", "output", "images"} <= set(data)
