"""``read_embeddings``: copies and zero-copy views (``copy=False``) give the same rows, bit for
bit, in both layouts, pooled or not, whatever the batch size; views are read-only and stay
valid while kept."""

from __future__ import annotations

import contextlib
import gc
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dsv4enc import read_embeddings
from dsv4enc.output.parts import (Row, output_schema, parquet_options, rows_per_group,
                                  rows_to_table)
from dsv4enc.output.read import (BATCH_ROWS, OWN_BATCH_BYTES, EmbeddingFormat, embedding_views,
                                 sole_row_array, valid_mask)


def write_output(path: Path, layout: str, pooled: bool, width: int, images: int,
                 rows: int = 6) -> dict[str, np.ndarray | None]:
    """An output file as ``dsv4enc encode`` writes it, with every fourth image failed."""
    rng = np.random.default_rng(3)
    written, table_rows = {}, []
    for i in range(images):
        name = f"img/{i:03d}.jpg"
        if i % 4 == 3:
            written[name] = None
            table_rows.append(Row(path=name, error="decode failed: truncated file"))
            continue
        shape = (width,) if pooled else (rows + i % 3, width)
        emb = rng.standard_normal(shape).astype(np.float16)
        written[name] = emb
        table_rows.append(Row(path=name, width=64, height=48, vit_h=4, vit_w=4, grid_h=1,
                              grid_w=1 if pooled else shape[0], embedding=emb))
    schema = output_schema(width, "float16", {}, pooled=pooled, layout=layout)
    pq.write_table(rows_to_table(table_rows, schema), path,
                   row_group_size=rows_per_group(schema, table_rows), **parquet_options(schema))
    return written


@pytest.mark.parametrize("layout", ["binary", "nested"])
@pytest.mark.parametrize("pooled", [False, True])
def test_views_and_copies_give_the_same_rows(tmp_path, layout, pooled):
    path = tmp_path / "emb.parquet"
    written = write_output(path, layout, pooled, width=32, images=23)
    for errors in ("skip", "include"):
        copies = list(read_embeddings(path, errors=errors))
        views = list(read_embeddings(path, errors=errors, copy=False))
        expected = [name for name, emb in written.items() if emb is not None or errors == "include"]
        assert [p for p, _, _ in copies] == [p for p, _, _ in views] == expected
        for (name, copied, grid), (_, view, view_grid) in zip(copies, views):
            if written[name] is None:
                assert copied is None and view is None and grid is None and view_grid is None
                continue
            assert grid == view_grid
            for emb in (copied, view):
                assert emb.dtype == np.float16 and emb.shape == written[name].shape
                assert emb.tobytes() == written[name].tobytes()
            assert copied.flags.writeable and copied.flags.owndata
            assert not view.flags.writeable
            with pytest.raises(ValueError):
                view[0] = 0


def test_dict_rows_with_views(tmp_path):
    path = tmp_path / "emb.parquet"
    written = write_output(path, "binary", False, width=16, images=9)
    rows = list(read_embeddings(path, columns=["path", "embedding", "error"],
                                errors="include", copy=False))
    assert [r["path"] for r in rows] == list(written)
    for row in rows:
        emb = written[row["path"]]
        assert (row["embedding"] is None) == (emb is None) == (row["error"] is not None)
        if emb is not None:
            assert row["embedding"].tobytes() == emb.tobytes()


def test_kept_views_stay_valid(tmp_path):
    """A view keeps its batch's memory alive: kept past the next batch, the reader's end and
    a garbage collection, it still holds the row's values."""
    path = tmp_path / "emb.parquet"
    written = write_output(path, "binary", False, width=64, images=12)
    kept = [(p, e) for p, e, _ in read_embeddings(path, batch_rows=2, copy=False)]
    gc.collect()
    [np.ones(1 << 16) for _ in range(50)]  # reuse freed memory, if any was freed
    for name, view in kept:
        assert view.tobytes() == written[name].tobytes()


