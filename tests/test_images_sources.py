"""Container inputs: WebDataset tar shards and Parquet/Arrow tables with an image column."""

from __future__ import annotations

import io
import logging
import os
import pickle
import shutil
import struct
import tarfile
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings, strategies as st
from PIL import Image
from typer.testing import CliRunner

from dsv4enc import read_embeddings
from dsv4enc.images import sources
from dsv4enc.cli import app
from dsv4enc.images.decode import decode_image, probe_image
from dsv4enc.errors import UsageError
from dsv4enc.images.discover import discover

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


#: The local keys of ``shard``'s images, in file order (its rows are keyed ``SHARD/KEY``).
SHARD_KEYS = ["train/0000", "train/0001", "train/0002", "train/0003.left.png",
              "train/0003.right.gif", "train/0006"]


def run(*args: str) -> None:
    result = runner.invoke(app, ["encode", *args, "--workers", "0", "--device", "cpu", "-q"])
    assert result.exit_code == 0, result.output


# --------------------------------------------------------------------------- tar shards

def test_tar_index_keys_and_skips(shard):
    found = discover([str(shard)])
    keys = [item.key for item in found.items]
    # Each key names its shard (as given): the same whatever else is in the run.
    assert keys == [f"{shard}/{key}" for key in SHARD_KEYS]
    assert found.skipped == 1  # train/0004 has no image; sidecars of image samples don't count
    assert all(isinstance(i.member, sources.TarMember) and i.path == str(shard)
               for i in found.items)
    assert sources.split_member("a/b.seg.png")[2:] == ("a/b", "seg.png")
    assert sources.split_member("plain")[2:] == ("plain", "")



def test_member_names_split_as_pathlib_splits_them():
    """A tar member's key and path, read from plain strings, are what ``PurePosixPath`` gave
    (keys written by earlier runs stay the keys an ``--update`` finds): every name of up to 6
    characters over ``/``, ``.``, ``a`` and ``b``."""
    import itertools
    from pathlib import PurePosixPath

    for size in range(7):
        for name in map("".join, itertools.product("/.ab", repeat=size)):
            path = PurePosixPath(name)
            stem, dot, ext = path.name.partition(".")
            parent = str(path.parent)
            key = stem if parent in ("", ".") else f"{parent}/{stem}"
            assert sources.posix_path(name) == path.as_posix(), name
            assert (sources.posix_parts(name)[1] or [""])[-1] == path.name, name
            assert sources.split_member(name) == (path.as_posix(), path.name, key,
                                                  ext if dot else ""), name


#: Pieces of odd member names: ``..``, ``.``, a hidden file, a dotted folder, an undecodable
#: byte (read back as its surrogate), and image and sidecar extensions.
NAME_PIECES = st.sampled_from(["", ".", "..", "a", "x.y", ".h", "\udcff", "b\udce9", "a.jpg",
                               "a.png", "a.txt", "a.seg.png", ".jpg", "\udcfe.gif", "n" * 120])


@settings(max_examples=150, deadline=None)
@given(names=st.lists(st.tuples(st.sampled_from(["", "/", "//", "///", "./"]),
                                st.lists(NAME_PIECES, min_size=1, max_size=4),
                                st.sampled_from(["/", "//"]), st.sampled_from(["", "/"])),
                      min_size=1, max_size=6))
def test_tar_keys_of_odd_member_names_are_pathlibs(names):
    """A shard's keys, its sample grouping and its count of samples without an image are what
    ``PurePosixPath`` and WebDataset's rule give for each member name as tarfile reads it
    (``..``, ``./a``, ``a//b``, a trailing ``/``, a dotted folder, non-UTF-8 bytes, a long name):
    keys written by earlier runs stay the keys an ``--update`` finds."""
    from pathlib import PurePosixPath

    written = [lead + sep.join(pieces) + trail for lead, pieces, sep, trail in names]
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "s.tar")
        with tarfile.open(path, "w", format=tarfile.GNU_FORMAT, encoding="utf-8",
                          errors="surrogateescape") as archive:
            for name in written:
                add_bytes(archive, name, b"x")
        with tarfile.open(path, encoding="utf-8", errors="surrogateescape") as archive:
            read = [(info.name, info.isdir()) for info in archive.getmembers()]
        items, skipped = sources.expand_tar(path, "S")
    images: dict[str, list[str]] = {}
    others: set[str] = set()
    for name, isdir in read:
        pure = PurePosixPath(name)
        stem = pure.name.partition(".")[0]
        key = stem if str(pure.parent) == "." else f"{pure.parent}/{stem}"
        if isdir or pure.name.startswith(".") or not key:
            continue
        if os.path.splitext(pure.name)[1].lower() in (".jpg", ".png", ".gif"):
            images.setdefault(key, []).append(name)
        else:
            others.add(key)
    expected = [f"S/{name}" if len(images[key]) > 1 else f"S/{key}"
                for name, _ in read for key, names in images.items() if name in names]
    assert [item.key for item in items] == expected
    assert skipped == len(others - images.keys())

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


def test_a_compressed_file_named_tar_is_its_error_row_not_the_run_s_end(tmp_path, images,
                                                                        shard):
    """Found among the shards (in a folder, a list, or named), a gzip file named ``.tar`` is
    one error row that says to decompress it; the other shards are read."""
    gz = tmp_path / "s.tar"
    with tarfile.open(gz, "w:gz") as archive:
        add_bytes(archive, "x.jpg", images["a.jpg"].read_bytes())
    shutil.copy(shard, tmp_path / "t.tar")
    found = discover([str(tmp_path)])
    assert keys_of(found.items) == ["s.tar@0"] + [f"t.tar/{key}" for key in SHARD_KEYS]
    assert "gzip-compressed tar" in found.items[0].member.reason
    assert "decompress it first" in found.items[0].member.reason


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
        np.testing.assert_array_equal(tar_rows[f"{shard}/train/{i:04d}"], loose_rows[name])
    table = pq.read_table(tmp_path / "tar.parquet", columns=["path", "width", "error"])
    assert table.column("path").to_pylist()[-1] == f"{shard}/train/0006"
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
    assert [i.key for i in items] == [f"{path}/a.jpg", f"{path}/b.png", f"{path}/side.png",
                                      f"{path}#3", f"{path}#4"]
    assert sources.open_item(items[2]) == str(tmp_path / "side.png")  # beside the table
    assert decode_image(items[2], _cfg()).width == 40
    assert "no image" in decode_image(items[3], _cfg()).error
    assert "neither bytes nor a path" in decode_image(items[4], _cfg()).error
    assert probe_image(items[0]).width == 64


def test_a_binary_path_field_names_its_file_as_a_string_one_does(tmp_path, images):
    """A ``{bytes, path}`` struct whose ``path`` is binary (a file name's own bytes) reads the
    file it names, keyed as its bytes are, not a TypeError about mixing str and bytes."""
    (tmp_path / "side.png").write_bytes(images["d.png"].read_bytes())
    (tmp_path / os.fsdecode(b"caf\xe9.png")).write_bytes(images["d.png"].read_bytes())
    binary = pa.struct([("bytes", pa.binary()), ("path", pa.binary())])
    path = tmp_path / "hf.parquet"
    pq.write_table(pa.table({"img": pa.array([{"bytes": None, "path": b"side.png"},
                                              {"bytes": None, "path": b"caf\xe9.png"}],
                                             binary)}), path)
    items = discover([str(path)]).items
    assert [i.key for i in items] == [f"{path}/side.png", f"{path}/caf\\xe9.png"]
    assert [decode_image(item, _cfg()).width for item in items] == [40, 40]


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
    assert [i.key for i in items] == [f"{path}/a.jpg", f"{path}/b.png", f"{path}/c.webp"]
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
    with pytest.raises(UsageError, match="no column holds image bytes") as refused:
        discover([str(tmp_path / "none.parquet")])
    assert "--image-column" not in str(refused.value)  # it would be refused for any column
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
    original = sources.TableReader.read

    def counting(self, group, columns):
        reads.append(group)
        return original(self, group, columns)

    monkeypatch.setattr(sources.TableReader, "read", counting)
    monkeypatch.setattr(sources, "GROUP_CACHE", sources.GroupCache())
    for item in items:
        sources.open_item(item)
    assert reads == [0, 1]
    monkeypatch.setattr(sources, "GROUP_CACHE", sources.GroupCache(max_bytes=1))
    reads.clear()
    for item in items + items:
        sources.open_item(item)
    assert reads == [0, 1, 0, 1]  # over budget: only the last group stays


