"""Hostile and broken inputs: every input file gets exactly one row (its embedding, or an
``error``), in input order, and the run exits 0.

One CLI run (in-process, one real decode worker) goes over a folder of broken, odd and
malicious files; further tests cover files that change between listing and decoding, the
decode pool's per-image time limit and crashed-worker replacement (driven directly), and a
hypothesis fuzz of the decode path plus one CLI run over fuzzed files.

The model is a random tiny tower saved as a real checkpoint, with a transform config that
keeps canvases small (at most 24 LLM tokens), so that every encode takes milliseconds.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import signal
import struct
import tempfile
import threading
import zlib
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings, strategies as st
from PIL import Image
from typer.testing import CliRunner

from dsv4enc import pipeline
from dsv4enc.checkpoint import random_state_dict, save_checkpoint
from dsv4enc.cli import app
from dsv4enc.config import VisionConfig
from dsv4enc.decode import DecodePool, decode_image, probe_image
from dsv4enc.pipeline import EncodeOptions, run_encode
from dsv4enc.transform import image_to_patches, plan_canvas

runner = CliRunner()
IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
MAX_PIXELS = 20_000  # the hostile run's --max-pixels: every honest image here is far smaller


# --------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def cfg(small_cfg) -> VisionConfig:
    return small_cfg


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, cfg) -> Path:
    folder = tmp_path_factory.mktemp("hostile_ckpt")
    save_checkpoint(folder, cfg, random_state_dict(cfg, seed=5))
    return folder


def noise(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def encoded(image: Image.Image, fmt: str, **params) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **params)
    return buffer.getvalue()


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_claiming(width: int, height: int) -> bytes:
    """A valid PNG signature and IHDR (right CRC) claiming ``width`` x ``height`` RGB pixels,
    followed by a few bytes of pixel data: opening it must never allocate the claimed size."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr)
            + png_chunk(b"IDAT", zlib.compress(b"\0" * 64)) + png_chunk(b"IEND", b""))


def idat_offset(data: bytes) -> tuple[int, int]:
    """(start of the first IDAT chunk's data, its length)."""
    at = data.find(b"IDAT")
    return at + 4, struct.unpack(">I", data[at - 4:at])[0]


def animated(fmt: str, path: Path) -> Path:
    frames = [noise(20, 16, seed) for seed in (1, 2, 3)]
    extra = {"lossless": True} if fmt == "WEBP" else {}
    frames[0].save(path, fmt, save_all=True, append_images=frames[1:], duration=50, loop=0,
                   **extra)
    with Image.open(path) as image:
        assert getattr(image, "n_frames", 1) == 3
    return path


def first_frame(path: Path, out: Path) -> Path:
    """The first frame of an animation as Pillow decodes it, saved alone (losslessly)."""
    with Image.open(path) as image:
        image.seek(0)
        image.load()
        frame = image.convert("RGBA" if image.mode in ("RGBA", "PA", "LA") else "RGB")
    frame.save(out)
    return out


# Expected outcome per key of the hostile tree: "ok" (an embedding), or a piece of the error.
EXPECT: dict[str, str] = {}
# Pillow formats dsv4enc never reads, saved under an accepted image name (EPS would go to
# Ghostscript; the others are rarely met and little hardened).
OTHER_FORMATS = [("SGI", "sgi.jpg"), ("PCX", "pcx.png"), ("DDS", "dds.png"), ("ICO", "ico.png"),
                 ("QOI", "qoi.webp"), ("JPEG2000", "j2k.jpg"), ("EPS", "eps.jpg"),
                 ("PPM", "ppm.tif"), ("PNG", "png.gif")]


