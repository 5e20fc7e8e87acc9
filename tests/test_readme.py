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
    from dsv4enc.tower.checkpoint import random_state_dict, save_checkpoint
    from dsv4enc.tower.config import VisionConfig

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
    # the pipeline recipes (Ray Data, datasets) give the broken image's error row
    assert set(namespace["errors"]) == {"nested/broken.jpg"}
    assert namespace["out"].filter(lambda row: row["error"] is not None)["path"] == [
        "nested/broken.jpg"]
    assert len(namespace["out"]) == len(namespace["files"])
    assert list((reader_folder / "ray_emb").glob("*.parquet"))
