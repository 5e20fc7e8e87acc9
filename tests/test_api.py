"""The Python API: ``Encoder`` (golden-exact, packed, streaming, errors) and
``read_embeddings`` on what the command line writes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

import dsv4enc
from dsv4enc import BatchEncoder, EncodeError, Encoder, read_embeddings
from dsv4enc.errors import UsageError
from dsv4enc.tower.checkpoint import random_checkpoint
from dsv4enc.cli import app

from helpers import rel_err, write_image

runner = CliRunner()


@pytest.fixture(scope="module")
def encoder(small_ckpt) -> Encoder:
    return Encoder.from_pretrained(small_ckpt, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def pictures(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("api_images")
    specs = [("a.jpg", (64, 48), "RGB"), ("b.png", (30, 90), "RGBA"), ("c.png", (120, 12), "L"),
             ("d.gif", (50, 50), "P"), ("e.bmp", (17, 33), "RGB"), ("f.png", (40, 30), "I;16")]
    return [write_image(root / name, size, mode) for name, size, mode in specs]


# --------------------------------------------------------------------------- golden

def test_from_pretrained_matches_golden_for_images_and_paths(golden):
    """The acceptance check: PIL images and paths, float32 on the CPU, vs the float64 reference."""
    enc = Encoder.from_pretrained(golden.ckpt, device="cpu", dtype=torch.float32)
    inputs = []
    for i, case in enumerate(golden.cases):
        if i % 2:
            inputs.append(str(case.path))
        else:
            with Image.open(case.path) as image:
                image.load()
                inputs.append(image)
    outs = enc.encode(inputs)
    assert len(outs) == len(golden.cases)
    for case, out in zip(golden.cases, outs):
        ref = golden.tensors[f"{case.key}.aligner"]
        assert out.device.type == "cpu" and out.dtype == torch.float32
        assert out.shape == ref.shape, case.name
        assert rel_err(out, ref) < 1e-4, case.name
    # The packed engine ran: fewer forwards than images.
    assert enc.engines["aligner"].stats.batches < len(golden.cases)
    # ViT features from bytes and Path objects, per call.
    case = golden.cases[0]
    vit = enc.encode([case.path.read_bytes(), Path(case.path)], features="vit")
    for out in vit:
        assert rel_err(out, golden.tensors[f"{case.key}.vit"]) < 1e-4


# --------------------------------------------------------------------------- inputs

def test_all_input_kinds_agree(encoder, pictures):
    path = pictures[0]
    with Image.open(path) as image:
        array = np.asarray(image.convert("RGB"))
        pil = image.copy()
    data = path.read_bytes()
    outs = encoder.encode([pil, array, str(path), path, data, bytearray(data),
                           {"bytes": data, "path": None}, {"bytes": None, "path": str(path)}])
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    single = encoder.encode(str(path))  # one image in, one tensor out
    assert torch.equal(single, outs[0])


def test_a_path_whose_name_says_another_format_reads_as_its_bytes_do(encoder, pictures,
                                                                    tmp_path):
    """A JPEG named .png (and a PNG named .jpg) is read from its path as from its bytes;
    an empty file names itself; a format outside the six stays an error."""
    jpeg, png = pictures[0], pictures[1]
    renamed = [tmp_path / "jpeg.png", tmp_path / "png.jpg"]
    for source, target in zip((jpeg, png), renamed):
        target.write_bytes(source.read_bytes())
    outs = encoder.encode([str(renamed[0]), renamed[1], jpeg.read_bytes(), png.read_bytes()])
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[3])
    empty = tmp_path / "empty.jpg"
    empty.write_bytes(b"")
    with pytest.raises(EncodeError, match=r"empty file \(0 bytes\)"):
        encoder.encode([str(empty)])
    pcx = tmp_path / "pcx.png"
    with Image.open(jpeg) as image:
        image.save(pcx, format="PCX")
    with pytest.raises(EncodeError, match="looks like PCX"):
        encoder.encode([str(pcx)])


def test_arrays_of_other_shapes(encoder):
    rng = np.random.default_rng(0)
    gray = rng.integers(0, 256, (40, 30), dtype=np.uint8)
    outs = encoder.encode([gray, gray[:, :, None], np.repeat(gray[:, :, None], 3, axis=2),
                           rng.integers(0, 256, (20, 20, 4), dtype=np.uint8)])
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    with pytest.raises(EncodeError, match=r"image 1: .*dtype float64"):
        encoder.encode([gray, gray.astype(np.float64)])
    with pytest.raises(EncodeError, match=r"shape \(2, 3, 5\)"):
        encoder.encode([np.zeros((2, 3, 5), np.uint8)])


def test_a_1d_array_of_paths_or_objects_is_a_list_of_inputs(encoder, pictures):
    """A 1-D numpy array of paths, bytes or objects (a DataFrame column's ``.to_numpy()``, a
    numpy-formatted ``datasets`` batch) holds several inputs, as a list does: it is not one
    image (an image array is 2-D or 3-D), refused as 'array has dtype <U..'."""
    paths = [str(p) for p in pictures[:3]]
    expected = encoder.encode(paths)
    for given in (np.array(paths), np.array(paths, dtype=object),
                  np.array([p.read_bytes() for p in pictures[:3]], dtype=object)):
        outs = encoder.encode(given)
        assert len(outs) == 3 and all(torch.equal(a, b) for a, b in zip(outs, expected))
    assert [k for k, _ in encoder.encode_iter(np.array(paths))] == paths


def test_bad_inputs_raise_naming_the_item(encoder, pictures, tmp_path):
    junk = tmp_path / "junk.png"
    junk.write_bytes(b"not an image at all")
    with pytest.raises(EncodeError) as info:
        encoder.encode([str(pictures[0]), str(junk), str(pictures[1])])
    assert info.value.index == 1 and info.value.key == str(junk)
    assert "junk.png" in str(info.value) and "image 1" in str(info.value)
    with pytest.raises(EncodeError, match="image 0"):
        encoder.encode([b"\x89PNG broken"])
    with pytest.raises(EncodeError, match="not found|No such file"):
        encoder.encode([str(tmp_path / "missing.jpg")])
    with pytest.raises(TypeError, match=r"image 1: unsupported input int"):
        encoder.encode([str(pictures[0]), 42])
    for nothing in (None, 5):
        with pytest.raises(TypeError, match=f"expected images .*got {type(nothing).__name__}"):
            encoder.encode(nothing)
    with pytest.raises(EncodeError, match="not a regular file .a folder"):
        encoder.encode([str(tmp_path)])
    with pytest.raises(ValueError, match="features"):
        encoder.encode([str(pictures[0])], features="pixels")


def test_encode_iter_keys_errors_and_order(encoder, pictures):
    items = [str(pictures[0]), b"garbage", ("mine", pictures[1]), pictures[2],
             np.zeros((8, 8, 3), np.uint8)]
    got = list(encoder.encode_iter(items, batch_tokens=64))
    assert [k for k, _ in got] == [str(pictures[0]), 1, "mine", str(pictures[2]), 4]
    assert isinstance(got[1][1], str) and got[1][1].startswith("UnidentifiedImageError")
    plain = encoder.encode([pictures[0], pictures[1], pictures[2], items[4]])
    for (_, out), ref in zip([got[0], got[2], got[3], got[4]], plain):
        assert torch.equal(out, ref)  # other batches: rows are batch-invariant


def test_a_dicts_key_is_its_path_as_in_the_batch_function(encoder, pictures, small_ckpt):
    """One rule names an input, for the API and ``BatchEncoder``: a ``{bytes, path}`` dict by
    its path even when it holds bytes; an unnamed input by its position (the API's index,
    the batch function's ``#N``)."""
    from dsv4enc import BatchEncoder

    data = pictures[0].read_bytes()
    items = [{"bytes": data, "path": "x/a.jpg"}, {"bytes": None, "path": str(pictures[1])},
             data, {"bytes": data, "path": None}]
    keys = [k for k, _ in encoder.encode_iter(items)]
    assert keys == ["x/a.jpg", str(pictures[1]), 2, 3]
    embed = BatchEncoder(small_ckpt, device="cpu", dtype="float32")
    assert [r.path for r in embed.rows(items)] == ["x/a.jpg", str(pictures[1]), "#2", "#3"]


def test_encode_iter_streams_with_bounded_lookahead(encoder, pictures):
    consumed = []

    def source():
        for i in range(40):
            consumed.append(i)
            yield pictures[i % len(pictures)]

    stream = encoder.encode_iter(source(), batch_tokens=32)
    first = next(stream)
    assert first[0] == str(pictures[0])
    assert len(consumed) < 12, "encode_iter read far ahead of what it yielded"
    rest = list(stream)
    assert len(rest) == 39 and len(consumed) == 40


def test_a_long_run_of_unreadable_inputs_streams(encoder):
    """Error rows are yielded as they come, not held (and recounted at each input) until a
    good image arrives."""
    consumed = []

    def unreadable():
        for i in range(8 * encoder.max_images):
            consumed.append(i)
            yield b""

    stream = encoder.encode_iter(unreadable())
    assert next(stream)[1].startswith("UnidentifiedImageError")
    assert len(consumed) <= 2 * encoder.max_images


def test_batch_tokens_and_threads_do_not_change_results(small_ckpt, pictures):
    base = Encoder.from_pretrained(small_ckpt, device="cpu", dtype="float32")
    ref = base.encode(pictures * 2, batch_tokens=10_000)
    threaded = Encoder.from_pretrained(small_ckpt, device="cpu", dtype="float32",
                                       decode_threads=3, max_images=3)
    small = threaded.encode(pictures * 2, batch_tokens=20)
    for a, b in zip(ref, small):
        assert torch.equal(b, a)
    assert threaded.engines["aligner"].stats.batches > base.engines["aligner"].stats.batches


def test_a_bad_per_call_option_is_refused_not_replaced_by_the_default(encoder, pictures):
    """``batch_tokens=0`` or ``features=""`` in a call refuses, as in the constructor,
    instead of the encoder's own setting silently taking its place."""
    with pytest.raises(UsageError, match="batch_tokens must be positive, got 0"):
        encoder.encode(pictures[:1], batch_tokens=0)
    with pytest.raises(UsageError, match="batch_tokens must be a whole number, got 64.5"):
        list(encoder.encode_iter(pictures[:1], batch_tokens=64.5))
    with pytest.raises(UsageError, match="features must be one of"):
        list(encoder.encode_iter(pictures[:1], features=""))
    with pytest.raises(UsageError, match="pool must be one of"):
        encoder.encode(pictures[0], pool="")
    # grid_for and width too: an unknown word is no features of the vit's shape
    for call in (lambda: encoder.grid_for((40, 30), features="cls"),
                 lambda: encoder.width("cls"), lambda: encoder.width("")):
        with pytest.raises(UsageError, match="features must be one of"):
            call()


def test_pool_mean_and_out_dtype(small_ckpt, pictures, small_cfg):
    enc = Encoder.from_pretrained(small_ckpt, device="cpu", dtype=torch.float32,
                                  out_dtype="float16", pool="mean")
    pooled = enc.encode(pictures[:3])
    assert all(p.shape == (small_cfg.hidden_size,) and p.dtype == torch.float16 for p in pooled)
    full = enc.encode(pictures[:3], pool="none")
    for p, f in zip(pooled, full):
        assert f.dtype == torch.float16 and f.ndim == 2
        assert torch.equal(p, f.float().mean(0).half())
    # out_dtype is the Encoder's (as the README says), features and pool are per call too
    with pytest.raises(TypeError, match="out_dtype"):
        enc.encode(pictures[:1], out_dtype="float32")
    vit = enc.encode(pictures[:1], features="vit", pool="none")[0]
    assert vit.shape[1] == small_cfg.dim
    with Image.open(pictures[0]) as image:
        gh, gw = enc.grid_for(image.size)
        assert full[0].shape[0] == gh * gw
        vh, vw = enc.grid_for(image.size, features="vit")
    assert vit.shape[0] == vh * vw


def test_from_config_forms(small_cfg, tmp_path):
    path = tmp_path / "config.json"
    import json

    path.write_text(json.dumps(small_cfg.to_flat()))
    a = Encoder.from_config(small_cfg, seed=3, device="cpu", dtype=torch.float32)
    b = Encoder.from_config(str(path), seed=3, device="cpu", dtype="float32")
    c = Encoder.from_config(small_cfg.to_flat(), seed=4, device="cpu")
    assert a.fingerprint == b.fingerprint == random_checkpoint(small_cfg, 3).fingerprint
    assert c.fingerprint != a.fingerprint and c.dtype == torch.float32
    image = np.full((30, 30, 3), 90, np.uint8)
    assert torch.equal(a.encode(image), b.encode(image))
    with pytest.raises(ValueError, match="out_dtype"):
        Encoder.from_config(small_cfg, device="cpu", out_dtype="int8")


@pytest.mark.parametrize("option, message", [
    ({"max_pixels": 0}, "max_pixels must be positive, got 0"),
    ({"attention": "flsh"}, "unknown attention backend 'flsh'"),
    ({"cuda_graphs": True}, "CUDA graphs need a CUDA device"),
    # a number given as text (read from an environment variable, a config file)
    ({"max_pixels": "1000"}, "max_pixels must be a positive number, got '1000'"),
    ({"batch_tokens": "4096"}, "batch_tokens must be a positive number, got '4096'"),
    ({"decode_threads": "2"}, "decode_threads must be a whole number, got '2'"),
    # a count that is not whole, as the command line's int options refuse it
    ({"batch_tokens": 2.5}, "batch_tokens must be a whole number, got 2.5"),
    ({"max_images": 3.0}, "max_images must be a whole number, got 3.0"),
    ({"max_pixels": 1000.5}, "max_pixels must be a whole number, got 1000.5"),
    ({"batch_tokens": True}, "batch_tokens must be a whole number, got True"),
    ({"decode_threads": -1}, "decode_threads must be 0 or more, got -1"),
    # a flag given as text is no flag ("no" is truthy: it would turn the setting on)
    ({"deterministic": "no"}, "deterministic must be True or False, got 'no'"),
    ({"fused": "off"}, "fused must be True, False or None, got 'off'"),
    ({"cuda_graphs": "no"}, "cuda_graphs must be True, False or None, got 'no'"),
    ({"settings": {"batch_tokens": 64}}, "settings must be an EngineSettings, got a dict")])
def test_a_bad_option_refuses_at_construction(small_cfg, option, message):
    """In one line, before any image: a pipeline's stage fails as it is built, not each batch
    (nor every row an error row, as max_pixels=0 made them)."""
    with pytest.raises(UsageError, match=message) as refused:
        Encoder.from_config(small_cfg, device="cpu", **option)
    assert "\n" not in str(refused.value)
    with pytest.raises(UsageError, match=message):
        BatchEncoder(config=small_cfg.to_flat(), device="cpu", **option)


@pytest.mark.parametrize("seed, message", [
    (1.5, "seed must be a whole number, got 1.5"),
    (2 ** 70, "seed must be from -2\\*\\*63 to 2\\*\\*64-1 \\(what torch takes\\), got 1180"),
    ("3", "seed must be a whole number, got '3'")])
def test_a_seed_torch_cannot_take_refuses_in_one_line(small_cfg, seed, message):
    """``from_config(seed=)`` (and ``BatchEncoder(config=, seed=)``) takes the seeds that
    ``--seed`` takes, and refuses others naming the option, as ``--seed`` does: not torch's
    "manual_seed expected a long" or "Overflow when unpacking long long"."""
    with pytest.raises(UsageError, match=message) as refused:
        Encoder.from_config(small_cfg, seed=seed, device="cpu")
    assert "\n" not in str(refused.value)
    with pytest.raises(UsageError, match=message):
        BatchEncoder(config=small_cfg.to_flat(), seed=seed, device="cpu")


def test_package_import_is_light():
    code = ("import sys, dsv4enc; assert 'torch' not in sys.modules; "
            "assert callable(dsv4enc.read_embeddings); assert 'torch' not in sys.modules; "
            "print(dsv4enc.Encoder.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "Encoder"
    assert "Encoder" in dir(dsv4enc)


# --------------------------------------------------------------------------- with the CLI

def test_api_equals_cli_output_read_back_with_read_embeddings(small_ckpt, pictures, tmp_path):
    folder = pictures[0].parent
    out = tmp_path / "emb.parquet"
    (folder / "broken.jpg").write_bytes(b"broken")
    try:
        result = runner.invoke(app, ["encode", str(folder), "--out", str(out), "--weights",
                                     str(small_ckpt), "--workers", "0", "--device", "cpu", "-q"])
    finally:
        (folder / "broken.jpg").unlink()
    assert result.exit_code == 0, result.output
    enc = Encoder.from_pretrained(small_ckpt, device="cpu", dtype=torch.float32,
                                  out_dtype=torch.float16)
    rows = list(read_embeddings(out))
    assert [p for p, _, _ in rows] == sorted(p.name for p in pictures)  # error row skipped
    expected = dict(enc.encode_iter((p.name, p) for p in pictures))
    for path, emb, (gh, gw) in rows:
        assert isinstance(emb, np.ndarray) and emb.dtype == np.float16
        assert emb.shape == (gh * gw, enc.width())
        # The same float16 bytes: the command line batches differently, rows do not care.
        np.testing.assert_array_equal(emb, expected[path].numpy())
    with_errors = list(read_embeddings(out, errors="include"))
    assert len(with_errors) == len(pictures) + 1
    assert [(p, e, g) for p, e, g in with_errors if e is None] == [("broken.jpg", None, None)]
    records = list(read_embeddings(out, columns=["path", "error", "embedding"], errors="include"))
    assert records[0].keys() == {"path", "error", "embedding"}
    broken = [r for r in records if r["path"] == "broken.jpg"][0]
    assert broken["embedding"] is None and broken["error"]
    assert pq.read_metadata(out).num_rows == len(records)
    with pytest.raises(ValueError, match="errors"):
        next(read_embeddings(out, errors="raise"))


def test_stacked_batches_and_abandoned_streams(encoder, pictures):
    rng = np.random.default_rng(1)
    stack = rng.integers(0, 256, (3, 20, 30, 3), dtype=np.uint8)
    outs = encoder.encode(stack)
    assert len(outs) == 3 and torch.equal(outs[1], encoder.encode(stack[1]))
    reference = encoder.encode(pictures[:3])
    stream = encoder.encode_iter(pictures * 3, batch_tokens=16)
    next(stream)
    del stream  # abandoned mid-way: the next call must not see its leftovers
    again = encoder.encode(pictures[:3])
    for a, b in zip(reference, again):
        assert torch.equal(b, a)