def test_a_released_cache_keeps_each_column_s_furthest_group_and_its_readers(
        tmp_path, images, monkeypatch):
    """After a window's probes (``release``), the next window's, which start in the row group
    where the last stopped, and the writer's kept columns read neither it nor the footer."""
    path = tmp_path / "t.parquet"
    table = image_table(images, ["a.jpg", "b.png", "c.webp", "d.png"], False)
    pq.write_table(table.append_column("n", pa.array(range(4))), path, row_group_size=2)
    cache = sources.GroupCache()
    monkeypatch.setattr(sources, "GROUP_CACHE", cache)
    items = discover([str(path)]).items  # the listing's reader is left in the cache
    reads, opened = [], []
    original_read, original_init = sources.TableReader.read, sources.TableReader.__init__

    def counting(self, group, columns):
        reads.append((group, *columns))
        return original_read(self, group, columns)

    def opening(self, path):
        opened.append(path)
        original_init(self, path)

    monkeypatch.setattr(sources.TableReader, "read", counting)
    monkeypatch.setattr(sources.TableReader, "__init__", opening)
    for item in items[:3]:
        sources.open_item(item)
    assert sources.unchecked_values(cache.value(str(path), 0, 1, "n")) == 1
    cache.release()
    for item in items[2:]:
        sources.open_item(item)
    assert sources.unchecked_values(cache.value(str(path), 0, 0, "n")) == 0
    assert reads == [(0, "img"), (1, "img"), (0, "n")] and opened == []


def test_a_fetched_table_cell_keeps_its_row_s_columns(tmp_path, images):
    """A table cell whose bytes its probe read (a store's, ``HELD``) goes to its decode as
    ``Fetched``, and a Ray actor writes that item's row: its kept columns are its row's."""
    from dsv4enc.images.items import Fetched

    path = tmp_path / "t.parquet"
    table = image_table(images, ["a.jpg", "b.png"], False)
    pq.write_table(table.append_column("n", pa.array([5, 6])), path)
    items = discover([str(path)]).items
    fetched = [replace(item, member=Fetched(None, b"", item.member)) for item in items]
    field = pa.field("n", pa.int64())
    assert sources.kept_values(fetched, [field])["n"].to_pylist() == [5, 6]


def test_a_row_group_too_large_to_hold_is_read_in_slices(tmp_path, monkeypatch):
    """A table written as one row group (pyarrow's and pandas' default) is never read whole
    into a worker (gigabytes of images failed every row with a MemoryError): slices of rows,
    each cell's bytes as written, in any order of the rows."""
    cells = [bytes([n]) * 1000 for n in range(100)]
    path = tmp_path / "one-group.parquet"
    pq.write_table(pa.table({"image": pa.array(cells, pa.binary())}), path,
                   use_dictionary=False, write_batch_size=10, data_page_size=5000)
    monkeypatch.setattr(sources, "CACHE_BYTES", 30_000)  # the group: about 100 KB
    monkeypatch.setattr(sources, "SLICE_BYTES", 10_000)  # about ten rows a slice
    monkeypatch.setattr(sources, "GROUP_CACHE", sources.GroupCache(max_bytes=30_000))
    monkeypatch.setattr(sources.TableReader, "read", lambda *a: pytest.fail("read whole"))
    items = discover([str(path)]).items
    rows = [*range(0, 100, 7), *range(99, -1, -3), *range(100)]
    for row in rows:
        assert sources.open_item(items[row]) == cells[row]


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
    assert [r["path"] for r in got] == ([f"{shard}/{key}" for key in SHARD_KEYS]
                                        + [f"{table}/d.png", f"{table}/e.gif"])
    assert [r["error"] is None for r in got] == [True] * 5 + [False] + [True] * 2
    inline = tmp_path / "i.parquet"
    run(str(shard), str(table), "--out", str(inline), "--weights", str(ckpt))
    a = dict((p, e) for p, e, _ in read_embeddings(out))
    b = dict((p, e) for p, e, _ in read_embeddings(inline))
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])


# --------------------------------------------------------------------------- damaged containers

def noise_png(seed: int, size: int = 40) -> bytes:
    """A PNG of noise, a few kB: its data spans several tar blocks."""
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def five(tmp_path_factory) -> tuple[bytes, list[int]]:
    """A five-sample shard's bytes and its members' header offsets."""
    path = tmp_path_factory.mktemp("five") / "five.tar"
    with tarfile.open(path, "w") as archive:
        for i in range(5):
            add_bytes(archive, f"s{i}.png", noise_png(i))
    headers = [item.member.offset - 512 for item in discover([str(path)]).items]
    return path.read_bytes(), headers


def set_size(data: bytearray, header: int, size: int) -> None:
    """Rewrite the size field of the tar header at ``header`` (checksum kept valid)."""
    info = tarfile.TarInfo.frombuf(bytes(data[header:header + 512]), "utf-8", "surrogateescape")
    info.size = size
    data[header:header + 512] = info.tobuf()


def damage(kind: str, data: bytes, headers: list[int]) -> bytes:
    third = headers[2]
    if kind == "bad checksum":
        broken = bytearray(data)
        broken[third + 148] ^= 0x11
        return bytes(broken)
    if kind == "cut in a header":
        return data[:third + 100]
    if kind == "size too small":
        broken = bytearray(data)
        set_size(broken, headers[1], 600)  # member 2 claims 600 of its ~5 kB
        return bytes(broken)
    if kind == "cut at a member boundary":
        return data[:third]
    if kind == "cut in a member's data":
        return data[:third + 1000]
    raise ValueError(kind)


@pytest.mark.parametrize("kind, readable, damaged_at", [
    ("bad checksum", ["s0", "s1", "s3", "s4"], "third"),
    ("cut in a header", ["s0", "s1"], "third"),
    ("size too small", ["s0", "s1", "s2", "s3", "s4"], None),
    ("cut at a member boundary", ["s0", "s1"], "end"),
    ("cut in a member's data", ["s0", "s1", "s2"], "end"),
])
def test_a_damaged_tar_never_reads_as_complete(tmp_path, five, kind, readable, damaged_at):
    """Members after the damage are not lost silently: the index reads on at the next valid
    header (as GNU tar does), and the damaged region is an error row ``FILE@OFFSET``."""
    data, headers = five
    path = tmp_path / "shard.tar"
    path.write_bytes(damage(kind, data, headers))
    items = discover([str(path)]).items
    member_keys = [i.key for i in items if isinstance(i.member, sources.TarMember)]
    assert member_keys == [f"{path}/{key}" for key in readable]
    errors = [i for i in items if isinstance(i.member, sources.Unreadable)]
    assert len(errors) == 1
    offset = int(errors[0].key.rpartition("@")[2])
    assert errors[0].key == f"{path}@{offset}"
    if damaged_at == "third":
        assert offset == headers[2]
    elif damaged_at == "end":
        assert offset == path.stat().st_size
    else:  # the short member's data ends mid-way: the damage starts there
        assert headers[1] < offset < headers[2]
    probe = probe_image(errors[0])
    assert probe.error.startswith("DamagedContainerError") and f"byte {offset}" in probe.error
    assert decode_image(errors[0], _cfg()).error == probe.error


def test_an_intact_tar_has_no_error_row(five, tmp_path):
    data, _ = five
    padded = tmp_path / "padded.tar"  # zero blocks between joined archives are no damage
    padded.write_bytes(data + data)
    keys = [i.key for i in discover([str(padded)]).items]
    # Each sample key now has two images: keyed by member name, the second with a suffix.
    assert keys == ([f"{padded}/s{i}.png" for i in range(5)]
                    + [f"{padded}/s{i}.png#2" for i in range(5)])


