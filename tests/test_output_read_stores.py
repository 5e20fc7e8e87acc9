"""Reading an output where it was written: ``read_embeddings``, ``inspect`` and ``inspect
--errors`` on ``s3://`` (the local S3 server, ``tests/objectstore.py``) and fsspec URLs give
what they give on the same files locally, for a single file and a folder output."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from dsv4enc import read_embeddings
from dsv4enc.cli import app
from dsv4enc.output.inspect import summarize

from helpers import write_image

runner = CliRunner()
IMAGES = {"a.jpg": (64, 48), "b/c.png": (40, 70), "b/d.jpg": (90, 90)}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory, small_ckpt) -> Path:
    """A single-file and a folder output of the same images, one of them broken."""
    root = tmp_path_factory.mktemp("read_stores")
    for name, size in IMAGES.items():
        (root / "in" / name).parent.mkdir(parents=True, exist_ok=True)
        write_image(root / "in" / name, size)
    (root / "in" / "broken.jpg").write_bytes(b"not an image")
    for out, extra in (("e.parquet", []), ("parts/", ["--part-images", "1"])):
        result = runner.invoke(app, ["encode", str(root / "in"), "--out", f"{root}/{out}",
                                     "--weights", str(small_ckpt), "--workers", "0",
                                     "--device", "cpu", "-q", *extra])
        assert result.exit_code == 0, result.output
    return root


def upload(s3, local: Path, key: str) -> str:
    """``local`` (a file, or a folder's files) as objects under ``key``; its URL."""
    files = [local] if local.is_file() else sorted(p for p in local.rglob("*") if p.is_file())
    for path in files:
        below = "" if path == local else "/" + path.relative_to(local).as_posix()
        s3.put(key + below, path.read_bytes())
    return f"{s3.url}/{key}"


def rows(location, **kwargs) -> list[tuple]:
    return [(p, None if e is None else e.tobytes(), g)
            for p, e, g in read_embeddings(location, errors="include", **kwargs)]


def comparable(summary) -> dict:
    facts = summary.as_dict()
    facts.pop("path")
    return facts


def invoke(*args: str) -> str:
    result = runner.invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.stdout


@pytest.mark.parametrize("name", ["e.parquet", "parts"])
def test_a_bucket_output_reads_as_the_local_one(s3, outputs, name):
    local = outputs / name
    url = upload(s3, local, f"emb/{name}")
    assert rows(url) == rows(local) and len(rows(local)) == len(IMAGES) + 1
    assert list(read_embeddings(url, columns=["path", "error"], errors="include")) == list(
        read_embeddings(local, columns=["path", "error"], errors="include"))
    assert comparable(summarize(url)) == comparable(summarize(local))
    assert summarize(url).failed == 1
    assert "4 (3 encoded, 1 failed)" in invoke("inspect", url)
    for extra in (["--json"], ["--errors"], ["--errors", "--json"]):
        assert invoke("inspect", url, *extra).replace(url, "OUT") == invoke(
            "inspect", str(local), *extra).replace(str(local), "OUT")
    assert invoke("inspect", url, "--errors").startswith("broken.jpg\t")


def test_storage_options_name_the_endpoint(s3, outputs, monkeypatch):
    """Without the environment's endpoint, ``storage_options`` / ``--storage-option`` give it."""
    url = upload(s3, outputs / "parts", "opt/parts")
    endpoint = s3.server.endpoint
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    want = rows(outputs / "parts")
    assert rows(url, storage_options={"endpoint_url": endpoint}) == want
    assert rows(url, storage_options=[f"endpoint_url={endpoint}"]) == want
    summary = json.loads(invoke("inspect", url, "--json", "--storage-option",
                                f"endpoint_url={endpoint}"))
    assert summary["rows"] == len(want) and summary["failed"] == 1


def test_a_missing_object_is_one_line(s3):
    result = runner.invoke(app, ["inspect", f"{s3.url}/nothing/here.parquet"])
    assert result.exit_code == 2
    assert f"no such file or folder: {s3.url}/nothing/here.parquet" in result.output
    assert "Traceback" not in result.output and "s3:/" + s3.name not in result.output



def test_a_key_with_an_empty_path_component_is_one_line(s3):
    """pyarrow's S3 client refuses a key with ``//`` in it (a ValueError): one line."""
    result = runner.invoke(app, ["inspect", f"{s3.url}/x//out.parquet"])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert result.output.startswith(f"error: {s3.url}/x//out.parquet: ")
    assert "empty path component" in result.output.lower()

def test_a_bucket_output_missing_a_committed_part_is_damage_in_one_line(s3, outputs):
    """A part object its manifest lists, gone: read_embeddings and inspect refuse in one line
    naming it under the URL given, as locally, rather than read the other parts as all."""
    from dsv4enc.errors import UsageError

    local = outputs / "parts"
    part = sorted(p.name for p in local.glob("part-*.parquet"))[1]
    for path in sorted(p for p in local.iterdir() if p.is_file() and p.name != part):
        s3.put(f"gone/parts/{path.name}", path.read_bytes())
    url = f"{s3.url}/gone/parts"
    says = f"{url}/{part}: missing, though the manifest lists it: the output is damaged"
    with pytest.raises(UsageError, match=says):
        list(read_embeddings(url))
    result = runner.invoke(app, ["inspect", url])
    assert result.exit_code == 2 and says in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1


def test_an_fsspec_url_reads_as_the_local_one(outputs):
    import fsspec

    memory = fsspec.filesystem("memory")
    for path in sorted(p for p in (outputs / "parts").iterdir() if p.is_file()):
        memory.pipe(f"/read-stores/parts/{path.name}", path.read_bytes())
    url = "memory://read-stores/parts"
    assert rows(url) == rows(outputs / "parts")
    assert comparable(summarize(url)) == comparable(summarize(outputs / "parts"))


def test_the_datasets_read_a_bucket_output(s3, outputs):
    """By key and through two DataLoader workers (each with its own connection)."""
    from torch.utils.data import DataLoader

    from dsv4enc.dataset import (EmbeddingDataset, EmbeddingIterableDataset,
                                 collate_embeddings)

    url = upload(s3, outputs / "parts", "ds/parts")
    want = {p: e for p, e, _ in read_embeddings(outputs / "parts")}
    by_key = EmbeddingDataset(url)
    for path, emb in want.items():
        assert by_key[path]["embedding"].numpy().tobytes() == emb.tobytes()
    loader = DataLoader(EmbeddingIterableDataset(url, shuffle=True), batch_size=2,
                        num_workers=2, collate_fn=collate_embeddings)
    assert sorted(p for batch in loader for p in batch["path"]) == sorted(want)


class CountedMemory:
    """fsspec's memory file system under a scheme of its own, counting the bytes read."""

    read = 0

    @classmethod
    def register(cls) -> str:
        import io

        import fsspec
        from fsspec.implementations.memory import MemoryFileSystem

        class Counted(io.BytesIO):
            def read(self, size=-1):
                data = super().read(size)
                cls.read += len(data)
                return data

        class CountingFileSystem(MemoryFileSystem):
            protocol = "countedmem"

            def _open(self, path, mode="rb", **kwargs):
                handle = super()._open(path, mode, **kwargs)
                return Counted(handle.getvalue()) if "r" in mode else handle

        fsspec.register_implementation("countedmem", CountingFileSystem, clobber=True)
        return "countedmem"


def test_only_what_is_asked_for_is_fetched(tmp_path):
    """Of a 3.4 MB output, the small columns (``inspect --errors``, ``columns=``) and one
    row by key take a small share of its bytes: footers, column chunks, one row group."""
    import fsspec
    import pyarrow.parquet as pq

    from dsv4enc.dataset import EmbeddingDataset
    from dsv4enc.output.parts import Row, output_schema, parquet_options, rows_to_table

    rng = np.random.default_rng(1)
    rows_ = [Row(path=f"{i:02d}.jpg", width=8, height=8, vit_h=1, vit_w=1, grid_h=12,
                 grid_w=28, embedding=rng.standard_normal((336, 256)).astype(np.float16))
             for i in range(20)]
    schema = output_schema(256, "float16", {})
    pq.write_table(rows_to_table(rows_, schema), tmp_path / "e.parquet", row_group_size=2,
                   **parquet_options(schema))
    size = (tmp_path / "e.parquet").stat().st_size
    scheme = CountedMemory.register()
    fsspec.filesystem(scheme).pipe("/few/e.parquet", (tmp_path / "e.parquet").read_bytes())
    url = f"{scheme}://few/e.parquet"
    assert [r["path"] for r in read_embeddings(url, columns=["path"])] == [r.path for r in rows_]
    assert invoke("inspect", url, "--errors") == ""
    assert 0 < CountedMemory.read < size / 10, (CountedMemory.read, size)
    dataset = EmbeddingDataset(url)
    CountedMemory.read = 0
    item = dataset[3]
    assert item["embedding"].numpy().tobytes() == rows_[3].embedding.tobytes()
    assert CountedMemory.read < size / 4, (CountedMemory.read, size)
