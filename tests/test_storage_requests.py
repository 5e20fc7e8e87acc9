"""Requests per image on the local S3 server (``tests/objectstore.py``; its own request log
counted, ``RequestLog``): a folder of objects is read with about one GET per image, and a
tar shard is streamed, not read member by member. The rows are the local inputs' rows, bit
for bit."""

from __future__ import annotations

import io
import tarfile

import numpy as np
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
    encode(*(str(local / f"shard-{n:03d}.tar") for n in range(shards)),
           out=tmp_path / "local.parquet")
    with RequestLog(s3) as log:
        encode(*(f"{s3.url}/shards/shard-{n:03d}.tar" for n in range(shards)),
               out=tmp_path / "remote.parquet")
    images = shards * per_shard
    with capsys.disabled():
        print(f"\n{shards} tar shards of {per_shard} images: {dict(log.counts)}, "
              f"{log.reads() / images:.3f} GET/HEAD per image")
    assert log.reads() <= 0.05 * images, dict(log.counts)
    assert_same_rows(tmp_path / "local.parquet", tmp_path / "remote.parquet")