@pytest.mark.parametrize("lead", [512, 10240])
def test_a_shard_after_an_empty_archive_reads_its_members(five, tmp_path, lead):
    """Zero blocks before the first member (an empty archive joined in front, ``cat empty.tar
    shard.tar``) are an end marker between joined archives, as they are after it: the members
    after them get their rows; before, the shard read as complete and empty, with no error row."""
    data, _ = five
    path = tmp_path / "joined.tar"
    path.write_bytes(bytes(lead) + data)
    items = discover([str(path)]).items
    assert [i.key for i in items] == [f"{path}/s{i}" for i in range(5)]
    assert probe_image(items[4]).width == 40


def test_pax_global_headers_gnu_long_names_and_links_are_no_damage(tmp_path, images):
    """What ``git archive`` and GNU tar write: a pax global header first, long names, links."""
    for fmt in (tarfile.PAX_FORMAT, tarfile.GNU_FORMAT):
        path = tmp_path / f"f{fmt}.tar"
        with tarfile.open(path, "w", format=fmt, pax_headers={"comment": "x" * 600}) as archive:
            add_bytes(archive, "d" * 120 + "/a.png", images["b.png"].read_bytes())
            link = tarfile.TarInfo("l" * 120 + "/b.png")
            link.type, link.linkname = tarfile.LNKTYPE, "d" * 120 + "/a.png"
            archive.addfile(link)
        items = discover([str(path)]).items
        assert [type(i.member) for i in items] == [sources.TarMember] * 2, fmt
        assert sources.open_item(items[1]) == images["b.png"].read_bytes()


def _valid_header(block: bytes) -> bool:
    """Whether a tar header block still reads as one (flips that keep its checksum, such as
    ``s0.png`` -> ``r1.png``, make another valid archive, not a damaged one)."""
    try:
        tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
    except tarfile.HeaderError:
        return False
    return True


@settings(max_examples=60, deadline=None)
@given(cut=st.integers(0, 10**6), flips=st.lists(st.tuples(st.integers(0, 10**6),
                                                             st.integers(1, 255)), max_size=3))
def test_fuzzed_tars_never_read_as_complete(five, cut, flips):
    """Any cut before the last member's end, or any changed header byte, gives an error row;
    the index never raises, and every item it gives reads or fails with one line."""
    data, headers = five
    end_of_members = headers[-1] + 512 + len(noise_png(4))
    broken = bytearray(data[:cut % (len(data) + 1)])
    for at, mask in flips:
        if broken:
            broken[at % len(broken)] ^= mask
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "f.tar"
        path.write_bytes(bytes(broken))
        try:
            items = discover([str(path)]).items
        except UsageError as exc:  # a flip that makes the first bytes a compressor's magic
            assert "compressed" in str(exc)
            return
        damaged = [i for i in items if isinstance(i.member, sources.Unreadable)]
        header_hit = any(h <= at % max(1, len(broken)) < h + 512 and not _valid_header(
                         bytes(broken[h:h + 512])) for h in headers for at, _ in flips if broken)
        if len(broken) < end_of_members or (header_hit and bytes(broken) != data[:len(broken)]):
            assert damaged or all(probe_image(i).error for i in items)
        for item in items:
            error = probe_image(item).error
            assert error is None or "\n" not in error


def test_a_damaged_header_after_a_long_name_skips_only_its_member(tmp_path):
    path = tmp_path / "long.tar"
    names = ["a" * 150 + f"/{i}.png" for i in range(3)]
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as archive:
        for name in names:
            add_bytes(archive, name, noise_png(1))
    data = bytearray(path.read_bytes())
    long_links = [at for at in range(0, len(data), 512) if data[at:at + 13] == b"././@LongLink"]
    data[long_links[1] + 1024 + 148] ^= 0x11  # the header that follows the 2nd long name
    path.write_bytes(bytes(data))
    items = discover([str(path)]).items
    assert [i.key for i in items] == [f"{path}/{'a' * 150}/0", f"{path}@{long_links[1]}",
                                      f"{path}/{'a' * 150}/2"]


def member_bytes(name: str, data: bytes, kind: bytes = tarfile.REGTYPE,
                 size: int | None = None) -> bytes:
    """One member as a tar holds it: its header (``size``, when given, in base-256 in the size
    field: a damaged header's claim, up to 2**88) and its data padded to whole blocks."""
    info = tarfile.TarInfo(name)
    info.size, info.type = len(data), kind
    header = bytearray(info.tobuf(tarfile.GNU_FORMAT))
    if size is not None:
        header[124:136] = b"\x80" + size.to_bytes(11, "big")
        header[148:156] = b"%06o\0 " % (256 + sum(header[:148]) + sum(header[156:]))
    return bytes(header) + data + bytes(-len(data) % 512)


def test_a_sidecar_whose_size_passes_the_file_end_is_damage_not_a_memory_error(tmp_path):
    """A kept sidecar member whose header claims more bytes than the shard holds (2**62: a
    damaged size field) leaves its sample without the text and is the shard's error row; before,
    its read asked for that many bytes at once and the MemoryError ended the run."""
    path = tmp_path / "s.tar"
    path.write_bytes(member_bytes("a.png", noise_png(1))
                     + member_bytes("a.txt", b"a caption", size=2**62) + bytes(1024))
    items, _ = sources.expand_tar(str(path), keep_members=("txt",))
    assert [i.key for i in items][0] == f"{path}/a" and items[0].sidecars == ()
    assert [type(i.member) for i in items] == [sources.TarMember, sources.Unreadable]


@pytest.mark.parametrize("size", [2**62, 2**63, 2**80])
def test_a_member_whose_size_passes_any_offset_is_the_shard_cut_short(tmp_path, size):
    """A member whose size field (base-256) claims 2**62 bytes or more is a shard cut inside
    that member, its error row at the file's end; before, the index sought its next header
    there: at 2**63 and above a ValueError ended the run, below it the error row was keyed at a
    byte the file does not have and said "Invalid argument"."""
    path = tmp_path / "s.tar"
    path.write_bytes(member_bytes("a.png", noise_png(1)) + member_bytes("b.png", b"xx", size=size)
                     + bytes(1024))
    items = discover([str(path)]).items
    assert [i.key for i in items] == [f"{path}/a", f"{path}/b", f"{path}@{path.stat().st_size}"]
    assert "ends inside the data of member 'b.png'" in items[2].member.reason


@pytest.mark.parametrize("kind", [tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK,
                                  tarfile.XHDTYPE])
@pytest.mark.parametrize("size", [2 << 20, 2**62])
def test_an_oversized_extended_header_is_damage_not_a_memory_error(tmp_path, kind, size):
    """A long-name, long-link or pax header whose size field claims more than
    ``EXTENDED_HEADER_BYTES`` (2 MiB of a name, or 2**62: a damaged size field) is a damaged
    header, skipped like one, its error row where it starts, and the members after it read;
    before, tarfile read that many bytes at once and the MemoryError ended the run."""
    path = tmp_path / "s.tar"
    first = member_bytes("a.png", noise_png(1))
    path.write_bytes(first + member_bytes("././@LongLink", b"b" * 600, kind, size=size)
                     + member_bytes("c.png", noise_png(2)) + bytes(1024))
    items = discover([str(path)]).items
    assert [i.key for i in items] == [f"{path}/a", f"{path}@{len(first)}", f"{path}/c"]
    assert "no valid tar header" in items[1].member.reason


def test_damaged_tar_through_the_cli(tmp_path, five, ckpt):
    data, headers = five
    path = tmp_path / "shard.tar"
    path.write_bytes(damage("bad checksum", data, headers))
    out = tmp_path / "o.parquet"
    run(str(path), "--out", str(out), "--weights", str(ckpt))
    rows = pq.read_table(out, columns=["path", "error"]).to_pylist()
    assert [r["path"] for r in rows] == [f"{path}/s0", f"{path}/s1", f"{path}@{headers[2]}",
                                         f"{path}/s3", f"{path}/s4"]
    assert [r["error"] is None for r in rows] == [True, True, False, True, True]
    assert "no valid tar header" in rows[2]["error"]