@pytest.mark.parametrize("layout", ["binary", "nested"])
def test_every_batch_size_reads_the_same_rows(tmp_path, layout):
    """The default batch (one row of these 2.75 MB ones with copies, 3 with views) and
    explicit ones yield the same rows."""
    path = tmp_path / "emb.parquet"
    written = write_output(path, layout, False, width=4096, images=7, rows=336)
    want = [(n, e.tobytes()) for n, e in written.items() if e is not None]
    for batch_rows in (None, 1, 2, BATCH_ROWS):
        for copy in (True, False):
            got = [(p, e.tobytes()) for p, e, _ in
                   read_embeddings(path, batch_rows=batch_rows, copy=copy)]
            assert got == want, (batch_rows, copy)


@pytest.mark.parametrize("option, message", [
    ({"batch_rows": 0}, "batch_rows must be positive, got 0"),
    ({"batch_rows": -1}, "batch_rows must be positive, got -1"),
    ({"batch_rows": 2.5}, "batch_rows must be a whole number, got 2.5"),
    ({"batch_rows": "2"}, "batch_rows must be a positive number, got '2'"),
    ({"copy": "no"}, "copy must be True or False, got 'no'"),
    ({"columns": "path"}, r"^columns must be a list of column names, not the text 'path' "
                          r"\(columns=\['path'\] for that column\)$")])
def test_a_bad_reading_option_refuses_in_one_line(tmp_path, option, message):
    """``read_embeddings``' options are checked as the encoder's are, naming the option,
    before any row: ``batch_rows=0`` is no request for the default batch, 2.5 rows no
    batch, ``copy="no"`` (truthy) no request for views, and ``columns="path"`` no list of
    the columns p, a, t and h ("no column 'p'", of a file that has a path column)."""
    path = tmp_path / "emb.parquet"
    write_output(path, "binary", False, width=8, images=3)
    with pytest.raises(ValueError, match=message) as refused:
        next(read_embeddings(path, **option))
    assert "\n" not in str(refused.value)


def test_valid_mask_matches_arrow():
    values = pa.array([b"a", None, b"c", None, None, b"f", b"g", None, b"i", b"j", None],
                      pa.large_binary())
    for start in range(0, 10):
        for length in (0, 1, 3, 11 - start):
            part = values.slice(start, length)
            assert valid_mask(part).tolist() == part.is_valid().to_pylist()
    assert valid_mask(pa.array([1, 2, 3])).tolist() == [True, True, True]


def test_large_rows_are_handed_over_not_copied(tmp_path):
    """Rows of OWN_BATCH_BYTES or more are read one per batch and yielded as the buffer Arrow
    decoded them into: writable, sharing memory with no other row, and the caller's to keep
    or change (a changed row leaves the file's rows and a second read as they were)."""
    path = tmp_path / "emb.parquet"
    written = write_output(path, "binary", False, width=4096, images=6, rows=160)
    assert min(e.nbytes for e in written.values() if e is not None) >= OWN_BATCH_BYTES
    kept = [(p, e) for p, e, _ in read_embeddings(path)]
    gc.collect()
    [np.ones(1 << 18) for _ in range(20)]  # reuse freed memory, if any was freed
    assert [p for p, _ in kept] == [n for n, e in written.items() if e is not None]
    for i, (name, emb) in enumerate(kept):
        assert emb.tobytes() == written[name].tobytes() and emb.flags.writeable
        assert not emb.flags.owndata  # Arrow's buffer, not a copy of it
        assert not any(np.shares_memory(emb, other) for _, other in kept[i + 1:])
    kept[0][1][:] = 0
    again = next(read_embeddings(path))[1]
    assert again.tobytes() == written[kept[0][0]].tobytes()
    assert kept[1][1].tobytes() == written[kept[1][0]].tobytes()


def test_only_a_buffer_that_is_the_rows_alone_is_handed_over():
    """A row is handed over only where its column is one row whose data buffer Arrow made
    for it and nothing else: not a slice of a longer column, not read-only memory."""
    fmt = EmbeddingFormat("binary", "float16", 2, pooled=False)
    row = np.arange(8, dtype=np.float16).tobytes()
    built = pa.array([row], pa.large_binary())  # Arrow's own buffer, for this row alone
    if not built.buffers()[2].is_mutable:
        pytest.skip("this pyarrow builds immutable buffers")
    handed = sole_row_array(built, embedding_views(built, fmt)[0])
    assert handed is not None and handed.flags.writeable and handed.shape == (4, 2)
    longer = pa.array([row, row], pa.large_binary())
    for column in (longer, longer.slice(1, 1)):
        assert sole_row_array(column, embedding_views(column, fmt)[0]) is None
    frozen = pa.Array.from_buffers(pa.large_binary(), 1, [None, built.buffers()[1],
                                                          pa.py_buffer(row)])
    assert sole_row_array(frozen, embedding_views(frozen, fmt)[0]) is None
    assert sole_row_array(built, None) is None


