"""The batch function for pipelines (``dsv4enc.batch.BatchEncoder``): the command line's rows
and schema for every kind of batch, error rows instead of exceptions, batch-invariant bytes,
and Hugging Face ``datasets.map(batched=True)`` with the output's ``features``."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image
from typer.testing import CliRunner

from dsv4enc import BatchEncoder
from dsv4enc.batch import OUTPUT_COLUMNS, datasets_features
from dsv4enc.cli import app

from helpers import write_image

runner = CliRunner()
SPECS = [("a.jpg", (64, 48), "RGB"), ("b.png", (30, 90), "RGBA"), ("c.png", (120, 12), "L"),
         ("d/e.gif", (50, 50), "P"), ("d/f.bmp", (17, 33), "RGB"), ("g.png", (40, 30), "I;16")]
BROKEN = {"d/broken.png": b"\x89PNG\r\n\x1a\n broken", "h/cut.jpg": None, "i/text.jpg": b"hello"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """Images of varied kinds, plus files that are not images though named as ones."""
    root = tmp_path_factory.mktemp("batch") / "images"
    for rel, size, mode in SPECS:
        write_image(root / rel, size, mode)
    for rel, data in BROKEN.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        if data is None:  # a JPEG cut in its data
            data = (root / "a.jpg").read_bytes()[:300]
        (root / rel).write_bytes(data)
    return root


@pytest.fixture(scope="module")
def rel_paths(folder) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def cli_table(folder, small_ckpt, tmp_path_factory) -> pa.Table:
    """What ``dsv4enc encode`` writes for the folder (CPU, float32 compute, float16 rows)."""
    out = tmp_path_factory.mktemp("batch_cli") / "emb.parquet"
    result = runner.invoke(app, ["encode", str(folder), "--out", str(out), "--weights",
                                 str(small_ckpt), "--workers", "0", "--device", "cpu",
                                 "--dtype", "float32", "-q"])
    assert result.exit_code == 0, result.output
    return pq.read_table(out)


@pytest.fixture(scope="module")
def embed(small_ckpt) -> BatchEncoder:
    """The command line's rows only (its other columns would be kept: ``keep_columns``)."""
    return BatchEncoder(small_ckpt, device="cpu", dtype="float32", key_column="key",
                        keep_columns=False)


@pytest.fixture(scope="module")
def keeping(small_ckpt) -> BatchEncoder:
    """The defaults: the batch's other columns pass through; ``id`` keys the rows."""
    return BatchEncoder(small_ckpt, device="cpu", dtype="float32", key_column="id")


def types(schema: pa.Schema) -> list[tuple[str, pa.DataType]]:
    """Names and types (a DataFrame cannot say that ``path`` is never null)."""
    return [(f.name, f.type) for f in schema]


def batch_of(folder: Path, rel_paths: list[str]) -> pa.Table:
    return pa.table({"image": [str(folder / r) for r in rel_paths], "key": rel_paths})


def test_rows_and_schema_are_the_command_lines(embed, folder, rel_paths, cli_table):
    out = embed(batch_of(folder, rel_paths))
    assert isinstance(out, pa.Table)
    assert out.schema.names == list(OUTPUT_COLUMNS)
    assert out.schema.equals(cli_table.schema, check_metadata=False)
    ours = json.loads(out.schema.metadata[b"dsv4enc"])
    theirs = json.loads(cli_table.schema.metadata[b"dsv4enc"])
    theirs.pop("part_images")  # how the command cut its parts
    assert ours == theirs
    # every row, error rows too, byte for byte (float16 cells, the same error texts)
    assert out.to_pylist() == cli_table.to_pylist()
    errors = {r["path"]: r["error"] for r in out.to_pylist() if r["error"]}
    assert set(errors) == set(BROKEN)


