"""README.md runs as written: its ```python and ```bash blocks, in order, in one folder that
holds what a reader has after cloning (``examples/``, ``configs/``), against the Quickstart's
own images and a tiny random checkpoint.

A block that needs what a test machine lacks (CUDA, GPUs, the network, other nodes, real
weights) is marked with an HTML comment on the line before its opening fence,
``<!-- skip-test: why -->``, and exactly those are skipped. The checkpoint paths the README
uses as placeholders (``/path/to/checkpoint``) name the tiny checkpoint here. Python blocks
share one namespace, as in a notebook (the API block's ``enc`` is used by later blocks).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import REPO_ROOT

README = REPO_ROOT / "README.md"
FENCE = re.compile(r"^```(\w*)\s*$")
SKIP = re.compile(r"^<!--\s*skip-test:\s*(.+?)\s*-->\s*$")
PLACEHOLDER_WEIGHTS = ("/path/to/checkpoint",)


@dataclass
class Block:
    language: str
    code: str
    line: int  # of the opening fence, 1-based
    skip: str | None  # why it is not run


def readme_blocks(text: str) -> list[Block]:
    """Every fenced block, with the skip-test reason written just before it (if any)."""
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match or not match.group(1):
            i += 1
            continue
        start, body = i, []
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        previous = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        reason = SKIP.match(previous)
        blocks.append(Block(match.group(1), "\n".join(body) + "\n", start + 1,
                            reason.group(1) if reason else None))
        i += 1
    return blocks


def test_the_parser_reads_markers():
    text = ("intro\n<!-- skip-test: needs CUDA -->\n```bash\nnvidia-smi\n```\n\n"
            "```python\nx = 1\n```\n```text\nnot code\n```\n")
    blocks = readme_blocks(text)
    assert [(b.language, b.code, b.skip) for b in blocks] == [
        ("bash", "nvidia-smi\n", "needs CUDA"), ("python", "x = 1\n", None),
        ("text", "not code\n", None)]


@pytest.fixture(scope="module")
def reader_folder(tmp_path_factory) -> Path:
    """What a reader has after cloning: examples/ (without generated images) and configs/."""
    root = tmp_path_factory.mktemp("readme")
    shutil.copytree(REPO_ROOT / "configs", root / "configs")
    shutil.copytree(REPO_ROOT / "examples", root / "examples",
                    ignore=shutil.ignore_patterns("images", "__pycache__"))
    return root


@pytest.fixture(scope="module")
def tiny_weights(tmp_path_factory) -> Path:
    """configs/tiny.json saved as a checkpoint folder (random weights)."""
    from dsv4enc.checkpoint import random_state_dict, save_checkpoint
    from dsv4enc.config import VisionConfig

    cfg = VisionConfig.from_file(REPO_ROOT / "configs" / "tiny.json")
    folder = tmp_path_factory.mktemp("readme_ckpt")
    save_checkpoint(folder, cfg, random_state_dict(cfg, seed=3))
    return folder


def _env(weights: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.update(DSV4ENC_WEIGHTS=str(weights), COLUMNS="120", OMP_NUM_THREADS="2")
    return env


def _with_weights(code: str, weights: Path) -> str:
    for placeholder in PLACEHOLDER_WEIGHTS:
        code = code.replace(placeholder, str(weights))
    return code


def test_readme_blocks_run(reader_folder, tiny_weights, monkeypatch):
    blocks = [b for b in readme_blocks(README.read_text()) if b.language in ("python", "bash")]
    assert any(b.skip is None and b.language == "bash" for b in blocks)
    assert any(b.skip is None and b.language == "python" for b in blocks)
    monkeypatch.chdir(reader_folder)
    monkeypatch.setenv("DSV4ENC_WEIGHTS", str(tiny_weights))  # as a user may have it set
    env = _env(tiny_weights)
    namespace: dict = {"__name__": "__readme__"}
    ran = 0
    for block in blocks:
        if block.skip is not None:
            continue
        code = _with_weights(block.code, tiny_weights)
        where = f"README.md line {block.line}"
        if block.language == "bash":
            proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", code], env=env,
                                  cwd=reader_folder, capture_output=True, text=True,
                                  timeout=300)
            assert proc.returncode == 0, (f"{where}: exit {proc.returncode}\n{code}\n"
                                          f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        else:
            try:
                exec(compile(code, where, "exec"), namespace)
            except Exception as exc:  # name the block, not this test's line
                pytest.fail(f"{where}: {type(exc).__name__}: {exc}\n{code}")
        ran += 1
    assert ran >= 5
    # what the blocks promise
    assert (reader_folder / "emb.parquet").is_file()
    assert (reader_folder / "summary.json").is_file()
    assert (reader_folder / "out" / "cat.jpg.npy").is_file()
    assert (reader_folder / "out" / "nested" / "holiday" / "beach.jpg.npy").is_file()


# --------------------------------------------------------------------------- the README and the tool

#: Flags of other programs the README shows (torchrun's).
OTHER_PROGRAMS_FLAGS = {"--nproc-per-node", "--nnodes", "--node-rank", "--rdzv-backend",
                        "--rdzv-endpoint", "--rdzv-id", "--no-python"}


def _command_flags() -> dict[str, set[str]]:
    import typer

    from dsv4enc.cli import app

    group = typer.main.get_command(app)
    flags = {name: {opt for param in command.params for opt in (*param.opts,
                                                                 *param.secondary_opts)
                    if opt.startswith("--")}
             for name, command in group.commands.items()}
    flags[""] = {opt for param in group.params for opt in param.opts if opt.startswith("--")}
    return flags


def test_every_flag_the_readme_names_is_an_option_of_its_command():
    """A flag named in the README belongs to ``encode`` (or inspect, extract, the group), to
    torchrun, or to ``bench`` in a paragraph that speaks of bench: no option a command lacks
    (``--max-images`` is bench's, and the Python API's ``max_images``, not encode's)."""
    flags = _command_flags()
    general = set().union(*(f for name, f in flags.items() if name != "bench"), {"--help"})
    wrong = []
    for paragraph in re.split(r"\n\s*\n", README.read_text()):
        for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", paragraph):
            if flag in general or flag in OTHER_PROGRAMS_FLAGS:
                continue
            if flag in flags["bench"] and "bench" in paragraph:
                continue
            wrong.append(f"{flag} in: {paragraph.strip()[:80]}")
    assert not wrong, wrong


def test_the_setup_block_starts_from_a_clone_in_a_venv():
    block = next(b for b in readme_blocks(README.read_text()) if "pip install" in b.code)
    steps = [line.split("#")[0].strip() for line in block.code.splitlines() if line.strip()]
    assert steps[0].startswith("git clone ") and steps[1] == "cd dsv4enc"
    assert steps[2] == "python -m venv .venv && . .venv/bin/activate"
    assert steps[3].startswith("pip install") and steps[4] == "pytest"


def test_the_pandas_recipe_keeps_int32_columns(tmp_path):
    """The README says that plain pandas reads failed rows' int32 columns as float64, and
    its recipe (run by test_readme_blocks_run) keeps them int32."""
    import pandas as pd
    import pyarrow as pa
    import pyarrow.parquet as pq

    text = README.read_text()
    assert "float64" in text and "to_pandas(types_mapper=pd.ArrowDtype)" in text
    table = pa.table({"width": pa.array([640, None], pa.int32()),
                      "embedding": pa.array([b"\0\0", None], pa.large_binary())})
    pq.write_table(table, tmp_path / "t.parquet")
    assert pd.read_parquet(tmp_path / "t.parquet").width.dtype == "float64"  # what it says
    kept = pq.read_table(tmp_path / "t.parquet").to_pandas(types_mapper=pd.ArrowDtype)
    assert str(kept.width.dtype) == "int32[pyarrow]" and kept.width.isna().tolist() == [False,
                                                                                        True]
    assert [bytes(b) for b in kept.embedding.dropna()] == [b"\0\0"]
