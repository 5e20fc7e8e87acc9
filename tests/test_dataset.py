"""``dsv4enc.dataset``: the map-style dataset gives ``read_embeddings``' rows by index and by
key; the iterable one, split over 2 ranks x 2 DataLoader workers, gives every row of a
1,000-row output exactly once an epoch, shuffled by seed and epoch; the collate pads."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import DataLoader

from dsv4enc import read_embeddings
from dsv4enc.dataset import EmbeddingDataset, EmbeddingIterableDataset, collate_embeddings
from dsv4enc.output.parts import Row, output_schema, parquet_options, rows_to_table

ROWS, FILES, WIDTH = 1000, 3, 8


def write_output(folder: Path, layout: str = "binary", pooled: bool = False) -> Path:
    """A folder output of ROWS rows over FILES part files in row groups of 1 to 13 rows,
    every 37th image failed, rows of 1 to 5 vectors."""
    rng = np.random.default_rng(7)
    folder.mkdir()
    schema = output_schema(WIDTH, "float16", {}, pooled=pooled, layout=layout)
    bounds = np.linspace(0, ROWS, FILES + 1).astype(int)
    for part, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        rows = []
        for i in range(lo, hi):
            name = f"img/{i:04d}.jpg"
            if i % 37 == 5:
                rows.append(Row(path=name, error="decode failed: truncated file"))
                continue
            shape = (WIDTH,) if pooled else (1 + i % 5, WIDTH)
            emb = rng.standard_normal(shape).astype(np.float16)
            rows.append(Row(path=name, width=64, height=48, vit_h=4, vit_w=4, grid_h=1,
                            grid_w=1 if pooled else shape[0], embedding=emb))
        table = rows_to_table(rows, schema)
        writer = pq.ParquetWriter(folder / f"part-{part:06d}.parquet", schema,
                                  **parquet_options(schema))
        at = 0
        while at < table.num_rows:  # row groups of uneven sizes
            size = 1 + (at * 7 + part) % 13
            writer.write_table(table.slice(at, size), row_group_size=size)
            at += size
        writer.close()
    return folder


@pytest.fixture(scope="module")
def output(tmp_path_factory) -> Path:
    return write_output(tmp_path_factory.mktemp("dataset") / "out")


def expected(output) -> dict[str, np.ndarray]:
    return {path: emb for path, emb, _ in read_embeddings(output)}


def test_by_index_and_by_key_equal_read_embeddings(output):
    dataset = EmbeddingDataset(output)
    want = list(read_embeddings(output))
    assert len(dataset) == len(want) == ROWS - len(range(5, ROWS, 37))
    for i in [0, 1, 17, 500, len(want) - 1, 3, 2]:
        item = dataset[i]
        path, emb, grid = want[i]
        assert item["path"] == path and (item["grid_h"], item["grid_w"]) == grid
        assert item["embedding"].dtype == torch.float16
        np.testing.assert_array_equal(item["embedding"].numpy(), emb)
    for path, emb, _ in want[::97]:
        np.testing.assert_array_equal(dataset[path]["embedding"].numpy(), emb)
        assert dataset.index_of(path) == [p for p, _, _ in want].index(path)
    with pytest.raises(KeyError):
        dataset["img/0005.jpg"]  # failed: skipped
    included = EmbeddingDataset(output, columns=["vit_h"], errors="include")
    assert len(included) == ROWS
    failed = included["img/0005.jpg"]
    assert failed["embedding"] is None and failed["error"].startswith("decode failed")
    assert included["img/0000.jpg"]["vit_h"] == 4


def loaded(output, rank: int, epoch: int, shuffle: bool = True) -> list[str]:
    dataset = EmbeddingIterableDataset(output, shuffle=shuffle, seed=3, rank=rank, world_size=2)
    dataset.set_epoch(epoch)
    loader = DataLoader(dataset, batch_size=7, num_workers=2, collate_fn=collate_embeddings)
    return [path for batch in loader for path in batch["path"]]


def test_two_ranks_two_workers_see_every_row_once(output):
    want = expected(output)
    for epoch in (0, 1):
        seen = [loaded(output, rank, epoch) for rank in (0, 1)]
        counts = Counter(seen[0] + seen[1])
        assert set(counts) == set(want) and set(counts.values()) == {1}
        assert abs(len(seen[0]) - len(seen[1])) <= 2 * 13  # a row group per worker, at most
        if epoch == 0:
            first = seen
    assert first != seen  # another epoch, another order
    assert loaded(output, 0, 1) == seen[0]  # the same seed and epoch: the same order
    plain = loaded(output, 0, 0, shuffle=False) + loaded(output, 1, 0, shuffle=False)
    assert sorted(plain) == sorted(want) and plain != sorted(plain)  # by group, not by row


def test_set_epoch_reaches_persistent_workers(output):
    """Persistent workers hold the copy of the dataset made at the first epoch; the epoch
    set later still draws each epoch's order there, the order fresh workers draw."""
    dataset = EmbeddingIterableDataset(output, shuffle=True, seed=3, rank=0, world_size=2)
    loader = DataLoader(dataset, batch_size=7, num_workers=2, collate_fn=collate_embeddings,
                        persistent_workers=True)
    for epoch in (0, 1, 2):
        dataset.set_epoch(epoch)
        assert [path for batch in loader for path in batch["path"]] == loaded(output, 0, epoch)


