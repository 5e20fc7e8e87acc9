"""The real CLI under torchrun (SPEC §7-9): 2 gloo ranks on the CPU must write what one
process writes, in every multi-rank mode, and fail cleanly when a rank dies.

Each torchrun launch costs seconds on a small machine, so most multi-rank runs share one
launch (tests/torchrun_launcher.py ``sequence`` runs several command lines in turn); the
``-m dsv4enc`` and console-script launches, and the dying rank, are launches of their own.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest
import torch

from dsv4enc.errors import UsageError
from dsv4enc.output.read import load_manifest
from dsv4enc.tower.checkpoint import random_state_dict, save_checkpoint
from dsv4enc.tower.config import VisionConfig
from dsv4enc.run.pipeline import EncodeOptions, run_encode
from dsv4enc.run.plan import assign_greedy, flops_cost
from dsv4enc.tower.transform import plan_canvas

from helpers import CONFIGS, Pauses, parts_of, reaped, table_rows, write_image

pytestmark = pytest.mark.slow

TESTS = Path(__file__).resolve().parent
LAUNCHER = TESTS / "torchrun_launcher.py"
COMMON = ["--device", "cpu", "--dtype", "float32", "--out-dtype", "float32"]  # summaries shown
FAST = [*COMMON, "--workers", "0", "--timeout", "60"]
LAUNCH_TIMEOUT_S = 180  # no launch may hang the suite
DIE_TIMEOUT_S = 5  # --timeout of the dying-rank run
PART_IMAGES = 3  # small parts, so that several parts (and part boundaries) are exercised

# (relative path, (width, height), mode): mixed sizes and aspect ratios, nested folders
IMAGES = [
    ("a_photo.jpg", (640, 480), "RGB"),
    ("b/tall.png", (200, 900), "RGBA"),
    ("b/c/wide.png", (900, 150), "L"),
    ("b/square.bmp", (300, 300), "RGB"),
    ("d/big.jpg", (1000, 750), "RGB"),
    ("d/palette.gif", (60, 40), "P"),
    ("e.webp", (400, 420), "RGB"),
]


# ----------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def cfg() -> VisionConfig:
    return VisionConfig.from_file(CONFIGS / "tiny.json")


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("torchrun")


@pytest.fixture(scope="module")
def ckpt(work: Path, cfg: VisionConfig) -> Path:
    """A random tiny checkpoint, sharded with an index, with a language-model decoy."""
    folder = work / "ckpt"
    gen = torch.Generator().manual_seed(7)
    decoy = {"embed.weight": torch.randn(64, cfg.hidden_size, generator=gen).to(torch.bfloat16)}
    save_checkpoint(folder, cfg, random_state_dict(cfg, seed=5), extra=decoy, shards=2)
    assert (folder / "model.safetensors.index.json").is_file()
    return folder


@pytest.fixture(scope="module")
def folders(work: Path) -> dict[str, Path]:
    """imgs: the mix plus a truncated JPEG (header fine, decode fails), an unreadable .png
    and a text file; one: a single image; broken: only images that fail; empty: no image;
    even: images of one size, which the ranks' greedy shares interleave (0, 2, 4 | 1, 3, 5);
    table: a Parquet table of those images, with an id and a caption column."""
    imgs = work / "imgs"
    for rel, size, mode in IMAGES:
        write_image(imgs / rel, size, mode)
    whole = (imgs / "d" / "big.jpg").read_bytes()
    (imgs / "b" / "truncated.jpg").write_bytes(whole[: len(whole) // 3])
    (imgs / "garbage.png").write_bytes(os.urandom(300))
    (imgs / "notes.txt").write_text("not an image\n")
    one = work / "one"
    write_image(one / "only.jpg", (520, 390), "RGB")
    broken = work / "broken"
    broken.mkdir()
    shutil.copy(imgs / "b" / "truncated.jpg", broken / "cut.jpg")
    shutil.copy(imgs / "garbage.png", broken / "junk.png")
    empty = work / "empty"
    empty.mkdir()
    (empty / "readme.txt").write_text("nothing to encode\n")
    for i in range(6):
        write_image(work / "even" / f"e{i}.png", (300, 300), "RGB")
    evens = sorted((work / "even").iterdir())
    pq.write_table(pa.table({"id": pa.array(range(6), pa.int64()),
                             "caption": [f"c{i}" for i in range(6)],
                             "image": [path.read_bytes() for path in evens]}),
                   work / "table.parquet")
    return {"imgs": imgs, "one": one, "broken": broken, "empty": empty, "even": work / "even",
            "table": work / "table.parquet"}


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "DSV4ENC_WEIGHTS"}
    env["OMP_NUM_THREADS"] = "1"
    # the console script sits beside this interpreter (a venv that is not activated)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    return env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True,
                              timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"hung for {LAUNCH_TIMEOUT_S}s: {' '.join(cmd)}\n"
                    f"{(exc.stderr or b'')[-3000:]!r}")


def torchrun(target: list[str], cwd: Path, nproc: int = 2) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run`` with the default (static) rendezvous."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}", *target]
    return run(cmd, cwd)


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


@pytest.fixture(scope="module")
def reference(work: Path, folders, ckpt: Path) -> Path:
    """One process, ``python -m dsv4enc encode``, default batches and parts."""
    out = work / "ref.parquet"
    ok(run([sys.executable, "-m", "dsv4enc", "encode", str(folders["imgs"]), "--out", str(out),
            "--weights", str(ckpt), *FAST], work))
    return out


def encode_here(folder: Path, out: Path, ckpt: Path) -> Path:
    """One process, in this process (the small references)."""
    run_encode(EncodeOptions(inputs=[str(folder)], out=str(out), weights=str(ckpt),
                             device="cpu", dtype="float32", out_dtype="float32", workers=0,
                             progress=False))
    return out


# ----------------------------------------------------------------------------- comparison

def rows_of(path: Path) -> list[dict]:
    table = (pads.dataset(path, format="parquet").to_table() if path.is_dir()
             else pq.read_table(path))
    return table_rows(table)


def assert_same_rows(got: list[dict], want: list[dict], ordered: bool = True,
                     exact: bool = True) -> None:
    """Same rows (path, order, sizes, grids, errors) and embeddings: bit for bit (rows are
    batch-invariant, so rank count, batches and resume change nothing), or with ``exact``
    off within 1e-5 relative."""
    got_paths, want_paths = [r["path"] for r in got], [r["path"] for r in want]
    if ordered:
        assert got_paths == want_paths
    else:
        assert sorted(got_paths) == sorted(want_paths) and len(set(got_paths)) == len(got_paths)
    by_path = {r["path"]: r for r in got}
    for w in want:
        g = by_path[w["path"]]
        for key in ("width", "height", "vit_h", "vit_w", "grid_h", "grid_w", "error"):
            assert g[key] == w[key], (w["path"], key, g[key], w[key])
        if w["embedding"] is None:
            assert g["embedding"] is None, w["path"]
            continue
        a = np.asarray(g["embedding"], dtype=np.float64)
        b = np.asarray(w["embedding"], dtype=np.float64)
        assert a.shape == b.shape == (w["grid_h"] * w["grid_w"], b.shape[1]), w["path"]
        if exact:
            assert np.array_equal(a, b), w["path"]
            continue
        rel = np.linalg.norm(a - b) / np.linalg.norm(b)
        assert rel < 1e-5, (w["path"], rel)


def summary_loads(stderr: str) -> tuple[list[float], float]:
    """The summary's per-rank loads and imbalance."""
    match = re.search(r"rank loads\s*\S\s*([\d,]+(?:, [\d,]+)+) \(imbalance ([\d.]+)\)", stderr)
    assert match, f"no rank loads in the summary:\n{stderr[-3000:]}"
    loads = [float(x.replace(",", "")) for x in match.group(1).split(", ")]
    return loads, float(match.group(2))