def test_every_kind_of_batch_gives_the_same_rows(embed, folder, rel_paths):
    table = batch_of(folder, rel_paths)
    expected = embed(table).to_pylist()
    # a RecordBatch gives a RecordBatch
    record = embed(table.to_batches()[0])
    assert isinstance(record, pa.RecordBatch) and record.to_pylist() == expected
    # pandas: a DataFrame whose Arrow-backed columns keep the schema's types
    frame = embed(table.to_pandas())
    assert isinstance(frame, pd.DataFrame) and list(frame.columns) == list(OUTPUT_COLUMNS)
    back = pa.Table.from_pandas(frame, preserve_index=False)
    assert types(back.schema) == types(embed.schema)
    assert back.to_pylist() == expected
    # a dict of numpy arrays (Ray's "numpy" batch format): numpy arrays back
    arrays = embed({"image": np.array(table["image"].to_pylist(), dtype=object),
                    "key": np.array(rel_paths)})
    assert set(arrays) == set(OUTPUT_COLUMNS)
    assert all(isinstance(v, np.ndarray) for v in arrays.values())
    assert [dict(zip(arrays, values)) for values in zip(*arrays.values())] == expected
    # a dict of lists (datasets.map(batched=True)): lists back
    lists = embed({"image": table["image"].to_pylist(), "key": rel_paths})
    assert all(isinstance(v, list) for v in lists.values())
    assert pa.Table.from_pydict(lists, schema=embed.schema).to_pylist() == expected


def test_every_kind_of_image_cell(embed, folder):
    path = folder / "a.jpg"
    data = path.read_bytes()
    image = Image.open(path)
    cells = [str(path), path, data, {"bytes": data, "path": "x/a.jpg"},
             {"bytes": None, "path": str(path)}, image, np.asarray(image.convert("RGB"))]
    rows = BatchEncoder.rows(embed, cells)
    reference = rows[0].embedding
    for row in rows:
        assert row.error is None and (row.width, row.height) == (64, 48)
        np.testing.assert_array_equal(row.embedding, reference)
    assert [r.path for r in rows][:5] == [str(path), str(path), "#2", "x/a.jpg", str(path)]
    bad = BatchEncoder.rows(embed, [None, {"bytes": None, "path": None}, 3.5,
                                    np.zeros((4, 4), np.float32), b"nothing"])
    assert [r.error.split(":")[0] for r in bad] == [
        "ValueError", "ValueError", "TypeError", "ValueError", "UnidentifiedImageError"]
    assert all(r.embedding is None and r.vit_h is None for r in bad)


def test_a_file_url_is_read_as_its_local_path(embed, folder):
    """A ``file://`` path (a cell or a dict's) is its local file, keyed as given."""
    url = f"file://{folder / 'a.jpg'}"
    rows = BatchEncoder.rows(embed, [url, {"bytes": None, "path": url}, str(folder / "a.jpg")])
    assert [(r.path, r.error) for r in rows] == [(url, None), (url, None),
                                                 (str(folder / "a.jpg"), None)]
    np.testing.assert_array_equal(rows[0].embedding, rows[2].embedding)
    np.testing.assert_array_equal(rows[1].embedding, rows[2].embedding)


def test_a_pandas_batchs_missing_cells_are_nulls(embed, folder):
    """pandas stores a null string as NaN: a missing image is the null image's error row,
    and a missing key falls back to the path, as in the same batch as Arrow."""
    image = Image.open(folder / "a.jpg")
    table = pa.table({"image": [str(folder / "a.jpg"), None, str(folder / "b.png")],
                      "key": ["a", "x", None]})
    expected = embed(table).to_pylist()
    assert expected[1]["error"] == "ValueError: row has no image (null 'image')"
    assert expected[2]["path"] == str(folder / "b.png")
    frame = embed(table.to_pandas())
    assert pa.Table.from_pandas(frame, preserve_index=False).to_pylist() == expected
    objects = pd.DataFrame({"image": [image, np.asarray(image), None], "key": ["p", "q", "r"]})
    assert embed(objects)["error"].isna().tolist() == [True, True, False]


