"""Joining Parquet parts by copying their bytes (``parquet_concat``), and the single-file
output built that way: equal to the parts read one after the other, readable by every
reader, and made of the parts' own bytes (no second encode)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dsv4enc.output.parquet_join import JoinError, ParquetJoiner, CompactWriter, read_footer
from dsv4enc.run.pipeline import EncodeOptions, run_encode
from dsv4enc.output.parts import Row, output_schema, parquet_options, rows_to_table

from helpers import CONFIGS, write_image


def write_parts(folder: Path, layout: str, pooled: bool, sizes=(0, 5, 7, 3)) -> list[Path]:
    """Part files of one schema, with failed rows, a few row groups each (one empty part)."""
    rng = np.random.default_rng(1)
    schema = output_schema(16, "float16", {"x": 1}, pooled=pooled, layout=layout)
    files = []
    for k, n in enumerate(sizes):
        shape = (16,) if pooled else (6, 16)
        rows = [Row(f"{k}/{i}", 1, 2, 3, 4, 2, 3, rng.standard_normal(shape).astype(np.float16))
                if i % 3 else Row(f"{k}/{i}", error="OSError: bad") for i in range(n)]
        path = folder / f"part-{k:06d}.parquet"
        pq.write_table(rows_to_table(rows, schema), path, row_group_size=2,
                       **parquet_options(schema))
        files.append(path)
    return files


def join(files: list[Path], out: Path) -> Path:
    joiner = ParquetJoiner(out)
    for f in files:
        joiner.append(f)
    joiner.close()
    return out


@pytest.mark.parametrize("layout", ["binary", "nested"])
@pytest.mark.parametrize("pooled", [False, True])
def test_joined_file_equals_the_parts_read_in_turn(tmp_path, layout, pooled):
    files = write_parts(tmp_path, layout, pooled)
    out = join(files, tmp_path / "joined.parquet")
    got, want = pq.read_table(out), pa.concat_tables([pq.read_table(f) for f in files])
    assert got.equals(want) and got.schema.metadata == want.schema.metadata
    meta = pq.read_metadata(out)
    assert meta.num_rows == 15
    assert meta.num_row_groups == sum(pq.read_metadata(f).num_row_groups for f in files)
    for i in range(meta.num_row_groups):  # each group reads on its own (its offsets moved)
        assert pq.ParquetFile(out).read_row_group(i).num_rows == meta.row_group(i).num_rows


def test_footer_codec_writes_back_the_bytes_it_read(tmp_path):
    for layout in ("binary", "nested"):
        for path in write_parts(tmp_path, layout, pooled=False):
            size = path.stat().st_size
            with open(path, "rb") as handle:
                footer, start = read_footer(handle, size)
                handle.seek(start)
                raw = handle.read(size - 8 - start)
            writer = CompactWriter()
            writer.struct(footer)
            assert bytes(writer.out) == raw


def test_other_readers_read_a_joined_file(tmp_path):
    files = write_parts(tmp_path, "binary", pooled=False)
    out = join(files, tmp_path / "joined.parquet")
    want = pa.concat_tables([pq.read_table(f) for f in files])
    pl = pytest.importorskip("polars")
    assert pl.read_parquet(out)["path"].to_list() == want.column("path").to_pylist()
    duckdb = pytest.importorskip("duckdb")
    cells = duckdb.connect().execute("SELECT embedding FROM read_parquet(?)",
                                     [str(out)]).fetchall()
    assert [c[0] for c in cells] == want.column("embedding").to_pylist()


def test_a_joiner_holds_each_part_s_row_groups_encoded(tmp_path):
    """A single file joined of many parts holds every part's row groups until it closes: as
    Thrift bytes (under 1 KB a row group here), not as the decoded footer (about 35 KB a row
    group, its schema and metadata included: GBs over 10^5 parts); the file is the same."""
    import tracemalloc

    part = write_parts(tmp_path, "binary", pooled=False, sizes=(43,))[0]
    groups = pq.ParquetFile(part).metadata.num_row_groups
    joiner = ParquetJoiner(tmp_path / "joined.parquet")
    tracemalloc.start()
    try:
        for _ in range(100):
            joiner.append(part)
        held = tracemalloc.get_traced_memory()[0] / (100 * groups)
    finally:
        tracemalloc.stop()
    joiner.close()
    assert held < 3000, f"{held:.0f} bytes held per row group"
    assert pq.ParquetFile(tmp_path / "joined.parquet").metadata.num_rows == 100 * 43


@pytest.mark.parametrize("footer", [
    b"\x15",  # a field header, then nothing: the footer ends inside it
    b"\x1b\xff\xff\xff\x0f\x11",  # a map of 2^32 bool pairs in one byte
    b"\x1c" * 5000,  # structs nested past any sane depth
], ids=["cut short", "huge map", "deep"])
def test_a_damaged_footer_is_a_join_error(tmp_path, footer):
    """A damaged footer is refused as ``JoinError``, which every caller handles (an
    IndexError, a RecursionError or a loop over a count the bytes cannot hold escaped)."""
    data = b"PAR1" + footer + len(footer).to_bytes(4, "little") + b"PAR1"
    with open(tmp_path / "d.parquet", "wb+") as handle:
        handle.write(data)
        with pytest.raises(JoinError):
            read_footer(handle, len(data))


def test_files_that_cannot_be_joined_by_copying_are_refused(tmp_path):
    files = write_parts(tmp_path, "binary", pooled=False)
    (tmp_path / "o").mkdir()
    other = write_parts(tmp_path / "o", "nested", pooled=False)
    joiner = ParquetJoiner(tmp_path / "mixed.parquet")
    joiner.append(files[1])
    with pytest.raises(JoinError, match="another schema"):
        joiner.append(other[1])
    joiner.abort()
    indexed = tmp_path / "indexed.parquet"
    pq.write_table(pq.read_table(files[1]), indexed, write_page_index=True)
    with pytest.raises(JoinError, match="page indexes"):
        ParquetJoiner(tmp_path / "x.parquet").append(indexed)
    (tmp_path / "junk.parquet").write_bytes(b"PAR1 not parquet")
    with pytest.raises(JoinError):
        ParquetJoiner(tmp_path / "y.parquet").append(tmp_path / "junk.parquet")


def test_a_single_file_output_is_its_parts_bytes(tmp_path):
    """The final file holds each committed part's column chunks byte for byte, in input
    order (nothing was encoded again; an appended part's own footer may follow its chunks),
    and reads back equal to the folder output of the same run."""
    images = tmp_path / "images"
    for i in range(7):
        write_image(images / f"{i}.png", (40 + 8 * i, 32))
    (images / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")
    base = dict(inputs=[str(images)], config=str(CONFIGS / "tiny.json"), random_init=True,
                device="cpu", part_images=3, workers=0, progress=False)
    out = tmp_path / "e.parquet"
    run_encode(EncodeOptions(out=str(out), **base))
    folder = tmp_path / "folder"
    run_encode(EncodeOptions(out=f"{folder}/", **base))
    manifest = json.loads((folder / "_manifest.json").read_text())
    parts = [folder / p["file"] for p in sorted(manifest["parts"].values(),
                                                key=lambda p: p["start"])]
    assert len(parts) >= 2
    data = out.read_bytes()
    position = 4
    for part in parts:
        size = part.stat().st_size
        with open(part, "rb") as handle:
            _, start = read_footer(handle, size)
        body = part.read_bytes()[4:start]
        found = data.find(body, position)
        assert found >= position, part.name
        position = found + len(body)
    got, want = pq.read_table(out), pa.concat_tables([pq.read_table(p) for p in parts])
    assert got.equals(want)


@pytest.mark.parametrize("layout", ["binary", "nested"])
@pytest.mark.parametrize("out_dtype", ["float16", "float32"])
@pytest.mark.parametrize("pooled", [False, True])
def test_every_layout_round_trips_through_read_embeddings(tmp_path, layout, out_dtype, pooled):
    """Parts committed by the writer, read back as a folder and as the joined single file:
    the same arrays, bit for bit, in the stored dtype and shape; failed rows as None."""

    from dsv4enc import read_embeddings
    from dsv4enc.output.read import embedding_format
    from dsv4enc.output.parts import PartStore, StreamingAssembler, rows_per_group

    rng = np.random.default_rng(2)
    width = 8
    schema = output_schema(width, out_dtype, {"tool": "dsv4enc"}, pooled=pooled, layout=layout)
    rows = []
    for i in range(9):
        n = 1 + i % 4
        emb = rng.standard_normal((width,) if pooled else (n, width)).astype(out_dtype)
        rows.append(Row(f"{i}.png", 10, 10, 2, 2, 1, n, emb) if i % 4 != 2
                    else Row(f"{i}.png", error="OSError: truncated"))
    store = PartStore(tmp_path / "parts", {"tool": "dsv4enc"})
    store.create()
    spans = [(0, 4), (4, 5), (5, 9)]
    names = [f"part-{a:06d}" for a, _ in spans]
    out = tmp_path / "e.parquet"
    assembler = StreamingAssembler(store, out, schema)
    for name, (a, b) in zip(names, spans):
        store.commit(name, rows_to_table(rows[a:b], schema),
                     rows_per_group(schema, rows[a:b]), a, b, "d")
        assembler.notify()
    assembler.finish()
    assert embedding_format(pq.read_schema(out)).layout == layout
    for source in (out, store.folder):
        got = list(read_embeddings(source, errors="include", batch_rows=3))
        assert [p for p, _, _ in got] == [r.path for r in rows]
        for (_, emb, grid), row in zip(got, rows):
            if row.embedding is None:
                assert emb is None and grid is None
                continue
            assert emb.dtype == np.dtype(out_dtype) and emb.shape == row.embedding.shape
            assert emb.tobytes() == row.embedding.tobytes() and grid == (1, row.grid_w)


def test_an_empty_single_file_output_has_the_schema(tmp_path):
    from dsv4enc.output.parts import PartStore, StreamingAssembler

    schema = output_schema(8, "float16", {"tool": "dsv4enc"})
    store = PartStore(tmp_path / "parts", {"tool": "dsv4enc"})
    store.create()
    assembler = StreamingAssembler(store, tmp_path / "e.parquet", schema)
    assembler.finish()
    table = pq.read_table(tmp_path / "e.parquet")
    assert table.num_rows == 0 and table.schema.equals(schema, check_metadata=True)


def test_joining_copies_by_hand_where_the_kernel_cannot(tmp_path, monkeypatch):
    import os

    def refuse(*args):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(os, "copy_file_range", refuse, raising=False)
    files = write_parts(tmp_path, "binary", pooled=False)
    out = join(files, tmp_path / "joined.parquet")
    assert pq.read_table(out).equals(pa.concat_tables([pq.read_table(f) for f in files]))


def test_parts_that_cannot_be_joined_are_encoded_again(tmp_path, caplog):
    """A part whose file metadata differs (here: other key-value metadata) cannot be copied
    under one footer: the assembler encodes every part into the file instead."""

    from dsv4enc.output.parts import PartStore, StreamingAssembler, rows_per_group

    schema = output_schema(8, "float16", {"tool": "dsv4enc"})
    store = PartStore(tmp_path / "parts", {"tool": "dsv4enc"})
    store.create()
    rows = [Row(f"{i}.png", 1, 1, 1, 1, 1, 2, np.full((2, 8), i, np.float16)) for i in range(6)]
    out = tmp_path / "e.parquet"
    assembler = StreamingAssembler(store, out, schema)
    for name, a, b in (("part-000000", 0, 3), ("part-000003", 3, 6)):
        table = rows_to_table(rows[a:b], schema)
        if a:
            table = table.replace_schema_metadata({b"dsv4enc": b'{"other": 1}'})
        store.commit(name, table, rows_per_group(schema, rows[a:b]), a, b, "d")
        assembler.notify()
    with caplog.at_level("WARNING", logger="dsv4enc"):
        assembler.finish()
    assert pq.read_table(out).equals(rows_to_table(rows, schema))
    assert "again" in caplog.text


def test_a_part_dropped_after_it_was_copied_in_leaves_the_file(tmp_path):
    """A resume copies in a kept part, then finds its inputs changed: the part is dropped
    and encoded again, and the single file holds the new rows, not the copied ones."""
    from dsv4enc.output.parts import PartStore, StreamingAssembler, rows_per_group

    schema = output_schema(8, "float16", {"tool": "dsv4enc"})
    store = PartStore(tmp_path / "parts", {"tool": "dsv4enc"})
    store.create()
    old = [Row(f"{i}.png", 1, 1, 1, 1, 1, 2, np.full((2, 8), -i, np.float16)) for i in range(3)]
    new = [Row(f"{i}.png", 1, 1, 1, 1, 1, 2, np.full((2, 8), i, np.float16)) for i in range(6)]

    def commit(rows, a, b):
        store.commit(f"part-{a:06d}", rows_to_table(rows[a:b], schema),
                     rows_per_group(schema, rows[a:b]), a, b, "d")

    commit(old, 0, 3)
    assembler = StreamingAssembler(store, tmp_path / "e.parquet", schema)
    assembler.notify()  # the kept part is copied in
    store.drop(["part-000000"])
    for a, b in ((0, 3), (3, 6)):
        commit(new, a, b)
        assembler.notify()
    assembler.finish()
    assert pq.read_table(tmp_path / "e.parquet").equals(rows_to_table(new, schema))