def expected_loads(want: list[dict], cfg: VisionConfig, balance: str = "patches",
                   part_images: int | None = None) -> list[float]:
    """SPEC §7 by hand: greedy per part, cost from the header's grid (unreadable: 0); the
    summary reports each rank's patches."""
    grids = []
    for r in want:
        canvas = plan_canvas(r["width"], r["height"], cfg) if r["width"] else None
        grids.append((canvas.n_h, canvas.n_w) if canvas else (0, 0))
    loads = [0.0, 0.0]
    parts = (parts_of([r["path"] for r in want], part_images) if part_images
             else [(0, len(grids))])
    for start, end in parts:  # the parts the keys cut
        chunk = grids[start:end]
        costs = [flops_cost(h, w, cfg) if balance == "flops" and h else float(h * w)
                 for h, w in chunk]
        for rank, share in enumerate(assign_greedy(costs, 2)):
            loads[rank] += sum(chunk[i][0] * chunk[i][1] for i in share)
    return loads


def check_loads(stderr: str, want_loads: list[float]) -> None:
    loads, shown = summary_loads(stderr)
    assert loads == want_loads
    assert shown == pytest.approx(max(loads) / (sum(loads) / 2), abs=1e-3)


# ----------------------------------------------------------------------------- the launches

def test_reference_is_sane(reference: Path):
    rows = rows_of(reference)
    assert len(rows) == len(IMAGES) + 2  # the text file is skipped, broken ones are rows
    errors = {r["path"]: r["error"] for r in rows if r["error"]}
    assert set(errors) == {"b/truncated.jpg", "garbage.png"}


def test_module_launch_matches_one_process(work, folders, ckpt, reference, cfg):
    """torchrun -m dsv4enc (gathered), with decode workers, small batches and parts."""
    out = work / "dp.parquet"
    proc = ok(torchrun(["-m", "dsv4enc", "encode", str(folders["imgs"]), "--out", str(out),
                        "--weights", str(ckpt), *COMMON, "--timeout", "60",
                        "--batch-tokens", "400", "--part-images", str(PART_IMAGES)], work))
    want = rows_of(reference)
    assert_same_rows(rows_of(out), want)
    check_loads(proc.stderr, expected_loads(want, cfg, part_images=PART_IMAGES))
    assert not (work / "dp.parquet.partial").exists()


def test_console_script_launch_matches_one_process(work, folders, ckpt, reference, cfg):
    if shutil.which("dsv4enc", path=_env()["PATH"]) is None:
        pytest.skip("the dsv4enc console script is not on PATH")
    out = work / "dp_script.parquet"
    proc = ok(torchrun(["--no-python", "dsv4enc", "encode", str(folders["imgs"]), "--out",
                        str(out), "--weights", str(ckpt), *FAST], work))
    want = rows_of(reference)
    assert_same_rows(rows_of(out), want)
    check_loads(proc.stderr, expected_loads(want, cfg))


def test_wall_time_counts_the_start_up_of_each_rank(work, folders, ckpt):
    """The summary's wall time ("the whole run, start-up included") counts from the rank
    process's start, interpreter, torch import and the process group's start-up included:
    at least the time rank 0 spent before the pipeline was called (measured by the launcher
    from its first line) plus the encoding loop, which both lie inside the run."""
    out, report, marker = work / "timed.parquet", work / "timed.json", work / "timed"
    ok(torchrun([str(LAUNCHER), "timed", str(marker), str(folders["one"]), "--out", str(out),
                 "--weights", str(ckpt), *FAST, "--summary-json", str(report)], work))
    times = json.loads(Path(f"{marker}.rank0.json").read_text())
    seconds = json.loads(report.read_text())["seconds"]
    before_pipeline = times["run_encode"] - times["launched"]
    assert before_pipeline > 0
    assert seconds["wall"] >= before_pipeline + seconds["encoding"], (seconds, times)


