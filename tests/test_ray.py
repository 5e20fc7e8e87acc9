"""Ray Data: ``dsv4enc.ray.RayEncoder`` in ``map_batches`` on a real local Ray (CPU): the
command line's rows, error rows instead of failed blocks, every batch format, and an actor
killed mid-run costing nothing (no row lost, none doubled)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from dsv4enc.cli import app

from helpers import write_image

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.slow,  # Ray's own DataContext warns about its deprecated settings
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

from dsv4enc.ray import RayEncoder, encode_dataset, ray_device  # noqa: E402

runner = CliRunner()
SPECS = [("a.jpg", (64, 48), "RGB"), ("b.png", (30, 90), "RGBA"), ("c.png", (120, 12), "L"),
         ("d/e.gif", (50, 50), "P"), ("d/f.bmp", (17, 33), "RGB"), ("g.webp", (200, 20), "RGB")]


@pytest.fixture(scope="module")
def local_ray():
    """A small local Ray: 2 CPUs, a 200 MB object store, no dashboard; its workers run torch on
    one thread, as this process does (conftest: a row's bytes may depend on the count)."""
    ray.init(address="local", num_cpus=2, object_store_memory=200 << 20,
             include_dashboard=False, log_to_driver=False, configure_logging=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ray") / "images"
    for rel, size, mode in SPECS:
        write_image(root / rel, size, mode)
    (root / "d" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")
    (root / "h.jpg").write_bytes((root / "a.jpg").read_bytes()[:200])
    return root


@pytest.fixture(scope="module")
def items(folder) -> list[dict]:
    return [{"image": str(p), "key": p.relative_to(folder).as_posix()}
            for p in sorted(folder.rglob("*")) if p.is_file()]


@pytest.fixture(scope="module")
def cli_rows(folder, small_ckpt, tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("ray_cli") / "emb.parquet"
    result = runner.invoke(app, ["encode", str(folder), "--out", str(out), "--weights",
                                 str(small_ckpt), "--workers", "0", "--device", "cpu",
                                 "--dtype", "float32", "-q"])
    assert result.exit_code == 0, result.output
    return {r["path"]: r for r in pq.read_table(out).to_pylist()}


def options(small_ckpt) -> dict:
    return {"weights": str(small_ckpt), "dtype": "float32", "key_column": "key"}


def output_row(row: dict) -> dict:
    """A row's output columns: what the command line writes (the kept key column aside)."""
    assert row.pop("key") == row["path"]
    return row


def test_map_batches_gives_the_command_lines_rows(local_ray, small_ckpt, items, cli_rows):
    ds = ray.data.from_items(items, override_num_blocks=4)
    rows = encode_dataset(ds, concurrency=2, batch_size=3, **options(small_ckpt)).take_all()
    assert sorted(r["path"] for r in rows) == sorted(cli_rows)  # each image once
    for row in rows:
        assert output_row(row) == cli_rows[row["path"]]  # float16 bytes, error texts alike
    assert {r["path"] for r in rows if r["error"]} == {"d/broken.png", "h.jpg"}


@pytest.mark.parametrize("batch_format", ["numpy", "pandas", "pyarrow"])
def test_every_batch_format_and_a_typed_schema(local_ray, small_ckpt, items, cli_rows,
                                              batch_format):
    """The output columns, typed, then the batch's other columns with their types (the
    string key, an int64 id) whatever the batch format."""
    ds = ray.data.from_items([{**item, "n": i} for i, item in enumerate(items)],
                             override_num_blocks=3)
    rows = ds.map_batches(RayEncoder, fn_constructor_kwargs=options(small_ckpt),
                          batch_format=batch_format, batch_size=2,
                          compute=ray.data.ActorPoolStrategy(size=1)).materialize()
    schema = rows.schema().base_schema
    assert [(f.name, f.type) for f in schema][:9] == [
        ("path", pa.string()), *((name, pa.int32()) for name in
                                 ("width", "height", "vit_h", "vit_w", "grid_h", "grid_w")),
        ("embedding", pa.large_binary()), ("error", pa.string())]
    # the kept columns, as pyarrow reads the batch format (a pandas string: large_string)
    assert schema.names[9:] == ["key", "n"] and schema.field("n").type == pa.int64()
    assert pa.types.is_string(schema.field("key").type) or pa.types.is_large_string(
        schema.field("key").type)
    got = rows.take_all()
    assert sorted(r.pop("n") for r in got) == list(range(len(items)))
    assert {r["path"]: output_row(r) for r in got} == cli_rows


@pytest.mark.parametrize("batch_format", ["numpy", "pandas", "pyarrow"])
def test_a_kept_tensor_column_passes_through(local_ray, small_ckpt, items, cli_rows,
                                             batch_format):
    """A tensor column beside the images (a mask, fixed or ragged in shape) is kept as Ray
    holds it, whatever the batch format: a numpy batch's does not fail its block (pyarrow
    alone takes no array of more than one dimension) after its images were encoded."""
    ds = ray.data.from_items([{**item, "mask": np.full((2, 3, 3), i, np.uint8),
                               "ragged": np.full((i % 3 + 1, 2), i, np.float32)}
                              for i, item in enumerate(items)], override_num_blocks=2)
    rows = ds.map_batches(RayEncoder, fn_constructor_kwargs=options(small_ckpt),
                          batch_format=batch_format, batch_size=3,
                          compute=ray.data.ActorPoolStrategy(size=1)).take_all()
    assert len(rows) == len(items)
    for row in rows:
        i = next(j for j, item in enumerate(items) if item["key"] == row["key"])
        np.testing.assert_array_equal(row.pop("mask"), np.full((2, 3, 3), i, np.uint8))
        np.testing.assert_array_equal(row.pop("ragged"), np.full((i % 3 + 1, 2), i, np.float32))
        assert output_row(row) == cli_rows[row["path"]]


def test_device_follows_what_ray_gave_the_actor(local_ray, small_ckpt):
    kwargs = options(small_ckpt)  # (the remote function takes values, not this module)

    @ray.remote(num_cpus=1)
    def where():
        encoder = RayEncoder(**kwargs)
        return ray_device(), str(encoder.embed.device)

    assert ray.get(where.remote()) == ("cpu", "cpu")
    assert ray_device() == "auto"  # the driver is no worker: what auto finds


def test_a_killed_actor_loses_and_doubles_nothing(local_ray, small_ckpt, items, cli_rows,
                                                  tmp_path):
    """The first actor to take a batch dies in it (os._exit): Ray restarts the actor and
    runs the batch again; every image's row comes out once."""
    marker = tmp_path / "killed"

    class DiesOnce(RayEncoder):  # defined here: shipped to the workers by value
        def __call__(self, batch):
            try:
                fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                return super().__call__(batch)
            os.close(fd)
            os._exit(1)

    ds = ray.data.from_items(items, override_num_blocks=4)
    rows = ds.map_batches(DiesOnce, fn_constructor_kwargs=options(small_ckpt),
                          batch_format="pyarrow", batch_size=2,
                          compute=ray.data.ActorPoolStrategy(size=2)).take_all()
    assert marker.exists()
    assert sorted(r["path"] for r in rows) == sorted(cli_rows)
    assert {r["path"]: output_row(r) for r in rows} == cli_rows


def test_write_parquet_reads_back_with_read_embeddings(local_ray, small_ckpt, items, cli_rows,
                                                       tmp_path):
    from dsv4enc import read_embeddings

    ds = ray.data.from_items(items, override_num_blocks=2)
    encode_dataset(ds, batch_size=4, **options(small_ckpt)).write_parquet(str(tmp_path / "emb"))
    files = sorted((tmp_path / "emb").glob("*.parquet"))
    assert files and all(pq.read_schema(f).field("error").type == pa.string() for f in files)
    got = {}
    for f in files:
        for path, emb, grid in read_embeddings(f, errors="include"):
            got[path] = (emb is None, grid)
    assert got == {p: (r["embedding"] is None,
                       None if r["embedding"] is None else (r["grid_h"], r["grid_w"]))
                   for p, r in cli_rows.items()}


def test_an_actor_refuses_truncated_images_whatever_its_process_set(small_ckpt, folder,
                                                                    tmp_path, monkeypatch):
    """Code the actor's process imported (a subclass in the user's module) may turn on Pillow's
    ``ImageFile.LOAD_TRUNCATED_IMAGES``, as training scripts often do: the actor still gives
    the command's error row for a file cut short, not an embedding of the grey Pillow fills."""
    from PIL import ImageFile

    photo = (folder / "a.jpg").read_bytes()
    (tmp_path / "cut.jpg").write_bytes(photo[:len(photo) * 2 // 3])  # cut in its pixel data
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    batch = pa.table({"image": [str(tmp_path / "cut.jpg")], "key": ["cut.jpg"]})
    row, = RayEncoder(**options(small_ckpt))(batch).to_pylist()
    assert row["embedding"] is None
    assert row["error"].startswith("OSError: image file is truncated (")
