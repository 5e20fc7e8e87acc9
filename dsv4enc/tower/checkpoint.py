"""Checkpoint loading: the tower's tensors only, from only the shards that hold them.

A full checkpoint holds hundreds of GB of language-model tensors beside the tower's: its index
(else each file's header) names the files holding ``vision.``/``aligner.`` tensors, and only
those tensors are read, memory-mapped."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from .config import VisionConfig
from ..errors import InsufficientMemory, WeightsError
from .model import VisionTower

TOWER_PREFIXES = ("vision.", "aligner.")
INDEX_NAME = "model.safetensors.index.json"
FLOAT_DTYPES = {torch.float32, torch.bfloat16, torch.float16, torch.float64}
COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def is_tower_tensor(name: str) -> bool:
    return name.startswith(TOWER_PREFIXES)


def keeps_float32(name: str) -> bool:
    """Norm weights stay float32 whatever the compute dtype (their math is float32)."""
    return ".norm" in name and name.endswith(".weight")


def expected_shapes(cfg: VisionConfig) -> dict[str, tuple[int, ...]]:
    """Every tower tensor's name and shape, from the model itself (built on the meta device)."""
    with torch.device("meta"):
        model = VisionTower(cfg)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def checked_shapes(cfg: VisionConfig, located: dict[str, Path]) -> dict[str, tuple[int, ...]]:
    """``expected_shapes(cfg)``, once ``located`` holds exactly those tower tensors."""
    shapes = expected_shapes(cfg)
    missing = sorted(set(shapes) - set(located))
    if missing:
        raise WeightsError(f"checkpoint is missing tower tensor {missing[0]}")
    extra = sorted(set(located) - set(shapes))
    if extra:
        raise WeightsError(f"checkpoint has unexpected tower tensor {extra[0]} "
                           "(does config.json match the weights?)")
    return shapes


def tower_bytes(cfg: VisionConfig, dtype: torch.dtype) -> int:
    """The bytes of the tower's weights in ``dtype`` (norms float32)."""
    return sum(math.prod(shape) * (4 if keeps_float32(name) else dtype.itemsize)
               for name, shape in expected_shapes(cfg).items())


def _is_allocation_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a MemoryError, a device's OutOfMemoryError, or the RuntimeError of
    torch's CPU allocator or of a size past its arithmetic."""
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        sign in text for sign in ("can't allocate memory", "out of memory",
                                  "Storage size calculation overflowed"))


@contextlib.contextmanager
def holding_tower(cfg: VisionConfig, dtype: torch.dtype, device: str | None = None):
    """Run the block that allocates the tower's weights (on ``device``; None: in RAM): an
    allocation failure in it becomes one line saying how much the tower needs. A tower larger
    than the RAM is refused first: with overcommit, writing it could end in the OOM killer."""
    need = tower_bytes(cfg, dtype)
    where = f"device {device}" if device is not None else "this machine"
    lacking = InsufficientMemory(
        f"the tower ({cfg.dim} wide, {cfg.n_layers} deep) needs {need / 2**30:.1f} GiB "
        f"of weights in {str(dtype).removeprefix('torch.')}, more memory than {where} can "
        "allocate")
    try:
        ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # the OS does not say
        ram = None
    if device is None and ram is not None and need > ram:
        raise lacking
    try:
        yield
    except (MemoryError, RuntimeError) as exc:
        if not _is_allocation_failure(exc):
            raise
        raise lacking from None


@dataclass
class Checkpoint:
    """A loaded tower: config, state dict in the compute dtype, and a weights fingerprint."""

    config: VisionConfig
    state_dict: dict[str, torch.Tensor]
    fingerprint: str
    source: str


def tower_index(index_path: Path) -> dict[str, str]:
    """Each tower tensor's file name, from the safetensors index at ``index_path``."""
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
        located = {name: fname for name, fname in weight_map.items() if is_tower_tensor(name)}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise WeightsError(f"{index_path}: not a safetensors index ({exc})") from None
    unnamed = next((name for name, fname in sorted(located.items())
                    if not isinstance(fname, str)), None)
    if unnamed is not None:
        raise WeightsError(f"{index_path}: the index names no file for tower tensor {unnamed} "
                           f"({located[unnamed]!r})")
    return located


def locate_tower_tensors(folder: Path) -> dict[str, Path]:
    """Map each tower tensor name to the safetensors file holding it."""
    index_path = folder / INDEX_NAME
    if index_path.is_file():
        return {name: folder / fname for name, fname in tower_index(index_path).items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"{folder}: no *.safetensors files and no {INDEX_NAME}")
    located: dict[str, Path] = {}
    for path in files:
        with open_safetensors(path) as handle:
            located.update((name, path) for name in handle.keys() if is_tower_tensor(name))
    return located


def open_safetensors(path: Path, named_for: str | None = None):
    """``safe_open`` of ``path``, its failures as one-line WeightsErrors (``named_for``: the
    tensor the index named it for)."""
    if not path.is_file():
        hint = f" (named by the index for {named_for})" if named_for else ""
        what = "is not a regular file" if path.exists() else "not found"
        raise WeightsError(f"weights file {what}: {path}{hint}")
    try:
        path.open("rb").close()  # safetensors words a read denied as "No such file"
    except OSError as exc:
        raise WeightsError(f"cannot read weights file {path}: {exc.strerror or exc}") from None
    try:
        return safe_open(str(path), framework="pt")
    except Exception as exc:  # safetensors raises its own error types for bad headers
        raise WeightsError(f"{path}: not a readable safetensors file ({exc})") from None