def test_rows_from_the_loader_equal_read_embeddings(output):
    want = expected(output)
    loader = DataLoader(EmbeddingIterableDataset(output, shuffle=True), batch_size=5,
                        collate_fn=collate_embeddings)
    for batch in loader:
        for i, path in enumerate(batch["path"]):
            length = int(batch["lengths"][i])
            assert batch["mask"][i].sum() == length
            np.testing.assert_array_equal(batch["embedding"][i, :length].numpy(), want[path])
            assert not batch["embedding"][i, length:].any()


def test_the_torch_distributed_rank_is_used(output):
    """Without ``rank``/``world_size``, a process group's rank and size split the rows."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        assert len(list(EmbeddingIterableDataset(output))) == len(expected(output))
    finally:
        dist.destroy_process_group()
    with pytest.raises(ValueError, match="rank 2"):
        list(EmbeddingIterableDataset(output, rank=2, world_size=2))
    for alone in ({"rank": 1}, {"world_size": 2}):  # else each rank would read every row
        with pytest.raises(ValueError, match="give rank and world_size together, or neither"):
            EmbeddingIterableDataset(output, **alone)


def test_spawned_workers_take_the_process_group_s_rank(output, monkeypatch):
    """A DataLoader worker started by spawn or forkserver (macOS's default, and a common
    choice beside CUDA) is a new interpreter with no process group: it takes the rank of the
    process that made it, so the ranks still split the rows rather than each reading all."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)  # a process group of 2 ranks
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    seen = []
    for rank in (0, 1):
        monkeypatch.setattr(dist, "get_rank", lambda group=None, rank=rank: rank)
        loader = DataLoader(EmbeddingIterableDataset(output, shuffle=True), batch_size=64,
                            num_workers=1, multiprocessing_context="spawn",
                            collate_fn=collate_embeddings)
        seen.append([path for batch in loader for path in batch["path"]])
    counts = Counter(seen[0] + seen[1])
    assert set(counts) == set(expected(output)) and set(counts.values()) == {1}


@pytest.mark.parametrize("layout", ["binary", "nested"])
def test_pooled_and_nested_outputs(tmp_path, layout):
    folder = write_output(tmp_path / "pooled", layout=layout, pooled=True)
    want = expected(folder)
    batch = collate_embeddings([EmbeddingDataset(folder)[i] for i in range(4)])
    assert batch["embedding"].shape == (4, WIDTH)
    for path, vector in zip(batch["path"], batch["embedding"]):
        np.testing.assert_array_equal(vector.numpy(), want[path])


