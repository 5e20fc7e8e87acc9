"""Requests per image on the local S3 server (``tests/objectstore.py``; its own request log
counted, ``RequestLog``): a folder of objects is read with about one GET per image, and a
tar shard is streamed, not read member by member. The rows are the local inputs' rows, bit
for bit."""

from __future__ import annotations

import io
import tarfile

import numpy as np
import pytest
from typer.testing import CliRunner

from dsv4enc import read_embeddings
from dsv4enc.cli import app

from helpers import CONFIGS
from objectstore import RequestLog, noise_images

runner = CliRunner()
RUN = ["--config", str(CONFIGS / "tiny.json"), "--random-init", "--device", "cpu",
       "--workers", "2", "-q"]


def encode(*sources: str, out) -> None:
    result = runner.invoke(app, ["encode", *sources, "--out", str(out), *RUN])
    assert result.exit_code == 0, result.output


def rows(out) -> dict:
    return {r["path"]: r for r in read_embeddings(out, ["path", "embedding", "error"],
                                                  errors="include")}


def assert_same_rows(local, remote) -> None:
    a, b = rows(local), rows(remote)
    assert sorted(a) == sorted(b)
    for key, row in a.items():
        assert row["error"] is None and b[key]["error"] is None, (key, b[key]["error"])
        assert np.array_equal(row["embedding"], b[key]["embedding"]), key


def test_a_folder_of_objects_takes_about_one_request_per_image(s3, tmp_path, capsys):
    count = 100
    folder, url = noise_images(s3, "objects", count, tmp_path)
    encode(str(folder), out=tmp_path / "local.parquet")
    with RequestLog(s3) as log:
        encode(url, out=tmp_path / "remote.parquet")
    with capsys.disabled():
        print(f"\nfolder of {count} objects: {dict(log.counts)}, "
              f"{log.reads() / count:.2f} GET/HEAD per image")
    assert log.reads() <= 1.2 * count, dict(log.counts)
    assert_same_rows(tmp_path / "local.parquet", tmp_path / "remote.parquet")



def test_an_update_reads_only_the_parts_it_encodes_again(s3, tmp_path):
    """Unchanged objects are matched by their listing's stamps: an update that adds one
    image reads the objects of the parts around it, not one per input."""
    count = 60
    folder, url = noise_images(s3, "objects", count, tmp_path)
    out, parts = tmp_path / "out", ["--part-images", "8"]
    result = runner.invoke(app, ["encode", url, "--out", str(out), *parts, *RUN])
    assert result.exit_code == 0, result.output
    (folder / "img000a.png").write_bytes((folder / "img007.png").read_bytes())
    s3.put("objects/img000a.png", (folder / "img000a.png").read_bytes())
    with RequestLog(s3) as log:
        result = runner.invoke(app, ["encode", url, "--out", str(out), "--update", *parts, *RUN])
    assert result.exit_code == 0, result.output
    read = {path for method, path in log.requests if method == "GET" and "?" not in path}
    assert "/objects/img000a.png" in read and len(read) <= 2 * 8 * 2, sorted(read)
    encode(str(folder), out=tmp_path / "clean")
    assert_same_rows(tmp_path / "clean", out)

def write_shard(path, first: int, count: int, rng) -> None:
    from PIL import Image

    with tarfile.open(path, "w") as archive:
        for i in range(first, first + count):
            buffer = io.BytesIO()
            shape = (10 + i % 7, 14 + i % 5, 3)
            Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(buffer, "PNG")
            for name, data in ((f"s/{i:05d}.png", buffer.getvalue()), (f"s/{i:05d}.cls", b"1")):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))


