"""The names dsv4enc gives the files of an output, each spelled here once, and the predicates
that recognise them (docs/output-format.md, "Part files"). dsv4enc deletes or replaces only
what these name, and a part file only where a dsv4enc manifest lists it (or lists its folder,
and the file's footer says dsv4enc wrote it)."""

from __future__ import annotations

import hashlib
import os
import re
import secrets
from pathlib import Path
from typing import Iterable, TypeVar

from .. import storage

P = TypeVar("P", str, Path)

#: The manifest of a folder of parts (per rank under --shard-output until they are merged).
MANIFEST_NAME = "_manifest.json"
MANIFEST_FILE = re.compile(r"_manifest(?:-rank(\d{3}))?\.json")
#: A manifest's journal of the parts committed since it was written whole.
JOURNAL_FILE = re.compile(r"_manifest(?:-rank\d{3})?\.journal")
#: A bucket's journal segment (an object store has no append): the lines of syncs FIRST to
#: LAST (numbered from 1) of the journal of the manifest STEM.json whose token is TOKEN.
SEGMENT_FILE = re.compile(r"(_manifest(?:-rank\d{3})?)\.([0-9a-f]{16})\.(\d{8})-(\d{8})\.journal")
#: A part file: ``part-N[_OFFSET][-rankR][.gG].parquet`` (``.gG``: an ``--update``'s generation).
PART_FILE = re.compile(r"part-\d{6,}(?:_\d{6,})?(?:-rank(\d{3}))?(?:\.g(\d+))?\.parquet")
#: The growing single file of one local process (``appending.AppendingStore``).
GROWING_NAME = "_growing.parquet"
#: A folder output's row stamps (the manifest's ``stamps`` entry names the current one).
STAMPS_FILE = re.compile(r"_stamps-[0-9a-f]{16}\.bin")
#: The run's lock in the parts folder (a flock locally, a lock object in a bucket).
LOCK_NAME = ".dsv4enc.lock"
#: ``temp_path`` names; group 1 is the name of the file it becomes.
TEMP_FILE = re.compile(r"\.(.+?)\.\d+-[0-9a-f]{8}\.tmp")
#: The parts folder beside a single-file ``--out`` is ``OUT`` + this.
PARTIAL = ".partial"
#: An update of a folder output builds the new output in ``.NAME`` + the first until the switch;
#: the old output waits in ``.NAME`` + the second when the switch takes two renames.
STAGING_SUFFIX, OLD_SUFFIX = ".dsv4enc-update", ".dsv4enc-old"


def output_paths(out: str) -> tuple[str, ...]:
    """What a run on ``--out`` writes under names a walk lists (its temporaries' are hidden):
    the output, and the parts folder beside a single file."""
    local = storage.local_path(out)
    if out.endswith(("/", os.sep)) or local is not None and os.path.isdir(local):
        return (out,)
    return out, out + PARTIAL


def part_name(number: int, offset: int = 0) -> str:
    """The name of the run's ``number``th part, or of its rest from ``offset`` on."""
    return f"part-{number:06d}" + (f"_{offset:06d}" if offset else "")


def rank_name(name: str, rank: int) -> str:
    """A part's name under --shard-output, where each rank commits its own share."""
    return f"{name}-rank{rank:03d}"


def part_file(name: str, generation: int = 0) -> str:
    """Part ``name``'s file name (``generation``: an update's, 0 for a run's own)."""
    return f"{name}.g{generation}.parquet" if generation else f"{name}.parquet"


def generation(file: str) -> int:
    """The generation of a part file name (0 for a run's own, or a name that is none)."""
    found = PART_FILE.fullmatch(file)
    return int(found.group(2) or 0) if found else 0


def manifest_name(rank: int | None = None) -> str:
    """The run's manifest, or rank ``rank``'s under --shard-output."""
    return MANIFEST_NAME if rank is None else f"_manifest-rank{rank:03d}.json"


def rank_of(name: str) -> int | None:
    """The rank whose own manifest, journal segment or part file ``name`` is (None: the
    run's, or neither)."""
    segment = SEGMENT_FILE.fullmatch(name)
    if segment:
        name = segment.group(1) + ".json"
    found = MANIFEST_FILE.fullmatch(name) or PART_FILE.fullmatch(name)
    return int(found.group(1)) if found and found.group(1) else None


def journal_path(manifest: P) -> P:
    """The journal beside a manifest: ``_manifest.json`` -> ``_manifest.journal``."""
    return type(manifest)(os.fspath(manifest)[:-len(".json")] + ".journal")


def segment_name(manifest: str, token: str, first: int, last: int) -> str:
    """The journal segment of syncs ``first`` to ``last`` of the manifest named ``manifest``
    (``_manifest.json``) under journal ``token``."""
    return f"{manifest[:-len('.json')]}.{token}.{first:08d}-{last:08d}.journal"


def segment_chain(manifest: str, token: str, names: Iterable[str]) -> list[str]:
    """Of the object ``names`` (paths or keys), the segments that hold the journal of the
    manifest named ``manifest`` under ``token``, in order: from sync 1 on, each time the one
    reaching furthest (a merged segment is written before the ones it replaces are deleted);
    what follows a gap is not taken."""
    stem, spans = manifest[:-len(".json")], {}
    for name in names:
        found = SEGMENT_FILE.fullmatch(name.rsplit("/", 1)[-1])
        if found and found.group(1) == stem and found.group(2) == token:
            first, last = int(found.group(3)), int(found.group(4))
            if last > spans.get(first, (0, ""))[0]:
                spans[first] = (last, name)
    chain, following = [], 1
    while following in spans:
        last, name = spans[following]
        chain.append(name)
        following = last + 1
    return chain


def stamps_name(data: bytes) -> str:
    """A folder output's stamps file, named by its content."""
    return f"_stamps-{hashlib.blake2b(data, digest_size=8).hexdigest()}.bin"


def temp_path(path: Path, folder: Path | None = None) -> Path:
    """A hidden temporary name for ``path`` (in ``folder``, default beside it), unique to this
    process and call: ``.NAME.PID-RANDOM.tmp``. Two runs never write the same temporary."""
    return (folder or path.parent) / f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp"


def write_probe(folder: Path) -> Path:
    """A hidden file that shows a folder can be written (removed at once)."""
    return folder / f".dsv4enc-write-test.{os.getpid()}"


def staging_folder(out: Path) -> Path:
    """Where an update of the folder output ``out`` builds the new output."""
    return out.parent / f".{out.name}{STAGING_SUFFIX}"


def old_folder(out: Path) -> Path:
    """Where the old output of ``out`` waits to be removed after a two-rename switch."""
    return out.parent / f".{out.name}{OLD_SUFFIX}"


def is_output_file(name: str) -> bool:
    """A name dsv4enc gives a file of an output folder: a part, manifest, journal (or a
    bucket's journal segment), stamps or the growing file."""
    return name == GROWING_NAME or any(pattern.fullmatch(name) for pattern in (
        PART_FILE, MANIFEST_FILE, JOURNAL_FILE, SEGMENT_FILE, STAMPS_FILE))


def temporary_of(name: str) -> str | None:
    """The name a ``temp_path`` file would have become, or None where ``name`` is none."""
    found = TEMP_FILE.fullmatch(name)
    return found.group(1) if found else None


def is_ours(name: str) -> bool:
    """A name dsv4enc gives in an output folder: its lock, its files, their temporaries."""
    became = temporary_of(name)
    return name == LOCK_NAME or is_output_file(name) or (became is not None
                                                          and is_output_file(became))
