"""``dsv4enc extract``: a vision-only checkpoint cut out of a full one, its tower's tensors
copied as stored, one at a time (never the whole tower in memory): the same embeddings and
weights fingerprint as the source."""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from .checkpoint import (checked_shape, checked_shapes, checkpoint_folder,
                         locate_tower_tensors, open_safetensors)
from .config import VisionConfig
from .hub import resolve_weights
from ..errors import OutputError, WeightsError

WEIGHTS_NAME = "model.safetensors"
TMP_NAME = f".{WEIGHTS_NAME}.tmp"  # the weights file while it is written
#: The safetensors metadata by which ``--overwrite`` recognises an earlier extract's weights
#: file, the only files it replaces.
EXTRACT_METADATA = {"format": "pt", "dsv4enc": "extract"}
#: The largest safetensors header read when recognising an extract (safetensors' own bound).
MAX_HEADER_BYTES = 100_000_000
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}


@dataclass
class Extracted:
    """What ``extract_tower`` wrote."""

    folder: Path
    tensors: int
    bytes: int
    source: str


def _prepare_out(out: Path, overwrite: bool) -> None:
    """Make folder ``out``, once it is empty or (with ``overwrite``) holds only an earlier
    extract's files: dsv4enc replaces nothing it did not write."""
    if out.exists() and not out.is_dir():
        raise OutputError(f"--out {out} is a file, not a folder")
    if out.is_dir():
        entries = sorted(out.iterdir())
        foreign = next((p.name for p in entries if not _is_extract_file(p)), None)
        if foreign is not None:
            raise OutputError(f"--out folder {out} holds {foreign}, which dsv4enc extract did "
                              "not write; extract replaces only its own files: choose an empty "
                              "or new folder")
        if entries and not overwrite:
            raise OutputError(f"--out folder {out} holds an earlier extract; pass --overwrite "
                              "to replace it")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"cannot create {out}: {exc.strerror or exc}") from None


def _is_extract_file(path: Path) -> bool:
    """Whether an extract wrote ``path``: a weights file (or its temporary copy) whose header
    carries ``EXTRACT_METADATA``, or the config.json beside one (written after it)."""
    if path.is_symlink() or not path.is_file():
        return False
    if path.name == "config.json":
        return _is_extract_file(path.with_name(WEIGHTS_NAME))
    return path.name in (WEIGHTS_NAME, TMP_NAME) and _metadata(path) == EXTRACT_METADATA


def _metadata(path: Path) -> dict | None:
    """The ``__metadata__`` of safetensors file ``path``'s header (None: no readable one)."""
    try:
        with open(path, "rb") as handle:
            size = struct.unpack("<Q", handle.read(8))[0]
            if size > MAX_HEADER_BYTES:
                return None
            header = json.loads(handle.read(size))
    except (OSError, struct.error, ValueError):
        return None
    return header.get("__metadata__") if isinstance(header, dict) else None


def extract_tower(source: str | os.PathLike, out: str | os.PathLike,
                  overwrite: bool = False) -> Extracted:
    """Write the tower of checkpoint ``source`` (a folder or a Hub id) to folder ``out``."""
    folder = checkpoint_folder(resolve_weights(source))
    cfg = VisionConfig.from_file(folder / "config.json")  # a bad one is one line
    raw_config = json.loads((folder / "config.json").read_text())
    located = locate_tower_tensors(folder)
    shapes = checked_shapes(cfg, located)
    out = Path(out)
    if out.resolve() == folder.resolve():
        raise OutputError("--out must differ from the source checkpoint folder")

    # The header first (dtype, shape, byte range of every tensor, in name order) ...
    names = sorted(shapes)
    header: dict[str, dict] = {"__metadata__": dict(EXTRACT_METADATA)}
    offset = 0
    handles = {}
    try:
        for name in names:
            path = located[name]
            if path not in handles:
                handles[path] = open_safetensors(path)
            shape = checked_shape(handles[path], name, shapes)
            dtype = handles[path].get_slice(name).get_dtype()
            if dtype not in _DTYPE_BYTES:
                raise WeightsError(f"tower tensor {name} has unsupported dtype {dtype}")
            end = offset + math.prod(shape) * _DTYPE_BYTES[dtype]
            header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, end]}
            offset = end
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned

        # ... then the bytes, one tensor at a time, under a temporary name, in --out made
        # only now that every tower tensor was found, of its shape and dtype.
        _prepare_out(out, overwrite)
        target = out / WEIGHTS_NAME
        tmp = out / TMP_NAME
        try:
            with open(tmp, "wb") as handle:
                handle.write(struct.pack("<Q", len(blob)))
                handle.write(blob)
                for name in names:
                    tensor = handles[located[name]].get_tensor(name)
                    handle.write(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, target)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise OutputError(f"cannot write {target}: {exc.strerror or exc}") from None
    finally:
        handles.clear()

    config = cfg.to_flat()
    if isinstance(raw_config.get("model_type"), str):
        config = {"model_type": raw_config["model_type"], **config}
    written = out / "config.json"
    try:
        written.write_text(json.dumps(config, indent=1) + "\n")
    except OSError as exc:  # no half-written config.json: `--weights` would read it
        written.unlink(missing_ok=True)
        raise OutputError(f"cannot write {written}: {exc.strerror or exc}") from None
    return Extracted(out, len(names), offset, str(folder))