def test_a_folder_with_a_run_s_lock_but_no_manifest_shows_no_rows(tmp_path):
    """Part files beside a run's lock and no manifest (a run that has committed nothing yet,
    or was killed before its first commit, an --overwrite among them) hold no committed row;
    the same files with no lock are another tool's folder of Parquet files, read whole."""
    from dsv4enc.output.files import LOCK_NAME

    folder = tmp_path / "out"
    folder.mkdir()
    written = write_output(folder / "part-000000.parquet", "binary", False, 8, 4)
    (folder / LOCK_NAME).write_text("{}")
    assert list(read_embeddings(folder)) == []
    (folder / LOCK_NAME).unlink()
    assert [key for key, _, _ in read_embeddings(folder, errors="include")] == list(written)


def _first_part_committed(tmp_path: Path, part_images: int):
    """Six rows written (``rows.parquet``), the first three committed as ``part-000000`` of a
    parts folder ``tmp_path / "out"``: its store, the six rows' table and ``write_output``'s
    rows."""
    from dsv4enc.output.parts import PartStore

    written = write_output(tmp_path / "rows.parquet", "binary", False, 8, 6)
    table = pq.read_table(tmp_path / "rows.parquet")
    store = PartStore(tmp_path / "out", {"tool": "dsv4enc"})
    store.create()
    store.commit("part-000000", table.slice(0, 3), part_images, 0, 3, "d0")
    return store, table, written


def test_a_part_committed_after_the_listing_is_read_a_part_gone_is_damage(tmp_path,
                                                                          monkeypatch):
    """A run that commits a part between a reader's listing of the folder and its read of
    the manifest (a folder still being written; an --update's switch alike) leaves the
    reader a part its listing lacks: it lists again and reads every committed part. A
    committed part whose file is gone is damage: one line naming it, never its rows left out."""
    from dsv4enc.errors import UsageError
    from dsv4enc.output import read

    store, table, written = _first_part_committed(tmp_path, part_images=4)
    folder = store.folder
    real = read.load_manifest

    def committed_meanwhile(path, fs=None, listed=()):
        if "part-000003" not in store.parts:  # after the listing, before the manifest's read
            store.commit("part-000003", table.slice(3), 4, 3, 6, "d3")
        return real(path, fs, listed)

    monkeypatch.setattr(read, "load_manifest", committed_meanwhile)
    assert [key for key, _, _ in read_embeddings(folder, errors="include")] == list(written)
    (folder / "part-000000.parquet").unlink()
    with pytest.raises(UsageError, match=f"{folder}/part-000000.parquet: missing, though the "
                       "manifest lists it: the output is damaged; rerun its encode command "
                       "with --update"):
        list(read_embeddings(folder))


def test_a_manifest_written_whole_while_its_journal_is_read_is_read_again(tmp_path,
                                                                        monkeypatch):
    """A run writes its manifest whole (as it finishes, or resumes) and then deletes the
    journal that it folds in: a reader that read the manifest before and its journal after
    finds no journal, and would take the parts the old manifest lists for every committed
    one (none, at a run's end, of a run that committed all by its journal). It reads the
    manifest again and gets every committed part."""
    from dsv4enc.output import read

    store, table, written = _first_part_committed(tmp_path, part_images=3)
    store.commit("part-000003", table.slice(3), 3, 3, 6, "d3")
    real = read._read_journal

    def written_whole_meanwhile(path, fs):
        if (store.folder / "_manifest.journal").exists():  # the run finishes meanwhile
            store.compact()
        return real(path, fs)

    monkeypatch.setattr(read, "_read_journal", written_whole_meanwhile)
    assert [key for key, _, _ in read_embeddings(store.folder, errors="include")] == list(
        written)