def test_tar_shards_in_a_bucket_are_streamed(s3, tmp_path, capsys):
    rng = np.random.default_rng(3)
    shards, per_shard = 2, 100
    local = tmp_path / "shards"
    local.mkdir()
    for n in range(shards):
        write_shard(local / f"shard-{n:03d}.tar", n * per_shard, per_shard, rng)
        s3.put(f"shards/shard-{n:03d}.tar", (local / f"shard-{n:03d}.tar").read_bytes())
    # a folder of shards and a prefix of them: the same keys (shard-000.tar/s/00000, ...)
    encode(str(local), out=tmp_path / "local.parquet")
    with RequestLog(s3) as log:
        encode(f"{s3.url}/shards/", out=tmp_path / "remote.parquet")
    images = shards * per_shard
    with capsys.disabled():
        print(f"\n{shards} tar shards of {per_shard} images: {dict(log.counts)}, "
              f"{log.reads() / images:.3f} GET/HEAD per image")
    assert log.reads() <= 0.05 * images, dict(log.counts)
    assert_same_rows(tmp_path / "local.parquet", tmp_path / "remote.parquet")


# --------------------------------------------------------------------------- damaged shards

DAMAGE = ["intact", "padded", "bad checksum", "cut in a header", "size too small",
          "cut at a member boundary", "cut in a member's data"]


def five_shard(kind: str) -> bytes:
    from test_images_sources import add_bytes, damage, noise_png

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as archive:
        for i in range(5):
            add_bytes(archive, f"{'d' * 120 if i == 3 else 's'}/s{i}.png", noise_png(i))
    data = buffer.getvalue()
    starts = [at for at in range(0, len(data), 512)
              if data[at + 257:at + 262] == b"ustar" and data[at + 156:at + 157] == b"0"]
    if kind == "intact":
        return data
    if kind == "padded":  # zero blocks between joined archives
        return data + data
    return damage(kind, data, starts)


def read(item, same) -> bytes | str:
    """An item's bytes, or the error that reading it raises."""
    from dsv4enc.images import sources

    try:
        return sources.open_item(item)
    except Exception as exc:
        return same(f"{type(exc).__name__}: {exc}")


@pytest.mark.parametrize("hold", ["default", "none"])
@pytest.mark.parametrize("kind", DAMAGE)
def test_a_shard_in_a_bucket_reads_as_the_same_file_on_disk(s3, tmp_path, monkeypatch, kind,
                                                            hold):
    """Streamed from the bucket (its members kept for the probes and the decode, or, with
    nothing held, each read by range), a shard gives the items, header probes and bytes of
    the same file on disk, damaged or not."""
    from dsv4enc.images import sources
    from dsv4enc.images.decode import probe_image

    if hold == "none":
        monkeypatch.setenv("DSV4ENC_HOLD_BYTES", "0")
    data = five_shard(kind)
    path = tmp_path / "shard.tar"
    path.write_bytes(data)
    url = s3.put("d/shard.tar", data)
    local, remote = sources.expand_tar(str(path)), sources.expand_tar(url)
    try:
        def same(text):
            return str(text).replace(url, "FILE").replace(str(path), "FILE")

        assert remote[1] == local[1]
        assert [same(i) for i in remote[0]] == [same(i) for i in local[0]]
        held = sum(len(sources.HELD.peek(sources.held_key(i)) or b"") for i in remote[0])
        assert held == (0 if hold == "none" else sum(  # every member whose data is there
            i.member.size for i in remote[0] if isinstance(i.member, sources.TarMember)
            and i.member.offset + i.member.size <= len(data)))
        for mine, theirs in zip(local[0], remote[0]):
            assert same(probe_image(theirs)) == same(probe_image(mine))
            if isinstance(mine.member, sources.TarMember):
                assert read(sources.attach_held(theirs), same) == read(mine, same)
    finally:
        sources.HELD.clear()


# --------------------------------------------------------------------------- the reads

