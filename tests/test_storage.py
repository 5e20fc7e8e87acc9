"""Object storage: the ``storage`` facade and URL inputs/outputs, against a real
S3-compatible server on 127.0.0.1 (``tests/objectstore.py``)."""

from __future__ import annotations

import io

import pytest

from dsv4enc.images import sources
from dsv4enc import storage
from dsv4enc.errors import OutputError, StorageError, UsageError


def test_is_url():
    assert storage.is_url("s3://b/k") and storage.is_url("gs://b") and storage.is_url("memory://x")
    assert not storage.is_url("data/x.jpg") and not storage.is_url("file:///tmp/x")
    assert not storage.is_url("/abs/s3:/x")


def test_parse_option():
    assert storage.parse_option("anonymous=true") == ("anonymous", True)
    assert storage.parse_option("connect_timeout=2.5") == ("connect_timeout", 2.5)
    assert storage.parse_option("region=eu-west-1") == ("region", "eu-west-1")
    with pytest.raises(UsageError):
        storage.parse_option("novalue")


def test_listing_is_sorted_recursive_and_relative(s3):
    for key in ["p/b.jpg", "p/a/z.png", "p/a/b.jpg", "p/c.txt", "other/x.jpg"]:
        s3.put(key, b"x" * 3)
    listed = storage.list_files(f"{s3.url}/p/")
    assert [o.key for o in listed] == ["a/b.jpg", "a/z.png", "b.jpg", "c.txt"]
    assert listed[0].url == f"{s3.url}/p/a/b.jpg" and listed[0].size == 3
    assert storage.kind(f"{s3.url}/p") == "folder"
    assert storage.kind(f"{s3.url}/p/b.jpg") == "file"
    assert storage.kind(f"{s3.url}/nothing") == "missing"


def test_a_prefix_is_listed_a_page_at_a_time(s3):
    """Its first objects come once the first page (1,000 keys) is listed, before the next
    page is asked for; in sorted order, folder markers passed over, stamped by ETag."""
    from objectstore import RequestLog

    client = s3.client()
    keys = [f"{i:05d}.png" for i in range(1003)]
    for key in keys:
        client.put_object(Bucket=s3.name, Key=f"many/{key}", Body=b"x")
    client.put_object(Bucket=s3.name, Key="many/sub/", Body=b"")
    with RequestLog(s3) as log:
        listing = storage.iter_files(f"{s3.url}/many")
        first = next(listing)
        lists_before_the_first = log.counts["GET"]
        rest = list(listing)
    assert lists_before_the_first == 1 and log.counts["GET"] == 2
    assert [first.key, *(o.key for o in rest)] == keys
    assert first.etag and storage.stamp(first.url) == f"1 {first.etag}"


def test_ranges_upload_and_stamp(s3):
    url = s3.put("obj.bin", bytes(range(100)))
    assert storage.read_range(url, 10, 5) == bytes(range(10, 15))
    assert storage.read_bytes(url) == bytes(range(100))
    with storage.open_input(url) as handle:
        handle.seek(90)
        assert handle.read(20) == bytes(range(90, 100))
    new = f"{s3.url}/out/new.bin"
    assert not storage.exists(new)
    storage.upload(new, b"abc")
    assert storage.exists(new) and s3.get("out/new.bin") == b"abc"
    assert storage.stamp(new).startswith("3 ")


def test_missing_bucket_is_one_setup_line_without_secrets(s3):
    with pytest.raises(StorageError) as info:
        storage.list_files("s3://no-such-bucket-here/prefix/")
    message = str(info.value)
    assert "bucket not found" in message and "\n" not in message
    assert "testing-secret" not in message


# --------------------------------------------------------------------------- URL inputs

import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from typer.testing import CliRunner

from dsv4enc import read_embeddings
from dsv4enc.cli import app
from dsv4enc.images.discover import discover

from helpers import write_image

runner = CliRunner()
SPECS = {"a.jpg": (64, 48), "sub/b.png": (30, 90), "sub/deeper/c.webp": (120, 12)}