@pytest.fixture(scope="module")
def sequence(work, folders, ckpt) -> dict[str, list[dict]]:
    """One launch, many runs: {name: [rank 0 result, rank 1 result]} (argv, code, stderr)."""
    def enc(folder: str, out: str, *extra: str) -> list[str]:
        return ["encode", str(folders[folder]), "--out", str(work / "seq" / out),
                "--weights", str(ckpt), *FAST, *extra]

    runs = {
        "shard": enc("imgs", "shard/", "--shard-output", "--part-images", str(PART_IMAGES),
                     "--batch-tokens", "400"),  # ranks take different numbers of batches
        "tp": enc("imgs", "tp.parquet", "--tp-mode", "weights", "--batch-tokens", "400"),
        "flops": enc("imgs", "flops.parquet", "--balance", "flops"),
        "rerun": enc("imgs", "flops.parquet", "--balance", "flops"),
        "shard_rerun": enc("imgs", "shard/", "--shard-output", "--part-images",
                           str(PART_IMAGES)),
        "one": enc("one", "one.parquet"),
        "one_shard": enc("one", "one_shard/", "--shard-output"),
        "broken": enc("broken", "broken.parquet"),
        "empty": enc("empty", "empty.parquet"),
        "empty_shard": enc("empty", "empty_shard/", "--shard-output"),
        "even_shard": enc("even", "even_shard/", "--shard-output"),
        "table_shard": enc("table", "table_shard/", "--shard-output", "--key-column", "id",
                           "--keep-column", "caption"),
        "interrupted": ["@interrupt", *enc("imgs", "resumed.parquet", "--part-images",
                                           str(PART_IMAGES))],
        "resumed": enc("imgs", "resumed.parquet", "--part-images", str(PART_IMAGES),
                       "--resume"),
        # finished: --resume judges the file (rank 0) and every rank ends as it says
        "complete": enc("imgs", "resumed.parquet", "--resume"),
        "complete_changed": enc("imgs", "resumed.parquet", "--resume", "--out-dtype", "float16"),
        # --shard-output, resumed after rank 1 lost a part that rank 0 still has
        "gap_first": enc("imgs", "gap/", "--shard-output", "--part-images", str(PART_IMAGES)),
        "gap_rm": ["@rm", str(work / "seq" / "gap" / "part-000000-rank001.parquet")],
        "gap_resumed": enc("imgs", "gap/", "--shard-output", "--part-images",
                           str(PART_IMAGES), "--resume"),
        # progress and summary figures, for comparison with one process
        "figures_dp": enc("imgs", "figures_dp.parquet", "--part-images", str(PART_IMAGES),
                          "--batch-tokens", "400", "--log-every", "0.01", "--summary-json",
                          str(work / "seq" / "figures_dp.json")),
        # rank 1 given one option or input more: every rank refuses, naming it
        "ranks_seed": ["@rank1", "--seed=1", *enc("imgs", "ranks_seed.parquet")],
        "ranks_out_dtype": ["@rank1", "--out-dtype=float16",
                            *enc("imgs", "ranks_dtype/", "--shard-output")],
        "ranks_update": ["@rank1", "--update", *enc("imgs", "ranks_update.parquet")],
        "ranks_inputs": ["@rank1", str(folders["one"]),
                         *enc("imgs", "ranks_inputs.parquet", "--part-images",
                              str(PART_IMAGES))],
        "ranks_out": ["@rank1", f"--out={work / 'seq' / 'ranks_out_1'}/",
                      *enc("imgs", "ranks_out_0/", "--shard-output")],
        "figures_shard": enc("imgs", "figures_shard/", "--shard-output", "--part-images",
                             str(PART_IMAGES), "--batch-tokens", "400", "--log-every", "0.01",
                             "--summary-json", str(work / "seq" / "figures_shard.json")),
    }
    (work / "runs.json").write_text(json.dumps(list(runs.values())))
    proc = torchrun([str(LAUNCHER), "sequence", str(work / "runs.json"), str(work / "results")],
                    work)
    results = []
    for rank in range(2):
        path = work / "results" / f"rank{rank}.json"
        assert path.is_file(), (f"rank {rank} reported nothing (exit {proc.returncode})\n"
                                f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
        results.append(json.loads(path.read_text()))
    assert proc.returncode == 0, proc.stderr[-5000:]
    return {name: [results[0][i], results[1][i]] for i, name in enumerate(runs)}


def seq_ok(sequence, name: str) -> str:
    """Rank 0's stderr of a run that every rank finished with exit 0."""
    for rank, result in enumerate(sequence[name]):
        assert result["code"] == 0, f"{name}, rank {rank}: exit {result['code']}\n" \
                                    f"{result['stderr'][-3000:]}"
    return sequence[name][0]["stderr"]


def test_shard_output_matches_one_process(work, sequence, reference):
    seq_ok(sequence, "shard")
    folder = work / "seq" / "shard"
    want = rows_of(reference)
    assert_same_rows(rows_of(folder), want, ordered=False)
    manifest = json.loads((folder / "_manifest.json").read_text())
    assert {p["file"] for p in manifest["parts"].values()} == \
        {p.name for p in folder.glob("*.parquet")}
    assert sum(p["rows"] for p in manifest["parts"].values()) == len(want)
    loads, shown = summary_loads(sequence["shard"][0]["stderr"])
    encoded = sum(r["vit_h"] * r["vit_w"] for r in want if r["embedding"] is not None)
    assert sum(loads) == encoded and shown == pytest.approx(max(loads) / (encoded / 2), abs=1e-3)


def test_finished_shard_output_records_stamps_that_update_uses(work, sequence, ckpt, folders,
                                                               reference):
    """A finished --shard-output folder records its rows' input stamps like any folder
    output, so that one process can --update it: nothing changed, every row is reused."""
    seq_ok(sequence, "shard")
    folder = work / "shard_update"
    shutil.copytree(work / "seq" / "shard", folder)
    manifest = json.loads((folder / "_manifest.json").read_text())
    assert manifest["stamps"]["rows"] == len(rows_of(reference))
    assert (folder / manifest["stamps"]["file"]).is_file()
    _update_reuses_every_row(folder, folders, ckpt, reference, work)


def _update_reuses_every_row(folder: Path, folders, ckpt, reference, work) -> None:
    """A one-process ``--update`` of the sharded ``folder`` reuses every row, as they are."""
    proc = ok(run([sys.executable, "-m", "dsv4enc", "encode", str(folders["imgs"]), "--out",
                   f"{folder}/", "--update", "--weights", str(ckpt), *FAST,
                   "--part-images", str(PART_IMAGES)], work))
    reused = re.search(r"reused from the output\s*\S\s*([\d,]+)", proc.stderr)
    assert reused and int(reused.group(1)) == len(rows_of(reference)), proc.stderr[-3000:]
    assert_same_rows(rows_of(folder), rows_of(reference), ordered=False)


def test_update_of_a_shard_output_encodes_only_what_changed(work, sequence, ckpt, folders):
    """A --shard-output part holds each rank's share in a file of its own, so its rows are not
    in input order (0, 2, 4, then 1, 3, 5): --update still carries every unchanged row (none
    was encoded again), and encodes the one image that changed."""
    seq_ok(sequence, "even_shard")
    folder, even = work / "even_update", folders["even"]
    shutil.copytree(work / "seq" / "even_shard", folder)
    files = [p["file"] for p in load_manifest(folder / "_manifest.json")["parts"].values()]
    assert len(files) == 2 and [r["path"] for r in rows_of(folder)] != sorted(
        r["path"] for r in rows_of(folder))

    def update() -> int:
        proc = ok(run([sys.executable, "-m", "dsv4enc", "encode", str(even), "--out",
                       f"{folder}/", "--update", "--weights", str(ckpt), *FAST], work))
        return int(re.search(r"encoded\s*\S\s*(\d+)", proc.stderr).group(1))

    assert update() == 0
    write_image(even / "e3.png", (300, 300), "RGB", seed=99)
    assert update() == 1
    want = rows_of(encode_here(even, work / "even_ref.parquet", ckpt))
    assert_same_rows(rows_of(folder), want, ordered=False)


def test_shard_output_of_a_table_keeps_each_rows_own_columns(work, sequence):
    """Each rank's part file holds its share of a part's rows: the kept columns (the typed
    --key-column's, --keep-column's) are those of its rows, not of the part's first inputs."""
    seq_ok(sequence, "table_shard")
    table = pads.dataset(work / "seq" / "table_shard", format="parquet").to_table()
    assert sorted(zip(table.column("path").to_pylist(), table.column("id").to_pylist(),
                      table.column("caption").to_pylist())) == [
        (str(i), i, f"c{i}") for i in range(6)]


def test_tensor_parallel_matches_one_process(work, sequence, reference):
    seq_ok(sequence, "tp")
    # The all-reduce of split layers sums in another order than one rank: float rounding.
    assert_same_rows(rows_of(work / "seq" / "tp.parquet"), rows_of(reference), exact=False)


def test_flops_balance_matches_one_process(work, sequence, reference, cfg):
    stderr = seq_ok(sequence, "flops")
    want = rows_of(reference)
    assert_same_rows(rows_of(work / "seq" / "flops.parquet"), want)
    check_loads(stderr, expected_loads(want, cfg, balance="flops"))


def test_rerun_without_overwrite_refuses(work, sequence, reference):
    for name, message in (("rerun", "already exists"), ("shard_rerun", "--overwrite")):
        for rank, result in enumerate(sequence[name]):
            assert result["code"] != 0, f"{name}: rank {rank} overwrote a finished output"
        assert message in sequence[name][0]["stderr"], sequence[name][0]["stderr"]
    # the finished outputs are untouched and readable
    assert_same_rows(rows_of(work / "seq" / "flops.parquet"), rows_of(reference))
    assert_same_rows(rows_of(work / "seq" / "shard"), rows_of(reference), ordered=False)


def test_fewer_images_than_ranks(work, sequence, folders, ckpt):
    stderr = seq_ok(sequence, "one")
    seq_ok(sequence, "one_shard")
    want = rows_of(encode_here(folders["one"], work / "one_ref.parquet", ckpt))
    assert len(want) == 1 and want[0]["error"] is None
    assert_same_rows(rows_of(work / "seq" / "one.parquet"), want)
    assert_same_rows(rows_of(work / "seq" / "one_shard"), want, ordered=False)
    loads, shown = summary_loads(stderr)
    assert loads == [want[0]["vit_h"] * want[0]["vit_w"], 0] and shown == 2.0


def test_ranks_with_no_images(work, sequence, folders, ckpt):
    """Every image fails (no rank encodes anything), or none is found at all."""
    seq_ok(sequence, "broken")
    want = rows_of(encode_here(folders["broken"], work / "broken_ref.parquet", ckpt))
    assert len(want) == 2 and all(r["error"] for r in want)
    assert_same_rows(rows_of(work / "seq" / "broken.parquet"), want)
    stderr = seq_ok(sequence, "empty")
    assert "skipped (not images) │ 1" in re.sub(r" +", " ", stderr)
    ref = pq.read_table(encode_here(folders["empty"], work / "empty_ref.parquet", ckpt))
    got = pq.read_table(work / "seq" / "empty.parquet")
    assert got.num_rows == ref.num_rows == 0 and got.schema.names == ref.schema.names
    seq_ok(sequence, "empty_shard")
    assert rows_of(work / "seq" / "empty_shard") == []


def test_interrupted_run_resumes(work, sequence, reference):
    for rank, result in enumerate(sequence["interrupted"]):
        assert result["code"] == 130, f"rank {rank}: {result}"
    assert "--resume" in sequence["interrupted"][0]["stderr"]
    stderr = seq_ok(sequence, "resumed")
    assert re.search(r"reused from earlier run\s*\S\s*[1-9]", stderr), stderr
    assert_same_rows(rows_of(work / "seq" / "resumed.parquet"), rows_of(reference))
    assert not (work / "seq" / "resumed.parquet.partial").exists()
    assert "already complete" in seq_ok(sequence, "complete")
    for rank, result in enumerate(sequence["complete_changed"]):
        assert result["code"] == 2, f"rank {rank}: {result}"
    assert "cannot resume" in sequence["complete_changed"][0]["stderr"]
    assert not (work / "seq" / "resumed.parquet.partial").exists()


def test_a_timeout_of_inf_is_a_wait_without_end(work, folders, ckpt):
    """--timeout inf (collectives wait as long as it takes): the ranks failed at their start in
    a traceback, OverflowError making it the process group's timeout."""
    out = work / "no_timeout.parquet"
    ok(torchrun(["-m", "dsv4enc", "encode", str(folders["one"]), "--out", str(out),
                 "--weights", str(ckpt), *COMMON, "--workers", "0", "--timeout", "inf"], work))
    assert [row["error"] for row in rows_of(out)] == [None]


def test_dead_rank_fails_the_job(work, folders, ckpt):
    """Rank 1 exits after its first batch: the job stops within about --timeout, non-zero,
    saying which rank failed, and leaves no half-written output."""
    out = work / "dead.parquet"
    marker = work / "rank1_died"
    began = time.time()
    proc = torchrun([str(LAUNCHER), "die", str(marker), str(folders["imgs"]), "--out", str(out),
                     "--weights", str(ckpt), *COMMON, "--workers", "0", "--timeout",
                     str(DIE_TIMEOUT_S), "--batch-tokens", "400"], work)
    ended = time.time()
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text[-3000:]
    assert marker.is_file(), f"rank 1 never got to die\n{text[-3000:]}"
    died = float(marker.read_text())
    assert ended - died <= DIE_TIMEOUT_S + 10, (ended - died, text[-3000:])
    assert re.search(r"error: rank \d+: .*(peer rank may have died|timed out)", text), \
        text[-3000:]
    assert not out.exists()
    assert ended - began < LAUNCH_TIMEOUT_S


def test_killed_rank_leaves_committed_pieces_that_resume_reuses(work, folders, ckpt, reference):
    """Gathered ranks commit every --commit-every, not once per part: rank 1 SIGKILLed once
    rank 0 has committed (a pause point) leaves those rows, and --resume encodes only the rest."""
    out, marker = work / "killed.parquet", work / "killed"
    pauses = Pauses(work / "killed_pauses", "commit")
    args = [str(folders["imgs"]), "--out", str(out), "--weights", str(ckpt), *COMMON,
            "--workers", "0", "--timeout", str(DIE_TIMEOUT_S), "--batch-tokens", "400",
            "--commit-every", "0.001"]  # one part (the default size): pieces of it
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}", str(LAUNCHER), "pid",
           str(marker), *args]
    with reaped(subprocess.Popen(cmd, cwd=work, env=pauses.env(_env()), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)) as proc:
        first = pauses.wait("commit", proc=proc, hang_guard_s=LAUNCH_TIMEOUT_S)
        os.kill(int(Path(f"{marker}.rank1.pid").read_text()), signal.SIGKILL)
        pauses.release()
        _, stderr = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    assert proc.returncode != 0, stderr[-3000:]
    assert not out.exists()
    parts = load_manifest(work / "killed.parquet.partial" / "_manifest.json")["parts"]
    kept = sum(p["end"] - p["start"] for p in parts.values())
    want = rows_of(reference)
    assert first["start"] == 0 and 1 <= kept < len(want), (first, parts)
    resumed = ok(torchrun(["-m", "dsv4enc", "encode", *args, "--resume"], work))
    reused = re.search(r"reused from earlier run\s*\S\s*([\d,]+)", resumed.stderr)
    assert reused and int(reused.group(1).replace(",", "")) == kept, resumed.stderr[-3000:]
    assert_same_rows(rows_of(out), want)