@pytest.fixture(scope="module")
def hostile(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hostile")
    rng = np.random.default_rng(3)
    photo = noise(24, 18)
    png, jpeg = encoded(photo, "PNG"), encoded(photo, "JPEG", quality=90)

    def put(key: str, data: bytes, expect: str) -> None:
        path = root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        EXPECT[key] = expect

    put("base.png", png, "ok")
    put("base.jpg", jpeg, "ok")
    put("broken/empty.jpg", b"", "error")
    put("broken/empty.png", b"", "error")
    put("broken/text.png", b"this is not an image\n" * 20, "error")
    put("broken/random.jpg", rng.integers(0, 256, 3000, dtype=np.uint8).tobytes(), "error")
    put("broken/random.webp", b"RIFF" + rng.integers(0, 256, 500, dtype=np.uint8).tobytes(),
        "error")
    put("broken/truncated.jpg", jpeg[: len(jpeg) // 2], "error")
    put("broken/truncated.png", png[: len(png) // 2], "error")
    put("broken/header_only.png", png[:33], "error")
    start, length = idat_offset(png)
    bad_crc = bytearray(png)
    bad_crc[start + length] ^= 0xFF  # the IDAT CRC: Pillow does not check it, pixels are fine
    put("broken/idat_crc.png", bytes(bad_crc), "ok")
    bad_data = bytearray(png)
    for i in range(start + 4, start + 12):
        bad_data[i] ^= 0x5A  # the deflate stream itself
    put("broken/idat_data.png", bytes(bad_data), "error")
    bad_ihdr = bytearray(png)
    bad_ihdr[29] ^= 0xFF  # the IHDR CRC
    put("broken/ihdr_crc.png", bytes(bad_ihdr), "error")
    put("bomb/huge_header.png", png_claiming(100_000, 100_000), "max-pixels")
    put("bomb/over_limit.png", encoded(Image.new("RGB", (200, 200), (9, 9, 9)), "PNG"),
        "max-pixels")
    put("bomb/just_under.png", encoded(Image.new("RGB", (140, 140), (9, 9, 9)), "PNG"), "ok")
    put("odd/1x1.png", encoded(Image.new("RGB", (1, 1), (200, 10, 30)), "PNG"), "ok")
    # Only the format an extension stands for is read (``imageformats``): anything else
    # behind an image name is an error row that names what it looks like.
    put("odd/jpeg_named.png", jpeg, "looks like JPEG data (a .png name stands for PNG only)")
    for fmt, name in OTHER_FORMATS:
        put(f"formats/{name}", encoded(photo, fmt), f"looks like {fmt}")
    put("formats/tga.png", encoded(photo, "TGA"), "UnidentifiedImageError")  # no signature
    put("odd/wide 64x1.png", encoded(noise(64, 1), "PNG"), "ok")
    put("odd/tall.gif", encoded(noise(2, 60).quantize(8), "GIF"), "ok")
    # Every Pillow mode a file can hold.
    gray16 = Image.fromarray(rng.integers(0, 65536, (18, 24), dtype=np.uint16))
    put("modes/I16.png", encoded(gray16, "PNG"), "ok")
    int32 = Image.fromarray(rng.integers(-10, 70_000, (18, 24)).astype(np.int32), "I")
    put("modes/I.tif", encoded(int32, "TIFF"), "ok")
    floats = Image.fromarray(rng.normal(100, 80, (18, 24)).astype(np.float32), "F")
    put("modes/F.tif", encoded(floats, "TIFF"), "ok")
    for mode in ("1", "L", "LA", "RGBA", "P"):
        put(f"modes/{mode}.png", encoded(photo.convert(mode), "PNG"), "ok")
    put("modes/P_transparency.png",
        encoded(photo.quantize(16), "PNG", transparency=3), "ok")
    put("modes/CMYK.jpg", encoded(photo.convert("CMYK"), "JPEG"), "ok")
    put("modes/CMYK.tif", encoded(photo.convert("CMYK"), "TIFF"), "ok")
    put("modes/LAB.tif", encoded(photo.convert("LAB"), "TIFF"), "ok")
    # Animations: the first frame is encoded, as if it were saved alone.
    (root / "anim").mkdir()
    for fmt, ext in (("GIF", "gif"), ("WEBP", "webp"), ("PNG", "png")):
        path = animated(fmt, root / "anim" / f"moving.{ext}")
        first_frame(path, root / "anim" / f"moving.{ext}.first.png")
        EXPECT[f"anim/moving.{ext}"] = EXPECT[f"anim/moving.{ext}.first.png"] = "ok"
    # Names and links.
    put("names/日本 語 photo (1).png", png, "ok")
    put("names/with  two spaces .jpg", jpeg, "ok")
    put("names/x.jpg/inside.png", png, "ok")  # a folder named like an image is walked
    (root / "names" / "empty_dir.png").mkdir()  # ... and an empty one gives no row
    os.symlink("..", root / "names" / "loop")  # names/loop -> root: followed once only
    os.symlink("self.png", root / "names" / "self.png")  # a symlink to itself (ELOOP)
    EXPECT["names/self.png"] = "error"
    os.symlink("missing.png", root / "names" / "dangling.png")
    EXPECT["names/dangling.png"] = "error"
    (root / "names" / "notes.txt").write_text("not an image")
    return root


def encode(*args: str):
    return runner.invoke(app, ["encode", *args, "--device", "cpu", "-q"],
                         env={"DSV4ENC_WEIGHTS": None, "COLUMNS": "200"})


def walk_order(keys) -> list[str]:
    return sorted(keys, key=lambda k: k.split("/"))


@pytest.fixture(scope="module")
def hostile_run(tmp_path_factory, hostile, ckpt):
    """The hostile folder plus a FIFO (given in --files-from), encoded through one real
    decode worker, float32 output."""
    work = tmp_path_factory.mktemp("hostile_out")
    fifo = work / "pipe.png"
    os.mkfifo(fifo)
    listing = work / "list.txt"
    listing.write_text(f"{fifo}\n")
    out = work / "e.parquet"
    result = encode(str(hostile), "--files-from", str(listing), "--out", str(out), "--weights",
                    str(ckpt), "--workers", "1", "--decode-timeout", "30", "--max-pixels",
                    str(MAX_PIXELS), "--out-dtype", "float32", "--part-images", "7")
    assert result.exit_code == 0, result.output
    rows = pq.read_table(out).to_pylist()
    return {row["path"]: row for row in rows}, [row["path"] for row in rows], str(fifo)


# --------------------------------------------------------------------------- the hostile run

def test_one_row_per_file_in_walk_order(hostile_run):
    by_key, order, fifo = hostile_run
    assert order == walk_order(EXPECT) + [fifo]
    assert len(set(order)) == len(order)
    # Not images, empty folders named like images and the loop's repeat give no rows.
    assert not any(k.endswith((".txt", "empty_dir.png")) or "loop/" in k for k in order)


def test_each_file_gets_its_embedding_or_its_error(hostile_run, cfg):
    by_key, _, fifo = hostile_run
    for key, expect in EXPECT.items():
        row = by_key[key]
        if expect == "ok":
            assert row["error"] is None, (key, row["error"])
            emb = np.array(row["embedding"], dtype=np.float64)
            assert emb.shape == (row["grid_h"] * row["grid_w"], cfg.hidden_size), key
            assert np.isfinite(emb).all(), key
            canvas = plan_canvas(row["width"], row["height"], cfg)
            assert (row["vit_h"], row["vit_w"]) == (canvas.n_h, canvas.n_w), key
        else:
            assert row["embedding"] is None, key
            assert row["error"] and "\n" not in row["error"], key
            if expect != "error":
                assert expect in row["error"], (key, row["error"])
    assert "not a regular file" in by_key[fifo]["error"]


def test_header_bombs_are_refused_with_their_claimed_size(hostile_run):
    by_key, _, _ = hostile_run
    assert "10000000000" in by_key["bomb/huge_header.png"]["error"]
    assert by_key["bomb/huge_header.png"]["width"] is None
    assert "40000" in by_key["bomb/over_limit.png"]["error"]


def close(a, b) -> bool:
    a, b = np.array(a, dtype=np.float64), np.array(b, dtype=np.float64)
    return a.shape == b.shape and np.abs(a - b).max() <= 1e-4 * max(np.abs(b).max(), 1.0)


def test_animations_encode_their_first_frame(hostile_run):
    by_key, _, _ = hostile_run
    for ext in ("gif", "webp", "png"):
        moving, alone = by_key[f"anim/moving.{ext}"], by_key[f"anim/moving.{ext}.first.png"]
        assert (moving["width"], moving["height"]) == (20, 16)
        assert close(moving["embedding"], alone["embedding"]), ext


def test_same_pixels_give_the_same_embedding(hostile_run):
    by_key, _, _ = hostile_run
    base_png, base_jpg = by_key["base.png"]["embedding"], by_key["base.jpg"]["embedding"]
    for key in ("broken/idat_crc.png", "names/日本 語 photo (1).png", "names/x.jpg/inside.png"):
        assert close(by_key[key]["embedding"], base_png), key
    assert close(by_key["names/with  two spaces .jpg"]["embedding"], base_jpg)


def test_sixteen_bit_and_float_modes_are_scaled_not_garbage(hostile, cfg):
    """I;16 samples are scaled to 8 bits (>> 8) before the RGB conversion (SPEC §4)."""
    with Image.open(hostile / "modes" / "I16.png") as image:
        values = np.asarray(image).astype(np.int64)
        patches, _ = image_to_patches(image, cfg)
    eight = Image.fromarray((values >> 8).astype(np.uint8), "L").convert("RGB")
    expected, _ = image_to_patches(eight, cfg)
    assert patches.equal(expected)
    decoded = decode_image(str(hostile / "modes" / "I16.png"), cfg)
    assert np.array_equal(decoded.patches, expected.view(dtype=decoded_dtype()).numpy())


def decoded_dtype():
    import torch

    return torch.uint16 if hasattr(torch, "uint16") else torch.int16


def test_a_header_claiming_ten_billion_pixels_is_never_allocated(tmp_path, cfg):
    path = tmp_path / "huge.png"
    path.write_bytes(png_claiming(100_000, 100_000))
    probe = probe_image(str(path))  # the default limit
    assert probe.error and "max-pixels" in probe.error and probe.width is None
    assert "max-pixels" in decode_image(str(path), cfg).error


# --------------------------------------------------------------------------- image formats

def test_only_the_named_format_is_opened_by_probes_and_decodes(tmp_path, cfg):
    """A path, a tar member and unnamed bytes (a table cell): probes and decodes alike read
    only the format the name stands for; unnamed bytes may be any accepted format, no other."""
    import tarfile

    from dsv4enc.inputs import discover

    photo = noise(24, 18)
    shard = tmp_path / "s.tar"
    with tarfile.open(shard, "w") as archive:
        for name, data in [("a.png", encoded(photo, "PNG")), ("b.png", encoded(photo, "JPEG")),
                           ("c.jpg", encoded(photo, "PCX"))]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    members = discover([str(shard)]).items
    (tmp_path / "named.jpg").write_bytes(encoded(photo, "PNG"))
    for source, error in [(members[0], None), (members[1], "looks like JPEG"),
                          (members[2], "looks like PCX"), (encoded(photo, "BMP"), None),
                          (encoded(photo, "TIFF"), None), (encoded(photo, "SGI"), "like SGI"),
                          (encoded(photo, "EPS"), "like EPS"),
                          (str(tmp_path / "named.jpg"), "looks like PNG")]:
        for got in (probe_image(source).error, decode_image(source, cfg).error):
            if error is None:
                assert got is None, got
            else:
                assert got.startswith("UnidentifiedImageError") and error in got, got


def test_ghostscript_is_never_run(tmp_path, cfg, monkeypatch):
    """An EPS file behind a .jpg name (or as unnamed bytes) never reaches Ghostscript: a fake
    ``gs`` first in PATH would leave a mark."""
    from PIL import EpsImagePlugin

    mark = tmp_path / "gs_ran"
    fake = tmp_path / "bin" / "gs"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\ntouch {mark}\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(EpsImagePlugin, "gs_binary", None)  # look gs up again
    eps = encoded(noise(24, 18), "EPS")
    (tmp_path / "x.jpg").write_bytes(eps)
    for source in (str(tmp_path / "x.jpg"), eps):
        assert "EPS" in decode_image(source, cfg).error
        assert "EPS" in probe_image(source).error
    assert not mark.exists()
    with pytest.raises(Exception), Image.open(io.BytesIO(eps)) as image:
        image.load()  # the check works: plain Pillow does run the fake gs (which fails)
    assert mark.exists()


# --------------------------------------------------------------------------- unique keys

def test_two_folders_with_the_same_names_get_distinct_keys(tmp_path, ckpt):
    """More than one folder: each key starts with its folder as given; a key still taken
    (the same folder twice) gets a ``#2`` suffix. A rerun gives the same keys."""
    from dsv4enc.inputs import discover

    for folder, seed in (("train", 1), ("val", 2)):
        (tmp_path / folder / "cat").mkdir(parents=True)
        (tmp_path / folder / "cat" / "1.png").write_bytes(encoded(noise(20, 20, seed), "PNG"))
    roots = [str(tmp_path / "train") + "/", str(tmp_path / "val"), str(tmp_path / "val")]
    keys = [i.key for i in discover(roots).items]
    assert keys == [f"{tmp_path}/train/cat/1.png", f"{tmp_path}/val/cat/1.png",
                    f"{tmp_path}/val/cat/1.png#2"]
    assert [i.key for i in discover(roots).items] == keys
    assert [i.key for i in discover(roots[:1]).items] == ["cat/1.png"]  # one folder: as before
    out = tmp_path / "e.parquet"
    result = encode(*roots, "--out", str(out), "--weights", str(ckpt), "--workers", "0")
    assert result.exit_code == 0, result.output
    assert pq.read_table(out, columns=["path"]).column(0).to_pylist() == keys


def test_a_non_utf8_name_and_its_escaped_text_get_distinct_keys(tmp_path, ckpt):
    raw = os.fsencode(tmp_path) + b"/caf\xe9.png"
    try:
        os.close(os.open(raw, os.O_WRONLY | os.O_CREAT, 0o644))
    except OSError:
        pytest.skip("file system refuses non-UTF-8 names")
    Path(os.fsdecode(raw)).write_bytes(encoded(noise(20, 20, 1), "PNG"))
    (tmp_path / "caf\\xe9.png").write_bytes(encoded(noise(20, 20, 2), "PNG"))  # literally
    out = tmp_path / "e.parquet"
    result = encode(str(tmp_path), "--out", str(out), "--weights", str(ckpt), "--workers", "0")
    assert result.exit_code == 0, result.output
    rows = pq.read_table(out, columns=["path", "error"]).to_pylist()
    assert [r["path"] for r in rows] == ["caf\\xe9.png", "caf\\xe9.png#2"]
    assert [r["error"] for r in rows] == [None, None]


def test_resume_uses_the_same_unique_keys(tmp_path, ckpt, monkeypatch):
    """A run over two folders (one given twice: ``#2`` keys) stopped after its first part
    resumes with the same keys: that part is reused, the output has every key once."""
    from dsv4enc import output

    for folder in ("train", "val"):
        for i in range(2):
            path = tmp_path / folder / "cat" / f"{i}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(encoded(noise(20, 20, i + len(folder)), "PNG"))
    roots = [str(tmp_path / "train"), str(tmp_path / "val"), str(tmp_path / "val")]
    out = tmp_path / "e.parquet"
    opts = EncodeOptions(inputs=roots, out=str(out), weights=str(ckpt), device="cpu",
                         part_images=2, workers=0, progress=False)
    put = output.PartWriter.put
    calls = []

    def stop_at_the_second_part(self, *args):
        calls.append(args)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return put(self, *args)

    monkeypatch.setattr(output.PartWriter, "put", stop_at_the_second_part)
    with pytest.raises(KeyboardInterrupt):
        run_encode(opts)
    monkeypatch.setattr(output.PartWriter, "put", put)
    opts.resume = True
    summary = run_encode(opts)
    assert summary.reused == 2
    keys = [f"{tmp_path}/{folder}/cat/{i}.png{suffix}"
            for folder, suffix in (("train", ""), ("val", ""), ("val", "#2")) for i in range(2)]
    table = pq.read_table(out, columns=["path", "error"])
    assert table.column("path").to_pylist() == keys
    assert table.column("error").null_count == len(keys)


# --------------------------------------------------------------------------- files that change

def test_files_that_vanish_or_change_between_listing_and_decoding(tmp_path, ckpt, monkeypatch):
    """Deleted after listing, deleted or unreadable after the header was read, replaced by a
    FIFO after the header was read (the decode worker blocks in open(): the time limit
    frees it): each gets an error row, the others their embeddings."""
    folder = tmp_path / "in"
    photo = encoded(noise(30, 20), "PNG")
    names = ["a.png", "gone_early.png", "gone_late.png", "locked.png", "swapped.png", "z.png"]
    for name in names:
        (folder / name).parent.mkdir(exist_ok=True)
        (folder / name).write_bytes(photo)

    real_discover, real_headers = pipeline.discover, pipeline.read_headers

    def discover(*args, **kwargs):
        found = real_discover(*args, **kwargs)
        (folder / "gone_early.png").unlink()
        return found

    def read_headers(*args, **kwargs):
        planned = real_headers(*args, **kwargs)
        (folder / "gone_late.png").unlink()
        (folder / "locked.png").chmod(0)
        (folder / "swapped.png").unlink()
        os.mkfifo(folder / "swapped.png")
        return planned

    monkeypatch.setattr(pipeline, "discover", discover)
    monkeypatch.setattr(pipeline, "read_headers", read_headers)
    out = tmp_path / "e.parquet"
    summary = run_encode(EncodeOptions(inputs=[str(folder)], out=str(out), weights=str(ckpt),
                                       device="cpu", workers=1, decode_timeout=2.0,
                                       progress=False))
    rows = {r["path"]: r for r in pq.read_table(out).to_pylist()}
    assert list(rows) == names
    assert rows["a.png"]["error"] is None and rows["z.png"]["error"] is None
    assert "No such file" in rows["gone_early.png"]["error"]
    assert rows["gone_early.png"]["width"] is None
    assert "No such file" in rows["gone_late.png"]["error"]
    assert rows["gone_late.png"]["width"] == 30  # the header was read before it vanished
    assert "timed out" in rows["swapped.png"]["error"]
    if IS_ROOT:  # chmod does not stop root from reading
        assert rows["locked.png"]["error"] is None
    else:
        assert "Permission denied" in rows["locked.png"]["error"]
    assert summary.encoded + summary.failed == len(names)


@pytest.mark.skipif(IS_ROOT, reason="chmod 000 does not stop root from reading")
def test_unreadable_file_and_folder_at_listing(tmp_path, ckpt):
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.png").write_bytes(encoded(noise(30, 20), "PNG"))
    (folder / "locked.png").write_bytes(encoded(noise(30, 20), "PNG"))
    (folder / "locked.png").chmod(0)
    (folder / "closed").mkdir()
    (folder / "closed" / "hidden.png").write_bytes(encoded(noise(30, 20), "PNG"))
    (folder / "closed").chmod(0)
    try:
        out = tmp_path / "e.parquet"
        result = encode(str(folder), "--out", str(out), "--weights", str(ckpt), "--workers",
                        "0")
        assert result.exit_code == 0, result.output
        rows = {r["path"]: r for r in pq.read_table(out).to_pylist()}
        assert rows["a.png"]["error"] is None
        assert "Permission denied" in rows["locked.png"]["error"]
    finally:
        (folder / "closed").chmod(0o755)


# --------------------------------------------------------------------------- the decode pool

def good_images(folder: Path, count: int) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        path = folder / f"good{i}.png"
        noise(20 + i, 15, seed=i).save(path)
        paths.append(str(path))
    return paths


def same_decode(got, path: str, cfg) -> bool:
    want = decode_image(path, cfg)
    return got.error is None and np.array_equal(got.patches, want.patches) and \
        (got.n_h, got.n_w) == (want.n_h, want.n_w)


def test_decode_timeout_kills_and_replaces_a_hung_worker(tmp_path, cfg):
    """A FIFO blocks open() forever: that image times out, the worker is replaced, and the
    images around it decode normally and in order. The clock starts once a worker is up:
    a limit shorter than a worker's start-up (spawn + imports) must not fail every image."""
    good = good_images(tmp_path, 3)
    fifo = tmp_path / "hang.png"
    os.mkfifo(fifo)
    tasks = [("a", good[0]), ("hang", str(fifo)), ("b", good[1]), ("c", good[2])]
    with DecodePool(cfg, 1, timeout_s=2.0) as pool:
        results = list(pool.imap(tasks, window=4))
        assert pool.replaced == 1
    assert [tag for tag, _ in results] == ["a", "hang", "b", "c"]
    got = dict(results)
    assert got["hang"].error == "decode timed out after 2s" and got["hang"].patches is None
    for tag, path in zip("abc", good):
        assert same_decode(got[tag], path, cfg), (tag, got[tag].error)


def test_a_crashed_worker_is_replaced_and_only_its_image_fails(tmp_path, cfg):
    """The worker is killed (as the OOM killer would) while it holds an image: that image
    gets an error row naming the crash, a new worker takes the rest."""
    good = good_images(tmp_path, 2)
    fifo = tmp_path / "stuck.png"
    os.mkfifo(fifo)
    tasks = [("stuck", str(fifo)), ("a", good[0]), ("b", good[1])]
    with DecodePool(cfg, 1, timeout_s=60.0) as pool:
        victims = mp.active_children()
        assert len(victims) == 1
        killer = threading.Timer(1.0, os.kill, (victims[0].pid, signal.SIGKILL))
        killer.start()
        try:
            results = list(pool.imap(tasks, window=3))
        finally:
            killer.cancel()
        assert pool.replaced == 1
    got = dict(results)
    assert [tag for tag, _ in results] == ["stuck", "a", "b"]
    assert "crashed" in got["stuck"].error and "-9" in got["stuck"].error
    assert same_decode(got["a"], good[0], cfg) and same_decode(got["b"], good[1], cfg)


# --------------------------------------------------------------------------- fuzzing

def seed_files() -> list[bytes]:
    image = noise(21, 13, seed=9)
    return [encoded(image, "PNG"), encoded(image, "JPEG"), encoded(image.quantize(8), "GIF"),
            encoded(image, "WEBP"), encoded(image, "BMP"), encoded(image, "TIFF"),
            encoded(image.convert("L"), "PNG"), encoded(image, "JPEG", progressive=True)]


SEEDS = seed_files()
FUZZ_MAX_PIXELS = 1 << 16


def mutate(data: bytes, edits: list[tuple[int, int]], cut: int | None) -> bytes:
    buffer = bytearray(data)
    for position, value in edits:
        buffer[position % len(buffer)] = value
    return bytes(buffer[:cut] if cut is not None else buffer)


fuzzed_bytes = st.one_of(
    st.binary(max_size=600),
    st.builds(mutate, st.sampled_from(SEEDS),
              st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), max_size=12),
              st.one_of(st.none(), st.integers(0, 4000))),
)


def check_decode_contract(path: str, cfg: VisionConfig) -> None:
    probe = probe_image(path, FUZZ_MAX_PIXELS)
    decoded = decode_image(path, cfg, FUZZ_MAX_PIXELS)
    assert (probe.error is None) == (probe.width is not None)
    if decoded.error is None:
        assert probe.error is None, probe.error  # decodable implies a readable header
        assert (decoded.width, decoded.height) == (probe.width, probe.height)
        canvas = plan_canvas(probe.width, probe.height, cfg)
        assert (decoded.n_h, decoded.n_w) == (canvas.n_h, canvas.n_w)
        assert decoded.patches.shape == (canvas.n_h * canvas.n_w, 3 * cfg.patch_size ** 2)
    else:
        assert decoded.patches is None
        assert isinstance(decoded.error, str) and "\n" not in decoded.error


@settings(max_examples=40, deadline=None)
@given(data=fuzzed_bytes)
def test_fuzzed_bytes_never_crash_the_decode_path(cfg, data):
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "fuzz.png")
        with open(path, "wb") as handle:
            handle.write(data)
        check_decode_contract(path, cfg)


def test_cli_over_fuzzed_files_gives_one_row_each(tmp_path, ckpt):
    rng = np.random.default_rng(2024)
    folder = tmp_path / "fuzz"
    folder.mkdir()
    names = []
    for i in range(24):
        seed = SEEDS[i % len(SEEDS)]
        edits = [(int(rng.integers(0, len(seed))), int(rng.integers(0, 256)))
                 for _ in range(int(rng.integers(0, 10)))]
        cut = None if i % 3 else int(rng.integers(0, len(seed)))
        data = mutate(seed, edits, cut) if i % 8 != 7 else rng.bytes(int(rng.integers(0, 300)))
        name = f"f{i:02d}.{('png', 'jpg', 'gif', 'webp', 'bmp', 'tif')[i % 6]}"
        (folder / name).write_bytes(data)
        names.append(name)
    out = tmp_path / "e.parquet"
    result = encode(str(folder), "--out", str(out), "--weights", str(ckpt), "--workers", "0",
                    "--max-pixels", str(FUZZ_MAX_PIXELS))
    assert result.exit_code == 0, result.output
    rows = pq.read_table(out).to_pylist()
    assert [r["path"] for r in rows] == sorted(names)
    for row in rows:
        assert (row["error"] is None) != (row["embedding"] is None), row["path"]