def test_a_committed_part_cut_short_is_damage_that_says_how_to_repair_it(tmp_path):
    """A folder's committed part cut short since (a bad copy, a full disk): one line naming
    it and the repair, as for a part gone (--update; --resume for an unfinished run); a
    single file cut short has no such repair, and its line offers none."""
    from dsv4enc.errors import UsageError
    from dsv4enc.dataset import EmbeddingDataset

    store, _, _ = _first_part_committed(tmp_path, part_images=4)
    part = store.folder / "part-000000.parquet"
    part.write_bytes(part.read_bytes()[:100])
    for reader in (lambda: list(read_embeddings(store.folder)), lambda: EmbeddingDataset(
            store.folder)):
        with pytest.raises(UsageError, match=f"{part}: not a readable Parquet file .* the "
                           "output is damaged; rerun its encode command with --update to "
                           r"repair it \(with --resume, if that run did not finish\)$"):
            reader()
    single = tmp_path / "rows.parquet"
    single.write_bytes(single.read_bytes()[:100])
    with pytest.raises(UsageError, match=r"not a readable Parquet file \([^)]*\)$"):
        list(read_embeddings(single))


@contextlib.contextmanager
def _paused_single_file_run(tmp_path: Path, weights: Path, name: str):
    """A single-file run of four images into ``tmp_path / name`` in another process, paused
    after its first commit: yields the output's path, the process and its pauses."""
    from helpers import Pauses, launch_tiny, reaped, write_image

    for i in range(4):
        write_image(tmp_path / "imgs" / f"{i}.png", (20 + i, 20))
    out = tmp_path / name
    pauses = Pauses(tmp_path / "pauses", "commit")
    launched = launch_tiny(pauses, tmp_path / "imgs", str(out), weights, stdout=None,
                           stderr=None)
    with reaped(launched) as proc:
        pauses.wait("commit", proc=proc)
        yield out, proc, pauses


def test_what_would_read_as_no_rows_but_is_no_empty_output_is_one_line(tmp_path, small_ckpt):
    """A single-file run's ``OUT.partial/`` while it runs (paused after its first commit)
    holds ranges of a growing file, no Parquet file: the readers say so, never an empty
    output; so is a folder with no Parquet file and no run in it (a wrong path)."""
    from dsv4enc.dataset import EmbeddingDataset, EmbeddingIterableDataset
    from dsv4enc.errors import UsageError

    with _paused_single_file_run(tmp_path, small_ckpt, "emb.parquet") as (out, proc, pauses):
        partial = f"{out}.partial"
        for reader in (read_embeddings, EmbeddingDataset, EmbeddingIterableDataset):
            with pytest.raises(UsageError, match=f"{partial}: an unfinished single-file run's "
                               "parts, ranges of its growing file: its rows read once"):
                list(reader(partial))
        pauses.release()
        assert proc.wait() == 0
    assert len(list(read_embeddings(out))) == 4
    (tmp_path / "empty").mkdir()
    for reader in (read_embeddings, EmbeddingDataset, EmbeddingIterableDataset):
        with pytest.raises(UsageError, match=f"{tmp_path / 'empty'}: no Parquet files found"):
            list(reader(tmp_path / "empty"))


def test_a_manifest_that_is_not_json_is_damage_in_one_line(tmp_path):
    """Read as a plain folder of Parquet files, a folder whose manifest no longer parses
    would give a killed run's uncommitted part as rows: the readers refuse it instead."""
    from dsv4enc.dataset import EmbeddingDataset
    from dsv4enc.errors import UsageError

    store, table, _ = _first_part_committed(tmp_path, part_images=4)
    folder = store.folder
    pq.write_table(table.slice(3), folder / "part-000003.parquet")  # written, not committed
    assert len(list(read_embeddings(folder, errors="include"))) == 3
    (folder / "_manifest.json").write_text('{"format": "dsv4enc-parts", "parts": {')
    for reader in (read_embeddings, EmbeddingDataset):
        with pytest.raises(UsageError, match=f"{folder}/_manifest.json: not JSON: the output "
                           "is damaged; encode it again"):
            list(reader(folder))