def test_not_a_tar_at_all_is_an_error_row(tmp_path):
    path = tmp_path / "junk.tar"
    path.write_bytes(b"hello" * 300)
    items = discover([str(path)]).items
    assert [i.key for i in items] == [f"{path}@0"]
    assert "not a tar file" in probe_image(items[0]).error


def test_tar_links_are_read_or_reported(tmp_path, images):
    """A hard link reads its target's data; a symlink or a link to nothing is an error row;
    none vanishes."""
    path = tmp_path / "links.tar"
    with tarfile.open(path, "w") as archive:
        add_bytes(archive, "a.png", images["b.png"].read_bytes())
        for name, kind, target in [("b.png", tarfile.LNKTYPE, "a.png"),
                                   ("c.png", tarfile.LNKTYPE, "missing.png"),
                                   ("d.png", tarfile.SYMTYPE, "a.png"),
                                   ("e.png", tarfile.FIFOTYPE, "")]:
            info = tarfile.TarInfo(name)
            info.type, info.linkname = kind, target
            archive.addfile(info)
    items = discover([str(path)]).items
    assert [i.key for i in items] == [f"{path}/{key}" for key in "abcde"]
    assert sources.open_item(items[1]) == images["b.png"].read_bytes()
    assert probe_image(items[1]).width == 30
    assert "hard link to 'missing.png'" in probe_image(items[2]).error
    assert "symbolic link" in probe_image(items[3]).error
    assert "not a regular file" in probe_image(items[4]).error


def test_tar_repeated_member_names_get_unique_keys(tmp_path, images):
    path = tmp_path / "again.tar"
    with tarfile.open(path, "w") as archive:
        add_bytes(archive, "x/0001.jpg", images["a.jpg"].read_bytes())
        add_bytes(archive, "x/0001.jpg", images["a.jpg"].read_bytes())
        add_bytes(archive, "x/0002.jpg", images["a.jpg"].read_bytes())
    keys = [i.key for i in discover([str(path)]).items]
    assert keys == [f"{path}/x/0001.jpg", f"{path}/x/0001.jpg#2", f"{path}/x/0002"]
    # The same shard given twice: its first copy keeps its keys, the second gets suffixes.
    twice = [i.key for i in discover([str(path), str(path)]).items]
    assert twice[:3] == keys and len(set(twice)) == 6


def write_stream(table: pa.Table, path: Path, rows_per_batch: int) -> list[int]:
    """Write ``table`` as an IPC stream; the byte offsets where each batch ends."""
    ends = []
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as out:
        for batch in table.to_batches(max_chunksize=rows_per_batch):
            out.write_batch(batch)
            ends.append(sink.tell())
    return ends


@pytest.mark.parametrize("cut", ["batch boundary", "inside a batch", "no end marker only"])
def test_a_cut_arrow_stream_never_reads_as_complete(tmp_path, images, cut):
    table = image_table(images, ["a.jpg", "b.png", "c.webp", "d.png", "e.gif"], struct=False)
    whole = tmp_path / "whole.arrow"
    ends = write_stream(table, whole, 2)
    data = whole.read_bytes()
    path = tmp_path / "cut.arrow"
    at = {"batch boundary": ends[0], "inside a batch": ends[0] + 50,
          "no end marker only": ends[-1]}[cut]
    path.write_bytes(data[:at])
    items = discover([str(path)]).items
    rows = [i for i in items if isinstance(i.member, sources.TableCell)]
    kept = 5 if cut == "no end marker only" else 2
    assert len(rows) == kept and len(items) == kept + 1
    assert items[-1].key == f"{path}@{ends[-1] if kept == 5 else ends[0]}"
    assert "DamagedContainerError" in probe_image(items[-1]).error
    assert sources.open_item(rows[1]) == images["b.png"].read_bytes()
    assert len(discover([str(whole)]).items) == 5  # the intact stream: no error row


def test_a_compressed_feather_file_is_held_a_batch_at_a_time(tmp_path):
    """Feather compresses with LZ4 by default: opening one held every batch decompressed, in
    the main process and in each decode worker (gigabytes for a large table)."""
    cells = [bytes([n]) * 100_000 for n in range(40)]  # 4 MB that compress to almost nothing
    path = tmp_path / "t.feather"
    feather.write_feather(pa.table({"image": cells}), path, compression="lz4", chunksize=4)
    before = pa.total_allocated_bytes()
    reader = sources.TableReader(str(path))
    assert reader.group_rows == [4] * 10
    assert pa.total_allocated_bytes() - before < 1_000_000  # a batch is 400 KB
    assert reader.read(7, ["image"]).column(0).to_pylist() == cells[28:32]


def test_a_cut_feather_file_keeps_its_batches(tmp_path, images):
    table = image_table(images, ["a.jpg", "b.png", "c.webp"], struct=False)
    path = tmp_path / "t.feather"
    feather.write_feather(table, path, chunksize=2, compression="uncompressed")
    data = path.read_bytes()
    path.write_bytes(data[:-40])  # the footer is gone
    items = discover([str(path)]).items
    assert [i.key for i in items[:3]] == [f"{path}#{r}" for r in range(3)]
    assert "no footer" in probe_image(items[3]).error


