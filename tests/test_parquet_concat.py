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

from dsv4enc.parquet_concat import JoinError, ParquetJoiner, _Writer, read_footer
from dsv4enc.pipeline import EncodeOptions, run_encode
from dsv4enc.writer import Row, output_schema, parquet_options, rows_to_table

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
            writer = _Writer()
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
    """The final file holds each committed part's column chunks byte for byte (nothing was
    encoded again), and reads back equal to the folder output of the same run."""
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
        assert data[position:position + len(body)] == body, part.name
        position += len(body)
    got, want = pq.read_table(out), pa.concat_tables([pq.read_table(p) for p in parts])
    assert got.equals(want)