@pytest.fixture(scope="module")
def local_images(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("s3_images")
    for name, size in SPECS.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        write_image(root / name, size)
    return root


def upload_folder(s3, root: Path, prefix: str) -> str:
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        s3.put(f"{prefix}/{path.relative_to(root).as_posix()}", path.read_bytes())
    return f"{s3.url}/{prefix}/"


def encode(*args: str, workers: str = "0") -> None:
    result = runner.invoke(app, ["encode", *args, "--workers", workers, "--device", "cpu",
                                 "-q"])
    assert result.exit_code == 0, result.output


def rows(out) -> dict[str, np.ndarray]:
    return {path: emb for path, emb, _ in read_embeddings(out)}


def test_prefix_lists_like_a_folder(s3, local_images):
    url = upload_folder(s3, local_images, "data/train")
    s3.put("data/train/notes.txt", b"text")
    found = discover([url])
    assert [i.key for i in found.items] == ["a.jpg", "sub/b.png", "sub/deeper/c.webp"]
    assert found.skipped == 1
    with pytest.raises(UsageError, match="input not found"):
        discover([f"{s3.url}/data/nothing/"])


def test_a_prefix_given_with_its_slash_is_the_prefix_beside_an_object_of_its_name(
        s3, local_images):
    """S3 holds an object ``data`` and objects under ``data/`` side by side: ``s3://b/data/``
    is the prefix (it was read as the object), ``s3://b/data`` the object."""
    url = upload_folder(s3, local_images, "data")
    s3.put("data", b"an object named as the prefix")
    assert storage.kind(url) == "folder" and storage.kind(url.rstrip("/")) == "file"
    assert storage.kind(f"{s3.url}/data/a.jpg/") == "missing"
    assert [i.key for i in discover([url]).items] == ["a.jpg", "sub/b.png", "sub/deeper/c.webp"]


@pytest.mark.parametrize("workers", ["0", "2"])
def test_prefix_encodes_like_the_local_folder(s3, local_images, small_ckpt, tmp_path, workers):
    url = upload_folder(s3, local_images, "imgs")
    encode(str(local_images), "--out", str(tmp_path / "local.parquet"),
           "--weights", str(small_ckpt))
    encode(url, "--out", str(tmp_path / "s3.parquet"), "--weights", str(small_ckpt),
           workers=workers)
    local, remote = rows(tmp_path / "local.parquet"), rows(tmp_path / "s3.parquet")
    assert sorted(remote) == sorted(local) == sorted(SPECS)
    for key in local:  # the same images, batched alike: the same rows
        np.testing.assert_allclose(remote[key], local[key], rtol=1e-5, atol=1e-5)


def test_single_object_and_missing_object(s3, local_images, small_ckpt, tmp_path):
    url = s3.put("one/a.jpg", (local_images / "a.jpg").read_bytes())
    bad = s3.put("one/broken.png", b"not a png")
    encode(url, bad, "--out", str(tmp_path / "o.parquet"), "--weights", str(small_ckpt))
    got = {r["path"]: r for r in read_embeddings(tmp_path / "o.parquet", ["path", "error"],
                                                 errors="include")}
    assert set(got) == {url, bad}
    assert got[url]["error"] is None and got[bad]["error"]



def test_a_files_from_list_of_object_urls_reads_them(s3, local_images, small_ckpt, tmp_path):
    """Object URLs in a --files-from list are read from the store, as when given by name (they
    were opened as local paths: every row "No such file or directory"); a missing one is an
    error row, as a missing listed file is."""
    url = s3.put("listed/a b.jpg", (local_images / "a.jpg").read_bytes())
    missing = f"{s3.url}/listed/gone.jpg"
    listing = tmp_path / "list.txt"
    listing.write_text(f"{url}\n{missing}\n")
    encode("--files-from", str(listing), "--out", str(tmp_path / "listed.parquet"),
           "--weights", str(small_ckpt))
    encode(url, "--out", str(tmp_path / "named.parquet"), "--weights", str(small_ckpt))
    got = {r["path"]: r for r in read_embeddings(tmp_path / "listed.parquet",
                                                 ["path", "error", "embedding"], errors="include")}
    assert set(got) == {url, missing}
    assert got[url]["error"] is None and "gone.jpg" in got[missing]["error"]
    np.testing.assert_array_equal(np.asarray(got[url]["embedding"]),
                                  rows(tmp_path / "named.parquet")[url])

def test_tar_shard_in_a_bucket(s3, local_images, small_ckpt, tmp_path):
    shard = tmp_path / "shard-000.tar"
    with tarfile.open(shard, "w") as archive:
        for i, name in enumerate(SPECS):
            data = (local_images / name).read_bytes()
            info = tarfile.TarInfo(f"s/{i:04d}.{name.rsplit('.', 1)[1]}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
            meta = tarfile.TarInfo(f"s/{i:04d}.cls")
            meta.size = 1
            archive.addfile(meta, io.BytesIO(b"1"))
    url = s3.put("shards/shard-000.tar", shard.read_bytes())
    encode(str(shard), "--out", str(tmp_path / "local.parquet"), "--weights", str(small_ckpt))
    encode(url, "--out", str(tmp_path / "s3.parquet"), "--weights", str(small_ckpt),
           workers="2")
    local, remote = rows(tmp_path / "local.parquet"), rows(tmp_path / "s3.parquet")
    # Each key names its shard: the path as given, or the URL.
    assert sorted(local) == [f"{shard}/s/{i:04d}" for i in range(3)]
    assert sorted(remote) == [f"{url}/s/{i:04d}" for i in range(3)]
    for i in range(3):
        np.testing.assert_allclose(remote[f"{url}/s/{i:04d}"], local[f"{shard}/s/{i:04d}"],
                                   rtol=1e-5, atol=1e-5)


def test_a_shard_in_a_bucket_keeps_its_sidecar_members(s3, local_images, tmp_path):
    """--keep-member reads a bucket's shard as a local one: the sidecars' text (before and
    after their image) from the shard's one stream, the images' bytes readable as before."""
    shard = tmp_path / "train-00000.tar"
    with tarfile.open(shard, "w") as archive:
        for i, name in enumerate(SPECS):
            for member, data in ((f"{i:06d}.txt", f"caption {i}".encode()),
                                 (f"{i:06d}.{name.rsplit('.', 1)[1]}",
                                  (local_images / name).read_bytes()),
                                 (f"{i:06d}.json", b'{"i": %d}' % i)):
                info = tarfile.TarInfo(member)
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))
    url = s3.put("wds/train-00000.tar", shard.read_bytes())
    local = discover([str(shard)], keep_members=("txt", "json")).items
    remote = discover([url], keep_members=("txt", "json")).items
    assert [i.sidecars for i in remote] == [i.sidecars for i in local] == [
        (("txt", f"caption {i}"), ("json", f'{{"i": {i}}}')) for i in range(len(SPECS))]
    for item, name in zip(remote, SPECS):
        data = sources.open_item(item)
        assert bytes(data) == (local_images / name).read_bytes()


def test_a_prefix_of_shards_is_read_as_its_shards(s3, local_images, tmp_path):
    """As a local folder: a prefix with no image but .tar shards is read as those shards,
    each key under the shard's path below the prefix."""
    shard = tmp_path / "train-00000.tar"
    with tarfile.open(shard, "w") as archive:
        archive.add(local_images / "a.jpg", arcname="000000.jpg")
    s3.put("wds/train-00000.tar", shard.read_bytes())
    s3.put("wds/more/train-00001.tar", shard.read_bytes())
    s3.put("wds/stats.json", b"{}")
    s3.put("wds/._train-00000.tar", b"macOS resource fork")  # hidden: left out, as in a folder
    found = discover([f"{s3.url}/wds/"])
    assert [i.key for i in found.items] == ["more/train-00001.tar/000000",
                                            "train-00000.tar/000000"]
    assert found.skipped == 1
    assert [i.key for i in discover([f"{s3.url}/wds/"], exclude=["more"]).items] == [
        "train-00000.tar/000000"]