#: One torchrun rank: the iterable dataset with no rank given (the process group's), through
#: 2 DataLoader workers; the paths it saw, in RESULTS/rank{R}.json.
RANK_SCRIPT = """
import json, os, sys
import torch.distributed as dist
from torch.utils.data import DataLoader
from dsv4enc.dataset import EmbeddingIterableDataset, collate_embeddings
dist.init_process_group("gloo")
data = EmbeddingIterableDataset(sys.argv[1], shuffle=True, seed=5)
seen = [p for b in DataLoader(data, batch_size=4, num_workers=2, collate_fn=collate_embeddings)
        for p in b["path"]]
with open(os.path.join(sys.argv[2], f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump(seen, f)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_under_torchrun_two_ranks_two_workers_see_every_row_once(output, tmp_path):
    import json
    import os
    import socket
    import subprocess
    import sys

    from helpers import REPO_ROOT

    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                           "--master-addr=127.0.0.1", f"--master-port={port}", str(script),
                           str(output), str(tmp_path)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert seen[0] and seen[1]
    counts = Counter(seen[0] + seen[1])
    assert set(counts) == set(expected(output)) and set(counts.values()) == {1}


def test_an_output_of_more_parts_than_the_open_file_limit(tmp_path):
    """The datasets hold a bounded number of open files, not one (and a memory map) per part
    file: an output of 40 parts reads whole under an open-file limit of 20 files more than
    are open, with the rows and order of an output read with no limit."""
    import os
    import resource

    from dsv4enc.output.parts import PartStore

    table = pq.read_table(write_output(tmp_path / "whole"))
    folder = tmp_path / "out"
    store = PartStore(folder, {"tool": "dsv4enc"})
    store.create()
    bounds = np.linspace(0, table.num_rows, 41).astype(int).tolist()
    for part, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        store.commit(f"part-{part:06d}", table.slice(lo, hi - lo), hi - lo, lo, hi, f"d{part}")
    want = [path for path, _, _ in read_embeddings(folder)]
    plain = [item["path"] for item in EmbeddingIterableDataset(folder, shuffle=True, seed=2)]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 20, hard))
    try:
        mapped = EmbeddingDataset(folder)
        assert [mapped[i]["path"] for i in range(len(mapped))] == want
        assert [mapped[i]["path"] for i in range(len(mapped) - 1, -1, -1)] == want[::-1]
        assert [item["path"] for item in EmbeddingIterableDataset(folder)] == want
        assert [item["path"] for item in EmbeddingIterableDataset(folder, shuffle=True,
                                                                  seed=2)] == plain
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize("pooled", [False, True])
def test_a_batch_of_failed_rows_has_the_keys_and_types_of_any_other(tmp_path, pooled):
    """A batch in which every row failed (``errors="include"``) still has ``embedding``,
    ``lengths`` and (unpooled) ``mask`` as tensors, of no vectors in the output's width and
    dtype, so that a training loop indexes it as it does any other batch."""
    folder = write_output(tmp_path / "out", pooled=pooled)
    dataset = EmbeddingDataset(folder, errors="include")
    failed = [dataset[f"img/{i:04d}.jpg"] for i in (5, 42, 79)]
    assert all(item["embedding"] is None for item in failed)
    some = collate_embeddings([dataset["img/0000.jpg"], *failed])
    batch = collate_embeddings(failed)
    assert batch.keys() == some.keys()
    assert batch["embedding"].dtype == some["embedding"].dtype == torch.float16
    assert batch["embedding"].shape == ((3, WIDTH) if pooled else (3, 0, WIDTH))
    assert not batch["embedding"].any()
    assert batch["lengths"].tolist() == [0, 0, 0]
    assert batch["lengths"].dtype == some["lengths"].dtype
    if not pooled:
        assert batch["mask"].shape == (3, 0) and batch["mask"].dtype == torch.bool
    loader = DataLoader(EmbeddingIterableDataset(folder, errors="include"), batch_size=1,
                        num_workers=1, collate_fn=collate_embeddings)
    alone = next(batch for batch in loader if batch["path"] == ["img/0005.jpg"])
    assert alone["embedding"].shape == ((1, WIDTH) if pooled else (1, 0, WIDTH))


@pytest.mark.parametrize("kind", [EmbeddingDataset, EmbeddingIterableDataset])
def test_columns_given_as_one_text_is_refused_naming_columns(output, kind):
    """``columns="vit_h"`` is refused as the dataset is made, saying how to ask for that
    column; not taken for the columns v, i, t, _ and h ("no column 'v'", of an output that
    has vit_h)."""
    with pytest.raises(ValueError, match=r"^columns must be a list of column names, not the "
                                         r"text 'vit_h' \(columns=\['vit_h'\] for that "
                                         r"column\)$"):
        kind(output, columns="vit_h")
    assert kind(output, columns=["vit_h"])


def test_a_negative_seed_or_epoch_is_refused_where_it_is_given(output):
    """numpy draws the order from non-negative integers alone: a negative ``seed`` is refused
    when the dataset is made, and a negative epoch by ``set_epoch``, naming the argument,
    not later in numpy's words when iteration starts (inside a DataLoader worker)."""
    with pytest.raises(ValueError, match="^seed must be a non-negative integer, not -1$"):
        EmbeddingIterableDataset(output, shuffle=True, seed=-1)
    dataset = EmbeddingIterableDataset(output, shuffle=True, seed=0)
    with pytest.raises(ValueError, match="^epoch must be a non-negative integer, not -1$"):
        dataset.set_epoch(-1)
    assert dataset.epoch == 0


