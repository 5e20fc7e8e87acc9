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
import json
import multiprocessing as mp
import os
import shutil
import signal
import struct
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import warnings
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings, strategies as st
from PIL import Image, TiffImagePlugin
from typer.testing import CliRunner

from dsv4enc.images import headers
from dsv4enc.run import setup as prefetch
from dsv4enc.tower.checkpoint import random_state_dict, save_checkpoint
from dsv4enc.cli import app
from dsv4enc.tower.config import VisionConfig
from dsv4enc.images.decode import DecodePool, Probe, decode_image, probe_image
from dsv4enc.images.discover import InputItem, discover
from dsv4enc.run.pipeline import EncodeOptions, run_encode
from dsv4enc.tower.transform import image_to_patches, plan_canvas

from helpers import REPO_ROOT, parts_of, processes_gone, table_rows

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
                 ("PPM", "ppm.tif")]
# Accepted formats under another accepted format's name: read as what they are.
MISNAMED = [("JPEG", "jpeg_named.png"), ("PNG", "png_named.jpg"), ("WEBP", "webp_named.jpeg"),
            ("BMP", "bmp_named.gif"), ("GIF", "gif_named.tif"), ("TIFF", "tiff_named.webp"),
            ("PNG", "png.gif")]


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
    put("broken/empty.jpg", b"", "UnidentifiedImageError: empty file (0 bytes)")
    put("broken/empty.png", b"", "UnidentifiedImageError: empty file (0 bytes)")
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
    # Any of the six accepted formats is read whatever the name (``imageformats``): anything
    # else behind an image name is an error row that names what it looks like.
    for fmt, name in MISNAMED:
        put(f"misnamed/{name}", encoded(photo.convert("RGB"), fmt), "ok")
    for fmt, name in OTHER_FORMATS:
        put(f"formats/{name}", encoded(photo, fmt), f"looks like {fmt}")
    # TGA has no signature at its start (a true-colour one's first bytes pass for a cursor's):
    # its footer names it.
    put("formats/tga.png", encoded(photo, "TGA"), "is a TGA (Truevision Targa) file, not the PNG")
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
    # Pillow warns as it decodes these, and their pixels are fine: a palette whose transparency
    # is given per entry (as pngquant writes it), and a TIFF tag with one value too many.
    put("modes/P_alpha_per_entry.png",
        encoded(photo.quantize(16), "PNG", transparency=bytes(range(0, 256, 16))), "ok")
    tags = TiffImagePlugin.ImageFileDirectory_v2()
    tags[296], tags.tagtype[296] = (2, 2), 3  # ResolutionUnit takes one value
    put("odd/tiff_tag_warning.tif", encoded(photo.convert("RGB"), "TIFF", tiffinfo=tags), "ok")
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
    rows = table_rows(pq.read_table(out))
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

def test_a_cut_short_webp_says_so_in_plain_words(tmp_path, cfg):
    """A WebP cut short (or damaged) is an error row that says so, whatever its name, not
    libwebp's "could not create decoder object"; other read errors keep their own type."""
    data = encoded(noise(80, 60), "WEBP")[:600]
    for name in ("cut.webp", "cut.jpg"):
        (tmp_path / name).write_bytes(data)
        for error in (probe_image(str(tmp_path / name)).error,
                      decode_image(str(tmp_path / name), cfg).error):
            assert error == "OSError: damaged or cut-short WebP data (libwebp cannot read it)"
    assert probe_image(str(tmp_path / "gone.webp")).error.startswith("FileNotFoundError")


def test_a_header_cut_short_names_its_format_not_an_unsupported_one(tmp_path):
    """A GIF, PNG or TIFF cut inside its header says it is damaged data of its format, not
    that only six formats are read (it is one of them); bytes of no format still say that."""
    for fmt, ext in (("GIF", "gif"), ("PNG", "png"), ("TIFF", "tif")):
        data = encoded(noise(80, 60), fmt)[:10]
        for name in (f"cut.{ext}", "cut.jpg"):
            (tmp_path / name).write_bytes(data)
            error = probe_image(str(tmp_path / name)).error
            assert error == (f"UnidentifiedImageError: cannot read the image: it starts as "
                             f"{fmt} data, but its header is damaged or cut short"), error
    (tmp_path / "text.png").write_bytes(b"hello world, no image")
    assert "only BMP, GIF, JPEG, PNG, TIFF, WEBP are read" in probe_image(
        str(tmp_path / "text.png")).error