def test_damaged_parquet(tmp_path, images):
    """A Parquet file without its footer is one error row; a row group whose pages are
    damaged gives each of its rows an error row, the other groups read."""
    table = image_table(images, ["a.jpg", "b.png", "c.webp", "d.png"], struct=False)
    path = tmp_path / "t.parquet"
    pq.write_table(table, path, row_group_size=2, compression="none")
    data = path.read_bytes()
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(data[:len(data) // 2])
    items = discover([str(cut)]).items
    assert [i.key for i in items] == [f"{cut}@0"]
    assert "cannot read it as a table" in probe_image(items[0]).error
    meta = pq.ParquetFile(path).metadata
    column = meta.row_group(1).column(meta.schema.names.index("img"))
    start = column.data_page_offset
    broken = bytearray(data)
    broken[start:start + 64] = b"\xff" * 64  # the second group's page header
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(bytes(broken))
    items = discover([str(bad)], key_column="id").items
    assert [i.key for i in items] == ["id-0", "id-1", "id-2", "id-3"]
    errors = [probe_image(i).error for i in items]
    assert errors[:2] == [None, None] and errors[2] and errors[3]


def test_a_table_whose_column_name_is_not_utf8_is_one_error_row(tmp_path, images, shard):
    """A Parquet footer (or an Arrow schema) whose column name is not UTF-8 is one error row
    (given by name, or found in a folder of shards), not a UnicodeDecodeError traceback that
    ends the run."""
    table = image_table(images, ["a.jpg"], struct=False).append_column("NNNN", pa.array([1]))
    pq.write_table(table, tmp_path / "t.parquet", store_schema=False)
    folder = tmp_path / "shards"
    folder.mkdir()
    bad = folder / "bad.parquet"
    bad.write_bytes((tmp_path / "t.parquet").read_bytes().replace(b"NNNN", b"\xff\xfeNN"))
    shutil.copy(shard, folder / "s.tar")
    assert [i.key for i in discover([str(bad)]).items] == [f"{bad}@0"]
    feather.write_feather(table, tmp_path / "t.arrow")
    arrow = tmp_path / "bad.arrow"  # an Arrow file's schema is decoded when first asked
    arrow.write_bytes((tmp_path / "t.arrow").read_bytes().replace(b"NNNN", b"\xff\xfeNN"))
    assert [i.key for i in discover([str(arrow)]).items] == [f"{arrow}@0"]
    items = discover([str(folder)]).items
    assert items[0].key == "bad.parquet@0" and "utf-8" in items[0].member.reason
    assert [i.key for i in items[1:]] == [f"s.tar/{key}" for key in SHARD_KEYS]


def test_a_damaged_column_chunk_footer_is_an_error_row_not_an_abort(tmp_path, images):
    """A footer whose column chunk metadata pyarrow cannot build (here: the image column's
    repetition changed, so its level histograms no longer fit) gives error rows; pyarrow
    aborts the whole process (a C++ exception) where that metadata is asked for in Python."""
    import subprocess
    import sys

    table = pa.table({"img": pa.array([{"bytes": images["a.jpg"].read_bytes(), "path": "a"}],
                                      STRUCT), "id": ["k0"]})
    pq.write_table(table, tmp_path / "t.parquet")
    data = bytearray((tmp_path / "t.parquet").read_bytes())
    at = data.rfind(b"\x35\x02\x18\x03img")  # the struct's schema element: optional
    data[at + 1] = 12  # a repetition type no field has
    path = tmp_path / "bad.parquet"
    path.write_bytes(bytes(data))
    probe = ("import sys; from dsv4enc.images.discover import discover; "
             "from dsv4enc.images.decode import probe_image; "
             "print([probe_image(i).error for i in discover([sys.argv[1]], key_column='id').items])")
    done = subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "histogram" in done.stdout, done.stdout


# --------------------------------------------------------------------------- table path cells

def path_table(folder: Path, paths: list[str]) -> Path:
    """A Parquet table in ``folder`` whose image structs hold only paths."""
    column = pa.array([{"bytes": None, "path": p} for p in paths], STRUCT)
    path = folder / "t.parquet"
    pq.write_table(pa.table({"img": column}), path)
    return path


def test_a_relative_path_cell_resolves_beside_the_table_never_the_cwd(tmp_path, images,
                                                                     monkeypatch):
    table_dir, cwd = tmp_path / "data", tmp_path / "cwd"
    (table_dir / "imgs").mkdir(parents=True)
    (cwd / "imgs").mkdir(parents=True)
    (table_dir / "imgs" / "x.png").write_bytes(images["b.png"].read_bytes())
    (cwd / "imgs" / "x.png").write_bytes(images["d.png"].read_bytes())  # a different image
    (cwd / "only_here.png").write_bytes(images["d.png"].read_bytes())
    table = path_table(table_dir, ["imgs/x.png", "only_here.png"])
    monkeypatch.chdir(cwd)
    items = discover([str(table)]).items
    assert probe_image(items[0]).width == 30  # b.png beside the table, not d.png (40)
    assert "FileNotFoundError" in probe_image(items[1]).error


def test_path_cells_outside_the_table_folder_are_refused(tmp_path, images):
    """A shared table must not make dsv4enc read a user's other files: paths outside the
    table's folder (after symlinks and ``..``), non-image names and non-regular files are
    error rows; ``--table-paths-root`` allows more folders."""
    private, data = tmp_path / "private", tmp_path / "data"
    private.mkdir()
    (data / "sub").mkdir(parents=True)
    (private / "photo.png").write_bytes(images["b.png"].read_bytes())
    (data / "sub" / "ok.png").write_bytes(images["d.png"].read_bytes())
    (data / "escape.png").symlink_to(private / "photo.png")
    os.mkfifo(data / "pipe.png")
    (data / "notes.txt").write_text("not an image")
    cells = ["../private/photo.png", str(private / "photo.png"), "escape.png",
             "sub/../../private/photo.png", "/etc/passwd", "/proc/self/environ", "/dev/zero",
             "pipe.png", "notes.txt", "sub/ok.png", str(data / "sub" / "ok.png")]
    table = path_table(data, cells)
    errors = [probe_image(i).error for i in discover([str(table)]).items]
    assert all(e.startswith("RefusedPathError") for e in errors[:9]), errors
    assert all("outside the table's folder" in e for e in errors[:4])
    assert "not a regular file" in errors[7] and "not an image file name" in errors[8]
    assert errors[9:] == [None, None]
    allowed = discover([str(table)], table_paths_roots=[str(private)]).items
    assert [probe_image(i).error for i in allowed[:4]] == [None] * 4
    assert probe_image(allowed[0]).width == 30
    assert "RefusedPathError" in decode_image(discover([str(table)]).items[0], _cfg()).error
    with pytest.raises(UsageError, match="not a folder"):
        discover([str(table)], table_paths_roots=[str(tmp_path / "nope")])


def test_table_paths_root_through_the_cli(tmp_path, images, ckpt):
    private, data = tmp_path / "private", tmp_path / "data"
    private.mkdir()
    data.mkdir()
    (private / "photo.png").write_bytes(images["b.png"].read_bytes())
    table = path_table(data, ["../private/photo.png"])
    for extra, refused in (((), True), (("--table-paths-root", str(private)), False)):
        out = tmp_path / f"o{int(refused)}.parquet"
        run(str(table), "--out", str(out), "--weights", str(ckpt), *extra)
        error = pq.read_table(out, columns=["error"]).column(0)[0].as_py()
        assert (error is not None and "RefusedPathError" in error) == refused, error


def test_arrow_offsets_pointing_outside_their_buffer_are_error_rows(tmp_path):
    """IPC data is read in place: a batch whose offsets point past its buffer is an error row
    (validated), never read blindly."""
    table = pa.table({"img": pa.array([b"A" * 100, b"B" * 100, b"C" * 100], pa.binary())})
    path = tmp_path / "t.arrow"
    write_stream(table, path, 3)
    data = bytearray(path.read_bytes())
    at = data.find(struct.pack("<4i", 0, 100, 200, 300))
    data[at + 4:at + 8] = struct.pack("<i", 10**8)
    path.write_bytes(bytes(data))
    items = discover([str(path)]).items
    assert len(items) == 3
    assert all("Offset invariant failure" in probe_image(i).error for i in items)


# --------------------------------------------------------------------------- unique keys

def test_repeated_table_keys_get_suffixes(tmp_path, images):
    """Hugging Face structs often repeat one file name (``image.jpg``) in every row."""
    table = pa.table({"img": pa.array([{"bytes": images["a.jpg"].read_bytes(), "path": name}
                                       for name in ["image.jpg", "image.jpg", "image.jpg#2",
                                                    "image.jpg"]], STRUCT)})
    path = tmp_path / "t.parquet"
    pq.write_table(table, path)
    keys = [i.key for i in discover([str(path)]).items]
    assert keys == [f"{path}/{key}" for key in ["image.jpg", "image.jpg#3", "image.jpg#2",
                                                 "image.jpg#4"]]


def test_binary_key_cells_keep_their_bytes_in_the_key(tmp_path, images):
    """A binary --key-column's bytes that are not UTF-8 are escaped as a file name's are, so
    two ids stay two keys."""
    data = images["a.jpg"].read_bytes()
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"id": [b"\xff1", b"\xfe1", b"ok"], "img": [data] * 3}), path)
    keys = [i.key for i in discover([str(path)], key_column="id", image_column="img").items]
    assert keys == ["\\xff1", "\\xfe1", "ok"]


# --------------------------------------------------------------------------- folders of containers

def test_a_folder_of_shards_and_tables_is_read_as_those_containers(tmp_path, shard, images,
                                                                   caplog):
    """The usual WebDataset layout: a folder holding only shards (and tables) is read as
    them, each image keyed under its container's path in the folder; in a folder with
    images, containers are passed over with a warning (a metadata.parquet is no image
    table)."""
    folder = tmp_path / "data"
    (folder / "more").mkdir(parents=True)
    shutil.copy(shard, folder / "train-00000.tar")
    shutil.copy(shard, folder / "more" / "train-00001.tar")
    pq.write_table(image_table(images, ["d.png"], struct=False), folder / "extra.parquet")
    (folder / "README.txt").write_text("shards")
    found = discover([str(folder)])
    assert keys_of(found.items) == (["extra.parquet#0"]
                                    + [f"more/train-00001.tar/{k}" for k in SHARD_KEYS]
                                    + [f"train-00000.tar/{k}" for k in SHARD_KEYS])
    assert found.skipped == 3 and found.tables == 1  # README.txt, train/0004 twice
    assert keys_of(discover([str(folder)], key_column="id").items)[0] == "id-0"
    # Two folders given: each container's key starts with its folder, as an image's does.
    two = discover([str(folder / "more"), str(folder)]).items
    assert two[0].key == f"{folder / 'more'}/train-00001.tar/train/0000"
    # Beside an image, the containers are not read.
    shutil.copy(images["a.jpg"], folder / "cover.jpg")
    with caplog.at_level(logging.WARNING, logger="dsv4enc"):
        mixed = discover([str(folder)])
    assert keys_of(mixed.items) == ["cover.jpg"] and mixed.skipped == 4
    assert any("3 .tar shards or tables beside its images are not read" in r.getMessage()
               for r in caplog.records)