def test_an_empty_path_is_a_row_with_no_image(embed, folder):
    """An empty path cell (or a dict whose path is empty) names no file: the row has no
    image, as a dict holding neither bytes nor a path, not a missing file called ''."""
    table = pa.table({"image": ["", str(folder / "a.jpg")], "key": ["e", "a"]})
    rows = embed(table).to_pylist()
    assert rows[0]["error"] == "ValueError: row has no image ('image' holds neither bytes " \
        "nor a path)"
    assert rows[1]["error"] is None
    dicts = embed({"image": [{"bytes": None, "path": ""}], "key": ["d"]})
    assert list(dicts["error"]) == [rows[0]["error"]]


def test_a_nan_key_in_a_numpy_batch_is_a_null(embed, folder):
    """Ray's numpy batches hold a float (or int) key column's nulls as NaN: such a row is
    keyed by its image's path, as in the same batch as Arrow or pandas, not by "nan"."""
    table = pa.table({"image": [str(folder / "a.jpg"), str(folder / "b.png")],
                      "key": pa.array([1.5, None], pa.float64())})
    expected = embed(table).to_pylist()
    assert [r["path"] for r in expected] == ["1.5", str(folder / "b.png")]
    arrays = embed({"image": np.array(table["image"].to_pylist(), dtype=object),
                    "key": table["key"].to_numpy(zero_copy_only=False)})
    assert list(arrays["path"]) == [r["path"] for r in expected]
    lists = embed({"image": table["image"].to_pylist(), "key": [1.5, np.float32("nan")]})
    assert lists["path"] == [r["path"] for r in expected]


def test_an_integer_key_with_nulls_is_its_integers_text(embed, folder):
    """pandas' nullable integer columns ("Int64", "UInt8", Arrow-backed "int64[pyarrow]") and
    their object arrays key a row "1", as the same batch as an Arrow int64 column, with their
    nulls null. A float64 column keys "1.0", as an Arrow float64 column and ``encode
    --key-column`` do: a float64 that pandas made of an integer column with nulls is not told
    from one that was float64 all along."""
    image = str(folder / "a.jpg")
    images = [image, str(folder / "b.png"), image]
    arrow = embed(pa.table({"image": images, "key": pa.array([1, None, 3], pa.int64())}))
    assert arrow["path"].to_pylist() == ["1", images[1], "3"]
    for dtype in ("Int64", "UInt8", "int64[pyarrow]"):
        keys = pd.array([1, None, 3], dtype=dtype)
        frame = embed(pd.DataFrame({"image": images, "key": keys}))
        assert list(frame["path"]) == ["1", images[1], "3"], dtype
        arrays = embed({"image": np.array(images, dtype=object),
                        "key": keys.to_numpy(dtype=object)})
        assert list(arrays["path"]) == ["1", images[1], "3"], dtype
    floats = pa.table({"image": images, "key": pa.array([1.0, None, 3.0], pa.float64())})
    assert embed(floats)["path"].to_pylist() == ["1.0", images[1], "3.0"]
    assert list(embed(floats.to_pandas())["path"]) == ["1.0", images[1], "3.0"]


def test_a_binary_key_that_is_not_utf8_is_escaped_as_the_command_line_does(embed, folder):
    """A binary key cell whose bytes are not UTF-8 is written as ``\\xNN`` escapes, as
    ``dsv4enc encode --key-column`` writes it (docs/inputs.md), not as U+FFFD, which loses
    the byte and makes two such keys one."""
    image = str(folder / "a.jpg")
    table = pa.table({"image": [image] * 3, "key": pa.array([b"caf\xe9", b"caf\xe8", b"ok"])})
    assert embed(table)["path"].to_pylist() == ["caf\\xe9", "caf\\xe8", "ok"]
    lists = embed({"image": [image] * 3, "key": table["key"].to_pylist()})
    assert lists["path"] == ["caf\\xe9", "caf\\xe8", "ok"]