def test_a_heic_photo_is_named_as_such_whatever_its_name(tmp_path, cfg):
    """An iPhone's HEIC photo (no format Pillow knows) saved as .jpg says what it is, as an
    AVIF does, rather than that the image cannot be identified; a video (MP4, the same
    ISO media boxes) is not taken for one."""
    heic = b"\0\0\0\x18ftypheic\0\0\0\0mif1heic" + bytes(300)
    (tmp_path / "IMG_0001.jpg").write_bytes(heic)
    for source, named in ((str(tmp_path / "IMG_0001.jpg"), ", not the JPEG its name says"),
                          (heic, "")):
        for got in (probe_image(source).error, decode_image(source, cfg).error):
            assert got == (f"UnidentifiedImageError: the image looks like HEIF (HEIC) data"
                           f"{named} (only BMP, GIF, JPEG, PNG, TIFF, WEBP are read)"), got
    mp4 = b"\0\0\0\x18ftypisom\0\0\0\0isomiso2" + bytes(300)
    assert "cannot identify the image" in probe_image(mp4).error


def test_any_accepted_format_is_opened_whatever_the_name_and_no_other(tmp_path, cfg):
    """A path, a tar member and unnamed bytes (a table cell): probes and decodes alike read
    any of the six accepted formats whatever the name (the probe says when the name says
    another), and no other format."""
    import tarfile

    from dsv4enc.images.discover import discover

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
    (tmp_path / "named.jpeg").write_bytes(encoded(photo, "WEBP"))
    (tmp_path / "empty.png").write_bytes(b"")
    for source, error, actual in [
            (members[0], None, None), (members[1], None, "JPEG"),
            (members[2], "looks like PCX", None), (encoded(photo, "BMP"), None, None),
            (encoded(photo, "TIFF"), None, None), (encoded(photo, "SGI"), "like SGI", None),
            (encoded(photo, "EPS"), "like EPS", None), (str(tmp_path / "named.jpg"), None, "PNG"),
            (str(tmp_path / "named.jpeg"), None, "WEBP"), (b"", "empty file (0 bytes)", None),
            (str(tmp_path / "empty.png"), "empty file (0 bytes)", None),
            (encoded(photo.convert("RGB"), "TGA"), "a TGA (Truevision Targa)", None)]:
        probe = probe_image(source)
        assert probe.misnamed == actual, (source, probe)
        for got in (probe.error, decode_image(source, cfg).error):
            if error is None:
                assert got is None, got
            else:
                assert got.startswith("UnidentifiedImageError") and error in got, got
    # The pixels are the same whatever the name.
    assert np.array_equal(decode_image(str(tmp_path / "named.jpg"), cfg).patches,
                          decode_image(encoded(photo, "PNG"), cfg).patches)


