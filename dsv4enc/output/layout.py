"""Where a run's output goes: the ``--out`` checks, the store its parts are committed to,
and the clean-up of dsv4enc's files only.

dsv4enc deletes or replaces only what is provably its own: a single-file ``--out`` that is a
Parquet file with dsv4enc's metadata, and in a parts folder (``OUT.partial/`` or a folder
``--out``) its lock, its temporaries, and the files under its names (``files.is_output_file``)
whose content says they are dsv4enc's: manifests (``parts.is_manifest``), journals, stamps,
the growing file and part files (``OutputLayout._is_ours``). Anything else makes the run
refuse in one line, before anything is written or deleted."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Iterable

import pyarrow.parquet as pq

from .. import storage
from ..errors import OutputError, output_os_error
from ..images.items import is_image_name
from .files import (GROWING_NAME, JOURNAL_FILE, LOCK_NAME, MANIFEST_FILE, MANIFEST_NAME,
                    PART_FILE, PARTIAL, STAMPS_FILE, is_output_file, manifest_name,
                    temporary_of, write_probe)
from . import appending
from .lock import OutputLock, holder_if_locked, holder_text
from .parquet_join import MAGIC
from .update import Update, is_stamps_file
from .read import JOURNAL_FORMAT, is_dsv4enc_parquet, metadata_of, read_metadata
from .parts import (PartStore, StreamingAssembler, listed_names,
                    pre_release_manifest, read_manifest, read_manifests)


def _inside(path: str, folder: str) -> bool:
    """``path`` lies strictly inside ``folder`` (both real, absolute paths)."""
    return path != folder and os.path.commonpath([path, folder]) == folder


#: How a journal's header line begins (``parts.PartStore`` writes it with ``json.dumps``
#: and sorted keys, so ``format`` comes first).
_JOURNAL_OPENING = json.dumps({"format": JOURNAL_FORMAT}).encode()[:-1]
#: A journal's first bytes that are read to recognise it (its header is far shorter).
_JOURNAL_HEAD = 4096


def _read_head(path: Path, size: int) -> bytes | None:
    """The first ``size`` bytes of the file at ``path``; None where it cannot be read."""
    try:
        with open(path, "rb") as handle:
            return handle.read(size)
    except OSError:
        return None


def _is_journal(path: Path) -> bool:
    """A manifest's journal: its first line is dsv4enc's journal header, or it is what a run
    killed while it created the journal leaves (empty, or that header cut short)."""
    head = _read_head(path, _JOURNAL_HEAD)
    if head is None:
        return False
    line, newline, _ = head.partition(b"\n")
    if not newline:  # torn: the header and its first entry are one write
        return len(head) < _JOURNAL_HEAD and (_JOURNAL_OPENING.startswith(line)
                                              or line.startswith(_JOURNAL_OPENING))
    try:
        header = json.loads(line)
    except ValueError:
        return False
    return isinstance(header, dict) and header.get("format") == JOURNAL_FORMAT


def _is_growing(path: Path) -> bool:
    """The growing file (``appending``): empty (a run killed as it made it), or ``PAR1`` and
    then either a footer with dsv4enc's metadata (its last part's, or the whole file's) or no
    footer at all (a run killed while a part was written into it)."""
    head = _read_head(path, len(MAGIC))
    if head is None or head and head != MAGIC:
        return False
    if not head:
        return True
    try:  # one footer read: whether there is one, and whose it is
        footer = pq.read_metadata(path)
    except Exception:  # no footer, a torn one, ...: pyarrow raises several kinds
        return True
    return metadata_of(footer.schema.to_arrow_schema()).get("tool") == "dsv4enc"


def _is_part(path: Path) -> bool:
    """A part file no manifest lists: a killed run's, whose footer says dsv4enc wrote it, or
    an empty one (a bucket output's stand-in)."""
    return path.stat().st_size == 0 or is_dsv4enc_parquet(path)


#: How the content of a file under each of dsv4enc's names shows it is dsv4enc's (a file a
#: manifest lists is, and a manifest is known by its own content: ``parts.is_manifest``).
_KNOWN_BY = ((PART_FILE, _is_part), (JOURNAL_FILE, _is_journal), (STAMPS_FILE, is_stamps_file))


#: How the refusal of an existing output names the two ways to continue it.
_UPDATE_OR_RESUME = ("--update to bring it up to date with the inputs, or --resume to finish "
                     "an interrupted run")


class OutputLayout:
    """Where parts go (``OUT.partial/`` beside a single-file ``--out``, or the ``--out`` folder),
    the checks before anything is computed, the lock, and the clean-up of dsv4enc's files only."""

    def __init__(self, out: str, shard_output: bool) -> None:
        self.out = Path(out)
        try:  # a name too long, a folder on its way the user may not enter: before any check
            os.lstat(out)
        except (FileNotFoundError, NotADirectoryError):
            pass
        except OSError as exc:
            raise OutputError(f"cannot use --out {out}: {exc.strerror or exc}") from None
        self.shard_output = shard_output
        self.folder_mode = shard_output or out.endswith(("/", os.sep)) or self.out.is_dir()
        self.parts_dir = (self.out if self.folder_mode
                          else self.out.with_name(self.out.name + PARTIAL))
        self.lock = OutputLock(self.parts_dir, self.out)
        #: The largest single file the store takes (``RemoteOutput.max_file_bytes``; None: any)
        self.max_file_bytes: int | None = None
        #: How a stop's line names the output (``RemoteOutput.translate``: by its URLs)
        self.shown: Callable[[str], str] = str
        self._made: list[Path] = []  # folders this run created (removed again if left empty)
        self._prepared = False  # this process checked the output (rank 0 under torchrun)
        #: ``--resume`` or ``--update`` found the single file finished, with no run to go on
        self.finished = False

    def interrupted_settings(self, rank: int | None = None) -> dict | None:
        """The settings the interrupted run recorded in this output's manifest, or that the
        finished single file's schema holds (what ``--resume`` adopts for ``--dtype auto``),
        or None when there is no such run."""
        if self.finished:
            return read_metadata(self.out)
        recorded = read_manifest(self.parts_dir / self.manifest_name(rank))
        return recorded["settings"] if recorded else None  # a dict: ``is_manifest`` checks

    def manifest_name(self, rank: int | None = None) -> str:
        """Each rank keeps its own manifest under --shard-output (``rank``: this process's,
        None outside torchrun); merged at the end."""
        return manifest_name(rank if self.shard_output else None)

    # -- what is ours -------------------------------------------------------------------
    def _is_ours(self, path: Path, manifests: dict[Path, dict], listed: set[str]) -> bool:
        """A file in the parts folder that dsv4enc wrote (the module's doc); ``manifests``:
        the dsv4enc manifests there, ``listed``: the files they list. What a killed run leaves
        under each name counts (``_KNOWN_BY``, ``_is_growing``)."""
        name = path.name
        became = temporary_of(name)
        if name == LOCK_NAME or became is not None and (
                is_output_file(became) or not self.folder_mode and became == self.out.name):
            return True
        if not manifests or not is_output_file(name) or not path.is_file():
            return False
        if MANIFEST_FILE.fullmatch(name):
            return path in manifests
        if name in listed:
            return True
        if name == GROWING_NAME:
            return _is_growing(path)
        return any(pattern.fullmatch(name) and known(path) for pattern, known in _KNOWN_BY)

    def _owned_and_foreign(self, manifests: dict | None = None) -> tuple[list[Path], list[str]]:
        """Files of the parts folder dsv4enc wrote (lock excepted), and the names of the others
        (hidden ones are neither: never deleted, never in the way); ``manifests``: if read."""
        if not self.parts_dir.is_dir():
            return [], []
        manifests = read_manifests(self.parts_dir) if manifests is None else manifests
        listed = listed_names(manifests.values())
        owned, foreign = [], []
        for path in sorted(self.parts_dir.iterdir()):
            if not path.is_dir() and self._is_ours(path, manifests, listed):
                if path.name != LOCK_NAME:
                    owned.append(path)
            elif not path.name.startswith("."):
                foreign.append(path.name)
        return owned, foreign

    def _remove(self, paths: Iterable[Path]) -> None:
        for path in paths:
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:
                raise output_os_error(path, exc) from None

    # -- checks -------------------------------------------------------------------------
    def check_not_inputs(self, inputs: Iterable[str], files_from: str | None) -> None:
        """Refuse an ``--out`` that is an input, holds one, or would be read as one."""
        out = os.path.realpath(self.out)
        parts = os.path.realpath(self.parts_dir)
        sources = [*inputs, *([files_from] if files_from not in (None, "-") else [])]
        for raw in sources:
            local = storage.local_path(raw)  # a ``file://`` input is its local path
            if local is None or not os.path.lexists(local):
                continue
            real = os.path.realpath(local)
            if real in (out, parts):
                raise OutputError(f"--out {self.out} is the input {raw}; choose an --out "
                                  "outside the inputs")
            if _inside(real, parts) or (self.folder_mode and _inside(real, out)):
                raise OutputError(f"--out {self.out} contains the input {raw}; choose an "
                                  "--out outside the inputs")
            if (not self.folder_mode and os.path.isdir(real) and _inside(out, real)
                    and (is_image_name(self.out.name) or is_image_name(out))):
                if os.path.lexists(self.out):
                    raise OutputError(f"--out {self.out} is an input (an image in the input "
                                      f"folder {raw}); choose an --out outside the inputs")
                raise OutputError(f"--out {self.out} has an image name inside the input folder "
                                  f"{raw} (it would be read as an input); choose another --out")

    def check_file_size(self, estimated: int) -> None:
        """Refuse, before anything is encoded, a single file larger than its store takes
        (``estimated``: the run's embedding bytes)."""
        limit = self.max_file_bytes
        if self.folder_mode or limit is None or estimated <= limit:
            return
        raise OutputError(f"--out {self.out} would be one object of about "
                          f"{estimated / 1e9:.0f} GB, more than one upload to its store holds "
                          f"({limit / 1e9:.0f} GB); write a folder output instead (an --out "
                          "ending in /: one object per part)")

    def _check_kinds(self) -> None:
        out = self.out
        if not out.is_absolute() and ":" in out.parts[0]:
            # pyarrow reads a relative path whose first name holds a colon as a URI
            raise OutputError(f"--out {out} names no store (a URL is SCHEME://...); a local "
                              "path whose first name holds a colon must be given absolute")
        for parent in [out.parent, *out.parent.parents]:
            if parent.exists() and not parent.is_dir():
                raise OutputError(f"cannot write {out}: {parent} is a file, not a folder")
        if self.folder_mode and out.exists() and not out.is_dir():
            raise OutputError(f"--out {out} is a file, but a folder output was asked for")
        if not self.folder_mode:
            if out.is_symlink():  # the finished file would replace the link, not its target
                raise OutputError(f"--out {out} is a symbolic link (to {os.readlink(out)}); "
                                  "give the path it points to as --out")
            if self.parts_dir.exists() and not self.parts_dir.is_dir():
                raise OutputError(f"cannot use {self.parts_dir} for parts: it is a file "
                                  "dsv4enc did not write; move it away")
            if out.exists() and not (out.is_file() and is_dsv4enc_parquet(out)):
                raise OutputError(f"--out {out} already exists and is not a dsv4enc output; "
                                  "dsv4enc replaces only its own files: choose another --out")

    def prepare(self, inputs: Iterable[str], files_from: str | None, *, overwrite: bool,
                resume: bool, update: bool = False) -> None:
        """Check ``--out`` against the inputs (``inputs``, ``files_from``) and what is there,
        take the lock (held until ``release``), and with ``overwrite`` delete the earlier
        run's files: only those (``update`` keeps what is there, as ``resume`` does)."""
        self.check_not_inputs(inputs, files_from)
        self._check_kinds()
        self._prepared = True
        try:
            self._make_parts_dir()
            self.lock.acquire()
            self._check_other_kind()
            self._check_existing(overwrite, resume, update)
        except BaseException:
            self.release()
            raise

    def _check_other_kind(self) -> None:
        """Refuse while a live run writes ``--out`` as the other kind of output: a single file
        (its lock is in ``OUT.partial/``) for a folder run, a folder (its lock in ``OUT/``) for
        a single-file run. Asked once this run holds its own lock: of two runs starting at
        once, the later to look sees the other's."""
        if self.folder_mode:
            out = Path(os.path.abspath(self.out))  # ``.`` has no name to add PARTIAL to
            if not out.name:
                return
            other, kind = out.with_name(out.name + PARTIAL) / LOCK_NAME, "a single file"
        else:
            other, kind = self.out / LOCK_NAME, "a folder"
        holder = holder_if_locked(other)
        if holder is not None:
            raise OutputError(f"another dsv4enc run is writing {self.out} as {kind}"
                              f"{holder_text(holder)}; "
                              "wait for it to finish or choose another --out")

    def _check_existing(self, overwrite: bool, resume: bool, update: bool = False) -> None:
        out = self.out
        older = pre_release_manifest(self.parts_dir)
        if older is not None:
            raise OutputError(f"{older} was written by a dsv4enc before 0.1.0, whose outputs "
                              "this version does not read; move it away or choose another --out")
        manifests = read_manifests(self.parts_dir)
        owned, foreign = self._owned_and_foreign(manifests)
        where = f"--out folder {out}" if self.folder_mode else str(self.parts_dir)
        if foreign and not manifests and self.folder_mode:
            which = (f" (its {MANIFEST_NAME} is no dsv4enc manifest: another tool's, or "
                     "damaged)" if MANIFEST_NAME in foreign else "")
            raise OutputError(f"--out folder {out} is not empty and holds no dsv4enc "
                              f"output{which}; choose another path")
        if foreign:
            shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more"
                                              if len(foreign) > 3 else "")
            raise OutputError(f"{where} holds files dsv4enc did not write ({shown}); move them "
                              "away or choose another --out")
        if not resume and not overwrite and not update:  # --update: keep all, like --resume
            if not self.folder_mode and out.exists():
                raise OutputError(f"{out} already exists; pass --overwrite to replace it, "
                                  f"{_UPDATE_OR_RESUME}")
            if manifests and self.folder_mode:
                raise OutputError(f"--out folder {out} already holds dsv4enc output; pass "
                                  f"--overwrite to replace it, {_UPDATE_OR_RESUME}")
            if manifests:
                raise OutputError(f"an unfinished run left {self.parts_dir}; pass --resume to "
                                  "continue it or --overwrite to start over")
        # Nothing to do, unless its inputs or the settings changed (the run judges that)
        self.finished = ((resume or update) and not manifests and not self.folder_mode
                         and out.is_file())
        if overwrite:
            self._remove(owned)
            return
        # We hold the lock: a killed run's temporaries go, and so do part files no manifest
        # lists (renamed just before a kill), which a folder would show beside their rows.
        listed = listed_names(manifests.values())
        self._remove(p for p in owned if temporary_of(p.name)
                     or (PART_FILE.fullmatch(p.name) and p.name not in listed))

    def _make_parts_dir(self) -> None:
        """Create the parts folder (and missing parents), remembering what was created."""
        missing = [folder for folder in [self.parts_dir, *self.parts_dir.parents]
                   if not folder.exists()]
        try:
            self.parts_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OutputError(f"cannot write to {self.parts_dir}: {exc.strerror or exc}") from None
        self._made = missing  # innermost first

    def create(self) -> None:
        """Check the parts folder is writable (once inputs and weights are known good)."""
        try:
            probe = write_probe(self.parts_dir)
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise OutputError(f"cannot write to {self.parts_dir}: {exc.strerror or exc}") from None

    # -- the end of a run -----------------------------------------------------------------
    def remove_parts(self) -> None:
        """The single file is in place: delete the parts and manifest (dsv4enc's only)."""
        self._remove(self._owned_and_foreign()[0])

    def encoding_hint(self, again: str = "--resume") -> str:
        """The one-line hint of a run stopped while it encodes (``resume_hint`` replaces it
        once the writer has committed what it held)."""
        return self.shown(f"finished parts are kept in {self.parts_dir}; rerun the same "
                          f"command with {again} to finish")

    def resume_hint(self, store: PartStore, again: str = "--resume") -> str:
        """What an interrupted run leaves, for its one-line message (``again``: the flag
        that finishes it, --resume or --update). The parts are where ``store`` keeps them:
        an --update of a folder's, in its staging folder beside the output."""
        if not store.parts:
            if self.folder_mode:
                return self.shown(f"nothing was committed to {self.out} yet; rerun the same "
                                  f"command with {again}")
            return "nothing was committed; rerun the same command"
        images = sum(part.get("rows", 0) for part in store.parts.values())
        return self.shown(f"{len(store.parts)} finished part{'s' if len(store.parts) > 1 else ''}"
                          f" ({images} image{'s' if images != 1 else ''}) kept in "
                          f"{store.folder}; rerun the same command with {again} to finish")

    def remove_temporaries(self) -> None:
        """Remove what killed or cancelled writers left as temporaries (we hold the lock)."""
        self._remove(p for p in self._owned_and_foreign()[0] if temporary_of(p.name))

    def discard_if_empty(self) -> None:
        """After a failed run, remove a single-file output's manifest, growing file and
        temporaries if no part was committed (committed parts are kept for --resume)."""
        if self.folder_mode:
            return
        manifests = read_manifests(self.parts_dir)
        owned, _ = self._owned_and_foreign(manifests)
        recorded = any(manifest["parts"] for manifest in manifests.values())
        if not recorded and not any(PART_FILE.fullmatch(p.name) for p in owned):
            self._remove(owned)

    def release(self) -> None:
        """Let go of the lock, and remove the folders this run created if they are empty
        (a ``.partial`` folder left empty is removed too: it is dsv4enc's by name)."""
        if not self._prepared:
            return
        self._prepared = False
        self.lock.release()
        folders = list(self._made)
        if not self.folder_mode and self.parts_dir not in folders:
            folders.insert(0, self.parts_dir)
        self._made = []
        for folder in folders:
            try:
                folder.rmdir()  # only when empty
            except OSError:
                break