def test_string_cells_that_are_not_utf8_are_read_as_the_command_reads_them(keeping, folder,
                                                                         tmp_path):
    """Arrow's and Parquet's writers do not check a string cell's UTF-8: a key, a path or a
    {bytes, path} struct's path that is not UTF-8 is read as the command reads a table's
    (``sources.unchecked_values``): a path names the file of its bytes, a key is written
    ``\\xNN`` (docs/inputs.md), and a kept column passes through; never a UnicodeDecodeError
    that fails the whole batch (a Ray block, a ``datasets.map``)."""
    def unchecked(*cells: bytes) -> pa.Array:  # as another writer may leave them
        return pa.array(cells, pa.binary()).cast(pa.string(), safe=False)

    named = os.fsencode(tmp_path) + b"/\xff.jpg"
    Path(os.fsdecode(named)).write_bytes((folder / "a.jpg").read_bytes())
    data = (folder / "a.jpg").read_bytes()
    struct = pa.StructArray.from_arrays([pa.array([None, data]), unchecked(named, b"x\xfe.jpg")],
                                        ["bytes", "path"])
    batch = pa.table({"image": unchecked(named, b"\xfe.jpg"), "id": unchecked(b"k\xff", b"k2"),
                      "caption": unchecked(b"c\xff", b"fine")})
    escaped = os.fsdecode(named).encode("utf-8", "surrogateescape").decode("utf-8",
                                                                            "backslashreplace")
    for table in (batch, batch.set_column(0, "image", struct)):
        for given in (table, table.to_batches()[0]):
            for out in (keeping(given), keeping.table(given)):
                for name in ("id", "caption"):  # as they came, bytes for bytes
                    assert out[name].cast(pa.binary()).to_pylist() == \
                        given[name].cast(pa.binary()).to_pylist()
                assert out["path"].to_pylist() == ["k\\xff", "k2"]
                assert out["error"][0].as_py() is None
    keyless = BatchEncoder(keeping._recipe["weights"], device="cpu", dtype="float32")
    assert keyless(batch)["path"].to_pylist() == [escaped, "\\xfe.jpg"]
    assert keyless(batch.set_column(0, "image", struct))["path"].to_pylist() == [
        escaped, "x\\xfe.jpg"]
    assert keyless(batch.set_column(0, "image", batch["image"].dictionary_encode()))[
        "error"][0].as_py() is None


def test_an_arrow_backed_pandas_batch_with_cells_not_utf8(keeping, folder):
    """A DataFrame of Arrow-backed columns (``pd.read_parquet(..., dtype_backend="pyarrow")``,
    or BatchEncoder's own pandas rows) holds a string cell that is not UTF-8 as it was
    written: its rows are those of the same batch as a pyarrow Table, not an ArrowException
    ('Wrapping ... failed') that fails the whole batch."""
    def unchecked(*cells: bytes) -> pa.Array:
        return pa.array(cells, pa.binary()).cast(pa.string(), safe=False)

    table = pa.table({"image": [str(folder / "a.jpg"), None], "id": unchecked(b"k\xff", b"k2"),
                      "caption": unchecked(b"c\xff", b"fine")})
    frame = keeping(table.to_pandas(types_mapper=pd.ArrowDtype))
    rows = pa.Table.from_pandas(frame, preserve_index=False).select(OUTPUT_COLUMNS)
    assert rows.to_pylist() == keeping(table).select(OUTPUT_COLUMNS).to_pylist()
    assert rows["path"].to_pylist() == ["k\\xff", "k2"]


def test_a_nan_image_in_a_numpy_or_list_batch_is_a_null(embed, folder):
    """A missing image that a numpy or list batch holds as NaN (a DataFrame column made numpy)
    is the null image's error row, as in the same batch as pandas or Arrow, not 'unsupported
    input float'."""
    image = str(folder / "a.jpg")
    expected = embed(pa.table({"image": [image, None], "key": ["a", "b"]}))["error"].to_pylist()
    assert expected[1] == "ValueError: row has no image (null 'image')"
    arrays = embed({"image": np.array([image, np.nan], dtype=object), "key": np.array(["a", "b"])})
    assert list(arrays["error"]) == expected
    assert embed({"image": [image, float("nan")], "key": ["a", "b"]})["error"] == expected


