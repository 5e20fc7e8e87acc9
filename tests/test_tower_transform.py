"""The image transform (SPEC §4) beyond the golden images: modes, bit depth, EXIF, budget."""

from __future__ import annotations

import dataclasses
import math
import signal
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image, ImageOps

from dsv4enc.tower.transform import PAD_FILL, count_llm_tokens, image_to_patches, plan_canvas, to_rgb

SIZE = (37, 23)  # odd on purpose: neither side a multiple of the patch size


def noise(size=SIZE, seed=0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB")


def sixteen_bit(values: np.ndarray, mode: str = "I;16") -> Image.Image:
    """A 16-bit grayscale image in ``mode`` holding ``values`` (uint16, (h, w))."""
    if mode == "I":
        return Image.fromarray(values.astype(np.int32), "I")
    if mode == "I;16B":
        image = Image.new("I;16B", (values.shape[1], values.shape[0]))
        image.frombytes(values.astype(">u2").tobytes())
        return image
    return Image.fromarray(values.astype(np.uint16))


@contextmanager
def time_limit(seconds: int):
    """Fail instead of hanging (plan_canvas must never loop forever)."""
    def fail(signum, frame):
        raise AssertionError(f"took longer than {seconds}s")
    old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def assert_patches_shape(patches, canvas, cfg):
    assert patches.dtype == torch.bfloat16
    assert patches.shape == (canvas.n_h * canvas.n_w, cfg.patch_dim)
    assert canvas.n_h >= 1 and canvas.n_w >= 1
    assert float(patches.abs().max()) <= 1.0


# --------------------------------------------------------------------------- modes and depth

@pytest.mark.parametrize("mode", ["I;16", "I;16B", "I"])
def test_sixteen_bit_is_scaled_not_clipped(tiny_cfg, mode):
    rng = np.random.default_rng(1)
    values = rng.integers(0, 65536, (SIZE[1], SIZE[0]), dtype=np.uint16)
    values[0, 0], values[0, 1] = 0, 65535
    image = sixteen_bit(values, mode)
    assert image.mode == mode
    eight = Image.fromarray((values >> 8).astype(np.uint8), "L")
    patches, canvas = image_to_patches(image, tiny_cfg)
    ref, ref_canvas = image_to_patches(eight, tiny_cfg)
    assert canvas == ref_canvas
    assert torch.equal(patches, ref)
    # Clipping would saturate nearly every sample; scaling keeps the spread.
    assert np.asarray(to_rgb(image))[..., 0].tolist() == (values >> 8).tolist()


def test_mode_i_with_eight_bit_values_is_not_scaled(tiny_cfg):
    # An "L" image converted to "I" keeps 8-bit samples; scaling them would blacken it.
    base = noise().convert("L")
    patches, _ = image_to_patches(base.convert("I"), tiny_cfg)
    ref, _ = image_to_patches(base, tiny_cfg)
    assert torch.equal(patches, ref)


def test_sixteen_bit_png_file_round_trip(tiny_cfg, tmp_path):
    rng = np.random.default_rng(2)
    values = rng.integers(0, 65536, (SIZE[1], SIZE[0]), dtype=np.uint16)
    path = tmp_path / "deep.png"
    Image.fromarray(values).save(path)
    with Image.open(path) as image:
        assert image.mode in ("I;16", "I")  # Pillow's choice for 16-bit grayscale PNG
        patches, _ = image_to_patches(image, tiny_cfg)
    ref, _ = image_to_patches(Image.fromarray((values >> 8).astype(np.uint8), "L"), tiny_cfg)
    assert torch.equal(patches, ref)


@pytest.mark.parametrize("sample_format", [1, 2])  # unsigned, signed (Pillow: mode "I")
def test_a_dark_sixteen_bit_tiff_is_scaled_however_dark(tiny_cfg, tmp_path, sample_format):
    """A 16-bit TIFF whose samples are all under 256 is as dark as its values say, signed or
    not: its BitsPerSample decides, not its brightest sample."""
    from PIL import TiffImagePlugin

    rng = np.random.default_rng(3)
    values = rng.integers(0, 256, (SIZE[1], SIZE[0]), dtype=np.uint16)
    values[0, 0] = 255
    tags = TiffImagePlugin.ImageFileDirectory_v2()
    tags[339], tags.tagtype[339] = sample_format, 3  # SampleFormat
    path = tmp_path / "dark.tif"
    Image.fromarray(values).save(path, tiffinfo=tags)
    with Image.open(path) as image:
        assert np.asarray(to_rgb(image)).max() == 0
        patches, _ = image_to_patches(image, tiny_cfg)
    ref, _ = image_to_patches(Image.new("L", SIZE), tiny_cfg)
    assert torch.equal(patches, ref)


def _image_in_mode(mode: str) -> Image.Image:
    base = noise()
    if mode == "P_transparency":
        image = base.quantize(16)
        image.info["transparency"] = 0
        return image
    if mode in ("I;16",):
        return sixteen_bit(np.asarray(base.convert("L"), dtype=np.uint16) * 257)
    if mode == "F":
        return Image.fromarray(np.asarray(base.convert("L"), dtype=np.float32) * 1.5, "F")
    return base.convert(mode)


@pytest.mark.parametrize("mode", ["1", "L", "LA", "P", "P_transparency", "PA", "RGB", "RGBA",
                                  "CMYK", "YCbCr", "I", "F", "I;16"])
def test_every_common_mode_gives_patches(tiny_cfg, mode):
    image = _image_in_mode(mode)
    patches, canvas = image_to_patches(image, tiny_cfg)
    assert canvas == plan_canvas(*SIZE, tiny_cfg)
    assert_patches_shape(patches, canvas, tiny_cfg)


def test_rgba_drops_alpha_like_the_reference(tiny_cfg):
    rgb = noise()
    rgba = rgb.copy()
    rgba.putalpha(Image.fromarray(np.full((SIZE[1], SIZE[0]), 3, np.uint8), "L"))
    assert torch.equal(image_to_patches(rgba, tiny_cfg)[0], image_to_patches(rgb, tiny_cfg)[0])


def test_files_of_varied_formats_give_patches(tiny_cfg, make_images):
    for path in make_images():
        with Image.open(path) as image:
            patches, canvas = image_to_patches(image, tiny_cfg)
            assert canvas == plan_canvas(image.width, image.height, tiny_cfg), path.name
        assert_patches_shape(patches, canvas, tiny_cfg)


# --------------------------------------------------------------------------- EXIF, resize mode

def test_exif_orientation_is_ignored(tiny_cfg, tmp_path):
    stored = (300, 100)  # stored landscape; orientation 6 would display it as portrait
    exif = Image.Exif()
    exif[0x0112] = 6
    path = tmp_path / "rotated.jpg"
    noise(stored).save(path, exif=exif.tobytes())
    with Image.open(path) as image:
        assert image.getexif().get(0x0112) == 6
        assert image.size == stored
        patches, canvas = image_to_patches(image, tiny_cfg)
        raw = image.copy()
    assert canvas == plan_canvas(*stored, tiny_cfg)
    assert canvas != plan_canvas(stored[1], stored[0], tiny_cfg)
    assert torch.equal(patches, image_to_patches(raw, tiny_cfg)[0])
    # The displayed orientation would give a different grid.
    shown = ImageOps.exif_transpose(raw)
    assert image_to_patches(shown, tiny_cfg)[1] != canvas


def test_wide_images_are_stretched(tiny_cfg):
    ratio = tiny_cfg.max_wh_ratio
    assert ratio == 8
    assert plan_canvas(800, 100, tiny_cfg).stretch  # exactly the ratio
    assert plan_canvas(3000, 100, tiny_cfg).stretch
    assert not plan_canvas(799, 100, tiny_cfg).stretch
    assert not plan_canvas(100, 3000, tiny_cfg).stretch  # tall images are padded
    no_limit = dataclasses.replace(tiny_cfg, max_wh_ratio=None)
    assert not plan_canvas(3000, 100, no_limit).stretch


def test_stretch_is_a_plain_resize_and_pad_uses_grey(tiny_cfg):
    wide = noise((400, 40), seed=3)
    patches, canvas = image_to_patches(wide, tiny_cfg)
    assert canvas.stretch
    ref = wide.resize((canvas.width, canvas.height))
    assert torch.equal(patches, _patches_of(ref, tiny_cfg))
    # A tall image is fitted and centred; the margins hold the grey fill.
    tall = Image.new("RGB", (40, 400), (255, 0, 0))
    patches, canvas = image_to_patches(tall, tiny_cfg)
    assert not canvas.stretch
    p = tiny_cfg.patch_size
    grid = patches.view(canvas.n_h, canvas.n_w, 3, p, p).float()
    grey = torch.tensor([(c / 255 - 0.5) / 0.5 for c in PAD_FILL]).bfloat16().float()
    assert torch.equal(grid[0, 0, :, 0, 0], grey)  # top-left pixel: margin
    red = torch.tensor([1.0, -1.0, -1.0])
    assert torch.equal(grid[canvas.n_h // 2, canvas.n_w // 2, :, p // 2, p // 2], red)


def _patches_of(rgb: Image.Image, cfg) -> torch.Tensor:
    """Independent patchify of an already-fitted RGB canvas (SPEC §4 steps 7-8)."""
    x = torch.from_numpy(np.asarray(rgb, dtype=np.uint8).copy()).float() / 255
    x = ((x - 0.5) / 0.5).bfloat16()  # (bh, bw, 3)
    p = cfg.patch_size
    n_h, n_w = rgb.height // p, rgb.width // p
    out = torch.empty(n_h * n_w, 3, p, p, dtype=torch.bfloat16)
    for i in range(n_h):
        for j in range(n_w):
            out[i * n_w + j] = x[i * p:(i + 1) * p, j * p:(j + 1) * p].permute(2, 0, 1)
    return out.reshape(n_h * n_w, -1)


# --------------------------------------------------------------------------- canvas planning

def check_canvas(width, height, cfg):
    """Return the canvas of a size, or None if it raised ValueError; check its invariants."""
    try:
        with time_limit(5):
            canvas = plan_canvas(width, height, cfg)
    except ValueError:
        return None
    p, r = cfg.patch_size, cfg.downsample_ratio
    assert canvas.n_h >= 1 and canvas.n_w >= 1
    assert (canvas.width, canvas.height) == (canvas.n_w * p, canvas.n_h * p)
    tokens = count_llm_tokens(canvas.height, canvas.width, p, r)
    assert tokens <= cfg.max_n_token - 3, (width, height, canvas, tokens)
    return canvas


@given(width=st.integers(1, 20000), height=st.integers(1, 20000))
def test_plan_canvas_respects_token_budget(tiny_cfg, width, height):
    assert check_canvas(width, height, tiny_cfg) is not None


@given(width=st.integers(1, 5000), height=st.integers(1, 5000),
       max_n_token=st.integers(6, 2000), ratio=st.sampled_from([None, 0.5, 1.0, 2.0, 8.0]),
       min_pixels=st.sampled_from([0, 1, 1000, 147456]))
def test_plan_canvas_other_settings_valid_or_value_error(tiny_cfg, width, height, max_n_token,
                                                         ratio, min_pixels):
    cfg = dataclasses.replace(tiny_cfg, max_n_token=max_n_token, max_wh_ratio=ratio,
                              min_pixels=min_pixels)
    canvas = check_canvas(width, height, cfg)
    if max_n_token >= 9 and (ratio is None or ratio >= 1):
        # A budget of 6 LLM tokens always fits one r x r block per row, two rows.
        assert canvas is not None, (width, height)


@pytest.mark.parametrize("size", [(1, 10000), (10000, 1), (1, 1), (1, 100000), (100000, 1),
                                  (2, 3), (14, 14), (65535, 65535)])
def test_extreme_sizes_give_a_canvas(tiny_cfg, size):
    assert check_canvas(*size, tiny_cfg) is not None


@pytest.mark.parametrize("size", [(0, 10), (10, 0), (0, 0), (-1, 5)])
def test_empty_size_is_a_value_error(tiny_cfg, size):
    with pytest.raises(ValueError):
        plan_canvas(*size, tiny_cfg)


def test_small_images_are_upscaled_towards_min_pixels(tiny_cfg):
    canvas = plan_canvas(64, 64, tiny_cfg)
    side = math.sqrt(tiny_cfg.min_pixels)
    assert canvas.width >= side and canvas.height >= side


def test_count_llm_tokens_by_hand():
    # 3x3 patch canvas, r=3: one LLM row of one token + newline; lh odd adds a row.
    assert count_llm_tokens(42, 42, 14, 3) == 1 * 2 + 2 + 2
    # 6x6 patches: lh = lw = 2, (lh+1)//2 * (lw+1) = 3 odd.
    assert count_llm_tokens(84, 84, 14, 3) == 2 * 3 + 2 + 2


def test_normalize_lookup_equals_torch_arithmetic_for_every_pixel_value():
    """The lookup table is the reference's float32 normalize and bf16 cast, value by value."""
    from dsv4enc.tower.transform import NORMALIZED_BF16_BITS

    levels = torch.arange(256, dtype=torch.float32)
    expected = ((levels / 255 - 0.5) / 0.5).to(torch.bfloat16).view(torch.int16).numpy()
    assert np.array_equal(NORMALIZED_BF16_BITS.view(np.int16), expected)


def test_patches_match_per_pixel_arithmetic(tiny_cfg):
    """Patchify-then-lookup equals normalize-then-patchify done in torch."""
    image = noise((61, 45), seed=3)
    patches, canvas = image_to_patches(image, tiny_cfg)
    fitted = ImageOps.pad(image, (canvas.width, canvas.height), color=PAD_FILL)
    pixels = torch.from_numpy(np.asarray(fitted).copy()).permute(2, 0, 1).float()
    values = ((pixels / 255 - 0.5) / 0.5).to(torch.bfloat16)
    p = tiny_cfg.patch_size
    expected = (values.reshape(3, canvas.n_h, p, canvas.n_w, p).permute(1, 3, 0, 2, 4)
                .reshape(canvas.n_patches, 3 * p * p))
    assert torch.equal(patches, expected)


def test_pair_lookup_equals_one_pixel_at_a_time():
    """The two-byte table gives every pair of 8-bit values the bits the one-byte table gives
    each value, in the right halves; odd rows and strided input take the one-byte path."""
    from dsv4enc.tower.transform import NORMALIZED_BF16_BITS, normalize_patch_pixels

    every_pair = np.arange(1 << 16, dtype=np.uint16).view(np.uint8).reshape(-1, 2)
    assert np.array_equal(normalize_patch_pixels(every_pair),
                          NORMALIZED_BF16_BITS[every_pair])
    rng = np.random.default_rng(0)
    for shape in [(5, 588), (3, 7), (1, 2)]:
        pixels = rng.integers(0, 256, shape, dtype=np.uint8)
        out = np.full(shape, 0xFFFF, dtype=np.uint16)
        assert normalize_patch_pixels(pixels, out) is out
        assert np.array_equal(out, NORMALIZED_BF16_BITS[pixels])
    strided = rng.integers(0, 256, (4, 12), dtype=np.uint8)[:, ::2]
    assert np.array_equal(normalize_patch_pixels(strided), NORMALIZED_BF16_BITS[strided])