def test_metadata_tables_beside_shards_are_passed_over_not_fatal(tmp_path, shard, images,
                                                                 caplog):
    """img2dataset writes a metadata table (urls, captions: no images) beside each shard: a
    folder of them reads the shards, passing the tables over with one warning; a table with
    images still gets its rows, and one given by name without images is still refused."""
    folder = tmp_path / "laion"
    folder.mkdir()
    for n in range(2):
        shutil.copy(shard, folder / f"{n:05d}.tar")
        pq.write_table(pa.table({"url": ["http://x"], "caption": ["a"]}), folder / f"{n:05d}.parquet")
    pq.write_table(image_table(images, ["d.png"], struct=False), folder / "images.parquet")
    with caplog.at_level(logging.WARNING, logger="dsv4enc"):
        found = discover([str(folder)])
    assert keys_of(found.items) == ([f"00000.tar/{k}" for k in SHARD_KEYS]
                                    + [f"00001.tar/{k}" for k in SHARD_KEYS] + ["images.parquet#0"])
    assert found.skipped == 2 + 2 and found.tables == 1  # train/0004 twice, the two tables
    assert any("2 tables without a column of images are not read" in r.getMessage()
               for r in caplog.records)
    assert keys_of(discover([str(folder)], image_column="img").items)[-1] == "images.parquet#0"
    with pytest.raises(UsageError, match="no column holds image bytes"):
        discover([str(folder / "00000.parquet")])


def keys_of(items) -> list[str]:
    return [item.key for item in items]


# --------------------------------------------------------------------------- kept columns

def test_string_cells_that_are_not_utf8_are_escaped_not_the_run_s_end(tmp_path, images, ckpt):
    """A table's string cells are not checked by their writer, nor by Parquet's reader: one
    that is not UTF-8 (a key, a {bytes, path} struct's path, a kept column) is read as its
    bytes, escaped as a binary key's are (``\\xNN``), never a traceback that ends the run."""
    picture = images["d.png"]
    (tmp_path / os.fsdecode(b"\xff\xfeQQ.png")).write_bytes(picture.read_bytes())
    table = pa.table({"img": pa.array([{"bytes": None, "path": "QQQQ.png"},
                                       {"bytes": picture.read_bytes(), "path": "ok.png"}], STRUCT),
                      "caption": ["ZZZZ", "fine"], "id": ["KKKK", "k2"]})
    pq.write_table(table, tmp_path / "t.parquet", compression="none", use_dictionary=False,
                   write_statistics=False)
    data = (tmp_path / "t.parquet").read_bytes()
    for marker in (b"QQQQ", b"ZZZZ", b"KKKK"):  # written unchecked, as another writer may
        data = data.replace(marker, b"\xff\xfe" + marker[:2])
    path = tmp_path / "bad.parquet"
    path.write_bytes(data)
    assert [i.key for i in discover([str(path)]).items] == [f"{path}/\\xff\\xfeQQ.png",
                                                            f"{path}/ok.png"]
    out = tmp_path / "o.parquet"
    run(str(path), "--key-column", "id", "--keep-column", "caption", "--out", str(out),
        "--weights", str(ckpt))
    rows = pq.read_table(out, columns=["path", "id", "caption", "error"]).to_pylist()
    assert rows == [{"path": "\\xff\\xfeKK", "id": "\\xff\\xfeKK", "caption": "\\xff\\xfeZZ",
                     "error": None},
                    {"path": "k2", "id": "k2", "caption": "fine", "error": None}]


def test_a_damaged_page_of_a_kept_column_is_null_not_the_run_s_end(tmp_path, images, ckpt):
    """A kept column whose page cannot be read (the image and key columns can) leaves that
    row group's cells null; the rows keep their embeddings, and the run completes."""
    names = ["a.jpg", "b.png", "c.webp", "d.png"]
    table = pa.table({"id": ["k0", "k1", "k2", "k3"], "caption": ["c0", "c1", "c2", "c3"],
                      "img": [images[n].read_bytes() for n in names]})
    path = tmp_path / "t.parquet"
    pq.write_table(table, path, row_group_size=2, compression="none")
    meta = pq.ParquetFile(path).metadata
    start = meta.row_group(1).column(meta.schema.names.index("caption")).data_page_offset
    broken = bytearray(path.read_bytes())
    broken[start:start + 16] = b"\xff" * 16  # the second group's caption page header
    path.write_bytes(bytes(broken))
    out = tmp_path / "o.parquet"
    run(str(path), "--key-column", "id", "--keep-column", "caption", "--out", str(out),
        "--weights", str(ckpt))
    rows = pq.read_table(out, columns=["path", "caption", "error"]).to_pylist()
    assert rows == [{"path": f"k{i}", "caption": f"c{i}" if i < 2 else None, "error": None}
                    for i in range(4)]


def test_a_column_with_fewer_values_than_rows_gives_error_rows(tmp_path, images, ckpt,
                                                                  monkeypatch):
    """A column chunk whose page is of an unknown type (skipped by the reader) gives fewer
    values than its row group has rows: an image cell past them is an error row that says
    so, a kept cell is null; never an IndexError that ends the run."""
    names = ["a.jpg", "b.png"]
    table = pa.table({"id": ["k0", "k1"], "caption": ["c0", "c1"],
                      "img": [images[n].read_bytes() for n in names]})
    pq.write_table(table, tmp_path / "t.parquet", compression="none")
    meta = pq.ParquetFile(tmp_path / "t.parquet").metadata
    for column in ("caption", "img"):
        data = bytearray((tmp_path / "t.parquet").read_bytes())
        start = meta.row_group(0).column(meta.schema.names.index(column)).data_page_offset
        data[start + 1] = 69  # the page header's type: none that a reader knows
        (tmp_path / f"{column}.parquet").write_bytes(bytes(data))
    out = tmp_path / "o.parquet"
    run(str(tmp_path / "caption.parquet"), "--key-column", "id", "--keep-column", "caption",
        "--out", str(out), "--weights", str(ckpt))
    rows = pq.read_table(out, columns=["path", "caption", "error"]).to_pylist()
    assert rows == [{"path": f"k{i}", "caption": None, "error": None} for i in range(2)]
    items = discover([str(tmp_path / "img.parquet")], key_column="id").items
    error = probe_image(items[1]).error
    assert error.startswith("DamagedContainerError") and "rows" in error, error
    monkeypatch.setattr(sources, "CACHE_BYTES", 1)  # the group read in slices of a row
    monkeypatch.setattr(sources, "GROUP_CACHE", sources.GroupCache(max_bytes=1))
    assert probe_image(items[1]).error == error