def test_sigterm_ends_ranks_whose_stop_is_held_up(work, folders, ckpt, reference):
    """SIGTERM to torchrun while rank 0's writer is held at a commit pause point that is never
    released (as a hung commit would hold the stop): the ranks still end, after the grace
    (``stopping.FORCE_EXIT_S``), rank 0 in one line that says so; --resume then finishes."""
    out = work / "held.parquet"
    pauses = Pauses(work / "held_pauses", "commit")
    args = [str(folders["imgs"]), "--out", str(out), "--weights", str(ckpt), *FAST,
            "--batch-tokens", "400", "--commit-every", "0.001"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}", "-m", "dsv4enc",
           "encode", *args]
    with reaped(subprocess.Popen(cmd, cwd=work, env=pauses.env(_env()), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)) as proc:
        pauses.wait("commit", proc=proc, hang_guard_s=LAUNCH_TIMEOUT_S)
        proc.send_signal(signal.SIGTERM)  # the launcher passes it to both ranks
        _, stderr = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    assert proc.returncode != 0, stderr[-3000:]
    assert re.search(r"error: interrupted by SIGTERM; .*--resume.* \(the run did not stop "
                     r"within [\d.]+ s of the signal: ended at once\)", stderr), stderr[-3000:]
    assert not out.exists()
    ok(torchrun(["-m", "dsv4enc", "encode", *args, "--resume"], work))
    assert_same_rows(rows_of(out), rows_of(reference))