def test_pandas_na_in_a_numpy_batch_is_a_null(embed, folder):
    """A DataFrame's nullable columns ("string", "Int64") made numpy hold their nulls as
    ``pandas.NA``: such a key or image is a null, the rows those of the same DataFrame, not a
    TypeError ('boolean value of NA is ambiguous') that fails the whole batch."""
    frame = pd.DataFrame({"image": pd.array([str(folder / "a.jpg"), None, str(folder / "b.png")],
                                            dtype="string"),
                          "key": pd.array(["a", "b", None], dtype="string")})
    expected = pa.Table.from_pandas(embed(frame), preserve_index=False).to_pylist()
    assert [r["path"] for r in expected] == ["a", "b", str(folder / "b.png")]
    arrays = embed({name: frame[name].to_numpy() for name in frame})
    assert [dict(zip(arrays, values)) for values in zip(*arrays.values())] == expected


def test_all_null_columns_keep_their_types(embed, folder):
    """A batch of good images only (error all null), and one of bad images only (embedding
    all null): the same schema, for every kind of batch."""
    good = embed(batch_of(folder, ["a.jpg"]))
    bad = embed(batch_of(folder, ["i/text.jpg"]))
    assert good.schema == bad.schema == embed.schema
    assert good["error"].null_count == 1 and bad["embedding"].null_count == 1
    for frame in (embed(batch_of(folder, ["i/text.jpg"]).to_pandas()),
                  embed(batch_of(folder, ["a.jpg"]).to_pandas())):
        assert types(pa.Table.from_pandas(frame, preserve_index=False).schema) == types(
            embed.schema)
    empty = embed(batch_of(folder, []))
    assert empty.num_rows == 0 and empty.schema == embed.schema


def test_rows_are_batch_invariant(embed, folder, rel_paths):
    """The same image gives the same bytes alone, in any company, at any position, and with
    any batch_tokens."""
    table = batch_of(folder, rel_paths)
    together = {r["path"]: r for r in embed(table).to_pylist()}
    reversed_rows = {r["path"]: r for r in embed(table.take(list(range(len(rel_paths)))[::-1]))
                     .to_pylist()}
    assert reversed_rows == together
    small = BatchEncoder(embed._recipe["weights"], device="cpu", dtype="float32",
                         key_column="key", batch_tokens=16, max_images=2, keep_columns=False)
    for rel in rel_paths:
        alone = embed(batch_of(folder, [rel])).to_pylist()[0]
        assert alone == together[rel]
        assert small(batch_of(folder, [rel, "a.jpg", rel])).to_pylist()[0] == together[rel]


def test_missing_column_is_a_clear_error(embed):
    with pytest.raises(KeyError, match="no column 'image'"):
        embed(pa.table({"img": ["x.jpg"]}))
    with pytest.raises(TypeError, match="a batch is"):
        embed(["x.jpg"])


def test_weights_and_a_config_together_are_refused(small_ckpt, monkeypatch):
    """A checkpoint has its own config.json: ``config=`` beside weights (given, or from
    ``DSV4ENC_WEIGHTS``) would be ignored, so it is refused as the command line refuses
    ``--config`` without ``--random-init``, before any weights are loaded."""
    tiny = Path(__file__).resolve().parents[1] / "configs" / "tiny.json"
    with pytest.raises(ValueError, match=r"weights or config= \(random weights\), not both"):
        BatchEncoder(small_ckpt, config=tiny)
    monkeypatch.setenv("DSV4ENC_WEIGHTS", str(small_ckpt))
    assert BatchEncoder(config=tiny, device="cpu").encoder.checkpoint.source != str(small_ckpt)


