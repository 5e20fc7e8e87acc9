"""A local single-file output of one process: parts appended once to a growing file with a
journal (dsv4enc/appending.py), and its resume after an interruption. Killed runs
(SIGKILL/SIGTERM/SIGINT) of the same output are in test_reliability.py."""

from __future__ import annotations

import json
import os
import random
import shutil
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from dsv4enc import read_embeddings
from dsv4enc.output import parts as writer
from dsv4enc.output.appending import AppendingStore
from dsv4enc.output.files import GROWING_NAME
from dsv4enc.errors import OutputError
from dsv4enc.run.pipeline import EncodeOptions, run_encode
from dsv4enc.output.parts import Row, output_schema, rows_per_group, rows_to_table
from dsv4enc.output.read import load_manifest

from helpers import CONFIGS, torch_threads

N_IMAGES = 14
PART = 3


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    yield from torch_threads(1)


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("app_images")
    rng = np.random.default_rng(5)
    for i in range(N_IMAGES - 1):
        Image.fromarray(rng.integers(0, 256, (12 + i % 5, 16 + i % 7, 3), dtype=np.uint8)
                        ).save(folder / f"img{i:03d}.png")
    (folder / "broken.png").write_bytes(b"not an image")
    return folder


def options(images: Path, out: Path | str, **changes) -> EncodeOptions:
    base = dict(inputs=[str(images)], out=str(out), config=str(CONFIGS / "tiny.json"),
                random_init=True, device="cpu", part_images=PART, batch_tokens=1500,
                workers=0, progress=False)
    return EncodeOptions(**{**base, **changes})