def test_sigterm_ends_a_rank_waiting_for_a_held_peer(work, folders, ckpt):
    """Rank 1 held at a pause point while rank 0 waits for it in a collective: SIGTERM to
    rank 0 alone ends it within the stop's grace, in its one line with exit 143, not after
    --timeout (300 s here) as a wait blocked in C++ would (its signal handler never ran)."""
    out, marker = work / "peer_held.parquet", work / "peer_held"
    pauses = Pauses(work / "peer_held_pauses", "encoded")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}", str(LAUNCHER), "held",
           str(marker), str(folders["imgs"]), "--out", str(out), "--weights", str(ckpt),
           *COMMON, "--workers", "0", "--timeout", "300", "--batch-tokens", "400"]
    proc = subprocess.Popen(cmd, cwd=work, env=pauses.env(_env()), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    waiting = Path(f"{marker}.rank0.waiting")
    try:
        pauses.wait("encoded", proc=proc, hang_guard_s=LAUNCH_TIMEOUT_S)  # rank 1 only
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        while not waiting.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "rank 0 never waited"
            time.sleep(0.005)
        signalled = time.monotonic()
        os.kill(int(Path(f"{marker}.rank0.pid").read_text()), signal.SIGTERM)
        _, stderr = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
        ended = time.monotonic()
    finally:
        pauses.release()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert ended - signalled < 120, (ended - signalled, stderr[-3000:])  # --timeout is 300
    assert re.search(r"error: interrupted by SIGTERM; .*\(the run did not stop within "
                     r"[\d.]+ s of the signal: ended at once\)", stderr), stderr[-3000:]
    assert "timed out" not in stderr, stderr[-3000:]
    assert re.search(r"exitcode\s*:\s*143", stderr), stderr[-3000:]  # torchrun's report


def test_shard_output_resumes_when_ranks_committed_different_parts(work, sequence, reference):
    """Each rank keeps its own manifest; when one rank lacks a part the others have, every
    rank must still walk the same parts (their collectives pair up), and the gap is filled."""
    seq_ok(sequence, "gap_first")
    assert sequence["gap_rm"][0]["code"] == 0, "rank 1 wrote no part-000000"
    stderr = seq_ok(sequence, "gap_resumed")
    assert re.search(r"reused from earlier run\s*\S\s*[1-9]", stderr), stderr
    folder = work / "seq" / "gap"
    assert (folder / "part-000000-rank001.parquet").is_file()
    assert_same_rows(rows_of(folder), rows_of(reference), ordered=False)


def test_ranks_with_different_options_or_inputs_refuse(work, sequence):
    """Ranks whose options or inputs differ would write rows of two towers, or pair up
    collectives that do not match: every rank stops with exit 2, in one line naming it."""
    for name, line in (("ranks_seed", "rank 1's --seed differs from rank 0's"),
                       ("ranks_out_dtype", "rank 1's --out-dtype differs from rank 0's"),
                       ("ranks_update", "rank 1's --update differs from rank 0's"),
                       ("ranks_inputs", "the ranks listed different inputs")):
        for rank, result in enumerate(sequence[name]):
            assert result["code"] == 2, f"{name}, rank {rank}: {result}"
            errors = [x for x in result["stderr"].splitlines() if x.startswith("error:")]
            assert len(errors) == 1 and line in errors[0], (name, rank, result["stderr"][-3000:])
            assert "Traceback" not in result["stderr"], result["stderr"][-3000:]
    for out in ("ranks_seed.parquet", "ranks_dtype", "ranks_update.parquet",
                "ranks_inputs.parquet"):
        assert not (work / "seq" / out).exists(), out


def test_progress_and_summary_count_every_rank(work, sequence, reference):
    """Gathered and --shard-output runs: the last progress line and --summary-json give the
    figures of one process (all images, all tokens), not rank 0's share."""
    want = rows_of(reference)
    failed = sum(1 for r in want if r["error"])
    tokens = sum(r["vit_h"] * r["vit_w"] for r in want if r["error"] is None)
    for name in ("figures_dp", "figures_shard"):
        stderr = seq_ok(sequence, name)
        lines = [line for line in stderr.splitlines() if line.startswith("dsv4enc: images")]
        assert lines, stderr[-3000:]
        match = re.match(r"dsv4enc: images (\d+)/(\d+) .*, tokens ([\d,]+)/([\d,]+), .*, "
                         r"(\d+) failed", lines[-1])
        assert match, lines[-1]
        done, total, got_tokens, total_tokens, got_failed = match.groups()
        assert (int(done), int(total)) == (len(want), len(want)), (name, lines[-1])
        assert int(got_tokens.replace(",", "")) == int(total_tokens.replace(",", "")) == tokens
        assert int(got_failed) == failed
        assert not any(line.startswith("dsv4enc: images") for line in
                       sequence[name][1]["stderr"].splitlines())  # rank 1 prints no progress
        summary = json.loads((work / "seq" / f"{name}.json").read_text())
        assert summary["images"]["encoded"] == len(want) - failed
        assert summary["images"]["failed"] == failed and summary["tokens"] == tokens
        assert summary["rates"]["tokens_per_s"] == pytest.approx(
            tokens / summary["seconds"]["encoding"])
        assert sum(m["count"] for m in summary["failures"]["messages"]) == failed


def unmerged_shard_copy(work: Path, sequence: dict, name: str) -> Path:
    """A copy, at ``work / name``, of the 2-rank --shard-output folder as a run stopped before
    rank 0 merged the ranks' manifests leaves it."""
    seq_ok(sequence, "shard")
    folder = work / name
    shutil.copytree(work / "seq" / "shard", folder)
    for merged in [folder / "_manifest.json", *folder.glob("_stamps-*.bin")]:
        merged.unlink()
    return folder


def test_resume_refuses_a_folder_committed_the_other_way(work, sequence, folders, ckpt):
    """--resume of a folder whose interrupted run committed its parts the other way (per
    --shard-output rank, or one manifest for the run) is refused in one line, the folder as
    it was: starting over beside those parts left them in it, so that a glob over the part
    files read their rows twice."""
    sharded = unmerged_shard_copy(work, sequence, "other_way_sharded")
    before = sorted(p.name for p in sharded.iterdir())
    with pytest.raises(UsageError, match=r"cannot resume: .* holds the parts of a run with "
                                         r"--shard-output on 2 torchrun ranks"):
        run_encode(EncodeOptions(inputs=[str(folders["imgs"])], out=str(sharded),
                                 weights=str(ckpt), device="cpu", dtype="float32",
                                 out_dtype="float32", workers=0, progress=False,
                                 shard_output=True, resume=True, part_images=PART_IMAGES))
    assert sorted(p.name for p in sharded.iterdir()) == before
    single = work / "other_way_single"
    run_encode(EncodeOptions(inputs=[str(folders["one"])], out=f"{single}/", weights=str(ckpt),
                             device="cpu", dtype="float32", out_dtype="float32", workers=0,
                             progress=False))
    before = sorted(p.name for p in single.iterdir())
    proc = torchrun(["-m", "dsv4enc", "encode", str(folders["one"]), "--out", str(single),
                     "--weights", str(ckpt), *FAST, "--shard-output", "--resume"], work)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and len(errors) == 2, proc.stderr[-3000:]  # one per rank
    assert all("holds the parts of a run without --shard-output" in e for e in errors), errors
    assert sorted(p.name for p in single.iterdir()) == before


@pytest.mark.parametrize("sharded", [False, True], ids=["gathered", "shard_output"])
def test_signal_to_torchrun_counts_every_rank_in_the_summary(work, folders, ckpt, reference,
                                                             sharded):
    """SIGINT to the torchrun launcher (it passes it to both ranks) while rank 0's writer
    commits the last part: every rank stops (exit 130), --summary-json counts every rank's
    images and tokens once, as a finished run's does (it held rank 0's share alone), and
    --resume (one process, or --shard-output's two ranks) finishes the rows of one process."""
    name = "signalled_" + ("shard" if sharded else "dp")
    out, summary_json = work / (name if sharded else f"{name}.parquet"), work / f"{name}.json"
    pauses = Pauses(work / f"{name}_pauses", "commit")
    args = [str(folders["imgs"]), "--out", str(out), "--weights", str(ckpt), *FAST,
            "--batch-tokens", "400", "--commit-every", "3600",  # one commit, once all is done
            *(["--shard-output"] if sharded else [])]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}", "-m", "dsv4enc",
           "encode", *args, "--summary-json", str(summary_json)]
    with reaped(subprocess.Popen(cmd, cwd=work, env=pauses.env(_env()), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)) as proc:
        pauses.wait("commit", proc=proc, hang_guard_s=LAUNCH_TIMEOUT_S)
        proc.send_signal(signal.SIGINT)
        pauses.release()
        _, stderr = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    assert proc.returncode != 0, stderr[-3000:]
    # Two processes share stderr: a rank's line may land after another's unended one.
    stopped = re.findall(r"error: (?:(?!error: )[^\n])*", stderr)
    assert len(stopped) == 2 and all("interrupted by SIGINT" in line and "--resume" in line
                                     for line in stopped), stderr[-3000:]  # one per rank
    want = rows_of(reference)
    failed = sum(1 for r in want if r["error"])
    summary = json.loads(summary_json.read_text())
    assert (summary["status"], summary["exit_code"]) == ("interrupted", 130)
    assert summary["images"]["encoded"] == len(want) - failed
    assert summary["images"]["failed"] == failed
    assert summary["tokens"] == sum(r["vit_h"] * r["vit_w"] for r in want if r["error"] is None)
    if sharded:
        ok(torchrun(["-m", "dsv4enc", "encode", *args, "--resume"], work))
        assert_same_rows(rows_of(out), want, ordered=False)
    else:
        encoded = run_encode(EncodeOptions(
            inputs=[str(folders["imgs"])], out=str(out), weights=str(ckpt), device="cpu",
            dtype="float32", out_dtype="float32", workers=0, progress=False, resume=True))
        assert (encoded.reused, encoded.encoded) == (len(want), 0)
        assert_same_rows(rows_of(out), want)


