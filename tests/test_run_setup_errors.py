"""Setup failures end the command with one clear line on stderr, no traceback and a non-zero
exit (1: setup, 2: usage), before anything is written; a full disk keeps what was committed
and ``--resume`` then finishes the run.

A handful of cases run as real ``python -m dsv4enc`` processes (started together, so their
start-up is paid once): nothing that the interpreter, torch or pyarrow print may spoil the
one line. The rest run in this process through Typer's CliRunner.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from dsv4enc.output import appending
from dsv4enc.output import parquet_join
from dsv4enc.output import parts as writer
from dsv4enc.tower.checkpoint import random_state_dict, save_checkpoint
from dsv4enc.cli import app
from dsv4enc.tower.config import VisionConfig
from dsv4enc.errors import OutputError, UsageError, output_os_error
from dsv4enc.process import available_cpus
from dsv4enc.run.options import WORKERS_PER_CPU
from dsv4enc.run.pipeline import EncodeOptions, run_encode
from dsv4enc.output.files import old_folder
from dsv4enc.output.read import load_manifest

from helpers import REPO_ROOT, needs_cuda, parts_of

runner = CliRunner()
IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
N_IMAGES = 12
PART = 3
#: The parts the images' keys are cut into
PARTS = parts_of([f"im{i:02d}.png" for i in range(N_IMAGES)], PART)


# --------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def cfg(small_cfg) -> VisionConfig:
    return small_cfg


@pytest.fixture(scope="module")
def state(cfg) -> dict[str, torch.Tensor]:
    return random_state_dict(cfg, seed=3)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, cfg, state) -> dict[str, Path]:
    """A good checkpoint and broken variants of it."""
    root = tmp_path_factory.mktemp("setup_ckpts")
    missing = dict(state)
    del missing["vision.blocks.1.mlp.w2.weight"]
    shaped = dict(state)
    shaped["aligner.w1.weight"] = state["aligner.w1.weight"].t().contiguous()
    integer = dict(state)
    integer["vision.norm.weight"] = torch.ones(cfg.dim, dtype=torch.int32)
    variants = {"good": state, "missing": missing, "shaped": shaped, "integer": integer}
    for name, tensors in variants.items():
        save_checkpoint(root / name, cfg, tensors)
    return {name: root / name for name in variants}


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("setup_images")
    rng = np.random.default_rng(1)
    for i in range(N_IMAGES):
        Image.fromarray(rng.integers(0, 256, (20 + i, 30, 3), dtype=np.uint8)).save(
            folder / f"im{i:02d}.png")
    return folder


def check_one_line(code: int, stderr: str, want: int, output: str = "") -> str:
    assert code == want, (code, stderr, output)
    assert "Traceback" not in stderr + output
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: "), lines[0]
    return lines[0]


# --------------------------------------------------------------------------- real processes

SUBPROCESS_CASES = ("missing weights folder", "missing tensor", "wrong shape",
                    "tensor of unsupported dtype", "unsupported --dtype", "output under a file",
                    "resume with overwrite")


def subprocess_cases(ckpts: dict[str, Path], images: Path, tmp: Path) -> dict[str, tuple]:
    """id -> (arguments after ``encode IMAGES --out OUT``, exit code, words the line holds)."""
    (tmp / "a_file").write_text("")
    return {
        "missing weights folder": (["--weights", str(tmp / "nowhere")], 1,
                                   ["weights folder not found", "nowhere"]),
        "missing tensor": (["--weights", str(ckpts["missing"])], 1,
                           ["missing", "vision.blocks.1.mlp.w2.weight"]),
        "wrong shape": (["--weights", str(ckpts["shaped"])], 1,
                        ["aligner.w1.weight", "shape"]),
        "tensor of unsupported dtype": (["--weights", str(ckpts["integer"])], 1,
                                        ["vision.norm.weight", "int32"]),
        "unsupported --dtype": (["--weights", str(ckpts["good"]), "--dtype", "int8"], 2,
                                ["int8", "float32"]),
        "output under a file": (["--weights", str(ckpts["good"]), "--out",
                                 str(tmp / "a_file" / "e.parquet")], 1,
                                ["a_file", "not a folder"]),
        "resume with overwrite": (["--weights", str(ckpts["good"]), "--resume",
                                   "--overwrite"], 2, ["--resume", "--overwrite"]),
    }


@pytest.fixture(scope="module")
def finished_processes(ckpts, images, tmp_path_factory) -> dict[str, tuple]:
    tmp = tmp_path_factory.mktemp("setup_procs")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "80",
           "PYTHONPATH": str(REPO_ROOT)}
    env.pop("DSV4ENC_WEIGHTS", None)
    cases = subprocess_cases(ckpts, images, tmp)
    procs = {}
    for number, (case, (args, _, _)) in enumerate(cases.items()):
        out = str(tmp / f"out{number}" / "e.parquet")
        full = [sys.executable, "-m", "dsv4enc", "encode", str(images), "--out", out,
                "--device", "cpu", "--workers", "0", *args]  # a later --out wins
        procs[case] = subprocess.Popen(full, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True, env=env)
    done = {}
    for case, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        done[case] = (proc.returncode, stdout, stderr)
    leftovers = [p.name for p in tmp.iterdir() if p.name.startswith("out")]
    return {"cases": cases, "done": done, "leftovers": leftovers}


@pytest.mark.parametrize("case", SUBPROCESS_CASES)
def test_setup_failure_in_a_real_process_is_one_line(finished_processes, case):
    _, want, words = finished_processes["cases"][case]
    code, stdout, stderr = finished_processes["done"][case]
    line = check_one_line(code, stderr, want, stdout)
    for word in words:
        assert word in line, (word, line)
    assert len(line) < 400  # a long path wraps in a terminal, but is still one line


def test_failed_starts_write_nothing(finished_processes):
    assert finished_processes["leftovers"] == []


def test_a_tower_past_the_memory_is_one_line(tmp_path, images):
    """A valid config whose tower (4 GiB in float32) is more than the process may allocate
    (its data segment bound to 2 GiB, as on a smaller machine): one line saying what the tower
    needs, exit 1, rather than the allocator's traceback."""
    config = tmp_path / "wide.json"
    flat = VisionConfig.from_file(REPO_ROOT / "configs" / "tiny.json").to_flat()
    config.write_text(json.dumps(dict(flat, vision_dim=4096, vision_n_heads=16,
                                      vision_inter_dim=16384, vision_n_layers=4)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}

    def bound_memory() -> None:
        resource.setrlimit(resource.RLIMIT_DATA, (2 << 30, resource.RLIM_INFINITY))

    proc = subprocess.run(
        [sys.executable, "-m", "dsv4enc", "encode", str(images), "--out",
         str(tmp_path / "o" / "e.parquet"), "--device", "cpu", "--workers", "0", "--dtype",
         "float32", "--config", str(config), "--random-init"],
        capture_output=True, text=True, env=env, preexec_fn=bound_memory, timeout=300)
    line = check_one_line(proc.returncode, proc.stderr, 1, proc.stdout)
    assert "needs 4.0 GiB" in line and "float32" in line and "memory" in line, line
    assert not (tmp_path / "o").exists()


# --------------------------------------------------------------------------- in-process

def encode(*args: str, env: dict | None = None):
    return runner.invoke(app, ["encode", *args, "-q"],
                         env={"DSV4ENC_WEIGHTS": None, "COLUMNS": "80", **(env or {})})


@pytest.mark.parametrize("args, code, words", [
    (["--random-init"], 2, ["--random-init", "--config"]),
    (["--random-init", "--weights", "W"], 2, ["--random-init", "--weights"]),
    (["--random-init", "--config", "C", "--weights", "W"], 2, ["--weights"]),
    (["--weights", "W", "--device", "tpu"], 2, ["tpu"]),
    (["--weights", "W", "--device", "cuda:banana"], 2, ["cuda:banana"]),
    (["--weights", "W", "--batch-tokens", "-5"], 2, ["--batch-tokens", "-5"]),
    (["--weights", "W", "--batch-tokens", "0"], 2, ["--batch-tokens"]),
    (["--weights", "W", "--max-pixels", "0"], 2, ["--max-pixels"]),
    (["--weights", "W", "--max-pixels", "100000000000000000000"], 2, ["--max-pixels", "2**36"]),
    (["--random-init", "--config", "C", "--seed", "99999999999999999999999"], 2,
     ["--seed", "2**64-1"]),
    (["--weights", "W", "--part-images", "0"], 2, ["--part-images"]),
    (["--weights", "W", "--workers", "-1"], 2, ["--workers"]),
    (["--weights", "W", "--decode-timeout", "0"], 2, ["timeout"]),
    (["--weights", "W", "--decode-timeout", "nan"], 2, ["timeout"]),
    (["--weights", "W", "--commit-every", "nan"], 2, ["--commit-every"]),
    (["--weights", "W", "--features", "pixels"], 2, ["--features"]),
    (["--weights", "W", "--out-dtype", "int8"], 2, ["--out-dtype"]),
    (["--weights", "W", "--tp-mode", "weights"], 2, ["--tp-mode weights", "torchrun", "2 or"]),
    ([], 2, ["--weights", "DSV4ENC_WEIGHTS"]),
])
def test_options_that_make_no_sense(tmp_path, images, ckpts, args, code, words):
    args = [str(ckpts["good"]) if a == "W" else
            str(REPO_ROOT / "configs" / "tiny.json") if a == "C" else a for a in args]
    out = tmp_path / "o" / "e.parquet"
    result = encode(str(images), "--out", str(out), "--device", "cpu", *args)
    line = check_one_line(result.exit_code, result.stderr, code, result.output)
    for word in words:
        assert word in line, (word, line)
    assert not (tmp_path / "o").exists()


def test_more_decode_workers_than_the_machine_can_run_are_refused(tmp_path, images, ckpts):
    """A --workers past WORKERS_PER_CPU a CPU (a typo's 100000) is one line naming the bound,
    exit 2, instead of starting every process (minutes of spawning, then the OOM killer)."""
    most = WORKERS_PER_CPU * available_cpus()
    out = tmp_path / "o" / "e.parquet"
    result = encode(str(images), "--out", str(out), "--device", "cpu", "--weights",
                    str(ckpts["good"]), "--workers", str(most + 1))
    line = check_one_line(result.exit_code, result.stderr, 2, result.output)
    assert f"--workers {most + 1}" in line and f"at most {most}" in line, line
    assert not (tmp_path / "o").exists()


def test_tensor_parallel_in_one_process_is_refused_by_run_encode(tmp_path, images, ckpts):
    """The Python API's run in one process refuses --tp-mode weights as the command does
    (the tower would stay whole), before the output is made."""
    out = tmp_path / "o" / "e.parquet"
    with pytest.raises(UsageError, match=r"^--tp-mode weights splits the tower across "
                                         r"torchrun ranks"):
        run_encode(options(images, out, ckpts["good"], tp_mode="weights"))
    assert not (tmp_path / "o").exists()


def test_refused_options_leave_an_update_s_stopped_switch_as_it_is(tmp_path, images, ckpts):
    """Options are checked before the output is touched: a refused --update leaves the old
    output that a switch stopped between its two renames put aside where it is."""
    out = tmp_path / "o"
    aside = old_folder(out)
    aside.mkdir()
    with pytest.raises(UsageError, match="--update and --resume contradict"):
        run_encode(options(images, out, ckpts["good"], update=True, resume=True))
    assert aside.is_dir() and not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_asked_for_without_cuda(tmp_path, images, ckpts):
    result = encode(str(images), "--out", str(tmp_path / "e.parquet"), "--weights",
                    str(ckpts["good"]), "--device", "cuda")
    assert "CUDA" in check_one_line(result.exit_code, result.stderr, 2)


@needs_cuda
def test_a_cuda_device_past_the_machine_s_count(tmp_path, images, ckpts):
    past = f"cuda:{torch.cuda.device_count()}"
    result = encode(str(images), "--out", str(tmp_path / "e.parquet"), "--weights",
                    str(ckpts["good"]), "--device", past)
    assert past in check_one_line(result.exit_code, result.stderr, 2)
    assert not (tmp_path / "e.parquet").exists()


@pytest.mark.skipif(IS_ROOT, reason="chmod does not stop root from writing")
def test_read_only_output_folder(tmp_path, images, ckpts):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        result = encode(str(images), "--out", str(folder / "e.parquet"), "--weights",
                        str(ckpts["good"]), "--device", "cpu", "--workers", "0")
        line = check_one_line(result.exit_code, result.stderr, 1)
        assert "cannot write" in line and "ro" in line
    finally:
        folder.chmod(0o755)


# --------------------------------------------------------------------------- a full disk

def options(images: Path, out: Path, ckpt: Path, **changes) -> EncodeOptions:
    base = dict(inputs=[str(images)], out=str(out), weights=str(ckpt), device="cpu",
                workers=0, part_images=PART, progress=False)
    return EncodeOptions(**{**base, **changes})


@pytest.fixture(scope="module")
def clean(images, ckpts, tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("setup_clean") / "e.parquet"
    run_encode(options(images, out, ckpts["good"]))
    return pq.read_table(out).to_pylist()


def enospc(*_args, **_kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def manifest_parts(partial: Path) -> dict:
    return load_manifest(partial / "_manifest.json")["parts"]


def resume_and_compare(images, out, ckpt, clean, reused: int) -> None:
    summary = run_encode(options(images, out, ckpt, resume=True))
    assert summary.reused == reused
    assert pq.read_table(out).to_pylist() == clean
    assert not out.with_name(out.name + ".partial").exists()


@pytest.fixture(params=["appended", "joined"])
def single_file(request, monkeypatch) -> str:
    """How a single-file output is built: appended to one growing file (one local process),
    or joined from part files (torchrun, object storage), forced here by saying positioned
    writes are missing."""
    if request.param == "joined":
        monkeypatch.setattr(appending, "AVAILABLE", False)
    return request.param


def recorded_end(partial: Path) -> int:
    """Where the growing file's last recorded range ends."""
    return max(p["offset"] + p["length"] for p in manifest_parts(partial).values())


def test_disk_full_writing_a_part_keeps_committed_parts_then_resume(
        tmp_path, images, ckpts, clean, monkeypatch, single_file):
    if single_file == "joined":
        real_write = writer.pq.write_table
        calls = []

        def write_table(*args, **kwargs):
            calls.append(args[1])
            if len(calls) > 1:
                enospc()
            return real_write(*args, **kwargs)

        monkeypatch.setattr(writer.pq, "write_table", write_table)
    else:
        real_write = appending.RangeSink.write
        ranges = []

        def write(self, data):  # the second part's range is where the disk fills up
            if self.base not in ranges:
                ranges.append(self.base)
            if len(ranges) > 1:
                enospc()
            return real_write(self, data)

        monkeypatch.setattr(appending.RangeSink, "write", write)
    out = tmp_path / "e.parquet"
    result = encode(str(images), "--out", str(out), "--weights", str(ckpts["good"]),
                    "--device", "cpu", "--workers", "0", "--part-images", str(PART))
    line = check_one_line(result.exit_code, result.stderr, 1)
    assert "no space left" in line and "--resume" in line
    monkeypatch.undo()
    partial = out.with_name("e.parquet.partial")
    parts = manifest_parts(partial)
    assert list(parts) == ["part-000000"]
    if single_file == "joined":
        first = pq.read_table(partial / parts["part-000000"]["file"]).to_pylist()
        assert first == clean[:PARTS[0][1]]
        assert sorted(p.name for p in partial.iterdir()) == [
            "_manifest.journal", "_manifest.json", "part-000000.parquet"]
    else:
        assert sorted(p.name for p in partial.iterdir()) == sorted(
            ["_manifest.journal", "_manifest.json", appending.GROWING_NAME])
    assert not out.exists()
    resume_and_compare(images, out, ckpts["good"], clean, reused=PARTS[0][1])


def test_disk_full_recording_a_part_then_resume(tmp_path, images, ckpts, clean, monkeypatch,
                                                single_file):
    """The part's bytes landed, but its journal line was torn by a full disk: the part is
    not trusted (it is encoded again)."""
    real_append = writer.PartStore._append

    def append(self, line):
        if self.parts:  # the second commit: half its line lands, then the disk is full
            with open(self.journal_path, "ab") as journal:
                journal.write(line[:len(line) // 2])
            raise output_os_error(self.journal_path, OSError(errno.ENOSPC, "No space"))
        return real_append(self, line)

    monkeypatch.setattr(writer.PartStore, "_append", append)
    out = tmp_path / "e.parquet"
    with pytest.raises(OutputError, match="no space left"):
        run_encode(options(images, out, ckpts["good"]))
    monkeypatch.undo()
    partial = out.with_name("e.parquet.partial")
    assert list(manifest_parts(partial)) == ["part-000000"]
    if single_file == "joined":
        assert (partial / "part-000001_000001.parquet").is_file()  # on disk, but not recorded
    else:  # its bytes follow the recorded range, unrecorded
        assert (partial / appending.GROWING_NAME).stat().st_size > recorded_end(partial)
    resume_and_compare(images, out, ckpts["good"], clean, reused=PARTS[0][1])


def test_disk_full_writing_the_final_file_then_resume(tmp_path, images, ckpts, clean,
                                                      monkeypatch, single_file):
    if single_file == "joined":
        # The final file is the parts' bytes joined: the disk fills up while copying them.
        monkeypatch.setattr(writer.ParquetJoiner, "append", enospc)
    else:
        # Every part is in the growing file: the disk fills up writing its footer.
        real_finish = appending.AppendingStore.finish

        def finish(self):
            monkeypatch.setattr(parquet_join, "pwrite_all", enospc)
            return real_finish(self)

        monkeypatch.setattr(appending.AppendingStore, "finish", finish)
    out = tmp_path / "e.parquet"
    with pytest.raises(OutputError, match="no space left") as caught:
        run_encode(options(images, out, ckpts["good"]))
    assert "\n" not in str(caught.value)
    monkeypatch.undo()
    assert not out.exists() and not out.with_name(".e.parquet.tmp").exists()
    partial = out.with_name("e.parquet.partial")
    assert len(manifest_parts(partial)) == len(PARTS)
    resume_and_compare(images, out, ckpts["good"], clean, reused=N_IMAGES)
