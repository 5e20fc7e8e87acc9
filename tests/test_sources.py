"""Container inputs: WebDataset tar shards and Parquet/Arrow tables with an image column."""

from __future__ import annotations

import io
import pickle
import tarfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from dsv4enc import read_embeddings, sources
from dsv4enc.cli import app
from dsv4enc.decode import decode_image, probe_image
from dsv4enc.errors import UsageError
from dsv4enc.inputs import discover

from helpers import CONFIGS, load_config, write_image

runner = CliRunner()
STRUCT = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


@pytest.fixture(scope="module")
def ckpt(small_ckpt) -> Path:
    return small_ckpt


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sources_images")
    specs = {"a.jpg": ((64, 48), "RGB"), "b.png": ((30, 90), "RGBA"), "c.webp": ((120, 12), "RGB"),
             "d.png": ((40, 30), "L"), "e.gif": ((24, 24), "P")}
    return {name: write_image(root / name, size, mode) for name, (size, mode) in specs.items()}


def add_bytes(archive: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    archive.addfile(info, io.BytesIO(data))


@pytest.fixture(scope="module")
def shard(tmp_path_factory, images) -> Path:
    """A WebDataset shard: samples with a .cls sidecar, one sample with two images, a
    sample without an image, a hidden file and a folder entry."""
    path = tmp_path_factory.mktemp("shards") / "shard-000.tar"
    with tarfile.open(path, "w") as archive:
        folder = tarfile.TarInfo("train")
        folder.type = tarfile.DIRTYPE  # not a regular file: passed over
        archive.addfile(folder)
        for i, name in enumerate(["a.jpg", "b.png", "c.webp"]):
            ext = name.split(".")[1]
            add_bytes(archive, f"train/{i:04d}.{ext}", images[name].read_bytes())
            add_bytes(archive, f"train/{i:04d}.cls", str(i).encode())
        add_bytes(archive, "train/0003.left.png", images["d.png"].read_bytes())
        add_bytes(archive, "train/0003.right.gif", images["e.gif"].read_bytes())
        add_bytes(archive, "train/0004.json", b"{}")
        add_bytes(archive, "train/.0005.jpg", images["a.jpg"].read_bytes())
        add_bytes(archive, "train/0006.jpg", b"not a jpeg")
    return path


def run(*args: str) -> None:
    result = runner.invoke(app, ["encode", *args, "--workers", "0", "--device", "cpu", "-q"])
    assert result.exit_code == 0, result.output


# --------------------------------------------------------------------------- tar shards

def test_tar_index_keys_and_skips(shard):
    found = discover([str(shard)])
    keys = [item.key for item in found.items]
    assert keys == ["train/0000", "train/0001", "train/0002", "train/0003.left.png",
                    "train/0003.right.gif", "train/0006"]
    assert found.skipped == 1  # train/0004 has no image; sidecars of image samples don't count
    assert all(isinstance(i.member, sources.TarMember) and i.path == str(shard)
               for i in found.items)
    assert sources.split_key("a/b.seg.png") == ("a/b", "seg.png")
    assert sources.split_key("plain") == ("plain", "")


def test_tar_members_are_read_by_offset_alone(shard, images, tmp_path):
    """Workers seek to their member: the rest of the tar (headers included) is never parsed."""
    items = discover([str(shard)]).items
    copy = tmp_path / "copy.tar"
    data = bytearray(shard.read_bytes())
    first = items[0].member
    data[:first.offset] = b"\xff" * first.offset  # wipe the first header
    for item in items[1:]:
        start = item.member.offset - 512  # and every other member's header
        data[start:item.member.offset] = b"\xff" * 512
    copy.write_bytes(bytes(data))
    moved = [replace(item, path=str(copy)) for item in items]
    assert sources.open_item(moved[1]) == images["b.png"].read_bytes()
    assert probe_image(moved[0]).width == 64
    assert decode_image(moved[2], _cfg()).error is None
    assert pickle.loads(pickle.dumps(moved[0])) == moved[0]
    bad = decode_image(moved[-1], _cfg())
    assert bad.error and "UnidentifiedImageError" in bad.error


def _cfg():
    return replace(load_config("tiny"), min_pixels=56 * 56, max_n_token=24)


def test_compressed_and_broken_tars_are_usage_errors(tmp_path, images):
    gz = tmp_path / "s.tar"
    with tarfile.open(gz, "w:gz") as archive:
        add_bytes(archive, "x.jpg", images["a.jpg"].read_bytes())
    with pytest.raises(UsageError, match="uncompressed"):
        discover([str(gz)])


def test_tar_encode_matches_loose_files(shard, images, ckpt, tmp_path):
    run(str(shard), "--out", str(tmp_path / "tar.parquet"), "--weights", str(ckpt))
    loose = tmp_path / "loose"
    loose.mkdir()
    for name in ["a.jpg", "b.png", "c.webp"]:
        (loose / name).write_bytes(images[name].read_bytes())
    run(str(loose), "--out", str(tmp_path / "loose.parquet"), "--weights", str(ckpt))
    tar_rows = {p: e for p, e, _ in read_embeddings(tmp_path / "tar.parquet")}
    loose_rows = {p: e for p, e, _ in read_embeddings(tmp_path / "loose.parquet")}
    for i, name in enumerate(["a.jpg", "b.png", "c.webp"]):
        np.testing.assert_array_equal(tar_rows[f"train/{i:04d}"], loose_rows[name])
    table = pq.read_table(tmp_path / "tar.parquet", columns=["path", "width", "error"])
    assert table.column("path").to_pylist()[-1] == "train/0006"
    assert table.column("error").to_pylist()[-1].startswith("UnidentifiedImageError")
    assert table.column("width").to_pylist()[:3] == [64, 30, 120]


# --------------------------------------------------------------------------- tables

def image_table(images: dict[str, Path], names: list[str], struct: bool) -> pa.Table:
    data = [images[n].read_bytes() for n in names]
    if struct:
        column = pa.array([{"bytes": d, "path": n} for d, n in zip(data, names)], STRUCT)
    else:
        column = pa.array(data, pa.binary())
    return pa.table({"id": [f"id-{i}" for i in range(len(names))], "img": column})


def test_parquet_bytes_column_keys_and_row_groups(tmp_path, images, ckpt):
    names = ["a.jpg", "b.png", "c.webp", "d.png", "e.gif"]
    path = tmp_path / "t.parquet"
    pq.write_table(image_table(images, names, struct=False), path, row_group_size=2)
    found = discover([str(path)])
    assert [i.key for i in found.items] == [f"{path}#{r}" for r in range(5)]
    assert [(i.member.group, i.member.row) for i in found.items] == [(0, 0), (0, 1), (1, 0),
                                                                     (1, 1), (2, 0)]
    keyed = discover([str(path)], key_column="id")
    assert [i.key for i in keyed.items] == [f"id-{r}" for r in range(5)]
    for item, name in zip(found.items, names):
        assert sources.open_item(item) == images[name].read_bytes()
    run(str(path), "--out", str(tmp_path / "o.parquet"), "--weights", str(ckpt),
        "--key-column", "id", "--image-column", "img")
    rows = pq.read_table(tmp_path / "o.parquet", columns=["path", "width", "height", "error"])
    assert rows.column("path").to_pylist() == [f"id-{r}" for r in range(5)]
    assert rows.column("error").null_count == 5
    assert rows.column("width").to_pylist() == [64, 30, 120, 40, 24]


def test_hf_struct_column_paths_nulls_and_files(tmp_path, images):
    names = ["a.jpg", "b.png"]
    table = image_table(images, names, struct=True)
    extra = pa.array([{"bytes": None, "path": "side.png"}, None, {"bytes": None, "path": None}],
                     STRUCT)
    full = pa.table({"id": ["x", "y", "z", "w", "v"],
                     "img": pa.concat_arrays([table.column("img").combine_chunks(), extra])})
    (tmp_path / "side.png").write_bytes(images["d.png"].read_bytes())
    path = tmp_path / "hf.parquet"
    pq.write_table(full, path)
    items = discover([str(path)]).items
    assert [i.key for i in items] == ["a.jpg", "b.png", "side.png", f"{path}#3", f"{path}#4"]
    assert sources.open_item(items[2]) == str(tmp_path / "side.png")  # beside the table
    assert decode_image(items[2], _cfg()).width == 40
    assert "no image" in decode_image(items[3], _cfg()).error
    assert "neither bytes nor a path" in decode_image(items[4], _cfg()).error
    assert probe_image(items[0]).width == 64


@pytest.mark.parametrize("fmt", ["feather", "stream"])
def test_arrow_files_and_streams(tmp_path, images, fmt):
    table = image_table(images, ["a.jpg", "b.png", "c.webp"], struct=True)
    path = tmp_path / "t.arrow"
    if fmt == "feather":
        path = tmp_path / "t.feather"
        feather.write_feather(table, path, chunksize=2)
    else:  # what Hugging Face `datasets` writes to its cache
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as out:
            for batch in table.to_batches(max_chunksize=2):
                out.write_batch(batch)
    items = discover([str(path)]).items
    assert [i.key for i in items] == ["a.jpg", "b.png", "c.webp"]
    assert [i.member.group for i in items] == [0, 0, 1]
    assert sources.open_item(items[2]) == images["c.webp"].read_bytes()


def test_column_choice_errors(tmp_path, images):
    path = tmp_path / "t.parquet"
    two = image_table(images, ["a.jpg"], struct=False).append_column(
        "thumb", pa.array([b"x"], pa.binary()))
    pq.write_table(two, path)
    with pytest.raises(UsageError, match="several columns"):
        discover([str(path)])
    assert discover([str(path)], image_column="thumb").items[0].member.column == "thumb"
    with pytest.raises(UsageError, match="no column 'nope'"):
        discover([str(path)], image_column="nope")
    with pytest.raises(UsageError, match="not image bytes"):
        discover([str(path)], image_column="id")
    with pytest.raises(UsageError, match="no key column 'k'"):
        discover([str(path)], image_column="img", key_column="k")
    pq.write_table(pa.table({"n": [1]}), tmp_path / "none.parquet")
    with pytest.raises(UsageError, match="pass --image-column"):
        discover([str(tmp_path / "none.parquet")])
    with pytest.raises(UsageError, match="--image-column applies"):
        discover([str(images["a.jpg"])], image_column="img")
    result = runner.invoke(app, ["encode", str(path), "--out", str(tmp_path / "o.parquet"),
                                 "--config", str(CONFIGS / "tiny.json"), "--random-init", "-q"])
    assert result.exit_code == 2 and "several columns" in result.output


def test_row_group_cache_reads_each_group_once(tmp_path, images, monkeypatch):
    path = tmp_path / "t.parquet"
    pq.write_table(image_table(images, ["a.jpg", "b.png", "c.webp", "d.png"], False), path,
                   row_group_size=2)
    items = discover([str(path)]).items
    reads = []
    original = sources._Table.read

    def counting(self, group, columns):
        reads.append(group)
        return original(self, group, columns)

    monkeypatch.setattr(sources._Table, "read", counting)
    monkeypatch.setattr(sources, "_CACHE", sources._GroupCache())
    for item in items:
        sources.open_item(item)
    assert reads == [0, 1]
    monkeypatch.setattr(sources, "_CACHE", sources._GroupCache(max_bytes=1))
    reads.clear()
    for item in items + items:
        sources.open_item(item)
    assert reads == [0, 1, 0, 1]  # over budget: only the last group stays


def test_decode_workers_take_container_items(shard, tmp_path, images, ckpt):
    """Real worker processes (spawn): items with members pickle and decode there."""
    table = tmp_path / "t.parquet"
    pq.write_table(image_table(images, ["d.png", "e.gif"], struct=True), table)
    out = tmp_path / "w.parquet"
    result = runner.invoke(app, ["encode", str(shard), str(table), "--out", str(out),
                                 "--weights", str(ckpt), "--workers", "1", "--device", "cpu",
                                 "-q"])
    assert result.exit_code == 0, result.output
    got = pq.read_table(out, columns=["path", "error"]).to_pylist()
    assert [r["path"] for r in got] == ["train/0000", "train/0001", "train/0002",
                                        "train/0003.left.png", "train/0003.right.gif",
                                        "train/0006", "d.png", "e.gif"]
    assert [r["error"] is None for r in got] == [True] * 5 + [False] + [True] * 2
    inline = tmp_path / "i.parquet"
    run(str(shard), str(table), "--out", str(inline), "--weights", str(ckpt))
    a = dict((p, e) for p, e, _ in read_embeddings(out))
    b = dict((p, e) for p, e, _ in read_embeddings(inline))
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])