def test_shard_output_resume_counts_every_ranks_reused_error_rows(work, sequence, folders,
                                                                   ckpt):
    """A --shard-output run killed before rank 0 merged the manifests: --resume keeps every
    part, and the summary counts the error rows among them on every rank (it counted rank
    0's alone)."""
    seq_ok(sequence, "shard")
    folder = work / "reused_failed_shard"
    shutil.copytree(work / "seq" / "shard", folder)
    for merged in [folder / "_manifest.json", *folder.glob("_stamps-*.bin")]:
        merged.unlink()
    failed = [sum(p["failed"] for p in load_manifest(folder / f"_manifest-rank00{r}.json")
                  ["parts"].values()) for r in range(2)]
    assert failed[1] > 0, failed  # else this test shows nothing
    summary_json = work / "reused_failed_shard.json"
    ok(torchrun(["-m", "dsv4enc", "encode", str(folders["imgs"]), "--out", str(folder),
                 "--weights", str(ckpt), *FAST, "--shard-output", "--part-images",
                 str(PART_IMAGES), "--resume", "--summary-json", str(summary_json)], work))
    images = json.loads(summary_json.read_text())["images"]
    assert (images["encoded"], images["reused_failed"]) == (0, sum(failed)), (images, failed)


def _spoil_keys(path: Path) -> bytes:
    """Overwrite the pages of a part file's ``path`` column, its footer intact (``--resume``
    keeps the part, judged by its footer): its keys can no longer be read. Returns the file's
    bytes as they were."""
    data = path.read_bytes()
    spoiled = bytearray(data)
    meta = pq.read_metadata(path)
    for group in range(meta.num_row_groups):
        chunk = next(c for c in map(meta.row_group(group).column, range(meta.num_columns))
                     if c.path_in_schema == "path")
        first = chunk.dictionary_page_offset or chunk.data_page_offset
        spoiled[first:first + chunk.total_compressed_size] = b"\xff" * chunk.total_compressed_size
    path.write_bytes(bytes(spoiled))
    with pytest.raises(Exception):
        pq.read_table(path, columns=["path"])
    return data


