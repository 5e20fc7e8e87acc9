"""The golden vectors (shared/golden): transform bit for bit, tower within the README's bounds."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from dsv4enc.tower.checkpoint import build_tower, load_checkpoint
from dsv4enc.tower.transform import image_to_patches

from helpers import packed_forward, rel_err

# Relative-error bounds of golden/README.md, per compute dtype.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2}
FEATURES = ("vit", "aligner")


def is_norm_weight(name: str) -> bool:
    return name == "vision.norm.weight" or name.endswith((".norm1.weight", ".norm2.weight"))


@pytest.fixture(scope="module")
def golden_inputs(golden):
    """Per case: (case, our patches (n, 3*p*p) bf16, canvas)."""
    cfg = load_checkpoint(golden.ckpt).config
    out = []
    for case in golden.cases:
        with Image.open(case.path) as image:
            patches, canvas = image_to_patches(image, cfg)
        out.append((case, patches, canvas))
    return out


@pytest.fixture(scope="module", params=list(TOLERANCE), ids=lambda d: str(d).removeprefix("torch."))
def golden_tower(request, golden):
    """The golden checkpoint built in each compute dtype."""
    return build_tower(load_checkpoint(golden.ckpt, dtype=request.param))


def test_transform_is_bit_exact(golden, golden_inputs):
    for case, patches, _ in golden_inputs:
        ref = golden.tensors[f"{case.key}.patches"]
        assert ref.dtype == torch.bfloat16
        n, c, p, p2 = ref.shape
        assert (c, p2) == (3, p)
        assert patches.dtype == torch.bfloat16
        assert patches.shape == (n, c * p * p), case.name
        assert torch.equal(patches.view(n, c, p, p), ref), f"{case.name}: patches differ"


def test_patch_grid_matches_expected(golden, golden_inputs):
    for case, patches, canvas in golden_inputs:
        assert (canvas.n_h, canvas.n_w) == (case.vit_h, case.vit_w), case.name
        assert patches.shape[0] == case.vit_h * case.vit_w
        assert golden.tensors[f"{case.key}.vit"].shape[0] == case.vit_h * case.vit_w


def test_golden_set_covers_pad_and_stretch(golden_inputs):
    """The vectors exercise both resize paths of SPEC §4 step 6."""
    assert {canvas.stretch for _, _, canvas in golden_inputs} == {True, False}


def test_weights_load_in_compute_dtype_with_float32_norms(golden_tower):
    dtype = golden_tower.dtype
    for name, param in golden_tower.state_dict().items():
        expected = torch.float32 if is_norm_weight(name) else dtype
        assert param.dtype == expected, f"{name}: {param.dtype}, expected {expected}"
    norms = [n for n in golden_tower.state_dict() if is_norm_weight(n)]
    assert len(norms) == 2 * golden_tower.cfg.n_layers + 1


@pytest.mark.parametrize("features", FEATURES)
def test_per_image_forward_matches_reference(golden, golden_inputs, golden_tower, features):
    tol = TOLERANCE[golden_tower.dtype]
    for case, patches, canvas in golden_inputs:
        with torch.inference_mode():
            out = golden_tower.forward_image(patches, canvas.n_h, canvas.n_w, features)
        assert out.dtype == golden_tower.dtype
        err = rel_err(out, golden.tensors[f"{case.key}.{features}"])
        assert err < tol, f"{case.name} {features}: rel err {err:.3g} >= {tol}"


@pytest.mark.parametrize("features", FEATURES)
def test_packed_forward_of_all_images_matches_reference(golden, golden_inputs, golden_tower,
                                                        features):
    tol = TOLERANCE[golden_tower.dtype]
    items = [(patches, canvas.n_h, canvas.n_w) for _, patches, canvas in golden_inputs]
    outs = packed_forward(golden_tower, items, features)
    assert len(outs) == len(golden_inputs)
    for (case, _, _), out in zip(golden_inputs, outs):
        err = rel_err(out, golden.tensors[f"{case.key}.{features}"])
        assert err < tol, f"{case.name} {features} (packed): rel err {err:.3g} >= {tol}"