def test_misnamed_images_are_counted_in_the_summary(tmp_path, ckpt):
    """Three images whose name says another format are encoded and counted, in the summary
    and in --summary-json."""
    photo = noise(24, 18)
    folder = tmp_path / "imgs"
    folder.mkdir()
    for fmt, name in [("JPEG", "a.png"), ("PNG", "b.jpg"), ("WEBP", "c.jpeg"), ("PNG", "d.png")]:
        (folder / name).write_bytes(encoded(photo, fmt))
    out, report = tmp_path / "e.parquet", tmp_path / "s.json"
    result = runner.invoke(app, ["encode", str(folder), "--out", str(out), "--weights",
                                 str(ckpt), "--device", "cpu", "--workers", "0",
                                 "--summary-json", str(report)],
                           env={"DSV4ENC_WEIGHTS": None, "COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert pq.read_table(out).column("error").null_count == 4
    assert "3 images whose name says another format" in result.output, result.output
    assert "a.png is JPEG" in result.output
    data = json.loads(report.read_text())
    assert data["images"]["misnamed"] == 3 and data["misnamed_example"] == "a.png is JPEG"


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
    from dsv4enc.images.discover import discover

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
    from dsv4enc.output import commit as output

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

    def stop_at_the_second_part(self, *args, **kwargs):
        calls.append(args)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return put(self, *args, **kwargs)

    monkeypatch.setattr(output.PartWriter, "put", stop_at_the_second_part)
    with pytest.raises(KeyboardInterrupt):
        run_encode(opts)
    monkeypatch.setattr(output.PartWriter, "put", put)
    opts.resume = True
    summary = run_encode(opts)
    keys = [f"{tmp_path}/{folder}/cat/{i}.png{suffix}"
            for folder, suffix in (("train", ""), ("val", ""), ("val", "#2")) for i in range(2)]
    assert summary.reused == parts_of(keys, 2)[0][1]  # the first part, committed
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

    # the run's set-up (prefetch.RunSetup) finds the inputs and probes their headers
    real_listing, real_headers = prefetch.stream_inputs, prefetch.probe_share

    def listing(*args, **kwargs):
        yield from real_listing(*args, **kwargs)
        (folder / "gone_early.png").unlink()

    def read_headers(*args, **kwargs):
        planned = real_headers(*args, **kwargs)
        (folder / "gone_late.png").unlink()
        (folder / "locked.png").chmod(0)
        (folder / "swapped.png").unlink()
        os.mkfifo(folder / "swapped.png")
        return planned

    monkeypatch.setattr(prefetch, "stream_inputs", listing)
    monkeypatch.setattr(prefetch, "probe_share", read_headers)
    out = tmp_path / "e.parquet"
    summary = run_encode(EncodeOptions(inputs=[str(folder)], out=str(out), weights=str(ckpt),
                                       device="cpu", workers=1, decode_timeout=2.0,
                                       progress=False))
    rows = {r["path"]: r for r in table_rows(pq.read_table(out))}
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
        rows = {r["path"]: r for r in table_rows(pq.read_table(out))}
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
    rows = table_rows(pq.read_table(out))
    assert [r["path"] for r in rows] == sorted(names)
    for row in rows:
        assert (row["error"] is None) != (row["embedding"] is None), row["path"]


# --------------------------------------------------------------------------- deep and unlistable folders

def make_chain(root: Path, names: list[str]) -> str:
    """Folders nested ``names`` deep under ``root``, made relative to an open folder each time
    (no path is ever spelled out whole, so depth and PATH_MAX do not matter); a small PNG
    at the bottom. Returns the bottom's path relative to ``root``."""
    fd = os.open(root, os.O_RDONLY)
    try:
        for name in names:
            os.mkdir(name, dir_fd=fd)
            inner = os.open(name, os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = inner
        image = os.open("deep.png", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
        os.write(image, encoded(noise(20, 10), "PNG"))
        os.close(image)
    finally:
        os.close(fd)
    return "/".join(names)


@pytest.fixture
def chain(tmp_path):
    """``make_chain`` for the test, removed after it."""
    made: list[tuple[Path, list[str]]] = []

    def make(root: Path, names: list[str]) -> str:
        made.append((root, names))
        return make_chain(root, names)

    yield make
    for root, names in made:
        # Not shutil.rmtree (pytest's clean-up too): it recurses, and these are too deep.
        subprocess.run(["rm", "-rf", "--", str(root / names[0])], check=True)


def test_a_folder_tree_1100_levels_deep_is_walked(tmp_path, chain):
    """Recursion would stop at Python's limit (a RecursionError and no output)."""
    (tmp_path / "a.png").write_bytes(encoded(noise(20, 10), "PNG"))
    bottom = chain(tmp_path, ["d"] * 1100)
    found = discover([str(tmp_path)])
    assert [item.key for item in found.items] == ["a.png", f"{bottom}/deep.png"]
    assert found.unlisted == []


def test_a_folder_past_path_max_is_reported_not_dropped(tmp_path, ckpt, caplog, chain):
    """Its path cannot be listed (ENAMETOOLONG): the run says so, names it, counts it, and
    encodes the rest; nothing is dropped in silence."""
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.png").write_bytes(encoded(noise(20, 10), "PNG"))
    chain(folder, ["x" * 250] * 20)  # about 5000 bytes of path: past PATH_MAX (4096)
    with caplog.at_level("WARNING", logger="dsv4enc"):
        found = discover([str(folder)])
    assert [item.key for item in found.items] == ["a.png"]
    assert len(found.unlisted) == 1
    unlisted, reason = found.unlisted[0]
    assert len(unlisted) > 4096 and "too long" in reason.lower()
    assert "cannot list folder" in caplog.text and "not in this run" in caplog.text
    summary = run_encode(EncodeOptions(inputs=[str(folder)], out=str(tmp_path / "e.parquet"),
                                       weights=str(ckpt), device="cpu", workers=0,
                                       progress=False))
    assert summary.encoded == 1 and summary.unlisted == 1


def test_a_folder_without_permission_is_reported(tmp_path):
    """As a user who may not list it (root may list anything, so the walk runs in a child
    process that gives up root first)."""
    root = Path(tempfile.mkdtemp(dir="/tmp" if IS_ROOT else None))
    try:
        root.chmod(0o755)
        (root / "a.png").write_bytes(encoded(noise(20, 10), "PNG"))
        (root / "closed").mkdir()
        (root / "closed" / "hidden.png").write_bytes(encoded(noise(20, 10), "PNG"))
        (root / "closed").chmod(0)
        script = ("import json, logging, os, sys\n"
                  "import dsv4enc.images.sources\n"  # imported as root: the code may be root's
                  "from dsv4enc.images.discover import discover\n"
                  "if os.geteuid() == 0:\n"
                  "    os.setgid(65534); os.setuid(65534)\n"
                  "found = discover([sys.argv[1]])\n"
                  "print(json.dumps([[i.key for i in found.items], found.unlisted]))\n")
        proc = subprocess.run([sys.executable, "-c", script, str(root)], capture_output=True,
                              text=True, timeout=60, cwd="/",
                              env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
        assert proc.returncode == 0, proc.stderr
        keys, unlisted = json.loads(proc.stdout)
        assert keys == ["a.png"]
        assert unlisted == [[str(root / "closed"), "Permission denied"]]
        assert "cannot list folder" in proc.stderr
    finally:
        (root / "closed").chmod(0o755)
        shutil.rmtree(root)


# --------------------------------------------------------------------------- hangs

def test_table_cells_naming_a_fifo_do_not_hang(tmp_path):
    """More than 4096 rows of {bytes: null, path: a FIFO} beside one real image, and the FIFO
    passed directly too: each is an error row at once (regular files only), the run
    completes."""
    os.mkfifo(tmp_path / "pipe.png")
    n = 4100
    cells = [{"bytes": encoded(noise(20, 10), "PNG"), "path": "real.png"}]
    cells += [{"bytes": None, "path": str(tmp_path / "pipe.png")} for _ in range(n)]
    table = tmp_path / "t.parquet"
    pq.write_table(pa.table({"image": cells}), table)
    out = tmp_path / "e.parquet"
    proc = subprocess.run(
        [sys.executable, "-m", "dsv4enc", "encode", str(table), str(tmp_path / "pipe.png"),
         "--out", str(out), "--config",
         str(REPO_ROOT / "configs" / "tiny.json"), "--random-init", "--device", "cpu",
         "--workers", "1", "--decode-timeout", "30", "-q"],
        capture_output=True, text=True, timeout=240,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    rows = pq.read_table(out, columns=["error"]).column("error").to_pylist()
    assert len(rows) == n + 2 and rows[0] is None
    assert all(error is not None for error in rows[1:])
    assert "not a regular file" in rows[-1]


def test_a_fifo_container_passed_directly_is_refused(tmp_path):
    os.mkfifo(tmp_path / "shard.tar")
    result = encode(str(tmp_path / "shard.tar"), "--out", str(tmp_path / "e.parquet"),
                    "--config", str(REPO_ROOT / "configs" / "tiny.json"), "--random-init")
    assert result.exit_code == 2
    assert "not a regular file or a folder" in result.output


def test_fifos_in_input_folders_never_block(tmp_path):
    """FIFOs named like a tar shard, a table and images, as themselves and behind links, in
    input folders: each is passed over or an error row at once (a tar shard or table is opened
    only when it is a regular file), and the real images around them are encoded."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    shards = tmp_path / "shards"  # a folder of containers only: they are read
    shards.mkdir()
    with tarfile.open(shards / "real.tar", "w") as tar:
        data = encoded(noise(20, 10), "PNG")
        info = tarfile.TarInfo("x.png")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    os.mkfifo(shards / "fifo.tar")
    for name in ("link.tar", "link.parquet"):
        (shards / name).symlink_to(fifo)
    images = tmp_path / "images"
    images.mkdir()
    (images / "real.png").write_bytes(encoded(noise(20, 10), "PNG"))
    os.mkfifo(images / "fifo.png")
    (images / "link.jpg").symlink_to(fifo)
    out = tmp_path / "e.parquet"
    proc = subprocess.run(
        [sys.executable, "-m", "dsv4enc", "encode", "shards", "images", "--out",
         str(out), "--config", str(REPO_ROOT / "configs" / "tiny.json"), "--random-init",
         "--device", "cpu", "--workers", "1", "-q"],
        cwd=tmp_path, capture_output=True, text=True, timeout=240,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    rows = {r["path"]: r["error"]
            for r in pq.read_table(out, columns=["path", "error"]).to_pylist()}
    assert rows["shards/real.tar/x"] is None and rows["images/real.png"] is None, rows
    refused = {key: error for key, error in rows.items() if error is not None}
    assert {key.split("@")[0] for key in refused} == {
        "shards/link.tar", "shards/link.parquet", "images/link.jpg"}, rows  # FIFOs: passed over
    assert all("not a regular file" in error for error in refused.values()), refused


def test_header_probes_are_bounded_in_time(tmp_path, monkeypatch):
    """A probe stuck on slow storage becomes its image's error row after the limit; the other
    headers are read meanwhile, and the stuck thread never delays the caller."""
    release = threading.Event()

    def probe(item, max_pixels):
        if item.key == "stuck.png":
            release.wait(60)
        return Probe(width=20, height=10)

    monkeypatch.setattr(headers, "probe_image", probe)
    items = [InputItem(key=f"{name}.png", path=f"{name}.png")
             for name in ("a", "stuck", "b", "c")]
    began = time.monotonic()
    probes = headers.probe_all(items, MAX_PIXELS, timeout_s=1.0, threads=2)
    release.set()
    assert time.monotonic() - began < 30  # the stuck probe holds on for 60 s
    assert [p.error for p in probes] == [None, "header read timed out after 1s", None, None]


# --------------------------------------------------------------------------- memory

def sixteen_bit_gray(path: Path, side: int) -> Path:
    ramp = (np.arange(side * side, dtype=np.uint32).reshape(side, side) * 7 % 65536)
    Image.fromarray(ramp.astype(np.uint16)).save(path)
    with Image.open(path) as image:
        assert image.mode.startswith("I;16")
    return path


PEAK_SCRIPT = """
import sys
from PIL import Image, PngImagePlugin
import dsv4enc.tower.transform
from dsv4enc.tower.config import VisionConfig
from dsv4enc.images.decode import decode_image

def status_bytes(field):
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(field))

cfg = VisionConfig.from_file(sys.argv[2])
before = status_bytes("VmRSS:")
result = decode_image(sys.argv[1], cfg, int(sys.argv[3]))
# VmHWM: this process's peak RSS. (ru_maxrss would also count the parent's peak: Linux
# carries it across fork and exec.)
print(result.error, status_bytes("VmHWM:") - before)
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads Linux's /proc")
def test_peak_memory_of_a_sixteen_bit_decode(tmp_path):
    """A 16-bit grayscale PNG of 16.8 megapixels: decoded, scaled to 8 bits and transformed
    within 14 bytes a pixel above the process's resting size (it takes about 9; an 8-bit
    image about 6; the int64 detour this replaces took 20)."""
    side = 4096
    path = sixteen_bit_gray(tmp_path / "gray16.png", side)
    proc = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(path),
                           str(REPO_ROOT / "configs" / "tiny.json"), str(side * side)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert proc.returncode == 0, proc.stderr
    error, grown = proc.stdout.split()
    assert error == "None"
    assert int(grown) < 14 * side * side, f"{int(grown) >> 20} MiB"


def test_a_worker_past_its_memory_bound_fails_that_image_and_is_replaced(tmp_path, cfg):
    """A 6000x6000 image needs ~100 MB to decode; with a 48 MB bound that image's row says
    MemoryError, the worker is replaced, and the next image decodes as usual."""
    big = tmp_path / "big.png"
    Image.new("RGB", (6000, 6000), (10, 200, 30)).save(big)
    good = good_images(tmp_path / "good", 2)
    tasks = [("a", good[0]), ("big", str(big)), ("b", good[1])]
    with DecodePool(cfg, 1, max_pixels=10 ** 8, timeout_s=60, memory_budget=48 << 20) as pool:
        results = dict(pool.imap(tasks, window=3))
        assert pool.replaced == 1
    assert results["big"].error.startswith("MemoryError") and results["big"].patches is None
    assert same_decode(results["a"], good[0], cfg) and same_decode(results["b"], good[1], cfg)


def test_a_memory_budget_past_what_the_kernel_takes_leaves_workers_unbounded(tmp_path, cfg):
    """16 bytes a pixel of --max-pixels 10**20 is past what setrlimit takes: the workers run
    without a bound rather than dying at start-up, and every image decodes."""
    good = good_images(tmp_path, 2)
    with DecodePool(cfg, 1, max_pixels=10 ** 20, timeout_s=60) as pool:
        results = dict(pool.imap([("a", good[0]), ("b", good[1])], window=2))
        assert pool.replaced == 0
    assert same_decode(results["a"], good[0], cfg) and same_decode(results["b"], good[1], cfg)


def tiff_with_tiles(width: int, height: int, tile: int) -> bytes:
    """A deflate-compressed 8-bit gray TIFF whose one tile is declared ``tile`` x ``tile``."""
    tags = {256: (4, width), 257: (4, height), 258: (3, 8), 259: (3, 8), 262: (3, 1),
            277: (3, 1), 322: (4, tile), 323: (4, tile), 324: (4, 0), 325: (4, 16)}
    data_offset = 8 + 2 + 12 * len(tags) + 4
    tags[324] = (4, data_offset)
    ifd = struct.pack("<H", len(tags))
    for tag, (kind, value) in sorted(tags.items()):
        packed = struct.pack("<HH", value, 0) if kind == 3 else struct.pack("<I", value)
        ifd += struct.pack("<HHI", tag, kind, 1) + packed
    return b"II*\0" + struct.pack("<I", 8) + ifd + b"\0" * 4 + b"\0" * 16


def test_a_tiff_declaring_huge_tiles_is_refused_before_allocating(tmp_path, cfg):
    """150 bytes declaring 16384x16384 tiles: decoding would allocate 256 MB for one tile."""
    path = tmp_path / "tiles.tif"
    path.write_bytes(tiff_with_tiles(64, 64, 16384))
    for result in (probe_image(str(path), 10 ** 8), decode_image(str(path), cfg, 10 ** 8)):
        assert "16384x16384 tiles" in result.error


# --------------------------------------------------------------------------- loose ends

def test_the_pixel_limit_is_per_call_and_pillow_is_left_alone(tmp_path, cfg):
    """Probes and decodes with different limits, on threads at once, each get their own
    answer; Pillow's process-wide limit and the warnings filters stay as they were."""
    path = tmp_path / "img.png"
    noise(40, 30).save(path)  # 1200 pixels
    pillow_limit, filters = Image.MAX_IMAGE_PIXELS, list(warnings.filters)
    answers: list[tuple[int, bool]] = []

    def work(limit: int) -> None:
        for _ in range(40):
            answers.append((limit, probe_image(str(path), limit).error is None))
            answers.append((limit, decode_image(str(path), cfg, limit).error is None))

    threads = [threading.Thread(target=work, args=(limit,)) for limit in (1000, 5000) * 2]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(ok == (limit == 5000) for limit, ok in answers)
    assert Image.MAX_IMAGE_PIXELS == pillow_limit and warnings.filters == filters
    refused = probe_image(str(path), 1000).error
    assert "1200 pixels, more than --max-pixels 1000" in refused


WORKER_SCRIPT = """
import os, signal, sys, time
from dsv4enc.tower.config import VisionConfig
from dsv4enc.images.decode import DecodePool
cfg = VisionConfig.from_file(sys.argv[1])
pool = DecodePool(cfg, 2)
for seq, worker in enumerate(pool.workers):  # results the parent will never read
    worker.conn.recv()  # ready
    worker.conn.send((seq, sys.argv[2], None))  # (seq, source, arena slot)
print(" ".join(str(w.proc.pid) for w in pool.workers), flush=True)
time.sleep(1.0)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads Linux's /proc")
def test_workers_exit_quietly_when_the_main_process_is_killed(tmp_path):
    image = tmp_path / "a.png"
    noise(30, 20).save(image)
    log = tmp_path / "stderr.txt"
    with open(log, "w") as stderr:
        proc = subprocess.run([sys.executable, "-c", WORKER_SCRIPT,
                               str(REPO_ROOT / "configs" / "tiny.json"), str(image)],
                              stdout=subprocess.PIPE, stderr=stderr, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert proc.returncode == -signal.SIGKILL
    pids = [int(pid) for pid in proc.stdout.split()]
    assert processes_gone(pids)
    time.sleep(0.2)  # their last writes to the shared stderr
    assert log.read_text() == ""


# --------------------------------------------------------------------------- endless inputs

def shard_with_a_negative_size(path: Path, size: int, pax: bool) -> int:
    """A shard of ``a.png``, ``b.png`` and ``c.png`` whose ``b.png`` says it holds ``size``
    bytes: in its size field (base-256, checksum kept valid), or with ``pax`` in a pax
    ``size`` record. Returns the offset of ``b.png``'s first header."""
    data = encoded(noise(20, 10), "PNG")
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT if pax else tarfile.USTAR_FORMAT) as tar:
        for name in ("a.png", "b.png", "c.png"):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            if pax and name == "b.png":
                info.pax_headers = {"size": str(size)}
            tar.addfile(info, io.BytesIO(data))
    header = 512 * (1 + -(-len(data) // 512))
    if not pax:
        raw = bytearray(path.read_bytes())
        raw[header + 124:header + 136] = b"\xff" + (size % 256 ** 11).to_bytes(11, "big")
        raw[header + 148:header + 156] = b" " * 8
        raw[header + 148:header + 156] = b"%06o\0 " % sum(raw[header:header + 512])
        path.write_bytes(bytes(raw))
    return header


def test_a_tar_member_with_a_negative_size_ends_its_shard_with_one_error_row(tmp_path):
    """A negative size sends tarfile back to the header it just read (an endless listing whose
    memory grows), or reads as an empty member: the shard keeps the rows before it and ends
    in one damaged-container row at that header; the run goes on to the next input."""
    shards = {"neg512.tar": (-512, False), "neg1.tar": (-1, False), "pax.tar": (-512, True)}
    at = {name: shard_with_a_negative_size(tmp_path / name, *how) for name, how in shards.items()}
    noise(20, 10).save(tmp_path / "after.png")
    out = tmp_path / "e.parquet"
    proc = subprocess.run(
        [sys.executable, "-m", "dsv4enc", "encode", *shards, "after.png", "--out", str(out),
         "--config", str(REPO_ROOT / "configs" / "tiny.json"), "--random-init", "--device",
         "cpu", "--workers", "1", "-q"],
        cwd=tmp_path, capture_output=True, text=True, timeout=240,  # a safety net, no bet
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    rows = pq.read_table(out, columns=["path", "error"]).to_pylist()
    expected = [key for name in shards for key in (f"{name}/a", f"{name}@{at[name]}")]
    assert [row["path"] for row in rows] == expected + ["after.png"]
    for row in rows:
        if "@" in row["path"]:
            assert row["error"].startswith("DamagedContainerError"), row
            assert "'b.png' has a negative size" in row["error"] and "\n" not in row["error"]
        else:
            assert row["error"] is None, row


def test_a_nul_byte_in_a_files_from_line_is_that_line_s_error_row(tmp_path, ckpt):
    noise(20, 10).save(tmp_path / "a.png")
    listing = tmp_path / "list.txt"
    listing.write_bytes(f"{tmp_path / 'a.png'}\n{tmp_path}/b\0ad.png\n".encode())
    out = tmp_path / "e.parquet"
    result = encode("--files-from", str(listing), "--out", str(out), "--weights", str(ckpt),
                    "--workers", "0")
    assert result.exit_code == 0, result.output
    rows = pq.read_table(out, columns=["path", "error"]).to_pylist()
    assert [row["path"] for row in rows] == [str(tmp_path / "a.png"), f"{tmp_path}/b\0ad.png"]
    assert rows[0]["error"] is None
    assert "null byte" in rows[1]["error"]


def test_a_files_from_line_past_the_bound_is_refused_in_bounded_memory(tmp_path):
    """A list file of 16 MiB on one line (a binary given by mistake) is refused at its first
    line, which is never read whole: memory stays bounded by the line limit."""
    from dsv4enc.errors import UsageError
    from dsv4enc.images.discover import MAX_LIST_LINE_BYTES, read_path_list

    listing = tmp_path / "list.txt"
    with open(listing, "wb") as handle:
        handle.write(b"a.png\n")
        handle.truncate(16 << 20)  # then NUL bytes, and no newline
    import tracemalloc

    tracemalloc.start()
    try:
        with pytest.raises(UsageError) as info:
            list(read_path_list(str(listing)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * MAX_LIST_LINE_BYTES + (1 << 20), peak
    assert str(info.value) == (f"--files-from {listing}: line 2 is longer than "
                               f"{MAX_LIST_LINE_BYTES} bytes, so this is no list of paths "
                               "(one path a line)")


def test_a_files_from_list_is_read_as_a_stream(tmp_path, monkeypatch):
    """The items of a list come as its lines are read: the first is listed before a bad
    line further down is reached; standard input alike."""
    from dsv4enc.errors import UsageError
    from dsv4enc.images.discover import MAX_LIST_LINE_BYTES, Discovery, stream_inputs

    noise(20, 10).save(tmp_path / "a.png")
    text = f"{tmp_path / 'a.png'}\nnotes.txt\n{'x' * (MAX_LIST_LINE_BYTES + 1)}\n".encode()
    (tmp_path / "list.txt").write_bytes(text)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(text)))
    for list_file in (str(tmp_path / "list.txt"), "-"):
        listing = stream_inputs(Discovery(), [], list_file)
        assert next(listing).path == str(tmp_path / "a.png")
        with pytest.raises(UsageError, match="line 3 is longer than"):
            next(listing)


def test_a_device_or_a_folder_as_files_from_is_one_line(tmp_path):
    for list_file, words in (("/dev/null", "a device, not a list of paths"),
                             (str(tmp_path), "cannot read --files-from")):
        result = encode("--files-from", list_file, "--out", str(tmp_path / "e.parquet"), "--config",
                        str(REPO_ROOT / "configs" / "tiny.json"), "--random-init")
        assert result.exit_code == 2, result.output
        line = result.stderr.strip()
        assert len(line.splitlines()) == 1 and words in line and "Traceback" not in result.output


def test_a_config_that_is_no_small_file_is_refused_in_one_line(tmp_path, monkeypatch):
    noise(20, 10).save(tmp_path / "a.png")
    huge = tmp_path / "huge.json"
    huge.write_bytes(b" " * ((1 << 20) + 1))  # blank: as JSON it would read as an error too
    for config, words in (("/dev/null", "not a regular file"), (str(huge), "larger than 1 MiB")):
        result = encode(str(tmp_path / "a.png"), "--out", str(tmp_path / "e.parquet"),
                        "--config", config, "--random-init")
        assert result.exit_code == 1, result.output
        line = result.stderr.strip()
        assert len(line.splitlines()) == 1 and "Traceback" not in result.output
        assert line == f"error: cannot read config {config}: {words}" + (
            " (a config.json is)" if config == "/dev/null" else ", which no config.json is")


def test_a_tar_member_over_the_read_bound_streams_like_a_plain_file(tmp_path, cfg, monkeypatch):
    """A small PNG followed by megabytes of zeros, as one member: past ``MEMBER_READ_BYTES``
    its decode reads it as it goes (never whole), and gives what the same file on disk gives."""
    from dsv4enc.images import sources

    data = encoded(noise(30, 20), "PNG") + bytes(4 << 20)
    (tmp_path / "padded.png").write_bytes(data)
    with tarfile.open(tmp_path / "shard.tar", "w") as tar:
        info = tarfile.TarInfo("padded.png")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    monkeypatch.setattr(sources, "MEMBER_READ_BYTES", 64 << 10)
    monkeypatch.setattr(sources, "MEMBER_BUFFER_BYTES", 64 << 10)
    item = discover([str(tmp_path / "shard.tar")]).items[0]
    assert hasattr(sources.open_item(item), "read")  # a file over it, not its bytes
    import tracemalloc

    tracemalloc.start()
    try:
        got = decode_image(item, cfg)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < len(data) // 4, peak
    want = decode_image(str(tmp_path / "padded.png"), cfg)
    assert got.error is None and want.error is None, (got.error, want.error)
    assert (got.width, got.height, got.n_h, got.n_w) == (want.width, want.height, want.n_h,
                                                         want.n_w)
    assert np.array_equal(got.patches, want.patches)


def test_a_dictionary_encoded_image_column_is_read(tmp_path, cfg):
    """Parquet and Arrow keep a dictionary-encoded column as such: its binary values are the
    images (a repeated image stored once), a null is an error row."""
    images = [encoded(noise(20, 10, seed), "PNG") for seed in (1, 2)]
    column = pa.array([images[0], images[1], None, images[0]]).dictionary_encode()
    for name in ("t.parquet", "t.arrow"):
        path = tmp_path / name
        if name.endswith(".parquet"):
            pq.write_table(pa.table({"image": column}), path, row_group_size=2)
        else:
            import pyarrow.feather as feather

            feather.write_feather(pa.table({"image": column}), path)
        items = discover([str(path)]).items
        assert [item.key for item in items] == [f"{path}#{row}" for row in range(4)]
        probes = [probe_image(item) for item in items]
        assert [(p.width, p.height) for p in probes] == [(20, 10), (20, 10), (None, None),
                                                         (20, 10)]
        assert "null 'image'" in probes[2].error
        for item, image in zip([items[0], items[1], items[3]], [*images, images[0]]):
            got, want = decode_image(item, cfg), decode_image(image, cfg)
            assert got.error is None and np.array_equal(got.patches, want.patches)