def open_store(layout: OutputLayout, settings: dict, schema, *, local: bool, is_main: bool,
               world_size: int, rank: int | None, update: Update | None = None,
               rows_settings: dict | None = None, written_elsewhere: bool = False) -> PartStore:
    """Where this process commits its parts. One process writing a local single file appends
    each part to it (``appending``), unless ``written_elsewhere`` (``--engine ray``'s actors
    write the part files) and no growing file is there yet; otherwise parts are files, joined
    at the end (``local=False``: the staging of an object storage output). A growing file is
    there when a local run began the file: the actors' parts are copied into it then, as its
    ``--resume`` copies in part files, so that the parts it committed are kept, not encoded
    again. ``rank``: this process's under torchrun (None outside), for --shard-output's
    manifests. ``update`` (``rows_settings``: the settings that decide its rows): --update's
    new parts go to its staging store."""
    staging = update.open_store(settings, rows_settings) if update is not None else None
    if staging is not None:
        return staging

    if (not layout.folder_mode and is_main and local and world_size == 1 and appending.AVAILABLE
            and (not written_elsewhere or (layout.parts_dir / GROWING_NAME).is_file())):
        return appending.AppendingStore(layout.parts_dir, settings, schema, layout.out)
    return PartStore(layout.parts_dir, settings, layout.manifest_name(rank),
                     drop_cache=layout.folder_mode and local)


def assembler_for(store: PartStore, layout: OutputLayout, schema, *, is_main: bool):
    """What makes the single file at the end: the appending store, a ``StreamingAssembler`` (a
    single-file output's main process), or None; its ``key_values`` take more footer metadata."""
    if isinstance(store, appending.AppendingStore):
        store.key_values = {}
        return store
    if not layout.folder_mode and is_main:
        return StreamingAssembler(store, layout.out, schema)
    return None
