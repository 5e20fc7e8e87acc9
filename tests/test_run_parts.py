"""Part boundaries cut by the inputs' keys (``run/plan.cut_parts``): the same for the same
keys on every machine, listed whole or streamed; sizes within their bounds; and inputs added
or removed anywhere move only the boundaries near them."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from dsv4enc.images.headers import Planned
from dsv4enc.images.items import InputItem
from dsv4enc.output.read import output_files
from dsv4enc.run.pipeline import EncodeOptions, run_encode
from dsv4enc.run.plan import cut_parts, key_hashes, part_sizes

from helpers import CONFIGS


def planned_of(keys: list[str]) -> list[Planned]:
    return [Planned(InputItem(key, key)) for key in keys]


def bounds(keys: list[str], part_images: int) -> list[tuple[int, int]]:
    return [(p.start, p.end) for p in cut_parts(planned_of(keys), part_images)]


def key_parts(keys: list[str], part_images: int) -> list[tuple[str, ...]]:
    """The parts as the keys they hold (what an update compares, whatever their positions)."""
    return [tuple(keys[start:end]) for start, end in bounds(keys, part_images)]


def names(count: int) -> list[str]:
    return [f"img{i:06d}.png" for i in range(count)]


def test_the_cut_is_pinned_by_the_keys_alone():
    """A key's hash is BLAKE2b's (the same everywhere), so an output made on one machine is
    cut the same on another: these bounds must not change, or every update of an earlier
    output writes it whole."""
    assert int(key_hashes(["img000000.png"])[0]) == int.from_bytes(
        hashlib.blake2b(b"img000000.png", digest_size=8).digest(), "little")
    assert bounds(names(40), 8) == [(0, 6), (6, 16), (16, 22), (22, 32), (32, 38), (38, 40)]
    # a key that is not UTF-8 (a file name's bytes held as surrogates) is hashed, not refused
    assert len(bounds(["caf\udce9.png", *names(20)], 4)) > 1


@pytest.mark.parametrize("part_images", [1, 2, 3, 8, 50, 333])
def test_sizes_stay_within_their_bounds_and_average_near_the_target(part_images):
    keys = names(6000)
    shortest, longest, _ = part_sizes(part_images)
    sizes = [end - start for start, end in bounds(keys, part_images)]
    assert sum(sizes) == len(keys)
    assert all(shortest <= size <= longest for size in sizes[:-1])
    assert 0 < sizes[-1] <= longest
    if part_images >= 8:
        assert 0.75 * part_images <= len(keys) / len(sizes) <= 1.25 * part_images


def test_keys_that_never_say_where_to_cut_give_the_longest_parts():
    """Keys whose hashes only grow hold no boundary of their own: each part is cut at its
    longest; hashes that only fall have their boundary at the list's end alone."""
    keys = names(500)
    hashes = key_hashes(keys)
    rising = [key for _, key in sorted(zip(hashes.tolist(), keys))]
    _, longest, _ = part_sizes(10)
    assert {end - start for start, end in bounds(rising, 10)[:-1]} == {longest}
    falling = rising[::-1]
    assert {end - start for start, end in bounds(falling, 10)[:-1]} == {longest}


def test_a_streamed_listing_cuts_the_parts_of_the_whole_list():
    """``more(count)`` lists on as the cut needs; each part is cut once enough keys past its
    end are listed, so the parts equal the whole list's."""
    planned = planned_of(names(1000))
    listed: list[Planned] = []
    asked = []

    def more(count: int) -> None:
        asked.append(count)
        listed.extend(planned[len(listed):min(count, len(planned))])

    streamed = cut_parts(listed, 20, more)
    first = next(streamed)
    assert len(listed) < 100  # the first part is cut long before the list is whole
    rest = [(p.start, p.end) for p in streamed]
    assert [(first.start, first.end), *rest] == bounds(names(1000), 20)


@pytest.mark.parametrize("where", ["first", "middle", "last", "spread"])
def test_inputs_added_or_removed_move_only_the_parts_around_them(where):
    """Five keys added (sorting first, in the middle, last, or one in each fifth) or removed:
    the parts that do not hold them are the same parts of the same keys, but for at most
    about two parts beside each change."""
    keys, part_images = names(2000), 50
    at = {"first": [0] * 5, "middle": [1000] * 5, "last": [2000] * 5,
          "spread": [0, 500, 1000, 1500, 2000]}[where]
    grown = list(keys)
    for k, position in sorted(enumerate(at), key=lambda kp: -kp[1]):
        grown.insert(position, f"img{position:06d}-new{k}.png" if position else f"a-new{k}.png")
    before, after = set(key_parts(keys, part_images)), key_parts(grown, part_images)
    written = sum(len(part) for part in after if part not in before)
    changes = len(set(at))
    assert written <= changes * 3 * part_images
    shrunk = keys[:700] + keys[705:]
    lost = set(key_parts(keys, part_images)) - set(key_parts(shrunk, part_images))
    assert sum(len(part) for part in lost) <= 3 * part_images


def test_a_boundary_depends_only_on_the_keys_within_reach():
    """A boundary after input i is where key i hashes lower than every key within ``reach``
    on either side: keys further away, changed at will, keep it (away from the forced cuts
    of parts at their longest)."""
    keys, part_images = names(3000), 40
    _, longest, reach = part_sizes(part_images)
    natural = [(start, end) for start, end in bounds(keys, part_images)
               if end - start < longest]
    start, end = natural[len(natural) // 2]
    changed = [key if abs(i - (end - 1)) <= reach + part_images else f"x{key}"
               for i, key in enumerate(keys)]
    assert end in {e for _, e in bounds(changed, part_images)}


def noise(path: Path, seed: int) -> None:
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)).save(path)