def test_a_file_that_cannot_be_opened_is_not_called_unreadable_parquet(tmp_path):
    """An open that fails for a reason outside the file (the open-file limit reached) is
    named as what it is; only a file whose content is no Parquet is "not a readable Parquet
    file"."""
    import os
    import resource

    from dsv4enc.errors import DsvError
    from dsv4enc.output.read import find_output

    write_output(tmp_path / "rows.parquet", "binary", False, 8, 4)
    found = find_output(tmp_path / "rows.parquet")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    free = os.dup(0)  # the lowest free descriptor: with the limit there, no open succeeds
    os.close(free)
    resource.setrlimit(resource.RLIMIT_NOFILE, (free, hard))
    try:
        with pytest.raises(DsvError) as raised:
            found.open(found.paths[0])
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert "Too many open files" in str(raised.value)
    assert "not a readable Parquet file" not in str(raised.value)
    (tmp_path / "junk.parquet").write_bytes(b"no parquet here")
    junk = find_output(tmp_path / "junk.parquet")
    with pytest.raises(DsvError, match="junk.parquet: not a readable Parquet file"):
        junk.open(junk.paths[0])


def _two_parts_read_midway(tmp_path):
    """A folder output of two parts (``table``'s rows), a ``read_embeddings`` of it one row in,
    and a dataset that read it once, its files closed as a DataLoader worker of the next epoch
    has them: ``(folder, table, rows, dataset)``."""
    from dsv4enc.dataset import EmbeddingIterableDataset

    store, table, _ = _first_part_committed(tmp_path, part_images=3)
    folder = store.folder
    store.commit("part-000003", table.slice(3), 3, 3, 6, "d3")
    rows = read_embeddings(folder, batch_rows=1)
    next(rows)
    dataset = EmbeddingIterableDataset(folder)
    assert len(list(dataset)) == len(list(read_embeddings(folder)))
    dataset._rows._handles.clear()  # closed, as a DataLoader worker of the next epoch has them
    return folder, table, rows, dataset


def _replaced_while_read(rows, dataset) -> None:
    """Both readers of ``_two_parts_read_midway`` stop in the replaced output's one line."""
    from dsv4enc.errors import UsageError

    replaced = ("part-000003.parquet: gone or rewritten since the output was listed: the "
                r"output was replaced \(by an --update or --overwrite\) while it was being "
                "read; read it again")
    with pytest.raises(UsageError, match=replaced):
        list(rows)
    with pytest.raises(UsageError, match=replaced.replace("part-000003", "part-000000")):
        list(dataset)


def test_a_part_gone_after_the_listing_says_the_output_was_replaced(tmp_path):
    """A reader that listed a folder output before an --update switched a new folder into
    place (or an --overwrite replaced it) finds a listed part gone: one line saying the
    output was replaced while it was read and to read it again, never "not a readable
    Parquet file" (no corruption); so does a dataset whose next epoch opens it again."""
    import shutil

    from dsv4enc.output.parts import PartStore

    folder, table, rows, dataset = _two_parts_read_midway(tmp_path)
    shutil.rmtree(folder)  # the old folder switched away; the new one's parts named anew
    store = PartStore(folder, {"tool": "dsv4enc"})
    store.create()
    store.commit("part-000000_000001", table, 6, 0, 6, "d")
    _replaced_while_read(rows, dataset)


def test_a_single_file_still_being_written_is_named_so(tmp_path, small_ckpt):
    """A single-file output whose run is writing it (paused after its first commit) is no
    file yet: the readers say it is being written and to read it when the run ends, as
    ``inspect`` does, never "no such file or folder"; once the run is gone (killed), the
    output is named interrupted, with how to finish it, as ``inspect`` names it."""
    from dsv4enc.dataset import EmbeddingDataset, EmbeddingIterableDataset
    from dsv4enc.errors import UsageError

    with _paused_single_file_run(tmp_path, small_ckpt, "lv.parquet") as (out, proc, pauses):
        for reader in (read_embeddings, EmbeddingDataset, EmbeddingIterableDataset):
            with pytest.raises(UsageError, match=f"{out}: being written by a run \\(pid "
                               f"{proc.pid} on .*\\): read it when the run ends"):
                list(reader(out))
        proc.kill()
        proc.wait()
    with pytest.raises(UsageError, match=f"{out}: an interrupted run, not finished \\(its "
                       f"parts in {out}.partial\\): rerun the same command with --resume to "
                       "finish it"):
        list(read_embeddings(out))