def test_one_example_instead_of_a_batch_is_refused(embed, folder):
    """``datasets.map`` without ``batched=True`` hands over one example, a path or bytes per
    column: it is refused naming the cause, not read as a batch of its characters or bytes
    (error rows keyed '/', 't', ... in a list per example)."""
    for cell in (str(folder / "a.jpg"), (folder / "a.jpg").read_bytes(),
                 {"bytes": None, "path": str(folder / "a.jpg")}, Image.open(folder / "a.jpg")):
        with pytest.raises(TypeError, match=r"batched=True"):
            embed({"image": cell, "key": "a"})
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"image": [str(folder / "a.jpg")], "key": ["a"]})
    with pytest.raises(TypeError, match=r"column '(image|key)' holds one str, not a column"):
        ds.map(embed)


def test_no_image_column_is_refused_at_construction(small_ckpt):
    """A batch function without an image column refuses as it is built, in one line, not at
    each batch with pandas' or pyarrow's own error about a None column name."""
    with pytest.raises(ValueError, match="image_column must name the batch's image column"):
        BatchEncoder(small_ckpt, image_column=None)


def test_keep_columns_that_is_no_flag_is_refused_at_construction(small_ckpt):
    """``keep_columns="no"`` (text from a config, truthy) is refused naming the option, as
    the encoder's flags are, not taken as keeping every column."""
    with pytest.raises(ValueError, match="keep_columns must be True or False, got 'no'"):
        BatchEncoder(small_ckpt, keep_columns="no")


def test_pickles_as_its_recipe(embed, folder):
    data = pickle.dumps(embed)
    assert len(data) < 4096  # the recipe, not the tensors
    again = pickle.loads(data)
    batch = batch_of(folder, ["a.jpg", "i/text.jpg"])
    assert again(batch).to_pylist() == embed(batch).to_pylist()


def test_options_pool_vit_nested_float32(small_ckpt, folder, tmp_path):
    """Other settings give the command line's rows for the same options too."""
    args = ["--pool", "mean", "--features", "vit", "--layout", "nested", "--out-dtype", "float32"]
    out = tmp_path / "emb.parquet"
    result = runner.invoke(app, ["encode", str(folder / "a.jpg"), str(folder / "i/text.jpg"),
                                 "--out", str(out), "--weights", str(small_ckpt), "--workers",
                                 "0", "--device", "cpu", "--dtype", "float32", "-q", *args])
    assert result.exit_code == 0, result.output
    cli = pq.read_table(out)
    embed = BatchEncoder(small_ckpt, device="cpu", dtype="float32", pool="mean",
                         features="vit", layout="nested", out_dtype="float32")
    rows = embed(pa.table({"image": [str(folder / "a.jpg"), str(folder / "i/text.jpg")]}))
    assert rows.schema.equals(cli.schema, check_metadata=False)
    assert rows.to_pylist() == cli.to_pylist()


def test_a_decoded_datasets_column_turns_by_exif_and_decode_false_does_not(embed, tmp_path):
    """Why docs/api.md casts an ``Image`` column to ``Image(decode=False)``, besides bad
    images: ``datasets`` applies the EXIF orientation where it decodes, the command does not."""
    datasets = pytest.importorskip("datasets")
    exif = Image.Exif()
    exif[0x0112] = 6  # stored 100x60, shown turned: 60x100
    path = tmp_path / "turned.jpg"
    Image.new("RGB", (100, 60), (10, 200, 30)).save(path, exif=exif.tobytes())
    ds = datasets.Dataset.from_dict({"image": [str(path)]}).cast_column("image", datasets.Image())
    sizes = [(r.width, r.height) for r in embed.rows([ds[0]["image"]])]
    raw = ds.cast_column("image", datasets.Image(decode=False))
    sizes += [(r.width, r.height) for r in embed.rows([raw[0]["image"], str(path)])]
    assert sizes == [(60, 100), (100, 60), (100, 60)]

