"""Plain helpers shared by the tests (import with ``from helpers import ...``).

Fixtures live in ``conftest.py``; this module holds functions that tests call directly.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np
import pytest
import torch
from PIL import Image

from dsv4enc.tower.attention import VarlenSpans
from dsv4enc.tower.checkpoint import INDEX_NAME
from dsv4enc.tower.config import VisionConfig
from dsv4enc.tower.model import VisionTower, rope_tables
from dsv4enc.engine.packing import pack

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIGS = REPO_ROOT / "configs"

# Nested ("converted") key of every official flat key, as SPEC §1 lists them.
NESTED_VISION_KEYS = {
    "vision_n_layers": "num_hidden_layers",
    "vision_dim": "hidden_size",
    "vision_n_heads": "num_attention_heads",
    "vision_inter_dim": "intermediate_size",
    "vision_patch_size": "patch_size",
    "vision_rope_theta": "rope_theta",
    "vision_downsample_ratio": "downsample_ratio",
    "vision_max_n_token": "max_image_tokens",
    "vision_min_pixels": "min_pixels",
    "vision_max_wh_ratio": "max_wh_ratio",
}

#: File names of the ``sharded_ckpt`` fixture.
SHARD_FILES = ("model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors")
DECOY_ONLY_FILE = "model-00003-of-00003.safetensors"


ImageSpec = tuple[str, tuple[int, int], str]

#: What ``make_images()`` writes by default: (relative path, (width, height), mode).
DEFAULT_IMAGES: tuple[ImageSpec, ...] = (
    ("photo.jpg", (64, 48), "RGB"),
    ("tall.png", (30, 90), "RGBA"),
    ("wide_gray.png", (120, 12), "L"),  # width/height 10: stretched, not padded
    ("palette.gif", (50, 50), "P"),
    ("gray16.png", (40, 30), "I;16"),
    ("cmyk.jpg", (24, 24), "CMYK"),
    ("nested/odd.bmp", (17, 33), "RGB"),
    ("nested/wide.webp", (200, 20), "RGB"),
)


def write_image(path: Path, size: tuple[int, int], mode: str = "RGB",
                seed: int | None = None) -> Path:
    """Write a noise image of ``size`` (width, height) in ``mode``; the format follows the
    suffix. Content is deterministic in the file name (or ``seed``)."""
    rng = np.random.default_rng(zlib.crc32(path.name.encode()) if seed is None else seed)
    w, h = size
    rgb = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")
    if mode == "I;16":
        image = Image.fromarray(rng.integers(0, 65536, (h, w), dtype=np.uint16))
    elif mode == "P":
        image = rgb.quantize(16)
    else:
        image = rgb.convert(mode)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return path


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative error ‖out − ref‖ / ‖ref‖, computed in float64 (the golden README's metric)."""
    out64, ref64 = out.detach().to(torch.float64), ref.detach().to(torch.float64)
    assert out64.shape == ref64.shape, f"shape {tuple(out64.shape)} != {tuple(ref64.shape)}"
    denom = ref64.norm().item()
    num = (out64 - ref64).norm().item()
    return num / denom if denom else num


def nested_layout(flat: Mapping) -> dict:
    """The converted vision_config/text_config layout holding the same values as ``flat``."""
    vision = {NESTED_VISION_KEYS[k]: v for k, v in flat.items() if k in NESTED_VISION_KEYS}
    text = {"hidden_size": flat["hidden_size"]} if "hidden_size" in flat else {}
    return {"model_type": flat.get("model_type", "deepseek_v4"),
            "vision_config": vision,
            "text_config": text}