def test_shard_output_resume_stamps_kept_parts_without_reading_them(work, sequence, folders,
                                                                    ckpt, reference):
    """A --shard-output run killed before rank 0 merged the manifests, then resumed: its end
    stamps each kept part's rows from what its rank recorded when it committed the part, and
    never reads the part back (a kept part whose keys cannot be read stops nothing), so the
    end costs the same however many parts were kept; a part recorded without it (by an
    earlier dsv4enc) is read back. The stamps file is the uninterrupted run's, byte for byte,
    and one process's --update of the folder reuses every row."""
    seq_ok(sequence, "shard")
    clean, folder = work / "seq" / "shard", work / "kept_stamps_shard"
    shutil.copytree(clean, folder)
    for merged in [folder / "_manifest.json", *folder.glob("_stamps-*.bin")]:
        merged.unlink()
    shares = sorted(((name, part) for rank in range(2)
                     for name, part in json.loads(
                         (folder / f"_manifest-rank00{rank}.json").read_text())["parts"].items()
                     if 0 < part["rows"] < part["end"] - part["start"]),
                    key=lambda item: item[1]["start"])
    assert len(shares) >= 3, shares  # else this test shows nothing
    assert all("share" in part for _, part in shares)  # each rank's own, for its --resume
    assert not any("share" in part for part in load_manifest(clean / "_manifest.json")["parts"]
                   .values())  # the merged manifest's parts are as readers know them
    (_, spoiled), (older, _), (_, gone) = shares[:3]
    kept_bytes = _spoil_keys(folder / spoiled["file"])
    for rank in range(2):  # ``older``'s entry as an earlier dsv4enc recorded it
        manifest = folder / f"_manifest-rank00{rank}.json"
        document = json.loads(manifest.read_text())
        if older in document["parts"]:
            document["parts"][older].pop("share", None)
            manifest.write_text(json.dumps(document))
    (folder / gone["file"]).unlink()  # encoded again
    ok(torchrun(["-m", "dsv4enc", "encode", str(folders["imgs"]), "--out", str(folder),
                 "--weights", str(ckpt), *FAST, "--shard-output", "--part-images",
                 str(PART_IMAGES), "--resume"], work))
    (folder / spoiled["file"]).write_bytes(kept_bytes)
    assert _stamps_file(folder) == _stamps_file(clean)
    _update_reuses_every_row(folder, folders, ckpt, reference, work)