def test_datasets_map_batched_with_features(embed, folder, rel_paths):
    """The user's case from the issue: a batched map over a folder holding bad images."""
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"image": [str(folder / r) for r in rel_paths],
                                     "key": rel_paths})
    features = datasets_features(embed)
    assert features == embed.features()
    # one bad image per batch, and a batch of bad images only
    out = ds.map(embed, batched=True, batch_size=2, features=features,
                 remove_columns=ds.column_names)
    assert out.features == features
    expected = embed(batch_of(folder, rel_paths)).to_pylist()
    assert out.to_list() == expected
    assert out.data.table.schema.field("error").type == pa.string()
    assert out.data.table.schema.field("embedding").type == pa.large_binary()
    # Image(decode=False) columns arrive as {bytes, path} dicts
    cast = datasets.Dataset.from_dict({"image": [str(folder / r) for r in rel_paths]}).cast_column(
        "image", datasets.Image(decode=False))
    embed_dicts = BatchEncoder(embed._recipe["weights"], device="cpu", dtype="float32")
    rows = cast.map(embed_dicts, batched=True, batch_size=4, features=features,
                    remove_columns=["image"]).to_list()
    assert [r["error"] is None for r in rows] == [e["error"] is None for e in expected]
    good = [(r["embedding"], e["embedding"]) for r, e in zip(rows, expected) if r["embedding"]]
    assert good and all(a == b for a, b in good)


def captioned(folder: Path, rel_paths: list[str]) -> pa.Table:
    """A batch as a dataset builder has it: images, an int64 id, a caption, and a column
    named as an output column (``error``), which the output's replaces."""
    return pa.table({"image": [str(folder / r) for r in rel_paths],
                     "id": pa.array(range(100, 100 + len(rel_paths)), pa.int64()),
                     "caption": [f"a photo of {r}" for r in rel_paths],
                     "error": ["not ours"] * len(rel_paths)})


def test_other_columns_pass_through_with_their_types(keeping, embed, folder, rel_paths):
    """Every kind of batch gives its output columns (the command line's rows, keyed by the
    id's text) followed by its other columns as they came: the id keeps its int64 type."""
    batch = captioned(folder, rel_paths)
    ids, captions = batch["id"].to_pylist(), batch["caption"].to_pylist()
    expected = embed(batch_of(folder, rel_paths).set_column(1, "key", pa.array(map(str, ids))))
    names = [*OUTPUT_COLUMNS, "id", "caption"]

    out = keeping(batch)
    assert out.schema.names == names and out.schema.field("id").type == pa.int64()
    assert out.select(OUTPUT_COLUMNS).to_pylist() == expected.to_pylist()
    assert out["id"].to_pylist() == ids and out["caption"].to_pylist() == captions
    assert out.schema.metadata == expected.schema.metadata
    record = keeping(batch.to_batches()[0])
    assert isinstance(record, pa.RecordBatch) and record.to_pylist() == out.to_pylist()
    frame = keeping(batch.to_pandas())
    assert list(frame.columns) == names and str(frame["id"].dtype) == "int64"
    assert pa.Table.from_pandas(frame, preserve_index=False).to_pylist() == out.to_pylist()
    lists = keeping(batch.to_pydict())
    assert list(lists) == names and lists["id"] == ids and lists["caption"] == captions
    arrays = keeping({name: np.array(batch[name].to_pylist(), dtype=object if name == "image"
                                     else None) for name in batch.schema.names})
    assert list(arrays) == names and arrays["id"].dtype == np.int64
    # as one pyarrow Table whatever came in (RayEncoder's output)
    for kind in (batch, batch.to_pandas(), batch.to_pydict()):
        table = keeping.table(kind)
        assert table.schema.names == names and table.schema.field("id").type == pa.int64()
        assert table.to_pylist() == out.to_pylist()
    # keep_columns=False: the output columns only
    assert embed(batch.rename_columns(["image", "key", "caption", "error"])).schema.names == \
        list(OUTPUT_COLUMNS)