def noise_folder(folder: Path, keys: list[str]) -> Path:
    """``folder`` made, with a noise image under each of ``keys``."""
    folder.mkdir()
    for i, key in enumerate(keys):
        noise(folder / key, i)
    return folder


def encode(images: Path, out: str, **more):
    base = dict(inputs=[str(images)], out=out, config=str(CONFIGS / "tiny.json"),
                random_init=True, device="cpu", part_images=4, batch_tokens=1500, workers=0,
                progress=False)
    return run_encode(EncodeOptions(**{**base, **more}))


def rows(out: Path) -> list[dict]:
    return [row for path in output_files(out) for row in pq.read_table(path).to_pylist()]


def files(out: Path) -> dict[str, tuple[int, int]]:
    """The folder's part files, each with its inode and time (a file kept as it is keeps both)."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.glob("*.parquet")}


@pytest.mark.parametrize("new", [["a-new0.png", "a-new1.png"],  # sorting first
                                 ["img000017-new.png", "img000018-new.png"]])  # in the middle
def test_an_update_after_an_insertion_keeps_the_parts_away_from_it(new, tmp_path):
    """A folder output's ``--update`` after images added before most others: the old part
    files that are whole parts of the new cut stay as they are (not even rewritten), nearly
    all of them, and the folder equals a clean run row for row."""
    old_keys = names(36)
    images = noise_folder(tmp_path / "in", old_keys)
    out = tmp_path / "emb"
    encode(images, f"{out}/")
    before = files(out)
    for k, key in enumerate(new):
        noise(images / key, 100 + k)
    summary = encode(images, f"{out}/", update=True)
    assert (summary.encoded, summary.reused) == (2, 36)
    after = files(out)
    kept = [name for name in after if after[name] == before.get(name)]
    new_keys = sorted(old_keys + new)
    unchanged = set(key_parts(old_keys, 4)) & set(key_parts(new_keys, 4))
    assert len(kept) == len(unchanged) >= len(before) - 3
    encode(images, str(tmp_path / "clean.parquet"))
    assert rows(out) == rows(tmp_path / "clean.parquet")


def test_an_update_keeps_the_pieces_that_commits_by_time_cut(tmp_path):
    """An output committed in pieces (a commit after each image's segment, as
    ``--commit-every`` cuts parts on a slow device): after images are added first, the
    pieces of every part the insertion left as it was are kept as they are, and the folder
    equals a clean run."""
    old_keys = names(24)
    images = noise_folder(tmp_path / "in", old_keys)
    out = tmp_path / "emb"
    encode(images, f"{out}/", commit_every=1e-6, batch_tokens=1)  # a piece per image
    before = files(out)
    assert len(before) == 24
    for k in range(2):
        noise(images / f"a-new{k}.png", 100 + k)
    summary = encode(images, f"{out}/", update=True)
    assert (summary.encoded, summary.reused) == (2, 24)
    after = files(out)
    kept = [name for name in after if after[name] == before.get(name)]
    unchanged = set(key_parts(old_keys, 4)) & set(key_parts(sorted(old_keys + ["a-new0.png",
                                                                               "a-new1.png"]), 4))
    assert len(kept) == sum(len(part) for part in unchanged) >= 24 - 3 * 7
    encode(images, str(tmp_path / "clean.parquet"))
    assert rows(out) == rows(tmp_path / "clean.parquet")


def test_resume_keeps_parts_cut_another_way(tmp_path):
    """Committed parts are judged by their inputs, wherever they were cut: a run resumed
    with another part size (or over parts an earlier dsv4enc cut by position) keeps them all,
    and equals a clean run."""
    images = noise_folder(tmp_path / "in", names(20))
    out = tmp_path / "emb"
    encode(images, f"{out}/", part_images=3)
    before = files(out)
    summary = encode(images, f"{out}/", part_images=7, resume=True)
    assert (summary.encoded, summary.reused) == (0, 20)
    assert files(out) == before
    encode(images, str(tmp_path / "clean.parquet"))
    assert rows(out) == rows(tmp_path / "clean.parquet")


def test_a_resume_that_encodes_every_part_again_writes_the_manifest_whole_once(
        tmp_path, monkeypatch):
    """Each committed part whose inputs changed is dropped by a journal line, not by writing
    the manifest whole (which lists every part: a resume of N changed parts cost N^2); the
    result equals a clean run."""
    from dsv4enc.output.parts import PartStore

    images = noise_folder(tmp_path / "in", names(24))
    out = tmp_path / "emb"
    assert encode(images, f"{out}/", part_images=1).encoded == 24
    for path in images.iterdir():  # copied without their times: every stamp changes
        os.utime(path, ns=(1, 1))
    saves = []
    monkeypatch.setattr(PartStore, "save", lambda self, save=PartStore.save: (
        saves.append(1), save(self))[1])
    summary = encode(images, f"{out}/", part_images=1, resume=True)
    assert (summary.encoded, summary.reused) == (24, 0)
    assert len(saves) <= 3, len(saves)
    encode(images, str(tmp_path / "clean.parquet"), part_images=1)
    assert rows(out) == rows(tmp_path / "clean.parquet")