def test_resume_of_a_tensor_parallel_run_in_one_process_names_why(work, sequence, folders,
                                                                   ckpt):
    """A --tp-mode weights run's rows are not batch-invariant: --resume in one process is
    refused, in a line that names the option behind it (it said "batch invariant differs");
    with --tp-mode weights given, in the line that says it needs torchrun's ranks."""
    seq_ok(sequence, "tp")
    resume = dict(inputs=[str(folders["imgs"])], out=str(work / "seq" / "tp.parquet"),
                  weights=str(ckpt), device="cpu", dtype="float32", out_dtype="float32",
                  workers=0, progress=False, resume=True)
    with pytest.raises(UsageError, match=r"cannot resume .*: batch invariance \(--deterministic; "
                                         r"off under --tp-mode weights\) differs"):
        run_encode(EncodeOptions(**resume))
    with pytest.raises(UsageError, match=r"^--tp-mode weights splits the tower across "
                                         r"torchrun ranks: run it under torchrun with 2"):
        run_encode(EncodeOptions(**resume, tp_mode="weights"))


def _stamps_file(folder: Path) -> tuple[bytes, int]:
    """A finished folder's stamps file (its bytes) and its rows."""
    entry = load_manifest(folder / "_manifest.json")["stamps"]
    return (folder / entry["file"]).read_bytes(), entry["rows"]


def _stamps_read_back(folder: Path, one_process: Path) -> bytes:
    """A sharded folder's stamps file as rank 0 made it by reading every part file's keys
    back: each row's stamp (as ``one_process``, a folder of the same inputs, records it), its
    parts by start, then file."""
    data, rows = _stamps_file(one_process)
    parts = sorted(load_manifest(one_process / "_manifest.json")["parts"].values(),
                   key=lambda p: p["start"])
    keys = [key for p in parts
            for key in pq.read_table(one_process / p["file"]).column("path").to_pylist()]
    stamps = data[len(data) - 8 * rows:]
    by_key = {key: stamps[8 * i:8 * i + 8] for i, key in enumerate(keys)}
    sharded = sorted(load_manifest(folder / "_manifest.json")["parts"].values(),
                     key=lambda p: (p["start"], p["file"]))
    return data[:len(data) - 8 * rows] + b"".join(
        by_key[key] for p in sharded
        for key in pq.read_table(folder / p["file"]).column("path").to_pylist())


def test_shard_output_stamps_come_from_each_ranks_parts(work, sequence, folders, ckpt):
    """Each --shard-output rank sends the stamps of its parts' rows (those it encoded, those
    --resume kept), which rank 0 joins in the rows' order: the stamps file is byte for byte
    the one made by reading every part's keys back, for a fresh run and a resumed one."""
    one_process = work / "imgs_folder"
    run_encode(EncodeOptions(inputs=[str(folders["imgs"])], out=f"{one_process}/",
                             weights=str(ckpt), device="cpu", dtype="float32",
                             out_dtype="float32", workers=0, progress=False))
    for name, folder in [("shard", "shard"), ("gap_resumed", "gap")]:
        seq_ok(sequence, name)
        got, rows = _stamps_file(work / "seq" / folder)
        assert rows == len(rows_of(one_process))
        assert got == _stamps_read_back(work / "seq" / folder, one_process), name
    seq_ok(sequence, "empty_shard")
    assert _stamps_file(work / "seq" / "empty_shard")[1] == 0


def test_shard_output_ranks_writing_to_different_folders_refuse(work, sequence):
    """--shard-output ranks given different --out folders (or folders that are not one shared
    folder) each write their parts where rank 0 never looks: every rank stops in one line
    naming it (exit 2), rather than all exiting 0 with a manifest that lists missing parts."""
    for rank, result in enumerate(sequence["ranks_out"]):
        errors = [x for x in result["stderr"].splitlines() if x.startswith("error:")]
        assert result["code"] == 2 and len(errors) == 1, (rank, result["stderr"][-3000:])
        assert "--shard-output ranks need one --out folder" in errors[0], errors[0]
        assert "Traceback" not in result["stderr"], result["stderr"][-3000:]
    assert not (work / "seq" / "ranks_out_0" / "_manifest.json").exists()


def test_resume_on_more_ranks_leaves_the_folder_as_it_was(work, sequence, folders, ckpt):
    """--resume of a stopped 2-rank --shard-output folder on 3 ranks is refused in one line on every
    rank, and the folder is left as it was: the rank with no manifest of its own there wrote
    an empty one before the others refused, which stayed in the folder."""
    folder = unmerged_shard_copy(work, sequence, "more_ranks")
    before = sorted(p.name for p in folder.iterdir())
    proc = torchrun(["-m", "dsv4enc", "encode", str(folders["imgs"]), "--out", str(folder),
                     "--weights", str(ckpt), *FAST, "--shard-output", "--part-images",
                     str(PART_IMAGES), "--resume"], work, nproc=3)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and len(errors) == 3, proc.stderr[-3000:]  # one per rank
    assert all("world size differs (2 then, 3 now)" in e for e in errors), errors
    assert sorted(p.name for p in folder.iterdir()) == before