def checked_shape(handle, name: str, shapes: dict[str, tuple[int, ...]]) -> list[int]:
    """The stored shape of tensor ``name`` in ``handle``, once it is ``shapes[name]``."""
    shape = list(handle.get_slice(name).get_shape())
    if tuple(shape) != shapes[name]:
        raise WeightsError(f"tower tensor {name} has shape {shape}, "
                           f"expected {list(shapes[name])}")
    return shape


def read_tower_tensors(located: dict[str, Path], cfg: VisionConfig, dtype: torch.dtype,
                       ) -> tuple[dict[str, torch.Tensor], str]:
    """The state dict, its names, shapes and dtypes checked (cast to ``dtype``, norms float32),
    and a fingerprint (blake2b over names, dtypes, shapes and bytes as stored, in name order:
    the same however the weights are sharded)."""
    shapes = checked_shapes(cfg, located)
    by_file: dict[Path, list[str]] = {}
    for name in sorted(shapes):
        by_file.setdefault(located[name], []).append(name)
    tensor_digests: dict[str, bytes] = {}
    state: dict[str, torch.Tensor] = {}
    for path, names in sorted(by_file.items()):
        with open_safetensors(path, named_for=names[0]) as handle:
            available = set(handle.keys())
            for name in names:
                if name not in available:
                    raise WeightsError(f"{path}: index names tower tensor {name}, "
                                       "but the file does not hold it")
                shape = tuple(checked_shape(handle, name, shapes))
                try:
                    tensor = handle.get_tensor(name)
                except Exception as exc:
                    raise WeightsError(f"tower tensor {name} in {path}: "
                                       f"cannot read ({exc})") from None
                if tensor.dtype not in FLOAT_DTYPES:
                    raise WeightsError(f"tower tensor {name} has unsupported dtype "
                                       f"{str(tensor.dtype).removeprefix('torch.')}")
                one = hashlib.blake2b(f"{name}|{tensor.dtype}|{shape}|".encode(), digest_size=16)
                one.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
                tensor_digests[name] = one.digest()
                state[name] = tensor.to(torch.float32 if keeps_float32(name) else dtype)
    joined = b"".join(tensor_digests[name] for name in sorted(tensor_digests))
    return state, hashlib.blake2b(joined, digest_size=16).hexdigest()


def checkpoint_folder(path: str | Path) -> Path:
    """``path`` as a checkpoint folder, once it is a folder holding a config.json."""
    folder = Path(path)
    if not folder.exists():
        raise WeightsError(f"weights folder not found: {folder}")
    if not folder.is_dir():
        raise WeightsError(f"weights path is not a folder: {folder}")
    if not (folder / "config.json").is_file():
        raise WeightsError(f"{folder}: no config.json")
    return folder


def load_checkpoint(path: str | Path, dtype: torch.dtype = torch.float32) -> Checkpoint:
    """Read config and tower tensors from a checkpoint folder."""
    folder = checkpoint_folder(path)
    cfg = VisionConfig.from_file(folder / "config.json")  # ConfigError names file and key
    located = locate_tower_tensors(folder)
    with holding_tower(cfg, dtype):
        state, fingerprint = read_tower_tensors(located, cfg, dtype)
    return Checkpoint(cfg, state, fingerprint, str(folder))


def random_state_dict(cfg: VisionConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random tower as a checkpoint stores it (bf16 weights, float32 norms near one). Weights
    are N(0, 1/fan_in), so activations keep their scale through the layers."""
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in expected_shapes(cfg).items():
        if keeps_float32(name):
            state[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen)
            continue
        fan_in = shape[1] if len(shape) == 2 else shape[0]
        scale = 0.02 if name.endswith(".bias") else fan_in ** -0.5
        state[name] = (scale * torch.randn(shape, generator=gen)).to(torch.bfloat16)
    return state


def random_checkpoint(cfg: VisionConfig, seed: int = 0,
                      dtype: torch.dtype = torch.float32) -> Checkpoint:
    """A random tower for demos and benchmarks, fingerprinted by its config and seed."""
    with holding_tower(cfg, dtype):
        stored = random_state_dict(cfg, seed)
        state = {n: t.to(torch.float32 if keeps_float32(n) else dtype) for n, t in stored.items()}
    key = json.dumps({"config": cfg.to_flat(), "seed": seed}, sort_keys=True)
    fingerprint = "random-" + hashlib.blake2b(key.encode(), digest_size=12).hexdigest()
    return Checkpoint(cfg, state, fingerprint, f"random(seed={seed})")


def build_tower(ckpt: Checkpoint, device: torch.device | str = "cpu") -> VisionTower:
    """Instantiate the tower from a loaded checkpoint, in eval mode, without gradients."""
    with torch.device("meta"):
        model = VisionTower(ckpt.config)
    dtype = next((t.dtype for n, t in ckpt.state_dict.items() if not keeps_float32(n)),
                 torch.float32)
    with holding_tower(ckpt.config, dtype, device=str(device)):
        model.load_state_dict({n: t.to(device) for n, t in ckpt.state_dict.items()},
                              strict=True, assign=True)
    return model.eval().requires_grad_(False)


def save_checkpoint(folder: str | Path, cfg: VisionConfig, state: dict[str, torch.Tensor],
                    extra: dict[str, torch.Tensor] | None = None, shards: int = 1) -> None:
    """Write a checkpoint in the official flat layout (with an index when ``shards`` > 1);
    ``extra`` tensors (e.g. language-model decoys) beside the tower's."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg.to_flat(), indent=1))
    tensors = {**state, **(extra or {})}
    names = sorted(tensors)
    if shards <= 1:
        save_file({n: tensors[n].contiguous() for n in names}, str(folder / "model.safetensors"))
        return
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s::shards]
        save_file({n: tensors[n].contiguous() for n in part}, str(folder / fname))
        weight_map.update({n: fname for n in part})
    (folder / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