@pytest.mark.parametrize("client", ["botocore", "pyarrow"])
def test_each_read_is_one_get_or_pyarrows_head_and_get(s3, client):
    """botocore's single GET and pyarrow's open-and-read (an option that only pyarrow takes
    sends reads there) give the same bytes; botocore's need no HEAD."""
    from dsv4enc import storage

    storage.configure(["load_frequency=900"] if client == "pyarrow" else None)
    data = bytes(range(256)) * 40
    url, empty = s3.put("r/x.bin", data), s3.put("r/empty.bin", b"")
    reads = [(lambda: storage.read_head(url, 100), (data[:100], len(data))),
             (lambda: storage.read_head(url, 1 << 20), (data, len(data))),
             (lambda: storage.read_object(url), data),
             (lambda: storage.read_range(url, 500, 10), data[500:510]),
             (lambda: storage.read_head(empty, 100), (b"", 0)),
             (lambda: storage.read_object(empty), b"")]
    for read, want in reads:
        with RequestLog(s3) as log:
            assert read() == want
        if client == "botocore":
            assert dict(log.counts) == {"GET": 1}
        else:  # no GET of an empty object: its size says so
            assert log.counts["HEAD"] == 1 and log.counts["GET"] <= 1, dict(log.counts)
    with pytest.raises(FileNotFoundError):
        storage.read_object(f"{s3.url}/r/missing.bin")
    storage.configure(None)


@pytest.mark.parametrize("client", ["botocore", "pyarrow"])
def test_a_zero_byte_read_gives_the_object_s_size_and_asks_only_when_it_is_needed(s3, client):
    """``read_head(url, 0)`` answers the object's size (not the offset asked from), by one
    HEAD; ``read_range`` of zero bytes, whose caller has no use for the size (a tar's empty
    member), sends no request at all."""
    from dsv4enc import storage

    storage.configure(["load_frequency=900"] if client == "pyarrow" else None)
    data = bytes(range(256)) * 4
    url = s3.put("z/x.bin", data)
    with RequestLog(s3) as log:
        assert storage.read_head(url, 0) == (b"", len(data))
    assert log.reads() == 1 and log.counts["GET"] == 0, dict(log.counts)
    with RequestLog(s3) as log:
        assert storage.read_range(url, 500, 0) == b""
    assert log.reads() == 0, dict(log.counts)
    with pytest.raises(FileNotFoundError):
        storage.read_head(f"{s3.url}/z/missing.bin", 0)
    storage.configure(None)


# --------------------------------------------------------------------------- tables

def _image_table(count: int, seed: int):
    """A table of ``count`` small PNGs of a few sizes, with an ``id`` and a ``caption``."""
    import pyarrow as pa
    from PIL import Image

    rng = np.random.default_rng(seed)
    images = []
    for i in range(count):
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (40 + i % 5, 48 + i % 7, 3), dtype=np.uint8)
                        ).save(buffer, "PNG")
        images.append(buffer.getvalue())
    return pa.table({"id": [f"img-{i:02d}" for i in range(count)], "image": images,
                     "caption": [f"caption {i}" for i in range(count)]})


def test_a_table_in_a_bucket_reads_each_byte_range_once(s3, tmp_path, capsys):
    """A Parquet table in a bucket: its footer, and each row group's image and kept columns,
    are each one ranged GET in the whole run (listing, header probes, decode workers, the
    writer's kept columns), wherever the parts cut its row groups; the key column is read
    twice, by the listing and by the writer (holding it between would hold a whole column)."""
    import collections

    import pyarrow.parquet as pq

    count, group_rows = 24, 6
    table = _image_table(count, seed=5)
    local = tmp_path / "t.parquet"
    pq.write_table(table, local, row_group_size=group_rows)
    url = s3.put("tables/t.parquet", local.read_bytes())
    size = local.stat().st_size
    assert size > 64 << 10  # pyarrow's footer read (the last 64 KiB) is not the whole file
    options = ["--key-column", "id", "--keep-column", "caption", "--part-images", "4"]
    encode(str(local), *options, out=tmp_path / "local.parquet")
    with RequestLog(s3) as log:
        encode(url, *options, out=tmp_path / "remote.parquet")
    reads = collections.Counter(span for key, span in log.ranges if key == "tables/t.parquet")
    meta = pq.ParquetFile(local).metadata
    ranges = {f"bytes={size - (64 << 10)}-{size - 1}": "footer"}  # as a ranged GET asks
    for group in range(meta.num_row_groups):
        for column in range(meta.num_columns):
            chunk = meta.row_group(group).column(column)
            start = chunk.dictionary_page_offset or chunk.data_page_offset
            ranges[f"bytes={start}-{start + chunk.total_compressed_size - 1}"] = (
                f"{chunk.path_in_schema}#{group}")
    got = {ranges.get(span, span): n for span, n in reads.items()}
    with capsys.disabled():
        print(f"\ntable of {count} images in {meta.num_row_groups} row groups: "
              f"{dict(log.counts)}, GETs by range: {dict(sorted(got.items()))}")
    assert got == {name: 2 if name.startswith("id#") else 1 for name in ranges.values()}
    assert log.counts["HEAD"] <= 2, dict(log.counts)
    assert_same_rows(tmp_path / "local.parquet", tmp_path / "remote.parquet")