@pytest.mark.parametrize("option, message", [
    ({"seed": 1.5}, "^seed must be a non-negative integer, not 1.5$"),
    ({"seed": "3"}, "^seed must be a non-negative integer, not '3'$"),
    ({"rank": 0.5, "world_size": 2}, "^rank 0.5 is not in a world of 2$"),
    ({"rank": 2, "world_size": 2}, "^rank 2 is not in a world of 2$"),
    ({"rank": 0, "world_size": 0}, "^world_size must be positive, got 0$"),
    ({"rank": 0, "world_size": 1.5}, "^world_size must be a whole number, got 1.5$"),
    ({"shuffle": "no"}, "^shuffle must be True or False, got 'no'$")])
def test_a_bad_split_or_order_option_is_refused_where_it_is_given(output, option, message):
    """A seed, rank or world size that is no whole number of its range, or a shuffle that
    is no flag ("no" is truthy), is refused as the dataset is made, naming the argument; not
    when iteration starts, in numpy's or a list index's words (inside a DataLoader worker),
    nor taken (a shuffled order for shuffle="no")."""
    with pytest.raises(ValueError, match=message):
        EmbeddingIterableDataset(output, **option)
    dataset = EmbeddingIterableDataset(output, shuffle=True)
    with pytest.raises(ValueError, match="^epoch must be a non-negative integer, not 1.5$"):
        dataset.set_epoch(1.5)


def test_a_damaged_column_chunk_footer_is_damage_in_one_line_not_an_abort(tmp_path):
    """A part whose footer's embedding column chunk metadata pyarrow cannot build (level
    histograms that do not fit its schema): both datasets refuse it in the readers' one line
    naming the part, where pyarrow aborted the process sizing a batch of its rows."""
    from helpers import damage_column_chunks, run_probe

    folder = write_output(tmp_path / "out")
    part = folder / "part-000001.parquet"
    damage_column_chunks(part, "embedding")
    probe = ("import sys; from dsv4enc.dataset import EmbeddingDataset, EmbeddingIterableDataset"
             "\nfor make in (lambda: EmbeddingDataset(sys.argv[1])[999], lambda: list("
             "EmbeddingIterableDataset(sys.argv[1]))):\n  try: make()\n  except Exception as e:"
             " print(type(e).__name__, e)")
    done = run_probe(probe, folder)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 2 and all(line.startswith(f"UsageError {part}: not a readable Parquet "
                                                   "file (") for line in lines), done.stdout
