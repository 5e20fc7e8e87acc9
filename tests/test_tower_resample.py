"""The transform as torch ops (tower/resample, transform.pixels_to_patches) against Pillow's
path: the same bytes for every size, aspect ratio, mode and geometry."""

from __future__ import annotations

import itertools

import numpy as np
import PIL
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image, ImageOps

from dsv4enc.tower.checkpoint import load_checkpoint
from dsv4enc.tower.config import VisionConfig
from dsv4enc.tower.resample import (coefficients, pad, resample_axis, resize,
                                    vertical_first)
from dsv4enc.tower.transform import (PAD_FILL, contained_size, image_pixels, image_to_patches,
                                     plan_canvas, pixels_to_patches)

from helpers import CONFIGS

FILL = PAD_FILL


def noise(width: int, height: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (height, width, 3), dtype=np.uint8)


def pillow_resize(pixels: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    return np.asarray(Image.fromarray(pixels, "RGB").resize(size, Image.Resampling.BICUBIC))


def pillow_pad(pixels: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    try:
        return np.asarray(ImageOps.pad(Image.fromarray(pixels, "RGB"), size, color=FILL))
    except ValueError:  # Pillow < 13: the contained image has a side of 0 (13: all fill)
        return np.asarray(Image.new("RGB", size, FILL))


def bits(patches: torch.Tensor) -> torch.Tensor:
    return patches.view(torch.int16)


SIDES = (1, 2, 3, 5, 14, 23, 64, 101)
TARGETS = ((1, 1), (14, 28), (97, 41), (3, 150), (150, 3))


@pytest.mark.parametrize("width,height", list(itertools.product(SIDES, SIDES)))
def test_resize_and_pad_equal_pillow_over_a_grid(width, height):
    pixels = noise(width, height, seed=width * 1000 + height)
    sizes = TARGETS + ((width * 3 + 1, height), (width, height * 2 + 3),
                       (max(1, width // 3), max(1, height // 2)), (width + 7, max(1, height - 1)))
    for size in sizes:
        assert np.array_equal(resize(torch.from_numpy(pixels), size).numpy(),
                              pillow_resize(pixels, size)), size
        inner = contained_size(width, height, size)
        assert np.array_equal(pad(torch.from_numpy(pixels), size, FILL, inner).numpy(),
                              pillow_pad(pixels, size)), size


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 300), st.integers(1, 300), st.integers(1, 300), st.integers(1, 300))
def test_resize_equals_pillow_for_random_sizes(width, height, out_w, out_h):
    pixels = noise(width, height, seed=out_w * 7 + out_h)
    got = resize(torch.from_numpy(pixels), (out_w, out_h)).numpy()
    assert np.array_equal(got, pillow_resize(pixels, (out_w, out_h)))


def test_pass_order_edges_equal_pillow():
    """Rows lost exactly twice the columns lost (horizontal first), one more (vertical first),
    rows lost with columns gained, extreme values that clip between the passes, and images
    just over and at 100 times taller than wide (Pillow 12.2's and 12.3's rule)."""
    cases = [((60, 90), (50, 70)), ((60, 91), (50, 70)), ((60, 89), (50, 70)),
             ((20, 90), (40, 30)), ((90, 20), (30, 40)), ((7, 200), (7, 13)),
             ((3, 1000), (2, 500)), ((10, 1001), (5, 100)), ((10, 1000), (5, 100))]
    for (w, h), size in cases:
        checker = np.indices((h, w)).sum(0) % 2 * 255  # the strongest overshoot
        pixels = np.repeat(checker[..., None], 3, axis=2).astype(np.uint8)
        for image in (pixels, noise(w, h)):
            assert np.array_equal(resize(torch.from_numpy(image), size).numpy(),
                                  pillow_resize(image, size)), ((w, h), size)


@pytest.mark.parametrize("dim", [0, 1])
def test_windows_at_once_equal_tap_by_tap(dim):
    """The GPU's way (each window gathered at once) and the CPU's (tap by tap) on the CPU."""
    pixels = torch.from_numpy(noise(90, 70, seed=3))
    for out_size in (1, 7, 33, 69, 91, 250):
        assert torch.equal(resample_axis(pixels, out_size, dim, at_once=True),
                           resample_axis(pixels, out_size, dim, at_once=False))


def test_pass_order_follows_each_pillow():
    """Pillow 13 orders the passes by the rows and columns lost; 12.2 and 12.3 go vertical
    first for an image over 100 times taller than wide that loses rows; older ones never."""
    assert vertical_first((60, 91), (50, 70), pillow=(13, 0))
    assert not vertical_first((60, 90), (50, 70), pillow=(13, 0))
    for pillow in ((12, 2), (12, 3)):
        assert vertical_first((5, 20000), (2, 7896), pillow=pillow)
        assert not vertical_first((5, 500), (2, 70), pillow=pillow)  # only 100 times taller
        assert not vertical_first((5, 20000), (5, 30000), pillow=pillow)  # rows gained
    for pillow in ((10, 0), (12, 1)):
        assert not vertical_first((5, 20000), (2, 7896), pillow=pillow)


def test_pad_with_an_empty_contained_image_is_all_fill():
    pixels = noise(1000, 1)  # contained in 10x10 it is 10x0: Pillow pastes nothing
    assert np.array_equal(pad(torch.from_numpy(pixels), (10, 10), FILL, (10, 0)).numpy(),
                          pillow_pad(pixels, (10, 10)))


def test_coefficients_sum_to_one_in_fixed_point():
    for in_size, out_size in [(1024, 882), (768, 658), (5, 300), (300, 5), (1, 7)]:
        index, weights = coefficients(in_size, out_size)
        assert index.shape == weights.shape and weights.dtype == torch.int32
        assert int(index.min()) >= 0 and int(index.max()) < in_size
        total = weights.to(torch.int64).sum(1)
        assert (total - (1 << 22)).abs().max() <= weights.shape[1]  # each weight rounds once


@pytest.mark.parametrize("config", ["tiny.json", "tiny-v41.json", "deepseek-v4-flash.json",
                                    "deepseek-v4.1-flash.json"])
@pytest.mark.parametrize("mode", ["RGB", "L", "P", "I;16"])
def test_pixels_to_patches_equals_the_pillow_path(config, mode):
    """V4 and V4.1 geometry: padded, stretched (wide past max_wh_ratio), upscaled to
    min_pixels, over the token budget, and a strip too thin to show on its canvas (all fill,
    where Pillow < 13's pad raises); grey images ship one channel."""
    cfg = VisionConfig.from_file(CONFIGS / config)
    sizes = [(37, 23), (1024, 768), (768, 1024), (5000, 300), (300, 5000), (9, 9), (3000, 200),
             (1, 20000)]
    for index, (w, h) in enumerate(sizes):
        image = Image.fromarray(noise(w, h, seed=index), "RGB")
        if mode == "I;16":
            image = Image.fromarray((noise(w, h, seed=index)[..., 0].astype(np.uint16) * 257))
        else:
            image = image.convert(mode)
        ref, ref_canvas = image_to_patches(image, cfg)
        pixels = image_pixels(image)
        assert pixels.shape[2] == (1 if image.mode == "L" else 3)
        got, canvas = pixels_to_patches(torch.from_numpy(pixels.copy()), cfg)
        assert canvas == ref_canvas == plan_canvas(w, h, cfg)
        assert got.dtype == torch.bfloat16
        assert torch.equal(bits(got), bits(ref)), (config, mode, (w, h))


def test_pixels_to_patches_equals_the_golden_patches(golden):
    cfg = load_checkpoint(golden.ckpt).config
    for case in golden.cases:
        with Image.open(case.path) as image:
            pixels = image_pixels(image)
        patches, canvas = pixels_to_patches(torch.from_numpy(pixels.copy()), cfg)
        ref = golden.tensors[f"{case.key}.patches"]
        assert (canvas.n_h, canvas.n_w) == (case.vit_h, case.vit_w), case.name
        assert torch.equal(bits(patches), bits(ref.reshape(patches.shape))), case.name


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pixels_to_patches_on_cuda_equals_the_cpu(tiny_cfg):
    for w, h in [(37, 23), (1024, 768), (300, 5000)]:
        pixels = torch.from_numpy(noise(w, h))
        on_cpu, _ = pixels_to_patches(pixels, tiny_cfg)
        on_gpu, _ = pixels_to_patches(pixels.cuda(), tiny_cfg)
        assert torch.equal(bits(on_gpu).cpu(), bits(on_cpu))
