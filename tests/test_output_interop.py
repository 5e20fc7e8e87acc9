"""The output as other tools read it (pyarrow, pandas, polars, duckdb where installed),
``read_embeddings`` round trips, ``--pool mean`` / ``--features vit`` layouts, and
``dsv4enc inspect``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from dsv4enc import read_embeddings
from dsv4enc.tower.checkpoint import random_state_dict, save_checkpoint
from dsv4enc.cli import app
from dsv4enc.output.inspect import error_group, summarize
from dsv4enc.output.read import EmbeddingFormat, embedding_arrays, output_files

from helpers import write_image

runner = CliRunner()
SPECS = [("a.jpg", (64, 48), "RGB"), ("b.png", (30, 90), "RGBA"), ("c.png", (120, 12), "L"),
         ("d/e.gif", (50, 50), "P"), ("d/f.bmp", (17, 33), "RGB")]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, small_cfg):
    """A checkpoint with a small transform and an image folder with one broken file."""
    root = tmp_path_factory.mktemp("interop")
    cfg = small_cfg
    save_checkpoint(root / "ckpt", cfg, random_state_dict(cfg, seed=11))
    for rel, size, mode in SPECS:
        write_image(root / "images" / rel, size, mode)
    (root / "images" / "d" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")
    return root, cfg


def encode(setup, name: str, *extra: str) -> Path:
    root, _ = setup
    out = root / name
    if not out.exists():
        target = str(out) + ("/" if name.endswith("/") else "")  # a folder output
        result = runner.invoke(app, ["encode", str(root / "images"), "--out", target,
                                     "--weights", str(root / "ckpt"), "--workers", "0",
                                     "--device", "cpu", "-q", *extra])
        assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module", params=["binary", "nested"])
def layout(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def emb_file(setup, layout) -> Path:
    return encode(setup, f"emb-{layout}.parquet", "--layout", layout)


def arrow_decoded(table: pa.Table) -> dict[str, np.ndarray | None]:
    """Per path: the embedding decoded straight from pyarrow's buffers, or None: float lists
    for the nested layout, the cell's bytes viewed with the metadata's dtype for binary."""
    meta = json.loads(table.schema.metadata[b"dsv4enc"])["embedding"]
    out = {}
    for row in table.to_pylist():
        emb = row["embedding"]
        if emb is not None and meta["layout"] == "binary":
            emb = np.frombuffer(emb, np.dtype(meta["dtype"])).reshape(-1, meta["width"])
        out[row["path"]] = None if emb is None else np.array(emb, dtype=meta["dtype"])
    return out


@pytest.fixture(scope="module")
def arrow_rows(emb_file):
    """Per path: the embedding as pyarrow decodes it (float16 numpy), or None."""
    return arrow_decoded(pq.read_table(emb_file))


def test_pyarrow_schema_and_float16(emb_file, setup, arrow_rows, layout):
    _, cfg = setup
    schema = pq.read_schema(emb_file)
    expected = {"binary": pa.large_binary(),
                "nested": pa.list_(pa.list_(pa.float16(), cfg.hidden_size))}[layout]
    assert schema.field("embedding").type == expected
    described = json.loads(schema.metadata[b"dsv4enc"])["embedding"]
    assert described == {"layout": layout, "dtype": "float16", "width": cfg.hidden_size,
                         "pooled": False, "shape": ["grid_h*grid_w", cfg.hidden_size],
                         "byte_order": "little"}
    assert arrow_rows["d/broken.png"] is None
    assert sum(v is not None for v in arrow_rows.values()) == len(SPECS)


def test_both_layouts_hold_the_same_rows(setup):
    """--layout changes how the column is stored, not a bit of what read_embeddings returns."""
    binary, nested = (list(read_embeddings(encode(setup, f"emb-{name}.parquet", "--layout",
                                                  name), errors="include"))
                      for name in ("binary", "nested"))
    assert [(p, g) for p, _, g in binary] == [(p, g) for p, _, g in nested]
    for (_, a, _), (_, b, _) in zip(binary, nested):
        assert (a is None and b is None) or (a.dtype == b.dtype and a.tobytes() == b.tobytes())


def test_outputs_of_the_previous_version_still_read(setup, tmp_path):
    """An output written before the layout was recorded (nested, no ``embedding`` metadata)
    reads back as before, through read_embeddings and inspect."""
    _, cfg = setup
    table = pq.read_table(encode(setup, "emb-nested.parquet", "--layout", "nested"))
    meta = json.loads(table.schema.metadata[b"dsv4enc"])
    del meta["embedding"], meta["layout"]
    old = tmp_path / "old.parquet"
    pq.write_table(table.replace_schema_metadata({b"dsv4enc": json.dumps(meta).encode()}), old)
    want = list(read_embeddings(encode(setup, "emb-binary.parquet", "--layout", "binary")))
    got = list(read_embeddings(old))
    assert [(p, g) for p, _, g in got] == [(p, g) for p, _, g in want]
    assert all(a.tobytes() == b.tobytes() and a.dtype == b.dtype
               for (_, a, _), (_, b, _) in zip(got, want))
    summary = summarize(old)
    assert (summary.layout, summary.width, summary.dtype) == ("nested", cfg.hidden_size,
                                                              "float16")


def test_read_embeddings_round_trips_exactly(emb_file, arrow_rows):
    rows = list(read_embeddings(emb_file, batch_rows=2))
    assert [p for p, _, _ in rows] == [p for p, v in arrow_rows.items() if v is not None]
    for path, emb, (gh, gw) in rows:
        assert emb.dtype == np.float16 and emb.shape[0] == gh * gw
        assert emb.tobytes() == arrow_rows[path].tobytes()  # bit for bit
        assert emb.flags.writeable and emb.flags.owndata  # a copy: safe to keep or modify


def test_embedding_arrays_handle_slices_and_nulls():
    width = 2
    values = pa.array(np.arange(12, dtype=np.float16))
    vectors = pa.FixedSizeListArray.from_arrays(values, width)
    lists = pa.ListArray.from_arrays(pa.array([0, 1, 1, 4, 6], pa.int32()), vectors,
                                     mask=pa.array([False, True, False, False]))
    got = embedding_arrays(lists.slice(1, 3))
    assert got[0] is None
    assert got[1].tolist() == [[2, 3], [4, 5], [6, 7]] and got[2].tolist() == [[8, 9], [10, 11]]
    pooled = pa.FixedSizeListArray.from_arrays(values, 3, mask=pa.array([False, True, False, False]))
    got = embedding_arrays(pooled.slice(1, 3))
    assert got[0] is None and got[1].tolist() == [6, 7, 8] and got[2].tolist() == [9, 10, 11]
    cells = pa.array([b"", None, values.to_numpy()[:6].tobytes(), values.to_numpy()[6:].tobytes()],
                     pa.large_binary())
    fmt = EmbeddingFormat("binary", "float16", width, pooled=False)
    got = embedding_arrays(cells.slice(1, 3), fmt)
    assert got[0] is None and got[1].tolist() == [[0, 1], [2, 3], [4, 5]]
    assert got[2].dtype == np.float16 and got[2].flags.owndata and got[2].shape == (3, 2)
    with pytest.raises(ValueError):
        embedding_arrays(cells, None)


def test_pandas(emb_file, arrow_rows, layout, setup):
    _, cfg = setup
    pd = pytest.importorskip("pandas")
    frame = pd.read_parquet(emb_file)
    assert list(frame["path"]) == list(arrow_rows)
    for path, emb in zip(frame["path"], frame["embedding"]):
        if arrow_rows[path] is None:
            assert emb is None
            continue
        if layout == "binary":  # a bytes object per image (the README's recipe)
            assert isinstance(emb, bytes)
            stacked = np.frombuffer(emb, np.float16).reshape(-1, cfg.hidden_size)
        else:  # an object array of per-row float16 arrays
            stacked = np.stack(list(emb))
        assert stacked.dtype == np.float16
        assert stacked.tobytes() == arrow_rows[path].tobytes()


def read_with_polars(pl, path: Path):
    try:
        return pl.read_parquet(path)
    except Exception as exc:  # releases before float16 support
        if "16" in str(exc).lower():
            pytest.skip(f"this polars cannot read float16 Parquet ({exc})")
        raise


def test_polars(emb_file, arrow_rows, layout, setup):
    _, cfg = setup
    pl = pytest.importorskip("polars")
    frame = read_with_polars(pl, emb_file)
    assert frame["path"].to_list() == list(arrow_rows)
    assert frame.schema["embedding"] == pl.Binary if layout == "binary" else True
    for path, emb in zip(frame["path"].to_list(), frame["embedding"].to_list()):
        if arrow_rows[path] is None:
            assert emb is None
            continue
        if layout == "binary":
            emb = np.frombuffer(emb, np.float16).reshape(-1, cfg.hidden_size)
        got = np.array(emb, dtype=np.float32)  # every float16 is exact in float32
        np.testing.assert_array_equal(got, arrow_rows[path].astype(np.float32))


def test_duckdb(emb_file, arrow_rows, layout, setup):
    _, cfg = setup
    duckdb = pytest.importorskip("duckdb")
    con = duckdb.connect()
    rows = con.execute("SELECT path, embedding, grid_h * grid_w AS n, error FROM "
                       "read_parquet(?) ORDER BY path", [str(emb_file)]).fetchall()
    assert [r[0] for r in rows] == sorted(arrow_rows)
    for path, emb, n, error in rows:
        if arrow_rows[path] is None:
            assert emb is None and error
            continue
        if layout == "binary":  # a BLOB, fetched as bytes
            emb = np.frombuffer(emb, np.float16).reshape(-1, cfg.hidden_size)
        got = np.array(emb, dtype=np.float32)
        assert got.shape[0] == n
        np.testing.assert_array_equal(got, arrow_rows[path].astype(np.float32))
    failed = con.execute("SELECT count(*) FROM read_parquet(?) WHERE error IS NOT NULL",
                         [str(emb_file)]).fetchone()[0]
    assert failed == 1


def test_torch(emb_file, arrow_rows, layout, setup):
    _, cfg = setup
    torch = pytest.importorskip("torch")
    for path, emb, grid in read_embeddings(emb_file):  # the README's recipe: from numpy
        tensor = torch.from_numpy(emb)
        assert tensor.dtype == torch.float16 and tensor.shape == (grid[0] * grid[1],
                                                                  cfg.hidden_size)
        assert tensor.numpy().tobytes() == arrow_rows[path].tobytes()
    if layout == "binary":  # straight from a cell's bytes
        cell = pq.read_table(emb_file).column("embedding")[0].as_py()
        tensor = torch.frombuffer(bytearray(cell), dtype=torch.float16).view(-1, cfg.hidden_size)
        assert tensor.numpy().tobytes() == next(v for v in arrow_rows.values()).tobytes()


def test_pool_mean_is_one_fixed_size_vector_per_image(setup, emb_file, arrow_rows, layout):
    _, cfg = setup
    pooled = encode(setup, f"pooled-{layout}.parquet", "--pool", "mean", "--layout", layout)
    schema = pq.read_schema(pooled)
    assert schema.field("embedding").type == (pa.large_binary() if layout == "binary" else
                                              pa.list_(pa.float16(), cfg.hidden_size))
    described = json.loads(schema.metadata[b"dsv4enc"])["embedding"]
    assert described["pooled"] and described["shape"] == [cfg.hidden_size]
    assert json.loads(schema.metadata[b"dsv4enc"])["pool"] == "mean"
    vectors = {p: e for p, e, _ in read_embeddings(pooled)}
    assert vectors.keys() == {p for p, v in arrow_rows.items() if v is not None}
    for path, vec in vectors.items():
        assert vec.shape == (cfg.hidden_size,) and vec.dtype == np.float16
        mean = arrow_rows[path].astype(np.float32).mean(0)
        # The pool averages float32 rows before its float16 cast; this mean averages the
        # float16-stored rows: the two differ by float16 rounding.
        np.testing.assert_allclose(vec.astype(np.float32), mean, rtol=2e-3, atol=2e-3)
    table = pq.read_table(pooled)
    assert table.column("embedding").null_count == 1
    vit_pooled = encode(setup, f"vit_pooled-{layout}.parquet", "--pool", "mean",
                        "--features", "vit", "--layout", layout)
    assert summarize(vit_pooled).width == cfg.dim
    assert all(v.shape == (cfg.dim,) for _, v, _ in read_embeddings(vit_pooled))
    pl = pytest.importorskip("polars")
    column = read_with_polars(pl, pooled)["embedding"]
    assert column.dtype == pl.Binary if layout == "binary" else isinstance(column.dtype, pl.Array)
    for path, vec in zip(table.column("path").to_pylist(), column.to_list()):
        if path in vectors:
            if layout == "binary":
                vec = np.frombuffer(vec, np.float16)
            np.testing.assert_array_equal(np.array(vec, np.float32),
                                          vectors[path].astype(np.float32))


def test_vit_features_in_a_dataset_folder(setup):
    _, cfg = setup
    folder = encode(setup, "vit_parts/", "--features", "vit", "--out-dtype", "float32",
                    "--part-images", "2")
    files = output_files(folder)
    assert len(files) == 3 and all(f.suffix == ".parquet" for f in files)
    rows = list(read_embeddings(folder, columns=["path", "vit_h", "vit_w", "grid_h", "grid_w",
                                                  "embedding"]))
    assert [r["path"] for r in rows] == ["a.jpg", "b.png", "c.png", "d/e.gif", "d/f.bmp"]
    for r in rows:
        assert (r["grid_h"], r["grid_w"]) == (r["vit_h"], r["vit_w"])
        assert r["embedding"].shape == (r["vit_h"] * r["vit_w"], cfg.dim)
        assert r["embedding"].dtype == np.float32
    dataset = pq.ParquetDataset(folder)
    assert dataset.read(columns=["path"]).num_rows == len(SPECS) + 1


def test_datasets_loads_a_folder_output_by_a_glob_of_its_parts(setup, tmp_path):
    """As the docs say: ``load_dataset("parquet", data_files="OUT/*.parquet")`` reads a
    finished folder output's rows (error rows too), the part files alone; ``data_dir=`` would
    also read the manifest beside them, which is no Parquet."""
    datasets = pytest.importorskip("datasets")
    folder = encode(setup, "hf_parts/", "--part-images", "2")
    assert (folder / "_manifest.json").is_file() and len(output_files(folder)) == 3
    ds = datasets.load_dataset("parquet", data_files=f"{folder}/*.parquet", split="train",
                               cache_dir=str(tmp_path / "hf-cache"))
    got = {row["path"]: row for row in ds}
    want = {row["path"]: row for row in read_embeddings(folder, ["path", "embedding", "error"],
                                                         errors="include")}
    assert set(got) == set(want) and len(ds) == len(want) == len(SPECS) + 1
    meta = json.loads(pq.read_schema(output_files(folder)[0]).metadata[b"dsv4enc"])["embedding"]
    for path, row in want.items():
        assert got[path]["error"] == row["error"]
        if row["embedding"] is None:
            assert got[path]["embedding"] is None
        else:
            cell = np.frombuffer(got[path]["embedding"], meta["dtype"]).reshape(-1, meta["width"])
            np.testing.assert_array_equal(cell, row["embedding"])


def test_inspect_file_and_folder(setup, emb_file, layout):
    _, cfg = setup
    summary = summarize(emb_file)
    assert (summary.rows, summary.failed, summary.width, summary.dtype) == (
        len(SPECS) + 1, 1, cfg.hidden_size, "float16")
    assert summary.metadata["features"] == "aligner" and not summary.pooled
    assert summary.layout == layout
    assert summary.errors and summary.errors[0][1] == 1
    assert summary.embedding_rows == sum(e.shape[0] for _, e, _ in read_embeddings(emb_file))
    result = runner.invoke(app, ["inspect", str(emb_file)], terminal_width=200)
    assert result.exit_code == 0, result.output
    for text in ("6 (5 encoded, 1 failed)", "float16", f"{layout} layout",
                 summary.metadata["weights_fingerprint"],
                 "top errors", "broken.png"):
        assert text in result.output, text
    folder = encode(setup, "vit_parts/", "--features", "vit", "--out-dtype", "float32",
                    "--part-images", "2")
    result = runner.invoke(app, ["inspect", str(folder), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert (data["rows"], data["files"], data["width"], data["dtype"]) == (
        len(SPECS) + 1, 3, cfg.dim, "float32")
    assert data["metadata"]["features"] == "vit"
    missing = runner.invoke(app, ["inspect", str(folder / "nope.parquet")])
    assert missing.exit_code == 2 and "no such file" in missing.output


def test_error_grouping():
    assert error_group("OSError: cannot open '/a/b.png'") == error_group("OSError: cannot open '/c.png'")
    assert error_group("x") == "x"


def test_datasets_loads_a_folder_holding_a_part_of_no_rows(setup, tmp_path):
    """A ``--shard-output`` rank whose share of a part is empty writes a part file of no
    rows: it has no row group, which ``datasets`` (sizing its batches by the first group's
    rows) would refuse, so the glob of the parts loads."""
    datasets = pytest.importorskip("datasets")
    from dsv4enc.output.parts import write_part

    folder = encode(setup, "hf_empty_part/", "--part-images", "2")
    table = pq.read_table(output_files(folder)[0])
    write_part(folder, "part-000009-rank001", table.slice(0, 0), 4, 9, 9, "none")
    assert pq.ParquetFile(folder / "part-000009-rank001.parquet").metadata.num_rows == 0
    ds = datasets.load_dataset("parquet", data_files=f"{folder}/*.parquet", split="train",
                               cache_dir=str(tmp_path / "hf-cache"))
    assert sorted(ds["path"]) == sorted(p for p, _, _ in read_embeddings(folder,
                                                                          errors="include"))