def test_kept_columns_and_the_typed_key_join_back_to_the_table(tmp_path, images, shard, ckpt):
    """--keep-column copies table columns into the rows in their own types (null for rows
    not from a table), and --key-column keeps its column typed beside the text ``path``: an
    int64 id merges with the source table as it is."""
    import pandas as pd

    names = ["a.jpg", "b.png", "c.webp"]
    table = pa.table({"id": pa.array([7, 8, 9], pa.int64()),
                      "caption": ["one", None, "three"], "score": [0.5, 1.5, 2.5],
                      "img": [images[n].read_bytes() for n in names]})
    path = tmp_path / "t.parquet"
    pq.write_table(table, path, row_group_size=2)
    for out in (tmp_path / "o.parquet", tmp_path / "folder/"):
        run(str(path), str(shard), "--key-column", "id", "--keep-column", "caption",
            "--keep-column", "score", "--out", str(out), "--weights", str(ckpt))
        got = pq.read_table(out)
        assert got.schema.names[-3:] == ["caption", "score", "id"]
        assert got.schema.field("id").type == pa.int64()
        rows = got.select(["path", "id", "caption", "score"]).to_pylist()
        assert rows[:3] == [{"path": str(i), "id": i, "caption": c, "score": s}
                            for i, c, s in zip([7, 8, 9], ["one", None, "three"],
                                               [0.5, 1.5, 2.5])]
        assert all(r["id"] is None and r["caption"] is None for r in rows[3:])  # the shard's
        merged = pd.read_parquet(path, columns=["id"]).merge(
            got.to_pandas()[["id", "grid_h"]], on="id")
        assert len(merged) == 3
    refusals = {("--keep-column", "width"): "has a 'width' column of its own",
                ("--keep-column", "nope"): "no column 'nope' to keep"}
    for (flag, name), message in refusals.items():
        result = runner.invoke(app, ["encode", str(path), flag, name, "--out",
                                     str(tmp_path / "r.parquet"), "--weights", str(ckpt)])
        assert result.exit_code == 2 and message in result.output, result.output
    result = runner.invoke(app, ["encode", str(shard), "--keep-column", "caption", "--out",
                                 str(tmp_path / "r.parquet"), "--weights", str(ckpt)])
    assert result.exit_code == 2 and "--keep-column applies to Parquet" in result.output
    other = tmp_path / "u.parquet"  # the same column in another type: refused in one line
    pq.write_table(table.set_column(0, "id", pa.array(["7", "8", "9"])), other)
    with pytest.raises(UsageError, match="'id' is int64 in one table and string in"):
        discover([str(path), str(other)], key_column="id")


def test_kept_tar_members_come_out_as_columns_beside_their_rows(tmp_path, images, ckpt):
    """--keep-member carries a sample's .txt, .json and .cls text into string columns (the
    JSON as its raw text; every image of a sample has its sample's); keys stay as they are,
    and a sample without the member, or an image from no shard, has null there."""
    shard = tmp_path / "wds" / "train-00000.tar"
    shard.parent.mkdir()
    caption = "a cat — on a mat\n"
    with tarfile.open(shard, "w") as archive:
        add_bytes(archive, "000000.cls", b"3")  # before its image: as webdataset sorts them
        add_bytes(archive, "000000.jpg", images["a.jpg"].read_bytes())
        add_bytes(archive, "000000.json", b'{"w": 64,  "tags": ["x"]}')
        add_bytes(archive, "000000.txt", caption.encode())
        add_bytes(archive, "000001.png", images["b.png"].read_bytes())  # no sidecars
        add_bytes(archive, "000002.left.png", images["d.png"].read_bytes())
        add_bytes(archive, "000002.right.gif", images["e.gif"].read_bytes())
        add_bytes(archive, "000002.txt", b"two views")
        add_bytes(archive, "000002.seg.txt", b"not the .txt member")
    found = discover([str(shard)], keep_members=("txt",))
    assert [dict(item.sidecars).get("txt") for item in found.items] == [
        caption, None, "two views", "two views"]
    assert keys_of(found.items) == keys_of(discover([str(shard)]).items)  # keys unchanged
    out = tmp_path / "out.parquet"
    table = tmp_path / "t.parquet"  # a table's rows: its kept column, no member
    pq.write_table(pa.table({"img": [images["d.png"].read_bytes()], "caption": ["from t"]}),
                   table)
    run(str(shard.parent), str(images["c.webp"]), str(table), "--keep-member", "txt",
        "--keep-member", "json", "--keep-member", "cls", "--keep-column", "caption", "--out",
        str(out), "--weights", str(ckpt))
    got = pq.read_table(out)
    assert got.schema.names[-4:] == ["caption", "txt", "json", "cls"]
    assert [r["txt"] for r in got.to_pylist() if r["caption"] == "from t"] == [None]
    assert {r["caption"] for r in got.to_pylist() if r["txt"]} == {None}
    assert all(got.schema.field(n).type == pa.string() for n in ("txt", "json", "cls"))
    rows = {r["path"].rpartition("train-00000.tar/")[2] or r["path"]: r
            for r in got.select(["path", "txt", "json", "cls", "error"]).to_pylist()}
    first = rows["000000"]
    assert (first["txt"], first["json"], first["cls"]) == (caption, '{"w": 64,  "tags": ["x"]}',
                                                           "3")
    assert first["error"] is None
    assert rows["000001"]["txt"] is None
    assert {rows[f"000002.{n}"]["txt"] for n in ("left.png", "right.gif")} == {"two views"}
    assert rows[str(images["c.webp"])]["txt"] is None  # not from a shard
    folder = tmp_path / "folder/"  # a part-file output carries them too
    run(str(shard), "--keep-member", "txt", "--out", str(folder), "--weights", str(ckpt))
    assert next(read_embeddings(str(folder), columns=["path", "txt"]))["txt"] == caption
    refusals = {("--keep-member", "jpg"): "--keep-member must be one of txt, json, cls"}
    for (flag, value), message in refusals.items():
        result = runner.invoke(app, ["encode", str(shard), flag, value, "--out",
                                     str(tmp_path / "r.parquet"), "--weights", str(ckpt)])
        assert result.exit_code == 2 and message in result.output, result.output
    result = runner.invoke(app, ["encode", str(images["c.webp"]), "--keep-member", "txt",
                                 "--out", str(tmp_path / "r.parquet"), "--weights", str(ckpt)])
    assert result.exit_code == 2 and "--keep-member applies to WebDataset" in result.output
    result = runner.invoke(app, ["encode", str(shard), "--keep-column", "txt", "--out",
                                 str(tmp_path / "r.parquet"), "--weights", str(ckpt)])
    assert result.exit_code == 2 and "kept with --keep-member" in result.output, result.output


def test_a_kept_member_that_is_a_hard_link_carries_its_target_s_text(tmp_path, images):
    """A sidecar member stored as a hard link (GNU tar stores a second name of one file so:
    captions shared by samples) carries its target's text, as an image member that is a hard
    link reads its target's bytes; before, its sample's column was null, as if it had none."""
    path = tmp_path / "links.tar"
    with tarfile.open(path, "w") as archive:
        add_bytes(archive, "a.png", images["b.png"].read_bytes())
        add_bytes(archive, "a.txt", b"a shared caption")
        add_bytes(archive, "b.png", images["b.png"].read_bytes())
        for name, target in [("b.txt", "./a.txt"), ("c.txt", "missing.txt")]:
            link = tarfile.TarInfo(name)
            link.type, link.linkname = tarfile.LNKTYPE, target
            archive.addfile(link)
        add_bytes(archive, "c.png", images["b.png"].read_bytes())
    items, _ = sources.expand_tar(str(path), keep_members=("txt",))
    assert [i.sidecars for i in items] == [(("txt", "a shared caption"),)] * 2 + [()]


def test_kept_members_through_update_and_resume_settings(tmp_path, images, ckpt):
    """An --update keeps the kept members of the rows it carries and adds the new shard's,
    equal to a clean run; a run that asks for other members is refused in one line."""
    shards = tmp_path / "wds"
    shards.mkdir()

    def shard(n: int, names: list[str]) -> None:
        with tarfile.open(shards / f"train-{n:05d}.tar", "w") as archive:
            for i, name in enumerate(names):
                add_bytes(archive, f"{i:06d}.{name.split('.')[1]}", images[name].read_bytes())
                add_bytes(archive, f"{i:06d}.txt", f"shard {n} sample {i}".encode())

    shard(0, ["a.jpg", "b.png"])
    out, clean = tmp_path / "out/", tmp_path / "clean/"
    args = ("--keep-member", "txt", "--weights", str(ckpt))
    run(str(shards), "--out", str(out), *args)
    shard(1, ["c.webp"])
    run(str(shards), "--out", str(out), "--update", *args)
    run(str(shards), "--out", str(clean), *args)
    columns = ["path", "txt", "embedding", "error"]
    assert [r["txt"] for r in read_embeddings(str(out), columns)] == [
        "shard 0 sample 0", "shard 0 sample 1", "shard 1 sample 0"]
    for got, want in zip(read_embeddings(str(out), columns), read_embeddings(str(clean), columns)):
        assert got["path"] == want["path"] and got["txt"] == want["txt"]
        assert np.array_equal(got["embedding"], want["embedding"])
    result = runner.invoke(app, ["encode", str(shards), "--out", str(out), "--update",
                                 "--weights", str(ckpt), "--device", "cpu", "--workers", "0"])
    assert result.exit_code == 2 and "--keep-member" in result.output, result.output