def write_checkpoint(folder: Path, config: Mapping, files: Mapping[str, Mapping[str, torch.Tensor]],
                     index: bool = True, index_extra: Mapping[str, str] | None = None) -> Path:
    """Write a checkpoint folder with an explicit tensor-to-file layout.

    ``config`` is written as config.json as is (either layout). ``files`` maps a file name to
    the tensors it holds. With ``index``, a model.safetensors.index.json maps every tensor to
    its file; ``index_extra`` adds entries (e.g. names in files that do not exist).
    """
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(dict(config), indent=1))
    weight_map: dict[str, str] = {}
    for fname, tensors in files.items():
        save_file({n: t.contiguous() for n, t in tensors.items()}, str(folder / fname))
        weight_map.update({n: fname for n in tensors})
    weight_map.update(index_extra or {})
    if index:
        (folder / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def decoy_tensors() -> dict[str, torch.Tensor]:
    """Language-model tensors a tower loader must never read: bf16, int8 and (where torch has
    it) FP8. Reading or casting any of them would be a bug."""
    gen = torch.Generator().manual_seed(2)
    decoys = {
        "embed.weight": torch.randn(64, 24, generator=gen).to(torch.bfloat16),
        "layers.0.ffn.experts.0.w1.scale": torch.randint(-8, 8, (16, 4), dtype=torch.int8,
                                                         generator=gen),
        "layers.0.attn.wq.weight": torch.randn(24, 24, generator=gen).to(torch.bfloat16),
        "head.weight": torch.randn(64, 24, generator=gen).to(torch.bfloat16),
    }
    if hasattr(torch, "float8_e4m3fn"):
        fp8 = torch.randn(16, 32, generator=gen).to(torch.float8_e4m3fn)
        decoys["layers.0.ffn.experts.0.w1.weight"] = fp8
    return decoys


def packed_forward(model: VisionTower, items: Sequence[tuple[torch.Tensor, int, int]],
                   features: str = "aligner") -> list[torch.Tensor]:
    """Run ``(patches, n_h, n_w)`` items as one packed forward; return one output per item."""
    batch = pack(items, model.cfg.downsample_ratio, features)
    cos, sin = rope_tables(batch.positions, model.cfg)
    spans = VarlenSpans.from_lengths(batch.lengths, "cpu")
    with torch.inference_mode():
        out = model.forward_packed(batch.patches, cos, sin, spans, batch.merge_index,
                                   batch.merge_mask, features)
    return batch.split_rows(out)


def load_config(name: str) -> VisionConfig:
    """A config shipped in configs/ (``tiny``, ``medium``, ``deepseek-v4-flash``)."""
    return VisionConfig.from_file(CONFIGS / f"{name}.json")


def parts_of(keys: Sequence[str], part_images: int) -> list[tuple[int, int]]:
    """The input ranges ``(start, end)`` of the parts a run cuts ``keys`` (in input order)
    into at ``--part-images part_images``."""
    from dsv4enc.images.headers import Planned
    from dsv4enc.images.items import InputItem
    from dsv4enc.run.plan import cut_parts

    return [(p.start, p.end)
            for p in cut_parts([Planned(InputItem(key, key)) for key in keys], part_images)]


def all_items(groups: Iterable[Iterable[int]]) -> list[int]:
    """Flatten bins of indices (for packing checks)."""
    return [i for group in groups for i in group]


def table_rows(table) -> list[dict]:
    """``table.to_pylist()`` for a dsv4enc output, whatever its embedding layout: each
    embedding as nested Python lists of floats (rows of width values, or one vector when
    pooled), None for failed rows, exactly as the ``nested`` layout reads back."""
    from dsv4enc.output.read import embedding_arrays, embedding_format

    if "embedding" not in table.column_names:
        return table.to_pylist()
    arrays = embedding_arrays(table.column("embedding"), embedding_format(table.schema))
    rows = table.drop_columns(["embedding"]).to_pylist()
    names = table.column_names
    return [{name: (None if a is None else a.tolist()) if name == "embedding" else row[name]
             for name in names} for row, a in zip(rows, arrays)]


def random_patch_items(grids: Iterable[tuple[int, int]], patch_dim: int,
                       seed: int = 0) -> list[tuple[torch.Tensor, int, int]]:
    """``(patches (h*w, patch_dim) bfloat16, h, w)`` of random content for each grid."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(h * w, patch_dim, generator=gen).to(torch.bfloat16), h, w)
            for h, w in grids]


def record_hub_downloads(hf, monkeypatch) -> list[str]:
    """Make ``hf.hf_hub_download`` (huggingface_hub's module) record each file name it is
    asked for, in order, into the returned list."""
    names: list[str] = []
    original = hf.hf_hub_download

    def recording(repo_id, filename, **kwargs):
        names.append(filename)
        return original(repo_id, filename, **kwargs)

    monkeypatch.setattr(hf, "hf_hub_download", recording)
    return names


def processes_gone(pids: Iterable[int], timeout_s: float = 30.0) -> bool:
    """Wait up to ``timeout_s`` until every process in ``pids`` has ended (exited, or a zombie
    nobody reaps); whether they all have. Reads Linux's /proc."""
    def gone(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as stat_file:
                return stat_file.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except FileNotFoundError:
            return True

    pids = list(pids)
    deadline = time.monotonic() + timeout_s
    while not all(gone(pid) for pid in pids):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def torch_threads(n: int):
    """For a module fixture: run its tests with ``n`` torch intra-op threads, then put the
    count back (``yield from torch_threads(1)``)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    yield
    torch.set_num_threads(previous)


class Pauses:
    """The pause points (``dsv4enc.pausepoints``) of one run a test starts in another
    process: the environment that asks for them, waiting until one is reached, releasing.

    The run waits at each named point until released, so a test that kills or signals it
    there acts at a known place however fast or loaded the machine is."""

    def __init__(self, folder: Path, *points: str) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.points = points

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        from dsv4enc.pausepoints import FOLDER_VARIABLE, POINTS_VARIABLE

        return {**(base or {}), POINTS_VARIABLE: ",".join(self.points),
                FOLDER_VARIABLE: str(self.folder)}

    def reached(self, point: str, n: int = 1) -> dict | None:
        """What the run reported at the ``n``-th pause at ``point``; None until it is there."""
        try:
            return json.loads((self.folder / f"{point}.{n}.json").read_text())
        except FileNotFoundError:
            return None

    def wait(self, point: str, n: int = 1, proc=None, hang_guard_s: float = 600.0) -> dict:
        """Block until the run pauses at ``point`` for the ``n``-th time; returns what it
        reported. ``proc``: the run's process, which must not end first. The guard only
        turns a hung run into a failure: no speed is assumed below it."""
        deadline = time.monotonic() + hang_guard_s
        while (facts := self.reached(point, n)) is None:
            if proc is not None and proc.poll() is not None:
                raise AssertionError(f"the run ended (rc {proc.returncode}) before it paused "
                                     f"at {point} #{n}")
            assert time.monotonic() < deadline, f"the run never paused at {point} #{n}"
            time.sleep(0.005)
        return facts

    def release(self, point: str | None = None, n: int = 1) -> None:
        """Let the run go on: past one pause, or (no ``point``) past every pause from now."""
        (self.folder / (f"{point}.{n}.go" if point else "go")).touch()

    def launch(self, *args: str, extra_env: Mapping[str, str] | None = None,
               **popen: Any) -> subprocess.Popen:
        """``python -m dsv4enc *args`` in another process that pauses at these points: one
        thread, this tree's code, no weights from the environment. Its output is piped as
        text unless ``popen`` says otherwise."""
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT),
               **(extra_env or {})}
        env.pop("DSV4ENC_WEIGHTS", None)
        popen = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, **popen}
        return subprocess.Popen([sys.executable, "-m", "dsv4enc", *args], env=self.env(env),
                                **popen)


def launch_tiny(pauses: Pauses, folder: Path, out: str, weights: Path,
                **popen: Any) -> subprocess.Popen:
    """A run of ``folder`` into ``out`` with the tiny checkpoint ``weights``, parts of two
    images, on the CPU, in another process that pauses at ``pauses``' points."""
    return pauses.launch("encode", str(folder), "--out", out, "--weights", str(weights),
                         "--part-images", "2", "--workers", "0", "--device", "cpu", "-q",
                         **popen)


def signal_after_first_part(monkeypatch, signum: int | None = None) -> None:
    """Make an in-process run send itself ``signum`` (SIGTERM by default) right after its
    first part is handed to the writer: a stop at a known point, whatever the speed."""
    import os
    import signal

    from dsv4enc.run.encoding import PartEncoder

    signum = signal.SIGTERM if signum is None else signum
    original = PartEncoder.run

    def run(self, *args, **kwargs):
        for index, part in enumerate(original(self, *args, **kwargs)):
            yield part
            if index == 0:
                os.kill(os.getpid(), signum)

    monkeypatch.setattr(PartEncoder, "run", run)


def needs_cuda(test):
    """A test that runs only where CUDA is available, marked ``cuda`` (``gpu_check.sh`` selects
    the device tests by that mark)."""
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(),
                                               reason="needs CUDA")(test))


@contextlib.contextmanager
def reaped(proc: subprocess.Popen) -> Iterator[subprocess.Popen]:
    """``proc``, killed and waited for on the way out if it still runs: a test that fails
    midway leaves no process behind."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def damage_column_chunks(path: Path, column: str) -> None:
    """Damage the footer of the Parquet file at ``path`` as pyarrow cannot build ``column``'s
    column chunk metadata: its schema element's repetition becomes one no field has, so its
    level histograms no longer fit (pyarrow aborts the whole process, an uncaught C++
    exception, where that metadata is asked for in Python; a read of it raises)."""
    data = bytearray(path.read_bytes())
    name = column.encode()
    at = data.rfind(b"\x02\x18" + bytes([len(name)]) + name)  # optional, then the name
    assert at > 0 and data[at - 1] in (0x25, 0x35), "no such optional leaf column"
    data[at] = 12
    path.write_bytes(bytes(data))


def run_probe(code: str, *args: str) -> subprocess.CompletedProcess:
    """``code`` run by Python in another process with ``args`` (a probe that may abort the
    process: the test survives and sees its exit status)."""
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True,
                          text=True, timeout=300)