def test_datasets_map_keeps_the_datasets_columns(keeping, embed, folder, rel_paths):
    """The issue's case: a batched map without remove_columns, an int id column and a
    caption, features from datasets_features(embed, ds.features)."""
    datasets = pytest.importorskip("datasets")
    batch = captioned(folder, rel_paths).drop_columns(["error"])
    ds = datasets.Dataset(batch)
    out = ds.map(keeping, batched=True, batch_size=2,
                 features=datasets_features(keeping, ds.features))
    assert out.column_names == ["image", "id", "caption", *OUTPUT_COLUMNS]
    assert out.features["id"] == datasets.Value("int64")
    assert list(out["id"]) == batch["id"].to_pylist()
    assert list(out["caption"]) == batch["caption"].to_pylist()
    assert list(out["path"]) == [str(i) for i in batch["id"].to_pylist()]
    assert out.data.table.schema.field("embedding").type == pa.large_binary()
    # without the image bytes: the features of what the map keeps
    kept = ds.remove_columns("image")
    slim = ds.map(keeping, batched=True, batch_size=4, remove_columns=["image"],
                  features=datasets_features(keeping, kept.features))
    assert slim.column_names == ["id", "caption", *OUTPUT_COLUMNS]
    assert slim.select_columns(list(OUTPUT_COLUMNS)).to_list() == \
        out.select_columns(list(OUTPUT_COLUMNS)).to_list()


#: The issue's session: a map that fails after encoding a batch here (its features lack the
#: kept id column), then a num_proc=2 map, whose forked workers would wait for good in their
#: first parallel region had this process's OpenMP threads run (two of them, here); then a
#: plain fork whose child calls the parent's object.
FORK_AFTER_FAILED_MAP = """
import json, os, sys
import torch, datasets
from dsv4enc import BatchEncoder
from dsv4enc.batch import datasets_features

torch.set_num_threads(2)
ckpt, paths = sys.argv[1], sys.argv[2:]
embed = BatchEncoder(ckpt, device="cpu", dtype="float32", key_column="id")
ds = datasets.Dataset.from_dict({"image": paths, "id": list(range(len(paths)))})
try:
    ds.map(embed, batched=True, batch_size=2, features=datasets_features(embed))
except Exception:
    pass
else:
    sys.exit("the first map did not fail")
out = ds.map(embed, batched=True, batch_size=2, num_proc=2,
             features=datasets_features(embed, ds.features))
# and the object itself across a plain fork (not pickled): the child builds its own engine
child = os.fork()
if child == 0:
    rows = embed({"image": paths, "id": list(range(len(paths)))})
    os._exit(0 if embed.pid == os.getpid() and rows["path"] == list(out["path"]) else 3)
assert os.waitpid(child, 0)[1] == 0, "the forked child's rows differ"
print(json.dumps([[r["id"], r["path"], r["error"], r["embedding"] is None] for r in out]))
"""


@pytest.mark.slow
def test_a_num_proc_map_after_a_failed_map_finishes(small_ckpt, folder, rel_paths, embed,
                                                    tmp_path):
    pytest.importorskip("datasets")
    paths = [str(folder / r) for r in rel_paths]
    env = {**os.environ, "HF_DATASETS_CACHE": str(tmp_path / "cache")}
    proc = subprocess.Popen([sys.executable, "-c", FORK_AFTER_FAILED_MAP, str(small_ckpt),
                             *paths], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)
    try:  # a guard: hung workers fail the test (and are ended), not the suite
        stdout, stderr = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("the num_proc=2 map hung")
    assert proc.returncode == 0, stderr[-3000:]
    got = json.loads(stdout.strip().splitlines()[-1])
    expected = embed(pa.table({"image": paths, "key": [str(i) for i in range(len(paths))]}))
    assert got == [[i, r["path"], r["error"], r["embedding"] is None]
                   for i, r in enumerate(expected.to_pylist())]