def test_a_kept_column_parquet_cannot_hold_is_refused_in_one_line(tmp_path, images):
    """An Arrow table's union or run-end-encoded column has no Parquet type: kept (or the key
    column, which is kept too), it is refused before the run starts, not a traceback at the
    first part written."""
    image = images["a.jpg"].read_bytes()
    table = pa.table({"img": [image, image],
                      "u": pa.UnionArray.from_sparse(pa.array([0, 1], pa.int8()),
                                                     [pa.array([1, 2]), pa.array(["a", "b"])]),
                      "r": pa.RunEndEncodedArray.from_arrays([2], ["x"])})
    path = tmp_path / "t.arrow"
    feather.write_feather(table, path)
    for option in ({"keep_columns": ["u"]}, {"keep_columns": ["r"]}, {"key_column": "r"}):
        with pytest.raises(UsageError, match="a Parquet output cannot hold"):
            discover([str(path)], **option)


def test_a_url_in_a_path_cell_is_refused_as_a_url(tmp_path, images):
    """A path cell that is a URL is no file beside the table (it was looked up as the folder
    ``data/s3:/bucket``, a FileNotFoundError naming a path the user never wrote): refused as
    a URL."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "ok.png").write_bytes(images["b.png"].read_bytes())
    cells = ["s3://bucket/x.png", "https://example.com/x.png", f"file://{data}/ok.png"]
    errors = [probe_image(i).error for i in discover([str(path_table(data, cells))]).items]
    assert all(e.startswith("RefusedPathError") and "is a URL" in e for e in errors), errors


def test_a_table_of_the_other_format_is_named_as_such(tmp_path, images):
    """A Parquet file named ``.arrow`` (or an Arrow file named ``.parquet``) does not open as
    what its name says: its error row says what it holds and how to name it, not the reader's
    'Expected to read 827474256 metadata bytes'."""
    table = image_table(images, ["a.jpg", "b.png"], struct=False)
    pq.write_table(table, tmp_path / "p.arrow")
    feather.write_feather(table, tmp_path / "f.parquet")
    with pa.ipc.new_stream(tmp_path / "s.parquet", table.schema) as writer:
        writer.write_table(table)
    (tmp_path / "v1.feather").write_bytes(b"FEA1" + bytes(64) + b"FEA1")
    for name, holds in (("p.arrow", "Parquet data"), ("f.parquet", "Arrow IPC data"),
                        ("s.parquet", "Arrow IPC data"), ("v1.feather", "Feather v1")):
        [item] = discover([str(tmp_path / name)]).items
        error = probe_image(item).error
        assert "cannot read it as a table" in error and holds in error, error


def test_a_nul_byte_in_a_path_cell_is_refused_as_no_file_name(tmp_path, images):
    """A path cell with a NUL byte names no file: a RefusedPathError that says so, as the
    docs promise of any cell not read, not Python's bare 'ValueError: embedded null byte'."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "ok.png").write_bytes(images["b.png"].read_bytes())
    [item] = discover([str(path_table(data, ["ok.png\0../../etc/x.png"]))]).items
    error = probe_image(item).error
    assert error.startswith("RefusedPathError") and "NUL byte" in error, error


@pytest.mark.parametrize("fmt", ["parquet", "arrow"])
def test_repeated_column_names_are_an_error_row_or_a_refusal_not_a_traceback(tmp_path, images,
                                                                             fmt):
    """Parquet and Arrow allow two columns of one name. One the run does not read is no
    matter; a repeated image or key column cannot be told apart: the table is one error row
    that says so; a repeated kept column is refused in one line (a KeyError traceback before)."""
    data = [images[n].read_bytes() for n in ("a.jpg", "b.png")]
    arrays = [pa.array(data), pa.array(["x", "y"]), pa.array([1, 2]), pa.array(["c", "d"])]

    def table(*names: str) -> str:
        path = tmp_path / f"{'-'.join(names)}.{fmt}"
        written = pa.Table.from_arrays(arrays, names=list(names))
        pq.write_table(written, path) if fmt == "parquet" else feather.write_feather(written, path)
        return str(path)

    other = discover([table("img", "k", "n", "n")], key_column="k").items
    assert [i.key for i in other] == ["x", "y"] and probe_image(other[0]).error is None
    for path, key in ((table("img", "k", "k", "n"), "k"), (table("img", "img", "k", "n"), None)):
        [item] = discover([path], key_column=key).items
        assert item.key == f"{path}@0", item.key
        assert "columns named" in probe_image(item).error
    with pytest.raises(UsageError, match="2 columns named 'n'"):
        discover([table("img", "k", "n", "n")], keep_columns=["n"])


def test_an_output_given_as_an_input_is_refused_as_no_images(tmp_path, images, ckpt):
    """An output holds embeddings, no image: given by name, it was read with ``embedding``
    (bytes) as its image column, a run of 'cannot identify the image' rows and exit 0; it is
    refused in one line, as the docs promise of an input that holds no image."""
    out = tmp_path / "emb.parquet"
    run(str(images["a.jpg"]), "--out", str(out), "--weights", str(ckpt))
    result = runner.invoke(app, ["encode", str(out), "--out", str(tmp_path / "again.parquet"),
                                 "--weights", str(ckpt), "--workers", "0", "-q"])
    assert result.exit_code == 2 and "an output of dsv4enc" in result.output, result.output


def test_an_arrow_file_s_string_cells_that_are_not_utf8_are_escaped_too(tmp_path, images, ckpt):
    """As in Parquet, an Arrow file's key or kept string cell that is not UTF-8 is read as its
    bytes (``\\xNN``): it made its whole batch unreadable (every row an error row, good images
    lost, and the kept column null on every row of it)."""
    table = pa.table({"img": [images[n].read_bytes() for n in ("a.jpg", "b.png")],
                      "caption": ["ZZZZ", "fine"], "id": ["KKKK", "k2"]})
    feather.write_feather(table, tmp_path / "t.arrow", compression="uncompressed")
    data = (tmp_path / "t.arrow").read_bytes()
    for marker in (b"ZZZZ", b"KKKK"):  # written unchecked, as another writer may
        data = data.replace(marker, b"\xff\xfe" + marker[:2])
    path = tmp_path / "bad.arrow"
    path.write_bytes(data)
    out = tmp_path / "o.parquet"
    run(str(path), "--key-column", "id", "--keep-column", "caption", "--out", str(out),
        "--weights", str(ckpt))
    rows = pq.read_table(out, columns=["path", "caption", "error"]).to_pylist()
    assert rows == [{"path": "\\xff\\xfeKK", "caption": "\\xff\\xfeZZ", "error": None},
                    {"path": "k2", "caption": "fine", "error": None}]


def test_an_arrow_file_s_struct_path_that_is_not_utf8_is_escaped_too(tmp_path, images):
    """A {bytes, path} struct's path that is not UTF-8, in an Arrow file, is read as its bytes
    (the key ``\\xNN``), as in Parquet: it made its whole batch's rows error rows."""
    picture = images["d.png"].read_bytes()
    table = pa.table({"img": pa.array([{"bytes": picture, "path": "QQQQ.png"},
                                       {"bytes": picture, "path": "ok.png"}], STRUCT)})
    feather.write_feather(table, tmp_path / "t.arrow", compression="uncompressed")
    path = tmp_path / "bad.arrow"
    path.write_bytes((tmp_path / "t.arrow").read_bytes().replace(b"QQQQ", b"\xff\xfeQQ"))
    items = discover([str(path)]).items
    assert [i.key for i in items] == [f"{path}/\\xff\\xfeQQ.png", f"{path}/ok.png"]
    assert [probe_image(i).error for i in items] == [None, None]