def test_parquet_image_column_in_a_bucket(s3, local_images, small_ckpt, tmp_path):
    names = list(SPECS)
    table = pa.table({"id": [f"img-{i}" for i in range(len(names))],
                      "jpg": [(local_images / n).read_bytes() for n in names]})
    local = tmp_path / "t.parquet"
    pq.write_table(table, local, row_group_size=2)  # two row groups
    url = s3.put("tables/t.parquet", local.read_bytes())
    encode(str(local), "--key-column", "id", "--out", str(tmp_path / "local.parquet"),
           "--weights", str(small_ckpt))
    encode(url, "--key-column", "id", "--out", str(tmp_path / "s3.parquet"),
           "--weights", str(small_ckpt), workers="2")
    here, there = rows(tmp_path / "local.parquet"), rows(tmp_path / "s3.parquet")
    assert sorted(there) == sorted(here) == ["img-0", "img-1", "img-2"]
    for key in here:
        np.testing.assert_allclose(there[key], here[key], rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- URL outputs

def read_object(s3, key: str, tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    path.write_bytes(s3.get(key))
    return path


def test_single_file_output_in_a_bucket(s3, local_images, small_ckpt, tmp_path):
    url = upload_folder(s3, local_images, "in")
    encode(str(local_images), "--out", str(tmp_path / "local.parquet"),
           "--weights", str(small_ckpt), "--part-images", "1")
    out = f"{s3.url}/emb/out.parquet"
    encode(url, "--out", out, "--weights", str(small_ckpt), "--part-images", "1")
    assert s3.keys("emb/") == ["emb/out.parquet"]  # parts and lock gone: one object
    got = rows(read_object(s3, "emb/out.parquet", tmp_path, "got.parquet"))
    want = rows(tmp_path / "local.parquet")
    assert sorted(got) == sorted(want)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-5)
    again = runner.invoke(app, ["encode", url, "--out", out, "--weights", str(small_ckpt),
                                "--workers", "0", "--device", "cpu", "-q"])
    assert again.exit_code == 1 and "already exists; pass --overwrite" in again.output
    assert "staging" not in again.output and out in again.output
    encode(url, "--out", out, "--weights", str(small_ckpt), "--overwrite")
    assert s3.keys("emb/") == ["emb/out.parquet"]


def test_folder_output_in_a_bucket(s3, local_images, small_ckpt, tmp_path, monkeypatch):
    url = upload_folder(s3, local_images, "in")
    out = f"{s3.url}/emb/"
    advised = []  # the staged parts are uploaded after they commit: they stay in the cache
    with monkeypatch.context() as patch:
        patch.setattr(os, "posix_fadvise", lambda *args: advised.append(args), raising=False)
        encode(url, "--out", out, "--weights", str(small_ckpt), "--part-images", "1")
    assert advised == []
    keys = s3.keys("emb/")
    assert "emb/_manifest.json" in keys and ".dsv4enc.lock" not in " ".join(keys)
    parts = [k for k in keys if k.endswith(".parquet")]
    assert len(parts) == 3
    folder = tmp_path / "mirror"
    folder.mkdir()
    for key in keys:
        (folder / key.split("/", 1)[1]).write_bytes(s3.get(key))
    assert sorted(rows(folder)) == sorted(SPECS)
    again = runner.invoke(app, ["encode", url, "--out", out, "--weights", str(small_ckpt),
                                "--workers", "0", "--device", "cpu", "-q"])
    assert again.exit_code == 1 and "--resume" in again.output
    encode(url, "--out", out, "--weights", str(small_ckpt), "--part-images", "1", "--resume")
    assert s3.keys("emb/") == keys


def test_a_bucket_folder_output_stages_no_part_and_resumes_without_reading_one(
        s3, local_images, small_ckpt, tmp_path, monkeypatch):
    """A folder output's parts go straight to the bucket (the staging folder holds only the
    manifest and the stamps); --resume judges the committed parts by the listing's sizes, with
    no GET of a part, and encodes again the one whose object was replaced by other bytes."""
    from objectstore import RequestLog

    from dsv4enc.output.files import PART_FILE
    from dsv4enc.output.remote import RemoteOutput

    url = upload_folder(s3, local_images, "in")
    out = f"{s3.url}/direct/"
    staged: list[list[str]] = []
    finish = RemoteOutput.finish

    def looked_at_finish(self) -> None:
        staged.append(sorted(p.name for p in self.local_parts.iterdir()))
        finish(self)

    monkeypatch.setattr(RemoteOutput, "finish", looked_at_finish)
    encode(url, "--out", out, "--weights", str(small_ckpt), "--part-images", "1")
    assert staged and "_manifest.json" in staged[0]
    assert not [name for name in staged[0] if PART_FILE.fullmatch(name)], staged[0]
    first = rows(out)
    parts = sorted(k for k in s3.keys("direct/") if PART_FILE.fullmatch(k.split("/", 1)[1]))
    assert len(parts) == 3

    def resumed() -> int:
        result = runner.invoke(app, ["encode", url, "--out", out, "--weights", str(small_ckpt),
                                     "--part-images", "1", "--resume", "--workers", "0",
                                     "--device", "cpu", "-q", "--summary-json",
                                     str(tmp_path / "s.json")])
        assert result.exit_code == 0, result.output
        return json.loads((tmp_path / "s.json").read_text())["images"]["reused"]

    with RequestLog(s3) as log:
        assert resumed() == 3
    assert not [path for method, path in log.requests
                if method == "GET" and any(path.startswith(f"/{key}") for key in parts)]
    s3.put(parts[0], s3.get(parts[0])[:-1])  # cut short: not the committed object
    assert resumed() == 2
    again = rows(out)
    assert sorted(again) == sorted(first)
    assert all(np.array_equal(first[key], again[key]) for key in first)
    # an input replaced: its part is dropped (a journal line in the store) and encoded again
    x, y = sorted(first)[:2]
    s3.put(f"in/{x}", s3.get(f"in/{y}"))
    assert resumed() == 2
    third = rows(out)
    assert sorted(third) == sorted(first) and np.array_equal(third[x], first[y])


# --------------------------------------------------------------------------- kill and resume

import contextlib
import json
import os
import signal
import subprocess
import sys
import time


from helpers import REPO_ROOT, Pauses
from objectstore import manifest_parts, noise_images, tiny_run_options

TINY = tiny_run_options()


@pytest.mark.slow
def test_sigkill_then_resume_on_the_bucket(s3, tmp_path):
    total = 240
    _, url = noise_images(s3, "noise", total, tmp_path)
    out = f"{s3.url}/res/e.parquet"
    pauses = Pauses(tmp_path / "pauses", "commit")
    proc = pauses.launch("encode", url, "--out", out, *TINY, "--workers", "1", "-q")
    try:
        # The run waits at its first local commit (however fast the machine) while its
        # upload thread goes on: kill it once the bucket's manifest lists that part.
        pauses.wait("commit", proc=proc)
        deadline = time.monotonic() + 600  # a hang guard, not a bet on speed
        while not manifest_parts(s3, "res/e.parquet.partial/_manifest.json"):
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "the committed part was never uploaded"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert "res/e.parquet" not in s3.keys("res/")  # never a half-written output
    parts = manifest_parts(s3, "res/e.parquet.partial/_manifest.json")
    keys = s3.keys("res/e.parquet.partial/")
    for part in parts.values():  # the manifest lists only parts that were uploaded whole
        assert f"res/e.parquet.partial/{part['file']}" in keys
    assert len(parts) < total // 3, "the run finished before it was killed"
    stale = staging_of(proc.pid)  # what the kill left in the temporary folder, marked
    assert stale is not None and (stale / "e.parquet.partial").is_dir()
    again = runner.invoke(app, ["encode", url, "--out", out, *TINY, "--workers", "0", "-q"])
    assert again.exit_code == 1 and "--resume" in again.output
    assert str(tempfile_root()) not in again.output  # the store is named, not the staging
    result = runner.invoke(app, ["encode", url, "--out", out, *TINY, "--workers", "1",
                                 "--resume", "--summary-json", str(tmp_path / "s.json")])
    assert result.exit_code == 0, result.output
    opening = next(line for line in result.output.splitlines() if "dsv4enc: encoding" in line)
    assert opening.endswith(f"; to {out}"), opening  # the URL, not the staging folder
    assert str(tempfile_root()) not in result.output
    assert not stale.exists()  # the killed run's staging went once the output was resumed
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["images"]["reused"] == sum(p["rows"] for p in parts.values()) > 0
    assert s3.keys("res/") == ["res/e.parquet"]
    resumed = pq.read_table(read_object(s3, "res/e.parquet", tmp_path, "r.parquet")).to_pylist()
    assert [r["path"] for r in resumed] == [f"img{i:03d}.png" for i in range(total)]
    assert all(r["error"] is None for r in resumed)


def staging_of(pid: int):
    """The staging folder that process ``pid`` marked as its own, or None."""
    import tempfile
    from pathlib import Path

    from dsv4enc.output.remote import STAGING_MARK, STAGING_PREFIX

    for folder in Path(tempfile.gettempdir()).glob(f"{STAGING_PREFIX}*"):
        try:
            if json.loads((folder / STAGING_MARK).read_text())["pid"] == pid:
                return folder
        except (OSError, ValueError, KeyError):
            continue
    return None


def tempfile_root() -> str:
    import tempfile

    return os.path.join(tempfile.gettempdir(), "dsv4enc-staging-")


# --------------------------------------------------------------------------- torchrun

@pytest.mark.slow
def test_two_rank_torchrun_reads_and_writes_the_bucket(s3, tmp_path):
    """2 gloo ranks (no shared folder needed): both read their images from the bucket, rank
    0 writes the output to it; the rows equal one process's."""
    from test_run_torchrun import ok, torchrun

    _, url = noise_images(s3, "tr-in", 12, tmp_path)
    out = f"{s3.url}/tr/e.parquet"
    ok(torchrun(["-m", "dsv4enc", "encode", url, "--out", out, *TINY, "--workers", "1",
                 "--timeout", "60", "-q"], tmp_path))
    assert s3.keys("tr/") == ["tr/e.parquet"]
    encode(url, "--out", str(tmp_path / "one.parquet"), *TINY)
    got = pq.read_table(read_object(s3, "tr/e.parquet", tmp_path, "got.parquet")).to_pylist()
    want = pq.read_table(tmp_path / "one.parquet").to_pylist()
    assert [r["path"] for r in got] == [r["path"] for r in want] and len(want) == 12
    for a, b in zip(got, want):
        assert a["error"] is None and b["error"] is None
        np.testing.assert_allclose(np.frombuffer(a["embedding"], np.float16),
                                   np.frombuffer(b["embedding"], np.float16), rtol=2e-2,
                                   atol=2e-3)


def mirror(s3, prefix: str, folder: Path) -> Path:
    """The objects under ``prefix`` (a folder output) as files of ``folder``."""
    folder.mkdir()
    for key in s3.keys(prefix):
        (folder / key[len(prefix):]).write_bytes(s3.get(key))
    return folder


def assert_rows_of_one_process(got: list[dict], want: list[dict]) -> None:
    """Each image exactly once, with one process's row."""
    assert sorted(r["path"] for r in got) == sorted(r["path"] for r in want)
    assert len({r["path"] for r in got}) == len(got)
    by_path = {r["path"]: r for r in got}
    for b in want:
        a = by_path[b["path"]]
        assert a["error"] is None and b["error"] is None
        np.testing.assert_allclose(np.frombuffer(a["embedding"], np.float16),
                                   np.frombuffer(b["embedding"], np.float16), rtol=2e-2,
                                   atol=2e-3)


def check_bucket_shards(s3, prefix: str, tmp_path: Path, want: list[dict]) -> None:
    """A --shard-output folder in the bucket: both ranks' parts and manifests, the merged
    manifest listing exactly the part objects, no lock, and one process's rows."""
    keys = s3.keys(prefix)
    assert {f"{prefix}_manifest.json", f"{prefix}_manifest-rank000.json",
            f"{prefix}_manifest-rank001.json"} <= set(keys) and ".dsv4enc.lock" not in str(keys)
    parts = {k[len(prefix):] for k in keys if k.endswith(".parquet")}
    assert any(p.endswith("-rank000.parquet") for p in parts)
    assert any(p.endswith("-rank001.parquet") for p in parts)  # rank 1 uploaded its own
    merged = json.loads(s3.get(f"{prefix}_manifest.json"))["parts"]
    assert {p["file"] for p in merged.values()} == parts
    folder = mirror(s3, prefix, tmp_path / f"mirror-{len(list(tmp_path.iterdir()))}")
    got = [row for path in sorted(folder.glob("*.parquet"))
           for row in pq.read_table(path).to_pylist()]
    assert_rows_of_one_process(got, want)
    assert sorted(rows(folder)) == sorted(r["path"] for r in want)  # read_embeddings too


@pytest.mark.slow
def test_two_ranks_write_their_shards_straight_to_the_bucket(s3, tmp_path):
    """torchrun --shard-output to a bucket: each rank uploads its own parts and manifest
    from its own staging folder, rank 0 the merged manifest once both are done; the rows
    are one process's. Run again without a flag it refuses; --resume reuses every part."""
    from test_run_torchrun import ok, torchrun

    _, url = noise_images(s3, "sh-in", 12, tmp_path)
    out = f"{s3.url}/sh/"
    command = ["-m", "dsv4enc", "encode", url, "--out", out, "--shard-output", *TINY,
               "--workers", "1", "--timeout", "60", "-q"]
    ok(torchrun(command, tmp_path))
    encode(url, "--out", str(tmp_path / "one.parquet"), *TINY)
    want = pq.read_table(tmp_path / "one.parquet").to_pylist()
    assert len(want) == 12
    check_bucket_shards(s3, "sh/", tmp_path, want)
    keys = s3.keys("sh/")
    again = torchrun(command, tmp_path)
    assert again.returncode != 0 and "--resume" in again.stderr, again.stderr[-3000:]
    ok(torchrun([*command, "--resume", "--summary-json", str(tmp_path / "s.json")], tmp_path))
    assert json.loads((tmp_path / "s.json").read_text())["images"]["reused"] == 12
    assert s3.keys("sh/") == keys
    ok(torchrun([*command, "--overwrite", "--part-images", "4"], tmp_path))
    check_bucket_shards(s3, "sh/", tmp_path, want)


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it (Linux's /proc), the lowest first."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                with open(f"/proc/{entry}/stat") as stat_file:
                    parent = int(stat_file.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(parent, []).append(int(entry))
    order, todo = [], [pid]
    while todo:
        order.append(todo.pop())
        todo.extend(children.get(order[-1], []))
    for each in reversed(order):
        with contextlib.suppress(ProcessLookupError):
            os.kill(each, signal.SIGKILL)


@pytest.mark.slow
def test_bucket_shards_resume_after_a_kill(s3, tmp_path):
    """Both ranks are killed at their first commit, once it is in the bucket: no merged
    manifest exists, and --resume (each rank pulling its own manifest and parts) finishes with every
    image once, one process's rows."""
    from test_run_torchrun import free_port, ok, torchrun

    total = 60
    _, url = noise_images(s3, "kr-in", total, tmp_path)
    out = f"{s3.url}/kr/"
    command = ["-m", "dsv4enc", "encode", url, "--out", out, "--shard-output", *TINY,
               "--workers", "1", "--timeout", "60", "-q"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    env.pop("DSV4ENC_WEIGHTS", None)
    pauses = Pauses(tmp_path / "pauses", "commit")
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                             "--master-addr=127.0.0.1", f"--master-port={free_port()}",
                             *command], cwd=tmp_path, env=pauses.env(env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # Each rank waits at its first local commit while its upload thread goes on: kill
        # them all once both ranks' manifests in the bucket list that first part.
        pauses.wait("commit", proc=proc)
        deadline = time.monotonic() + 600  # a hang guard, not a bet on speed
        while not all(manifest_parts(s3, f"kr/_manifest-rank{rank:03d}.json")
                      for rank in range(2)):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the committed part was never uploaded"
            time.sleep(0.01)
    finally:
        kill_tree(proc.pid)  # torchrun starts each rank in a session of its own
        proc.communicate()
    keys = s3.keys("kr/")
    assert "kr/_manifest.json" not in keys  # merged only once every rank has finished
    for name in ("_manifest-rank000.json", "_manifest-rank001.json"):
        for part in manifest_parts(s3, f"kr/{name}").values():  # listed: uploaded whole
            assert f"kr/{part['file']}" in keys
    ok(torchrun([*command, "--resume", "--summary-json", str(tmp_path / "s.json")], tmp_path))
    reused = json.loads((tmp_path / "s.json").read_text())["images"]["reused"]
    assert 0 < reused < total
    encode(url, "--out", str(tmp_path / "one.parquet"), *TINY)
    check_bucket_shards(s3, "kr/", tmp_path, pq.read_table(tmp_path / "one.parquet").to_pylist())


# --------------------------------------------------------------------------- failures

def one_line_failure(result) -> str:
    assert result.exit_code == 1, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


@pytest.mark.parametrize("where", ["input", "output file", "output folder"])
def test_missing_bucket_is_one_setup_line(s3, local_images, small_ckpt, tmp_path, where):
    url = upload_folder(s3, local_images, "in")
    missing = "s3://no-such-bucket-dsv4enc"
    source, out = {"input": (f"{missing}/in/", str(tmp_path / "o.parquet")),
                   "output file": (url, f"{missing}/o.parquet"),
                   "output folder": (url, f"{missing}/o/")}[where]
    result = runner.invoke(app, ["encode", source, "--out", out, "--weights", str(small_ckpt),
                                 "--workers", "0", "--device", "cpu", "-q",
                                 "--storage-option", "access_key=testing",
                                 "--storage-option", "secret_key=do-not-print-me"])
    line = one_line_failure(result)
    assert "bucket not found" in line and "no-such-bucket-dsv4enc" in line
    assert "do-not-print-me" not in result.output and "testing-secret" not in result.output


@pytest.mark.parametrize("where", ["input", "output file", "output folder"])
def test_a_key_with_an_empty_path_component_is_one_line(s3, local_images, small_ckpt, tmp_path,
                                                         where):
    """pyarrow's S3 client refuses a key with ``//`` in it (a ValueError, not an OSError):
    as an input or an --out, that is one line naming it, not a traceback."""
    url = s3.put("in/dbl//a.jpg", (local_images / "a.jpg").read_bytes())
    source, out = {"input": (url, str(tmp_path / "o.parquet")),
                   "output file": (str(local_images), f"{s3.url}/x//o.parquet"),
                   "output folder": (str(local_images), f"{s3.url}/x//o/")}[where]
    result = runner.invoke(app, ["encode", source, "--out", out, "--weights", str(small_ckpt),
                                 "--workers", "0", "--device", "cpu", "-q"])
    line = one_line_failure(result)
    assert line.startswith("error: ") and "//" in line and "empty path component" in line.lower()


def test_no_credentials_is_one_setup_line(s3, local_images, small_ckpt, tmp_path, monkeypatch):
    """An S3 client that finds no credentials anywhere it looks says so, in one line."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                 "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    for name in ("AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.setenv(name, str(tmp_path / "none"))
    result = runner.invoke(app, ["encode", str(local_images), "--out", f"{s3.url}/nocred/",
                                 "--weights", str(small_ckpt), "--workers", "0", "--device",
                                 "cpu", "-q"])
    assert "no credentials found" in one_line_failure(result)


def test_an_unreachable_store_gives_error_rows_after_retries(s3, monkeypatch):
    """Reads that keep failing (a store that went away after the listing) are retried with
    backoff, then become the image's error, not a crash."""
    import socket

    from dsv4enc.images.decode import probe_image

    s3.put("p/a.png", b"\x89PNG\r\n\x1a\n" + b"\0" * 64)
    items = discover([f"{s3.url}/p/"]).items
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    storage.configure(None)
    monkeypatch.setattr(storage, "ATTEMPTS", 2)  # fewer rounds: each costs the SDK's retries
    waits: list[float] = []  # the backoff's sleeps, recorded instead of slept
    monkeypatch.setattr(storage, "time", type("Clock", (), {"sleep": staticmethod(waits.append)}))
    probe = probe_image(items[0])
    assert probe.error is not None and probe.width is None
    assert waits == [storage.BACKOFF_S * 2 ** i for i in range(storage.ATTEMPTS - 1)]
    with pytest.raises(OSError):
        sources.open_item(items[0])  # what a decode worker does: its error row says why


def test_storage_options_reach_the_decode_workers(s3, local_images, small_ckpt, tmp_path,
                                                  monkeypatch):
    """The endpoint from --storage-option instead of the environment, in the main process
    and in a decode worker process."""
    url = upload_folder(s3, local_images, "opt")
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    encode(url, "--out", str(tmp_path / "o.parquet"), "--weights", str(small_ckpt),
           "--storage-option", f"endpoint_override={s3.server.endpoint}", workers="1")
    got = {r["path"]: r["error"] for r in read_embeddings(tmp_path / "o.parquet",
                                                          ["path", "error"], errors="include")}
    assert got == {key: None for key in SPECS}


def test_a_fresh_lock_object_of_another_host_refuses(s3, local_images, small_ckpt):
    url = upload_folder(s3, local_images, "in")
    lock = {"pid": 4242, "host": "node7.example", "time": time.time()}
    s3.put("busy/e.parquet.partial/.dsv4enc.lock", json.dumps(lock).encode())
    result = runner.invoke(app, ["encode", url, "--out", f"{s3.url}/busy/e.parquet",
                                 "--weights", str(small_ckpt), "--workers", "0", "--device",
                                 "cpu", "-q"])
    line = one_line_failure(result)
    assert "pid 4242 on host node7.example" in line and "delete that object" in line
    assert s3.keys("busy/") == ["busy/e.parquet.partial/.dsv4enc.lock"]  # left alone
    lock["time"] -= 3600  # not refreshed for an hour: its run is gone
    s3.put("busy/e.parquet.partial/.dsv4enc.lock", json.dumps(lock).encode())
    encode(url, "--out", f"{s3.url}/busy/e.parquet", "--weights", str(small_ckpt))
    assert s3.keys("busy/") == ["busy/e.parquet"]


def test_a_conditional_write_creates_once_and_replaces_only_what_it_read(s3):
    """The bucket lock's one atomic step (S3's conditional writes): create if absent, or
    replace the object only while it is the one read."""
    url = f"{s3.url}/c/.dsv4enc.lock"
    first = storage.put_if(url, b"a")
    with pytest.raises(storage.Changed):
        storage.put_if(url, b"b")  # there is one: no second creator
    assert storage.read_tagged(url) == (b"a", first)
    second = storage.put_if(url, b"c", first)
    with pytest.raises(storage.Changed):
        storage.put_if(url, b"d", first)  # replaced since that read
    assert storage.read_tagged(url) == (b"c", second)


class _FailingRead(io.BytesIO):
    """A file whose read fails past ``after`` bytes (a disk error halfway through an upload)."""

    def __init__(self, data: bytes, after: int) -> None:
        super().__init__(data)
        self.after = after

    def read(self, size: int | None = -1) -> bytes:
        reaches = len(self.getbuffer()) if size is None or size < 0 else self.tell() + size
        if reaches > self.after:
            raise OSError("the disk failed halfway")
        return super().read(size)


@pytest.mark.parametrize("size", [1 << 20, 11 << 20], ids=["one-put", "multipart"])
def test_an_upload_is_whole_or_leaves_the_object_as_it_was(s3, monkeypatch, size):
    """An upload that fails halfway (after the retries) leaves the object it would replace,
    and no open multipart upload; one that succeeds holds every byte."""
    monkeypatch.setattr(storage, "PUT_BYTES", 5 << 20)  # S3's smallest part
    monkeypatch.setattr(storage, "MAX_PARTS", 2)  # the multipart one: parts of 5.5 MiB
    monkeypatch.setattr(storage, "ATTEMPTS", 1)
    data = bytes(range(256)) * (size // 256)
    url = s3.put("w/part-000000.parquet", b"the old object")
    with pytest.raises(OSError, match="halfway"):
        storage._put(url, lambda: _FailingRead(data, size - 1))
    assert s3.get("w/part-000000.parquet") == b"the old object"
    assert not s3.client().list_multipart_uploads(Bucket=s3.name).get("Uploads")
    storage._put(url, lambda: io.BytesIO(data))
    assert s3.get("w/part-000000.parquet") == data


def test_without_botocore_s_client_uploads_go_through_pyarrow(s3, monkeypatch):
    """Options that botocore's client does not take leave uploads to pyarrow's stream."""
    monkeypatch.setattr(storage, "_direct", lambda url: None)
    url = f"{s3.url}/p/object.bin"
    storage.upload(url, b"x" * 5000)
    assert s3.get("p/object.bin") == b"x" * 5000


HOLD_LOCK = """
import sys
from dsv4enc.output.remote import RemoteOutput
remote = RemoteOutput(sys.argv[1], writer=True)
try:
    remote.pull()
except Exception as exc:
    print(exc, flush=True)
    sys.exit(3)
print("held", flush=True)
sys.stdin.readline()
remote.close()
"""


def test_of_two_runs_taking_over_a_stale_lock_one_refuses(s3, tmp_path):
    """Two runs find the same stale lock object; the first pauses between that look and its
    write, the second takes the lock over meanwhile: the first then refuses in one line,
    naming the second, instead of writing the output beside it."""
    out = f"{s3.url}/race/"
    gone = {"pid": 4242, "host": "node7.example", "time": time.time() - 3600}
    s3.put("race/.dsv4enc.lock", json.dumps(gone).encode())
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    pauses = Pauses(tmp_path / "pauses", "lock")
    first = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, out], env=pauses.env(env),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    second = None
    try:
        pauses.wait("lock", proc=first)  # it found the stale lock: the second starts only now
        second = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, out], env=env,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert second.stdout.readline() == "held\n"
        pauses.release()
        refusal = first.communicate(timeout=600)[0]  # a hang guard, not a bet on speed
        assert first.returncode == 3, refusal
        assert f"being written by pid {second.pid}" in refusal and "delete that object" in refusal
        assert json.loads(s3.get("race/.dsv4enc.lock"))["pid"] == second.pid
        second.communicate("\n", timeout=600)
        assert second.returncode == 0 and "race/.dsv4enc.lock" not in s3.keys("race/")
    finally:
        for proc in (first, second):
            if proc is not None:
                proc.kill()
                proc.wait()


@pytest.mark.parametrize("first", ["single", "folder"])
def test_a_single_file_and_a_folder_output_of_one_name_are_one_output(s3, first):
    """``--out s3://b/x.parquet`` and ``--out s3://b/x.parquet/`` hold different lock objects
    (``x.parquet.partial/`` and ``x.parquet/``); a run of either form refuses while one of the
    other holds its own, whichever took its lock first (the single-file run decided on a
    file before the folder run began), and a folder run refuses beside the finished file, as
    a local one does: the two never write the two outputs of one name side by side."""
    from dsv4enc.output.remote import RemoteOutput

    single, folder = f"{s3.url}/x.parquet", f"{s3.url}/x.parquet/"
    held, mine = (single, folder) if first == "single" else (folder, single)
    here = RemoteOutput(mine, writer=True)  # decides on its form now, as a run does
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    other = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, held], env=env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline() == "held\n"
        with pytest.raises(OutputError, match=f"being written by pid {other.pid} "):
            here.pull()
        here.close()
        other.communicate("\n", timeout=600)
        assert other.returncode == 0
    finally:
        other.kill()
        other.wait()
    assert not [key for key in s3.keys() if key.endswith(".dsv4enc.lock")]
    # no "x.parquet/" marker is left where a lock object was deleted: it made a later run
    # of the single file (its --resume) a folder output
    assert storage.kind(single) == "missing"
    s3.put("x.parquet", b"PAR1")
    here = RemoteOutput(folder, writer=True)
    with pytest.raises(OutputError, match="is a file, but a folder output was asked for"):
        here.pull()
    here.close()
    assert s3.keys() == ["x.parquet"]


@pytest.mark.parametrize("flag", ["--resume", "--update"])
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM])
def test_a_run_stopped_at_the_stale_lock_leaves_the_committed_rows(s3, tmp_path, flag, signum):
    """A run killed or stopped while it takes over a stale lock (``lock``) has written
    nothing: read_embeddings, pyarrow and duckdb see the committed rows; SIGTERM ends it."""
    import pyarrow.dataset as pads

    folder, _ = noise_images(s3, "held", 6, tmp_path)
    out = f"{s3.url}/held/out/"
    command = [sys.executable, "-m", "dsv4enc", "encode", str(folder), "--out", out, *TINY,
               "--workers", "0", "-q"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    env.pop("DSV4ENC_WEIGHTS", None)
    subprocess.run(command, env=env, check=True, capture_output=True)

    def readers() -> dict[str, list[str]]:
        storage.configure(None)
        fs, path = storage.filesystem(out)
        parts = pads.dataset(path, filesystem=fs, format="parquet").to_table(columns=["path"])
        seen = {"read_embeddings": [r["path"] for r in read_embeddings(out, ["path"],
                                                                        errors="include")],
                "pyarrow.dataset": parts.column("path").to_pylist()}
        with contextlib.suppress(ImportError):
            import duckdb

            seen["duckdb"] = [key for (key,) in duckdb.sql("SELECT path FROM parts").fetchall()]
        return {reader: sorted(keys) for reader, keys in seen.items()}

    committed = readers()
    gone = {"pid": 4242, "host": "node7.example", "time": time.time() - 3600}
    s3.put("held/out/.dsv4enc.lock", json.dumps(gone).encode())
    pauses = Pauses(tmp_path / "pauses", "lock")
    proc = subprocess.Popen([*command, flag], env=pauses.env(env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        pauses.wait("lock", proc=proc)
        proc.send_signal(signum)
        began = time.monotonic()
        proc.communicate(timeout=600)  # a hang guard; the bound is asserted below
        took = time.monotonic() - began
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode in (-signal.SIGKILL, 143) and took < 10
    assert readers() == committed and len(committed["read_embeddings"]) == 6


def test_a_stopped_bucket_run_s_summary_names_the_out_given(s3, tmp_path):
    """--summary-json of a bucket run stopped midway names the --out given (it named the
    local staging folder, removed as the run ends)."""
    folder, _ = noise_images(s3, "sj", 6, tmp_path)
    out, summary = f"{s3.url}/sj/out/", tmp_path / "s.json"
    pauses = Pauses(tmp_path / "pauses", "commit")
    proc = pauses.launch("encode", str(folder), "--out", out, *TINY, "--workers", "0", "-q",
                         "--summary-json", str(summary))
    try:
        pauses.wait("commit", proc=proc)
        proc.send_signal(signal.SIGTERM)
        pauses.release()
        proc.communicate(timeout=600)  # a hang guard
    finally:
        proc.kill()
        proc.wait()
    report = json.loads(summary.read_text())
    assert proc.returncode == 143 and report["status"] == "interrupted"
    assert report["output"] == out


OTHER_HOLDER = {"pid": 4242, "host": "node7.example", "token": "x"}


@pytest.mark.parametrize("then, conditional, message", [
    ("taken over", True, "another run .pid 4242 on host node7.example. took over the lock"),
    ("taken over", False, "another run .pid 4242 on host node7.example. took over the lock"),
    ("removed", True, "lock object .* was removed"),  # that run has ended, or it was deleted
    ("removed", False, "lock object .* was removed"),
])
def test_a_run_whose_lock_was_lost_stops_and_leaves_it(s3, monkeypatch, then, conditional,
                                                       message):
    """A lock that another run replaced, or that is gone (this run could not refresh it in
    time), is found at the next refresh, on a store with conditional writes or without: the
    run stops at its next commit with one line, and its end neither uploads nor deletes the
    lock, nor writes a manifest."""
    from dsv4enc.errors import OutputError
    from dsv4enc.output.remote import RemoteOutput

    if not conditional:
        monkeypatch.setattr(storage, "put_if", lambda url, data, etag=None: None)
    remote = RemoteOutput(f"{s3.url}/taken/", writer=True)
    other = {**OTHER_HOLDER, "time": time.time()}
    try:
        remote.pull()
        if then == "taken over":
            s3.put("taken/.dsv4enc.lock", json.dumps(other).encode())
        else:
            s3.client().delete_object(Bucket=s3.name, Key="taken/.dsv4enc.lock")
        remote.lock.refresh()
        with pytest.raises(OutputError, match=message):
            remote.adopt_part("part-000000.parquet", Path("unused"))
        with pytest.raises(OutputError, match=message):
            remote.finish()
        remote.abandon()
    finally:
        remote.close()
    if then == "taken over":
        assert s3.keys("taken/") == ["taken/.dsv4enc.lock"]
        assert json.loads(s3.get("taken/.dsv4enc.lock")) == other
    else:
        assert s3.keys("taken/") == []


def test_any_fsspec_scheme_works_through_fsspec(local_images, small_ckpt, tmp_path):
    """A scheme pyarrow has no client for goes through fsspec (here its in-process memory
    file system: one process, so no decode workers)."""
    import fsspec

    memory = fsspec.filesystem("memory")
    for name in SPECS:
        memory.pipe(f"/fs-in/{name}", (local_images / name).read_bytes())
    storage.configure(None)
    encode("memory://fs-in/", "--out", "memory://fs-out/e.parquet", "--weights",
           str(small_ckpt))
    (tmp_path / "e.parquet").write_bytes(memory.cat("/fs-out/e.parquet"))
    assert sorted(rows(tmp_path / "e.parquet")) == sorted(SPECS)


def test_the_python_api_reads_urls(s3, local_images, small_cfg):
    import torch

    from dsv4enc import Encoder

    url = s3.put("api/a.jpg", (local_images / "a.jpg").read_bytes())
    encoder = Encoder.from_config(small_cfg, seed=3, device="cpu", dtype=torch.float32)
    remote, local = encoder.encode([url, str(local_images / "a.jpg")])
    torch.testing.assert_close(remote, local)
    missing = f"{s3.url}/api/missing.jpg"
    (key, error), = encoder.encode_iter([missing])
    assert key == missing and isinstance(error, str)


def test_overwrite_of_a_folder_output_leaves_only_the_new_parts(s3, local_images, small_ckpt,
                                                                 tmp_path):
    url = upload_folder(s3, local_images, "in")
    out = f"{s3.url}/ow/"
    encode(url, "--out", out, "--weights", str(small_ckpt), "--part-images", "1")
    assert len([k for k in s3.keys("ow/") if k.endswith(".parquet")]) == 3
    s3.put("ow/.hidden-note", b"kept")  # hidden names are never in the way, never deleted
    encode(url, "--out", out, "--weights", str(small_ckpt), "--part-images", "100",
           "--overwrite")
    keys = s3.keys("ow/")
    parts = [k for k in keys if k.endswith(".parquet")]
    assert len(parts) == 1 and "ow/_manifest.json" in keys and "ow/.hidden-note" in keys
    manifest = json.loads(s3.get("ow/_manifest.json"))
    assert [p["file"] for p in manifest["parts"].values()] == [parts[0].split("/", 1)[1]]
    assert sorted(rows(read_object(s3, parts[0], tmp_path, "p.parquet"))) == sorted(SPECS)



def test_an_overwrite_replaces_the_old_manifest_before_its_first_part(s3, tmp_path):
    """``--overwrite`` of an interrupted folder output (a part object no manifest lists): at
    the new run's first commit the store already holds the new run's manifest, never none, so
    a reader never falls back to reading every part object (the uncommitted one among them)."""
    folder, _ = noise_images(s3, "ow2", 4, tmp_path)
    out = f"{s3.url}/ow2/out/"
    command = [sys.executable, "-m", "dsv4enc", "encode", str(folder), "--out", out, *TINY,
               "--workers", "0", "-q", "--part-images", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    env.pop("DSV4ENC_WEIGHTS", None)
    subprocess.run(command, env=env, check=True, capture_output=True)
    old_token = json.loads(s3.get("ow2/out/_manifest.json"))["journal"]
    s3.put("ow2/out/part-000009.parquet", s3.get("ow2/out/part-000000.parquet"))  # uncommitted
    pauses = Pauses(tmp_path / "pauses", "commit")
    proc = subprocess.Popen([*command, "--overwrite"], env=pauses.env(env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pauses.wait("commit", proc=proc)
        manifest = json.loads(s3.get("ow2/out/_manifest.json"))
        seen = [r["path"] for r in read_embeddings(out, ["path"], errors="include")]
    finally:
        pauses.release()
        _, err = proc.communicate(timeout=600)  # a hang guard, not a bet on speed
    assert proc.returncode == 0, err
    assert manifest["journal"] != old_token and len(seen) <= 2 and len(set(seen)) == len(seen)
    assert len(list(read_embeddings(out, ["path"], errors="include"))) == 4



def test_an_object_under_a_part_name_that_dsv4enc_did_not_write_is_kept(s3, local_images,
                                                                         small_ckpt):
    """As for a local folder: an unlisted part object whose footer is not dsv4enc's makes
    --resume and --overwrite refuse, naming it, and stays; an uncommitted one of dsv4enc's
    does not stop --resume."""
    url = upload_folder(s3, local_images, "in")
    out = f"{s3.url}/foreign/"
    encode(url, "--out", out, "--weights", str(small_ckpt), "--part-images", "1")
    s3.put("foreign/part-000042.parquet", b"my notes")
    for extra in ("--resume", "--overwrite"):
        result = runner.invoke(app, ["encode", url, "--out", out, "--weights", str(small_ckpt),
                                     "--workers", "0", "--part-images", "1", "-q", extra])
        line = one_line_failure(result)
        assert "did not write" in line and "part-000042.parquet" in line
    assert s3.get("foreign/part-000042.parquet") == b"my notes"
    s3.put("foreign/part-000042.parquet", s3.get("foreign/part-000000.parquet"))
    encode(url, "--out", out, "--weights", str(small_ckpt), "--part-images", "1", "--resume")
    assert "foreign/part-000042.parquet" not in s3.keys("foreign/")


# --------------------------------------------------------------------------- whole or absent

def test_a_killed_upload_leaves_no_object_and_its_retry_uploads_the_whole_file(
        s3, tmp_path, monkeypatch):
    """The upload's child process is killed after its first part: the key stays empty, the
    open multipart upload is aborted, and the retry sends the whole file."""
    import threading

    data = np.random.default_rng(0).bytes(20 << 20)  # two parts of the upload
    (tmp_path / "big.bin").write_bytes(data)
    pauses = Pauses(tmp_path / "pauses", "upload")
    for name, value in pauses.env().items():
        monkeypatch.setenv(name, value)
    failed = []
    upload = threading.Thread(target=lambda: failed.extend(
        _raised(storage.upload_file_whole, tmp_path / "big.bin", f"{s3.url}/w/big.bin")))
    upload.start()
    try:
        first = pauses.wait("upload")
        assert first["sent"] < len(data)
        os.kill(first["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 600  # a hang guard, not a bet on speed
        while (again := pauses.reached("upload")) is None or again["pid"] == first["pid"]:
            assert time.monotonic() < deadline, "the upload was not tried again"
            time.sleep(0.01)
        assert s3.keys("w/") == []  # killed after a chunk: no short object
    finally:
        pauses.release()
        upload.join()
    assert not failed
    assert s3.get("w/big.bin") == data
    open_uploads = s3.client().list_multipart_uploads(Bucket=s3.name, Prefix="w/")
    assert open_uploads.get("Uploads", []) == []  # the killed child's upload was aborted


def _raised(call, *args) -> list:
    try:
        call(*args)
    except BaseException as exc:  # handed to the test's thread
        return [exc]
    return []


def test_a_signal_during_the_final_upload_leaves_no_object(s3, tmp_path):
    """SIGINT while the single file is uploaded (the run waits at the upload's first
    chunk): exit 130 and no object under --out; --resume then publishes the whole file."""
    folder, _ = noise_images(s3, "sig", 6, tmp_path)
    out = f"{s3.url}/sigout/e.parquet"
    pauses = Pauses(tmp_path / "pauses", "upload")
    proc = pauses.launch("encode", str(folder), "--out", out, *TINY, "--workers", "0", "-q")
    try:
        pauses.wait("upload", proc=proc)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=600)  # a hang guard, not a bet on speed
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert "--resume" in err and "staging" not in err
    keys = s3.keys("sigout/")
    assert "sigout/e.parquet" not in keys  # no short object: none at all
    open_uploads = s3.client().list_multipart_uploads(Bucket=s3.name, Prefix="sigout/")
    assert open_uploads.get("Uploads", []) == []  # and no upload left open
    result = runner.invoke(app, ["encode", str(folder), "--out", out, *TINY, "--workers", "0",
                                 "-q", "--resume"])
    assert result.exit_code == 0, result.output
    assert s3.keys("sigout/") == ["sigout/e.parquet"]
    got = pq.read_table(read_object(s3, "sigout/e.parquet", tmp_path, "got.parquet"))
    assert got.column("path").to_pylist() == [f"img{i:03d}.png" for i in range(6)]


def test_a_single_file_larger_than_one_upload_is_refused_up_front(s3, tmp_path, monkeypatch):
    folder, _ = noise_images(s3, "big", 4, tmp_path)
    for limit in ("S3_MAX_BYTES", "S3_STREAM_MAX_BYTES"):  # the tiny tower's rows: more
        monkeypatch.setattr(storage, limit, 1000)
    result = runner.invoke(app, ["encode", str(folder), "--out", f"{s3.url}/bigout/e.parquet",
                                 *TINY, "--workers", "0", "-q"])
    line = one_line_failure(result)
    assert "s3://" in line and "folder" in line and "ending in /" in line
    assert "staging" not in line
    assert s3.keys("bigout/") == []  # refused before anything was written
    folder_out = runner.invoke(app, ["encode", str(folder), "--out", f"{s3.url}/bigout/e/",
                                     *TINY, "--workers", "0", "-q"])
    assert folder_out.exit_code == 0, folder_out.output
