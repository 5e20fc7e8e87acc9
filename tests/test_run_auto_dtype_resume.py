"""``--dtype auto`` and ``--resume``: a resumed run computes in the dtype the interrupted run
used, says so in one line, and ends bit for bit equal to a clean run in that dtype."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from dsv4enc.engine.cpufeatures import PIN_VARIABLE
from dsv4enc.engine.device import resume_compute
from dsv4enc.output.files import LOCK_NAME

from helpers import CONFIGS, REPO_ROOT, Pauses

N_IMAGES = 12


@pytest.fixture
def images(tmp_path: Path) -> Path:
    folder = tmp_path / "images"
    folder.mkdir()
    rng = np.random.default_rng(5)
    for i in range(N_IMAGES):
        pixels = rng.integers(0, 256, (24 + i, 32, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"img{i:02d}.png")
    return folder


def command(images: Path, out: Path, *extra: str) -> list[str]:
    """``dsv4enc encode`` with ``--dtype`` left to auto."""
    return [sys.executable, "-m", "dsv4enc", "encode", str(images), "--out", str(out),
            "--config", str(CONFIGS / "tiny.json"), "--random-init", "--device", "cpu",
            "--part-images", "3", "--workers", "1", "--log-every", "3600", *extra]


def environment(auto_means: str) -> dict[str, str]:
    """A process on a CPU where ``auto`` means ``auto_means`` (pinned, as a CPU kind
    measured faster in bfloat16, or in float32, would decide)."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1",
           PIN_VARIABLE: auto_means}
    env.pop("DSV4ENC_WEIGHTS", None)
    return env


def rows(path: Path) -> list[dict]:
    return pq.read_table(path).to_pylist()


def test_resume_with_auto_adopts_the_interrupted_dtype(images, tmp_path):
    out = tmp_path / "e.parquet"
    pauses = Pauses(tmp_path / "pauses", "commit")
    first = subprocess.Popen(command(images, out), env=pauses.env(environment("bfloat16")),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        pauses.wait("commit", proc=first)  # one part committed in bfloat16: killed there
        first.kill()
    finally:
        first.kill()
        first.wait()
    partial = out.with_name("e.parquet.partial")
    def kept() -> dict[str, bytes]:  # the parts and manifest (the lock comes and goes)
        return {p.name: p.read_bytes() for p in partial.iterdir() if p.name != LOCK_NAME}

    before = kept()

    # An explicit other dtype is refused, naming the flag that would resume.
    refused = subprocess.run(command(images, out, "--resume", "--dtype", "float32"),
                             env=environment("bfloat16"), capture_output=True, text=True,
                             timeout=600)
    assert refused.returncode == 2, refused.stderr
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "rerun with --dtype bfloat16 to resume" in lines[0], lines
    assert kept() == before  # nothing touched

    # The same command on a CPU where auto now means float32: it follows the record.
    resumed = subprocess.run(command(images, out, "--resume"), env=environment("float32"),
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    said = [line for line in resumed.stderr.splitlines() if "resuming in" in line]
    assert said == ["dsv4enc: resuming in bfloat16 on cpu, as the interrupted run computed "
                    "(for --dtype auto)"], resumed.stderr
    assert "encoded again" not in resumed.stderr and "pyarrow" not in resumed.stderr
    assert "in bfloat16" in resumed.stderr.splitlines()[0]  # the opening line's dtype

    clean = tmp_path / "clean.parquet"
    done = subprocess.run(command(images, clean, "--dtype", "bfloat16"),
                          env=environment("float32"), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    assert rows(out) == rows(clean)  # bit for bit: embeddings compare as exact bytes
    settings = json.loads(pq.read_schema(out).metadata[b"dsv4enc"])
    assert settings["compute_dtype"] == "bfloat16", settings


def test_resume_compute_follows_the_record_only_where_auto_chose():
    cpu, f32, bf16 = torch.device("cpu"), torch.float32, torch.bfloat16
    record = {"device": "cpu", "compute_dtype": "bfloat16"}
    assert resume_compute(cpu, f32, "auto", "auto", None) == (cpu, f32, None)
    device, dtype, line = resume_compute(cpu, f32, "auto", "auto", record)
    assert (device, dtype) == (cpu, bf16)
    assert line.endswith("(for --device auto and --dtype auto)")
    # explicit flags are kept: the settings check refuses a mismatch and names the flag
    assert resume_compute(cpu, f32, "cpu", "float32", record) == (cpu, f32, None)
    device, dtype, line = resume_compute(cpu, f32, "cpu", "auto", record)
    assert dtype == bf16 and line.endswith("(for --dtype auto)")
    # a record from a CUDA run, resumed where there is none: the device stays (and the
    # settings check then names --device cuda)
    if not torch.cuda.is_available():
        cuda_record = {"device": "cuda", "compute_dtype": "bfloat16"}
        device, dtype, line = resume_compute(cpu, f32, "auto", "auto", cuda_record)
        assert device == cpu and dtype == bf16 and line.endswith("(for --dtype auto)")
    # a torchrun rank's device is its own
    device, _, _ = resume_compute(cpu, f32, "auto", "auto", {"device": "cuda"},
                                  device_fixed=True)
    assert device == cpu