def test_a_binary_embedding_without_its_metadata_is_named_in_one_line(tmp_path):
    """A file of dsv4enc's columns rewritten by a tool that drops the Parquet metadata (as
    ``datasets``' ``to_parquet`` does) holds bytes whose dtype and width nothing says: every
    reader refuses it naming the file, the datasets when they are made (in the training
    process, not later inside a DataLoader worker)."""
    from dsv4enc.dataset import EmbeddingDataset, EmbeddingIterableDataset
    from dsv4enc.errors import UsageError
    from dsv4enc.output.inspect import summarize

    write_output(tmp_path / "emb.parquet", "binary", False, 8, 6)
    folder = tmp_path / "rewritten"
    folder.mkdir()
    table = pq.read_table(tmp_path / "emb.parquet")
    pq.write_table(table, folder / "a.parquet")
    pq.write_table(table.replace_schema_metadata(None), folder / "b.parquet")
    said = f"{folder}/b.parquet: a binary embedding column without the dsv4enc metadata"
    for reader in (lambda: list(read_embeddings(folder)), lambda: EmbeddingDataset(folder),
                   lambda: EmbeddingIterableDataset(folder), lambda: summarize(folder)):
        with pytest.raises(UsageError, match=said):
            reader()


#: A probe: ``read_embeddings`` of argv[1], its one-line error printed (an abort: exit 134).
READ_PROBE = ("import sys; from dsv4enc import read_embeddings; from dsv4enc.errors import "
              "DsvError\ntry: list(read_embeddings(sys.argv[1]))\nexcept DsvError as e: print(e)")


@pytest.mark.parametrize("column", ["embedding", "error"])
def test_a_damaged_column_chunk_footer_is_damage_in_one_line_not_an_abort(tmp_path, column):
    """A part whose footer's column chunk metadata pyarrow cannot build (level histograms that
    do not fit its schema): the reader's damage line, as for a part cut short, where pyarrow
    aborted the process (asked for the chunk's size) or raised a bare OSError (reading it)."""
    from helpers import damage_column_chunks, run_probe

    store, _, _ = _first_part_committed(tmp_path, part_images=4)
    part = store.folder / "part-000000.parquet"
    single = tmp_path / "rows.parquet"
    for path in (part, single):
        damage_column_chunks(path, column)
    done = run_probe(READ_PROBE, store.folder)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"{part}: not a readable Parquet file (")
    assert done.stdout.endswith(
        "histogram does not fit its schema): the output is damaged; rerun its encode command "
        "with --update to repair it (with --resume, if that run did not finish)\n"), done.stdout
    done = run_probe(READ_PROBE, single)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"{single}: not a readable Parquet file (")
    assert done.stdout.endswith("histogram does not fit its schema)\n"), done.stdout


def test_a_part_rewritten_under_its_name_after_the_listing_says_the_output_was_replaced(
        tmp_path):
    """An --overwrite writes the new output's parts under the old ones' names, of the same
    sizes where only the weights differ: a reader that listed the old output
    (``read_embeddings`` midway, a dataset's next epoch) finds a part rewritten since, and
    stops in the replaced output's one line; it never reads the new output's rows (under the
    old one's footer) as the old output's."""
    import os

    folder, table, rows, dataset = _two_parts_read_midway(tmp_path)
    for name in ("part-000000.parquet", "part-000003.parquet"):  # as a later run writes them
        path = folder / name
        old = pq.read_table(path)
        cells = [None if cell is None else cell[::-1]
                 for cell in old.column("embedding").to_pylist()]
        new = old.set_column(old.schema.get_field_index("embedding"), "embedding",
                             pa.array(cells, old.schema.field("embedding").type))
        pq.write_table(new, folder / ".new", **parquet_options(new.schema))
        listed = path.stat()
        os.replace(folder / ".new", path)
        os.utime(path, ns=(listed.st_atime_ns, listed.st_mtime_ns + 10**9))  # a second later
        assert path.stat().st_size == listed.st_size
    _replaced_while_read(rows, dataset)
