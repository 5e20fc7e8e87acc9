"""The fused tower's compiled kernels kept on disk: a second process loads them (inductor's FX
graph cache hits), and a tower with another key compiles afresh in a folder of its own."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsv4enc.tower import compile_cache
from dsv4enc.tower.compile_cache import cache_key, cache_root, use_compile_cache

from helpers import REPO_ROOT, load_config

#: Builds the tiny fused tower in the dtype argv[1] names, encodes one image, and prints
#: inductor's FX graph cache counters.
PROBE = """
import json, sys, torch
sys.path.insert(0, "tests")
from helpers import load_config, random_patch_items
from torch._dynamo.utils import counters
from dsv4enc.engine.engine import Engine
from dsv4enc.engine.factory import build_model
from dsv4enc.engine.packing import pack
from dsv4enc.tower.checkpoint import random_checkpoint
cfg = load_config("tiny")
state = random_checkpoint(cfg, 0, getattr(torch, sys.argv[1]))
Engine(build_model(state, torch.device("cpu"), fused=True)).encode(
    pack(random_patch_items([(5, 7)], cfg.patch_dim), 3))
print(json.dumps(dict(counters["inductor"])))
"""


def compile_in_new_process(cache: Path, dtype: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != compile_cache.INDUCTOR_CACHE_ENV}
    env.update(DSV4ENC_CACHE_DIR=str(cache), PYTHONPATH=str(REPO_ROOT))
    done = subprocess.run([sys.executable, "-c", PROBE, dtype], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_second_process_loads_the_kernels_and_another_key_compiles_afresh(tmp_path):
    first = compile_in_new_process(tmp_path, "float32")
    assert first.get("fxgraph_cache_miss", 0) > 0 and not first.get("fxgraph_cache_hit")
    second = compile_in_new_process(tmp_path, "float32")
    assert second.get("fxgraph_cache_hit", 0) > 0 and not second.get("fxgraph_cache_miss")
    other = compile_in_new_process(tmp_path, "bfloat16")
    assert other.get("fxgraph_cache_miss", 0) > 0 and not other.get("fxgraph_cache_hit")
    assert len(list((tmp_path / "inductor").iterdir())) == 2


def test_the_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("DSV4ENC_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine"
    monkeypatch.delenv("DSV4ENC_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "dsv4enc"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "dsv4enc"


def test_the_key_names_the_config_the_dtype_and_the_torch():
    cfg, cpu = load_config("tiny"), torch.device("cpu")
    key = cache_key(cfg, cpu, torch.float32)
    assert key == cache_key(load_config("tiny"), cpu, torch.float32)
    assert key != cache_key(cfg, cpu, torch.bfloat16)
    assert key != cache_key(load_config("medium"), cpu, torch.float32)
    assert torch.__version__.split("+")[0] in key and "/" not in key


def test_a_cache_folder_the_user_chose_is_kept(monkeypatch, tmp_path):
    monkeypatch.setenv("DSV4ENC_CACHE_DIR", str(tmp_path / "ours"))
    monkeypatch.setenv(compile_cache.INDUCTOR_CACHE_ENV, str(tmp_path / "theirs"))
    assert use_compile_cache(load_config("tiny"), torch.device("cpu"), torch.float32) is None
    assert os.environ[compile_cache.INDUCTOR_CACHE_ENV] == str(tmp_path / "theirs")
    monkeypatch.delenv(compile_cache.INDUCTOR_CACHE_ENV)
    folder = use_compile_cache(load_config("tiny"), torch.device("cpu"), torch.float32)
    assert folder is not None and folder.is_dir() and folder.parent == tmp_path / "ours" / "inductor"
    assert os.environ[compile_cache.INDUCTOR_CACHE_ENV] == str(folder.resolve())


def test_no_home_folder_compiles_without_keeping(monkeypatch):
    """No HOME and a user id without a passwd entry (a container's arbitrary uid): the
    kernels are not kept, and the run goes on (it was a traceback)."""
    import pwd

    for name in ("DSV4ENC_CACHE_DIR", "XDG_CACHE_HOME", "HOME", compile_cache.INDUCTOR_CACHE_ENV):
        monkeypatch.delenv(name, raising=False)

    def no_entry(uid):
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.setattr(pwd, "getpwuid", no_entry)
    assert use_compile_cache(load_config("tiny"), torch.device("cpu"), torch.float32) is None


#: Builds the tiny fused tower with the fault argv[1] names (argv[2]: a folder to spoil),
#: encodes one image, and prints the line it refuses with (in a process of its own: one that
#: compiled the kernels before holds them in memory, and compiles nothing at its first batch).
FAULT = """
import sys, torch
from pathlib import Path
sys.path.insert(0, "tests")
from helpers import load_config, random_patch_items
from torch._inductor import config as inductor_config
from dsv4enc.engine.engine import Engine
from dsv4enc.engine.factory import build_model
from dsv4enc.engine.packing import pack
from dsv4enc.errors import UsageError
from dsv4enc.tower import compile_cache
from dsv4enc.tower.checkpoint import random_checkpoint
import os
fault, spoiled = sys.argv[1], Path(sys.argv[2])
cfg = load_config("tiny")
model = build_model(random_checkpoint(cfg, 0), torch.device("cpu"), fused=True)
if fault == "no compiler":
    inductor_config.cpp.cxx = (None, str(spoiled / "no-g++"))
else:
    (spoiled / "a_file").write_text("")
    os.environ[compile_cache.INDUCTOR_CACHE_ENV] = str(spoiled / "a_file" / "c")
try:
    Engine(model).encode(pack(random_patch_items([(5, 7)], cfg.patch_dim), 3))
except UsageError as exc:
    print(repr(str(exc)))
"""


@pytest.mark.parametrize("fault", ["no compiler", "cache not writable"])
def test_a_compile_that_fails_at_the_first_batch_is_one_line(tmp_path, fault):
    """The kernels compile at the first batch: a compiler or cache folder that fails there
    is a UsageError line (the command's one line), not inductor's traceback."""
    env = {k: v for k, v in os.environ.items() if k != compile_cache.INDUCTOR_CACHE_ENV}
    env.update(DSV4ENC_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(REPO_ROOT))
    done = subprocess.run([sys.executable, "-c", FAULT, fault, str(tmp_path)], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    line = ast.literal_eval(done.stdout.strip().splitlines()[-1])  # the repr FAULT printed
    assert "fused kernels cannot be compiled" in line and "--no-fused" in line, line
    assert "\n" not in line