@pytest.fixture(scope="module")
def folder_rows(images, tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("app_folder") / "emb"
    run_encode(options(images, f"{out}/"))
    return pq.read_table(out).to_pylist()


def rows_of(path: Path) -> list[dict]:
    return pq.read_table(path).to_pylist()


def test_a_single_file_is_written_once_and_equals_a_folder_output(images, folder_rows,
                                                                   tmp_path, monkeypatch):
    """No part file is ever written for it: the parts' bytes go into the one file."""
    def no_part_files(*args, **kwargs):
        raise AssertionError("a part file was written for a single-file output")

    monkeypatch.setattr(writer, "write_table_atomic", no_part_files)
    out = tmp_path / "e.parquet"
    summary = run_encode(options(images, out))
    assert summary.encoded == N_IMAGES - 1 and summary.failed == 1
    assert rows_of(out) == folder_rows
    assert pq.ParquetFile(out).num_row_groups >= N_IMAGES // PART  # one per part at least
    got = list(read_embeddings(out, errors="include"))
    assert [p for p, _, _ in got] == [r["path"] for r in folder_rows]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.parquet"]


def test_several_writer_threads_in_a_run(images, folder_rows, tmp_path, monkeypatch):
    """Parts committed by three writer threads at once (so they may land out of order)
    come out in input order."""
    from dsv4enc.run import pipeline

    monkeypatch.setattr(pipeline, "default_writer_threads", lambda: 3)
    out = tmp_path / "e.parquet"
    run_encode(options(images, out))
    assert rows_of(out) == folder_rows


def table_rows(n: int, seed: int = 0) -> list[Row]:
    rng = np.random.default_rng(seed)
    return [Row(f"{i}.png", 10, 10, 2, 2, 1, 1 + i % 3,
                rng.standard_normal((1 + i % 3, 8)).astype("float16"))
            if i % 5 != 3 else Row(f"{i}.png", error="OSError: truncated") for i in range(n)]


def committed_store(tmp_path: Path, spans, rows, order) -> AppendingStore:
    """A store with parts ``spans`` committed by one thread each, landing in ``order``."""
    schema = output_schema(8, "float16", {"tool": "dsv4enc"})
    store = AppendingStore(tmp_path / "e.parquet.partial", {"tool": "dsv4enc"}, schema,
                           tmp_path / "e.parquet")
    store.create()
    store.segments = {f"part-{a:06d}": SimpleNamespace(start=a, end=b) for a, b in spans}
    turn = threading.Condition()
    landed: list[int] = []

    def commit(index: int) -> None:
        a, b = spans[index]
        table = rows_to_table(rows[a:b], schema)
        with turn:  # commit in the given order, each from its own thread
            turn.wait_for(lambda: order[len(landed)] == index)
            store.commit(f"part-{a:06d}", table, rows_per_group(schema, rows[a:b]) // 2 or 1,
                         a, b, "d")
            landed.append(index)
            turn.notify_all()

    threads = [threading.Thread(target=commit, args=(i,)) for i in range(len(spans))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return store


def test_parts_landing_out_of_order_come_out_in_input_order(tmp_path):
    rows = table_rows(11)
    spans = [(0, 3), (3, 4), (4, 8), (8, 11)]
    store = committed_store(tmp_path, spans, rows, order=[2, 0, 3, 1])
    offsets = [store.parts[f"part-{a:06d}"]["offset"] for a, _ in spans]
    assert offsets != sorted(offsets)  # the bytes really landed out of input order
    store.finish()
    out = tmp_path / "e.parquet"
    got = list(read_embeddings(out, errors="include"))
    assert [p for p, _, _ in got] == [r.path for r in rows]
    for (_, emb, _), row in zip(got, rows):
        assert (emb is None) == (row.embedding is None)
        if emb is not None:
            assert emb.tobytes() == row.embedding.tobytes()
    metadata = pq.read_metadata(out)
    assert metadata.num_rows == 11
    assert metadata.schema.to_arrow_schema().metadata == store.schema.metadata


def test_many_writer_threads_at_once(tmp_path):
    rows = table_rows(40, seed=1)
    spans = [(a, a + 2) for a in range(0, 40, 2)]
    order = list(range(len(spans)))
    random.Random(3).shuffle(order)
    store = committed_store(tmp_path, spans, rows, order)
    store.finish()
    assert [r["path"] for r in rows_of(tmp_path / "e.parquet")] == [r.path for r in rows]


def test_an_empty_output_has_the_schema(tmp_path):
    schema = output_schema(8, "float16", {"tool": "dsv4enc"})
    store = AppendingStore(tmp_path / "p", {"tool": "dsv4enc"}, schema, tmp_path / "e.parquet")
    store.create()
    store.finish()
    table = pq.read_table(tmp_path / "e.parquet")
    assert table.num_rows == 0 and table.schema.equals(schema, check_metadata=True)


# --------------------------------------------------------------------------- resume

@pytest.fixture
def unfinished(images, tmp_path, monkeypatch) -> Path:
    """A run whose every part is journaled but whose final file was never written (its
    footer write failed): ``tmp_path/e.parquet.partial``."""
    def fail(self):
        raise OutputError("disk gone")

    with monkeypatch.context() as patch:
        patch.setattr(AppendingStore, "finish", fail)
        with pytest.raises(OutputError):
            run_encode(options(images, tmp_path / "e.parquet"))
    partial = tmp_path / "e.parquet.partial"
    # the writer folded its journal into the manifest when it closed
    assert sorted(p.name for p in partial.iterdir()) == [GROWING_NAME, "_manifest.json"]
    return partial


def column_bytes(path: Path) -> int:
    """Bytes of all column chunks the footer lists."""
    metadata = pq.read_metadata(path)
    return sum(metadata.row_group(g).column(c).total_compressed_size
               for g in range(metadata.num_row_groups) for c in range(metadata.num_columns))


def journal(partial: Path) -> dict:
    """The manifest with its journal's parts (what every reader of it sees)."""
    return load_manifest(partial / "_manifest.json")


def keep_only(partial: Path, names: set[str]) -> dict:
    """Make the journal list only ``names`` (the others: not committed before a kill)."""
    data = journal(partial)
    data["parts"] = {n: p for n, p in data["parts"].items() if n in names}
    data.pop("journal")  # written whole: the journal no longer applies
    (partial / "_manifest.json").write_text(json.dumps(data))
    return data["parts"]


def test_resume_cuts_a_torn_tail_and_appends_after_the_last_range(unfinished, images,
                                                                  folder_rows):
    parts = journal(unfinished)["parts"]
    by_offset = sorted(parts, key=lambda n: parts[n]["offset"])
    kept = set(by_offset[:2])  # the first two ranges in the file stay committed
    keep_only(unfinished, kept)
    growing = unfinished / GROWING_NAME
    with open(growing, "ab") as handle:
        handle.write(b"torn half of a part")
    summary = run_encode(options(images, unfinished.with_name("e.parquet"), resume=True))
    assert summary.reused == sum(parts[n]["rows"] for n in kept)
    assert rows_of(unfinished.with_name("e.parquet")) == folder_rows
    assert not unfinished.exists()
    # The torn tail was cut: the file holds the parts' ranges (column chunks, each part's
    # own footer) and the footer, nothing else.
    out = unfinished.with_name("e.parquet")
    assert b"torn half of a part" not in out.read_bytes()
    assert out.stat().st_size > 4 + column_bytes(out) + pq.read_metadata(out).serialized_size + 8


def test_the_ranges_of_parts_encoded_again_are_left_out_of_the_file(unfinished, images,
                                                                     folder_rows):
    """A resume that encodes a committed part again (its input files changed) appends the
    new rows: the old range's bytes stay in the growing file, but not in the output."""
    parts = journal(unfinished)["parts"]
    live = sum(part["length"] for part in parts.values())
    assert (unfinished / GROWING_NAME).stat().st_size >= live
    times = {path: path.stat() for path in images.iterdir()}
    try:
        for path in images.iterdir():  # every part's inputs changed: all encoded again
            os.utime(path, ns=(times[path].st_atime_ns, times[path].st_mtime_ns + 10**9))
        summary = run_encode(options(images, unfinished.with_name("e.parquet"), resume=True))
    finally:
        for path, stat in times.items():
            os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    out = unfinished.with_name("e.parquet")
    assert summary.reused == 0 and rows_of(out) == folder_rows
    assert out.stat().st_size < live + pq.read_metadata(out).serialized_size + 16
    assert not unfinished.exists()


def test_a_journal_entry_is_a_few_numbers_and_its_range_ends_with_its_footer(unfinished):
    """The manifest is rewritten at every commit, and a million images make ~10,000 parts:
    an entry holds no row-group metadata (4.4 KB for a real-dims part), only where the part
    is; its own footer closes its range, as in a part file."""
    parts = journal(unfinished)["parts"]
    data = (unfinished / GROWING_NAME).read_bytes()
    for part in parts.values():
        assert set(part) == {"start", "end", "digest", "rows", "failed", "transient", "offset",
                             "length"}
        end = part["offset"] + part["length"]
        assert data[end - 4:end] == b"PAR1"


def test_a_range_whose_footer_is_damaged_is_encoded_again(unfinished, images, folder_rows):
    parts = journal(unfinished)["parts"]
    first = min(parts, key=lambda n: parts[n]["offset"])
    end = parts[first]["offset"] + parts[first]["length"]
    with open(unfinished / GROWING_NAME, "r+b") as handle:  # its footer's length, garbled
        handle.seek(end - 8)
        handle.write(b"\xff\xff\xff\x7f")
    summary = run_encode(options(images, unfinished.with_name("e.parquet"), resume=True))
    assert summary.reused == sum(p["rows"] for n, p in parts.items() if n != first)
    assert rows_of(unfinished.with_name("e.parquet")) == folder_rows


def test_a_journal_entry_beyond_the_file_is_encoded_again(unfinished, images, folder_rows):
    growing = unfinished / GROWING_NAME
    parts = journal(unfinished)["parts"]
    last = max(parts, key=lambda n: parts[n]["offset"])
    with open(growing, "r+b") as handle:  # the last range's bytes never reached the disk
        handle.truncate(parts[last]["offset"] + parts[last]["length"] - 1)
    summary = run_encode(options(images, unfinished.with_name("e.parquet"), resume=True))
    assert summary.reused == sum(p["rows"] for n, p in parts.items() if n != last)
    assert rows_of(unfinished.with_name("e.parquet")) == folder_rows


def test_a_growing_file_that_is_not_parquet_is_refused_and_kept(unfinished, images):
    """No run leaves that under the growing file's name (it starts with ``PAR1`` as soon as
    it is more than empty): it is a file of someone else's."""
    (unfinished / GROWING_NAME).write_bytes(b"junk" * 10)
    with pytest.raises(OutputError, match=f"did not write .{GROWING_NAME}"):
        run_encode(options(images, unfinished.with_name("e.parquet"), resume=True))
    assert (unfinished / GROWING_NAME).read_bytes() == b"junk" * 10


def test_a_refused_resume_changes_nothing(unfinished, images):
    before = {p.name: p.read_bytes() for p in unfinished.iterdir()}
    with pytest.raises(Exception, match="cannot resume"):
        run_encode(options(images, unfinished.with_name("e.parquet"), resume=True,
                           out_dtype="float32"))
    assert {p.name: p.read_bytes() for p in unfinished.iterdir()} == before


def test_resume_from_part_files_copies_the_committed_ones_in(images, folder_rows, tmp_path):
    """A ``.partial`` folder of part files and their manifest (what a run that joins part
    files leaves, e.g. under torchrun): its committed parts are copied in, not encoded
    again."""
    folder = tmp_path / "emb"
    run_encode(options(images, f"{folder}/"))
    partial = tmp_path / "e.parquet.partial"
    shutil.copytree(folder, partial)
    names = sorted(journal(partial)["parts"])
    kept = keep_only(partial, set(names[::2]))  # every other part was committed
    for name in names[1::2]:  # the others' files were never renamed into place
        (partial / f"{name}.parquet").unlink()
    summary = run_encode(options(images, tmp_path / "e.parquet", resume=True))
    assert summary.reused == sum(p["rows"] for p in kept.values())
    assert rows_of(tmp_path / "e.parquet") == folder_rows
    assert not partial.exists()


def test_a_part_larger_than_its_reservation_goes_through_memory(tmp_path, monkeypatch):
    from dsv4enc.output import appending

    monkeypatch.setattr(appending, "group_room", lambda table, group_rows: 100)
    rows = table_rows(12, seed=2)
    store = committed_store(tmp_path, [(0, 5), (5, 12)], rows, order=[1, 0])
    ranges = sum(part["length"] for part in store.parts.values())
    store.finish()
    out = tmp_path / "e.parquet"
    assert [r["path"] for r in rows_of(out)] == [r.path for r in rows]
    # No gap: each range was reserved at its exact size (the parts' chunks and own footers).
    assert out.stat().st_size == 4 + ranges + pq.read_metadata(out).serialized_size + 8
    assert column_bytes(out) < ranges


def test_output_pages_leave_the_page_cache_once_synced(images, folder_rows, tmp_path,
                                                       monkeypatch):
    """Every byte dsv4enc writes for a local output is advised out of the page cache after
    its sync (the run never reads it back): each folder part whole, each appended range of
    a single file. Parts that are read again (joined by torchrun's rank 0, uploaded to
    object storage) are not: ``PartStore(drop_cache=False)``, the default."""
    import os

    advised: list[tuple[str, int, int]] = []

    def record(fd, offset, length, advice):
        assert advice == os.POSIX_FADV_DONTNEED
        advised.append((os.readlink(f"/proc/self/fd/{fd}"), offset, length))

    if not hasattr(os, "posix_fadvise") or not Path("/proc/self/fd").is_dir():
        pytest.skip("needs posix_fadvise and /proc")
    monkeypatch.setattr(os, "posix_fadvise", record)
    folder = tmp_path / "emb"
    run_encode(options(images, f"{folder}/"))
    parts = sorted(p.name for p in folder.glob("*.parquet"))
    assert len(parts) >= N_IMAGES // PART
    # Each part is advised whole (offset 0, length 0: to the end) under its temporary name.
    assert all(offset == 0 and length == 0 for _, offset, length in advised)
    assert len(advised) == len(parts)

    advised.clear()
    out = tmp_path / "e.parquet"
    run_encode(options(images, out))
    assert rows_of(out) == folder_rows
    ranges = sorted((offset, length) for _, offset, length in advised)
    assert ranges and all(length > 0 for _, length in ranges)
    assert all(a + n <= b for (a, n), (b, _) in zip(ranges, ranges[1:]))  # disjoint
    assert ranges[-1][0] + ranges[-1][1] < out.stat().st_size  # the footer follows them
    assert writer.PartStore(tmp_path, {}).drop_cache is False