def test_an_arrow_file_in_a_bucket_reads_each_byte_range_once(s3, tmp_path, capsys):
    """An Arrow IPC file in a bucket: each record batch's columns are fetched once in the
    whole run (listing, header probes, decode workers, the writer's kept columns), the key
    column twice (by the listing and by the writer, as a Parquet table's), never the whole
    batch again for each column; only the batches' small metadata and the footer are read
    by each reader of a set of columns."""
    import pyarrow as pa

    count, batch_rows = 24, 6
    table = _image_table(count, seed=6)
    local = tmp_path / "t.arrow"
    with pa.ipc.new_file(local, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=batch_rows):
            writer.write_batch(batch)
    data = local.read_bytes()
    bodies = []  # each record batch's body: (first byte, end), past its metadata
    source = pa.BufferReader(data[8:])  # past the file's magic, its messages are a stream
    messages = pa.ipc.MessageReader.open_stream(source)
    for message in messages:
        if message.type == "record batch":
            bodies.append((8 + source.tell() - message.body.size, 8 + source.tell()))
    assert len(bodies) == count // batch_rows
    url = s3.put("tables/t.arrow", data)
    for options in ([], ["--key-column", "id", "--keep-column", "caption"]):
        options = [*options, "--part-images", "4"]
        name = "-".join(options)
        encode(str(local), *options, out=tmp_path / f"local{name}.parquet")
        with RequestLog(s3) as log:
            encode(url, *options, out=tmp_path / f"remote{name}.parquet")
        gets = [tuple(map(int, span.removeprefix("bytes=").split("-")))
                for key, span in log.ranges if key == "tables/t.arrow"]
        fetched = []  # each batch body's bytes fetched, and the most times one byte was
        for start, end in bodies:
            times = np.zeros(end - start, dtype=int)
            for first, last in gets:
                times[max(first, start) - start:max(min(last + 1, end) - start, 0)] += 1
            fetched.append((int(times.sum()), int(times.max())))
        with capsys.disabled():
            print(f"\nArrow file of {count} images in {len(bodies)} batches {options}: "
                  f"{dict(log.counts)}, {len(gets)} GETs; each body's size, bytes fetched "
                  f"and most fetches of a byte: "
                  f"{[(end - start, *got) for (start, end), got in zip(bodies, fetched)]}")
        keys = 2 if "--key-column" in options else 1
        for (start, end), (got, most) in zip(bodies, fetched):
            assert got >= (end - start) * 9 // 10 and most <= keys, (got, most, gets)
            assert got <= end - start + 256 * keys, (got, most, gets)  # the key column's
        assert log.counts["HEAD"] <= 2, dict(log.counts)
        local_rows, remote_rows = (
            {key.replace(str(local), url): row for key, row in rows(out).items()}
            for out in (tmp_path / f"local{name}.parquet", tmp_path / f"remote{name}.parquet"))
        assert sorted(local_rows) == sorted(remote_rows) and len(local_rows) == count
        for key, row in local_rows.items():
            assert row["error"] is None and remote_rows[key]["error"] is None, key
            assert np.array_equal(row["embedding"], remote_rows[key]["embedding"]), key
