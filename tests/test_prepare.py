"""``images.prepare``: one input of the Python API read once (a path opened once, bytes parsed
once), its header's size kept on an error row, and the checks in their order (no pixels, too
many pixels, no canvas, then the decode)."""

from __future__ import annotations

import builtins
import io
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from dsv4enc import Encoder
from dsv4enc.images.decode import decode_image, probe_image
from dsv4enc.images.prepare import Prepared, prepare
from dsv4enc.tower.transform import no_pixels, plan_canvas

from helpers import write_image


@pytest.fixture
def opens(monkeypatch) -> dict[str, list]:
    """Every ``PIL.Image.open`` call (what it was given) and every ``open`` of a path."""
    seen: dict[str, list] = {"images": [], "files": []}
    pil_open, file_open = Image.open, builtins.open

    def image_open(fp, *args, **kwargs):
        seen["images"].append(fp)
        return pil_open(fp, *args, **kwargs)

    def any_open(file, *args, **kwargs):
        seen["files"].append(os.fspath(file) if isinstance(file, (str, os.PathLike)) else file)
        return file_open(file, *args, **kwargs)

    monkeypatch.setattr(Image, "open", image_open)
    monkeypatch.setattr(builtins, "open", any_open)
    return seen


def _truncated(path: Path, size: tuple[int, int], keep: int) -> Path:
    """A PNG of ``size`` whose header is whole and whose pixel data is cut after ``keep`` bytes."""
    write_image(path, size)
    path.write_bytes(path.read_bytes()[:keep])
    return path


def test_encode_opens_a_local_file_once_and_parses_bytes_once(small_ckpt, tmp_path, opens):
    path = write_image(tmp_path / "a.png", (64, 48))
    data = path.read_bytes()
    encoder = Encoder.from_pretrained(small_ckpt, device="cpu", dtype=torch.float32)
    opens["images"].clear()
    opens["files"].clear()
    from_path = encoder.encode([str(path)])[0]
    assert opens["files"].count(str(path)) == 1
    assert len(opens["images"]) == 1
    opens["images"].clear()
    assert torch.equal(encoder.encode([data])[0], from_path)
    assert len(opens["images"]) == 1 and isinstance(opens["images"][0], io.BytesIO)


def test_a_broken_files_row_keeps_its_header_size(small_cfg, tmp_path, opens):
    path = _truncated(tmp_path / "cut.png", (300, 200), keep=400)
    header = probe_image(str(path))
    want = decode_image(str(path), small_cfg)
    assert header.error is None and want.error is not None
    assert (want.width, want.height) == (header.width, header.height) == (300, 200)
    for source in (str(path), path.read_bytes()):
        opens["images"].clear()
        item = prepare(source, small_cfg, 10 ** 6, Prepared())
        assert (item.width, item.height, item.error) == (300, 200, want.error)
        assert item.patches is None and item.tokens == 0
        assert len(opens["images"]) == 1


def test_checks_run_in_order_pixels_canvas_then_decode(tiny_cfg, tmp_path):
    """A header over the pixel limit is refused before its canvas is planned, and a size
    without a canvas before the (broken) pixels are read; the latter keeps its size."""
    no_canvas = replace(tiny_cfg, max_wh_ratio=0.05, min_pixels=1)  # 1000x1: an empty canvas
    path = str(_truncated(tmp_path / "wide.png", (1000, 1), keep=60))
    assert decode_image(path, tiny_cfg).error is not None  # its pixels are broken
    for pixels in (False, True):
        canvas = decode_image(path, no_canvas, pixels=pixels)
        assert canvas.error == "ValueError: image size 1000x1 gives an empty canvas"
        assert (canvas.width, canvas.height) == (1000, 1)
    item = prepare(path, no_canvas, 10 ** 6, Prepared())
    assert (item.width, item.height, item.error) == (1000, 1, canvas.error)
    item = prepare(path, no_canvas, 999, Prepared())
    assert item.error.startswith("ValueError: image has 1000x1 = 1000 pixels, more than")
    assert item.width is None and item.error == probe_image(path, 999).error


def test_an_image_without_pixels_is_an_error_row_of_its_type(small_cfg):
    """An empty array or image gets the ``ErrorType: message`` text of every error row (the
    summary groups errors by that type), from the API and the batch function alike."""
    for empty, size in ((np.zeros((0, 0, 3), np.uint8), "0x0"), (Image.new("RGB", (0, 5)), "0x5")):
        item = prepare(empty, small_cfg, 10 ** 6, Prepared())
        assert item.error == f"ValueError: image has no pixels ({size})"
    assert no_pixels(3, 0) == "ValueError: image has no pixels (3x0)"
    with pytest.raises(ValueError, match=r"^image has no pixels \(0x4\)$"):
        plan_canvas(0, 4, small_cfg)


def test_a_fifo_or_a_missing_path_is_an_error_not_a_wait(small_cfg, tmp_path):
    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)
    missing = str(tmp_path / "missing.png")
    item = prepare(str(fifo), small_cfg, 10 ** 6, Prepared())
    assert item.error == "ValueError: not a regular file (a folder, FIFO, socket or device)"
    assert item.error == probe_image(str(fifo)).error
    item = prepare(missing, small_cfg, 10 ** 6, Prepared())
    assert item.error.startswith("FileNotFoundError: ") and item.width is None
    assert item.error == probe_image(missing).error


def test_an_array_not_shaped_as_an_image_has_no_size(small_cfg):
    """Only an HxW or HxWxC array has a size: a stacked (1, H, W, 3) or a 5-D array is the
    shape's error row, without a width and height read off its first two axes."""
    for array in (np.zeros((1, 20, 30, 3), np.uint8), np.zeros((1, 2, 3, 4, 5), np.uint8),
                  np.zeros((1, 0, 5, 3), np.uint8)):
        item = prepare(array, small_cfg, 10 ** 6, Prepared())
        assert item.error == (f"ValueError: array has shape {array.shape}; expected HxW, "
                              "HxWx1, HxWx3 or HxWx4")
        assert (item.width, item.height) == (None, None)
    item = prepare(np.zeros((10, 12, 2), np.uint8), small_cfg, 10 ** 6, Prepared())
    assert item.error.startswith("ValueError: array has shape (10, 12, 2)")
    assert (item.width, item.height) == (12, 10)  # an image's shape, a wrong channel count


def test_a_dict_whose_path_is_bytes_reads_the_file_it_names(small_cfg, tmp_path):
    """A ``{bytes: None, path: b"..."}`` dict (a table's binary path field, as the command line
    reads it) opens the file its bytes name, not those bytes as an image's."""
    from dsv4enc.images.prepare import image_source

    picture = write_image(tmp_path / os.fsdecode(b"caf\xe9.png"), (30, 20), seed=1)
    source, name = image_source({"bytes": None, "path": os.fsencode(picture)})
    assert source == name == str(picture)
    item = prepare(source, small_cfg, 10 ** 6, Prepared())
    assert item.error is None and (item.width, item.height) == (30, 20)
