"""``dsv4enc inspect``: ``--errors`` lists every failed row (``--json``: JSON lines),
``--errors-list FILE`` writes their paths as a ``--files-from`` list that an ``--update``
turns into rows once the files are fixed; a killed run's output shows its committed parts
(its journal's, never a part file not committed), ``interrupted: true`` and the images left."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from dsv4enc import read_embeddings
from dsv4enc.cli import app
from dsv4enc.output.inspect import OutputSummary as Summary, list_line, progress_text
from dsv4enc.output.read import load_manifest

from helpers import REPO_ROOT, Pauses, launch_tiny, write_image

runner = CliRunner()


def run(*args: str):
    return runner.invoke(app, list(args))


def encode(*args: str, weights: Path):
    result = run("encode", *args, "--weights", str(weights), "--workers", "0", "--device",
                 "cpu", "-q")
    assert result.exit_code == 0, result.output
    return result


def test_every_failure_listed_then_retried_with_files_from_and_update(tmp_path, small_ckpt):
    """A batch whose every image came truncated: all its failures are listed, as text and
    JSON lines; the list, once the files are fixed, goes back through ``--update``."""
    folder = tmp_path / "imgs"
    folder.mkdir()
    names = [folder / f"{i}.jpg" for i in range(3)] + [folder / "#odd.jpg"]
    for path in names:
        path.write_bytes(b"\xff\xd8 truncated")
    given = tmp_path / "all.txt"
    given.write_text("".join(f"{list_line(str(p))}\n" for p in names))
    out = tmp_path / "out"
    encode("--files-from", str(given), "--out", f"{out}/", weights=small_ckpt)
    listed = run("inspect", str(out), "--errors")
    assert listed.exit_code == 0, listed.output
    lines = listed.stdout.splitlines()
    assert [line.split("\t")[0] for line in lines] == [str(p) for p in names]
    as_json = [json.loads(line) for line in run("inspect", str(out), "--errors",
                                                "--json").stdout.splitlines()]
    assert [(r["path"], r["error"]) for r in as_json] == [tuple(l.split("\t")) for l in lines]
    retry = tmp_path / "failed.txt"
    wrote = run("inspect", str(out), "--errors-list", str(retry))
    assert wrote.exit_code == 0 and "wrote 4 failed paths" in wrote.output
    assert retry.read_text().splitlines()[-1] == f"{folder}/#odd.jpg"  # absolute: as given
    again = run("inspect", str(out), "--errors-list", str(retry))
    assert again.exit_code == 2 and "exists" in again.output  # never overwritten
    foreign = tmp_path / "foreign.parquet"
    pq.write_table(pa.table({"a": [1]}), foreign)
    refused = run("inspect", str(foreign), "--errors-list", str(tmp_path / "none.txt"))
    assert refused.exit_code == 2 and not (tmp_path / "none.txt").exists()  # nothing written
    for i, path in enumerate(names):
        write_image(path, (40 + i, 30))
    encode("--files-from", str(retry), "--out", f"{out}/", "--update", weights=small_ckpt)
    got = {p: e for p, e, _ in read_embeddings(out, errors="include")}
    assert sorted(got) == sorted(str(p) for p in names)
    assert all(e is not None for e in got.values())
    assert run("inspect", str(out), "--errors").stdout == ""


def _rows(out: Path) -> dict[str, tuple]:
    """Each row of ``out`` by path: its error, then its other columns (embedding as bytes)."""
    names = ["path", "error", "embedding", "grid_h", "grid_w", "width", "height"]
    return {row["path"]: tuple(v.tobytes() if k == "embedding" and v is not None else v
                               for k, v in row.items() if k != "path")
            for row in read_embeddings(out, names, errors="include")}


@pytest.mark.parametrize("target", ["out/", "out.parquet"])
def test_some_failures_retried_from_their_list_keep_every_other_row(tmp_path, small_ckpt,
                                                                   monkeypatch, target):
    """A folder where 2 of 6 images came corrupt: once they are fixed, the errors list goes
    back through ``--files-from ... --update --keep-unlisted`` run inside the folder (so each
    line is its row's key): the 2 rows become embeddings, the 4 others keep their bytes, and
    the output equals a clean run's. Without the flag the partial list is refused, naming
    it; a dry run writes nothing; a later ``--update`` of the folder encodes nothing."""
    folder = tmp_path / "imgs"
    for i in range(6):
        write_image(folder / ("sub" if i % 2 else "") / f"{i}.png", (24 + 4 * i, 20))
    broken = [folder / "2.png", folder / "sub" / "5.png"]
    for path in broken:
        path.write_bytes(b"\x89PNG truncated")
    out = tmp_path / target
    encode(str(folder), "--out", str(out), "--part-images", "2", weights=small_ckpt)
    before = _rows(out)
    assert sorted(p for p, row in before.items() if row[0]) == ["2.png", "sub/5.png"]
    failed = tmp_path / "failed.txt"
    listed = run("inspect", str(out), "--errors-list", str(failed))
    assert listed.exit_code == 0 and "--keep-unlisted" in listed.output
    assert failed.read_text().splitlines() == ["2.png", "sub/5.png"]
    for path in broken:
        path.unlink()
        write_image(path, (30, 26))
    monkeypatch.chdir(folder)
    retry = ["--files-from", str(failed), "--out", str(out), "--update"]
    refused = run("encode", *retry, "--weights", str(small_ckpt), "--device", "cpu", "-q")
    assert refused.exit_code == 2 and "--keep-unlisted" in refused.output
    dry = encode(*retry, "--keep-unlisted", "--dry-run", weights=small_ckpt)
    assert "2 to encode, 4 reused, 0 dropped; nothing was written" in " ".join(dry.output.split())
    assert _rows(out) == before
    encode(*retry, "--keep-unlisted", weights=small_ckpt)
    after = _rows(out)
    assert list(after) == list(before) and all(row[0] is None for row in after.values())
    assert all(after[p] == row for p, row in before.items() if row[0] is None)
    monkeypatch.chdir(tmp_path)
    clean = tmp_path / ("clean/" if target.endswith("/") else "clean.parquet")
    encode(str(folder), "--out", str(clean), weights=small_ckpt)
    assert after == _rows(clean)
    again = encode(str(folder), "--out", str(out), "--update", "--dry-run", weights=small_ckpt)
    assert "0 to encode, 6 reused, 0 dropped" in " ".join(again.output.split())


def test_a_killed_keep_unlisted_update_finishes_when_run_again(tmp_path, small_ckpt):
    """Killed after the update's first commit: the old output is whole; the same command
    again reuses the committed part and ends equal to a clean run."""
    folder = tmp_path / "imgs"
    names = [f"{i}.png" for i in range(8)]
    broken = names[1::2]  # one in each part of two
    for name in names:
        write_image(folder / name, (20 + 2 * int(name[0]), 20))
    for name in broken:
        (folder / name).write_bytes(b"\x89PNG truncated")
    out = tmp_path / "out"
    encode(str(folder), "--out", f"{out}/", "--part-images", "2", weights=small_ckpt)
    before = _rows(out)
    failed = tmp_path / "failed.txt"
    assert run("inspect", str(out), "--errors-list", str(failed)).exit_code == 0
    for name in broken:
        (folder / name).unlink()
        write_image(folder / name, (28, 24))
    command = [sys.executable, "-m", "dsv4enc", "encode", "--files-from", str(failed),
               "--out", f"{out}/", "--weights", str(small_ckpt), "--part-images", "2",
               "--workers", "0", "--device", "cpu", "-q", "--update", "--keep-unlisted"]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    pauses = Pauses(tmp_path / "pauses", "commit")
    proc = subprocess.Popen(command, cwd=folder, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=pauses.env(env))
    try:
        pauses.wait("commit", proc=proc)
    finally:
        proc.kill()
        proc.wait()
    assert _rows(out) == before  # nothing switched yet
    again = subprocess.run(command + ["--summary-json", str(tmp_path / "s.json")], cwd=folder,
                           env=env, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    images = json.loads((tmp_path / "s.json").read_text())["images"]
    assert images["encoded"] < len(broken) and images["dropped"] == 0
    clean = tmp_path / "clean"
    encode(str(folder), "--out", f"{clean}/", weights=small_ckpt)
    assert _rows(out) == _rows(clean)


@pytest.mark.parametrize("flags, says", [
    (["--keep-unlisted"], "--keep-unlisted applies to --update only"),
    (["--update", "--keep-unlisted", "--prune"], "choose one")])
def test_keep_unlisted_is_refused_without_update_or_with_prune(tmp_path, flags, says):
    write_image(tmp_path / "a.png", (20, 20))
    result = run("encode", str(tmp_path / "a.png"), "--out", str(tmp_path / "o.parquet"),
                 "--config", str(REPO_ROOT / "configs" / "tiny.json"), "--random-init", *flags)
    assert result.exit_code == 2 and says in result.output
    assert not (tmp_path / "o.parquet").exists()


def test_list_lines():
    assert list_line("a/b.jpg") == "a/b.jpg" and list_line("#x.jpg") == "./#x.jpg"
    assert list_line("a\nb.jpg") is None and list_line(" lead.jpg") is None


def test_a_killed_run_shows_its_journal_not_its_stray_files(tmp_path, small_ckpt):
    """SIGKILLed while paused after its second commit; then a part file is there that no
    commit lists (as a part written just before a kill is): inspect reports the journal's
    parts and rows, ``interrupted: true`` and the images left, and readers skip the stray."""
    folder = tmp_path / "imgs"
    for i in range(12):
        write_image(folder / f"{i:02d}.png", (20 + i, 20))
    out = tmp_path / "out"
    pauses = Pauses(tmp_path / "pauses", "commit")
    proc = launch_tiny(pauses, folder, f"{out}/", small_ckpt)
    try:
        pauses.release("commit", 1)
        pauses.wait("commit", 2, proc=proc)
    finally:
        proc.kill()
        proc.wait()
    parts = load_manifest(out / "_manifest.json")["parts"]
    assert len(parts) == 2
    files = sorted(out.glob("part-*.parquet"))
    shutil.copy(files[0], out / "part-000009.parquet")  # no commit names it
    data = json.loads(run("inspect", str(out), "--json").stdout)
    done = sum(p["rows"] for p in parts.values())
    assert data["interrupted"] and (data["parts"], data["images_done"]) == (2, done)
    assert data["rows"] == done and data["files"] == 2
    assert (data["images_total"], data["images_left"]) == (12, 12 - done)
    assert len(list(read_embeddings(out))) == done
    text = run("inspect", str(out)).stdout
    assert f"2 parts, {done} images done, {12 - done} of 12 left" in " ".join(text.split())


@contextlib.contextmanager
def paused_at_first_commit(tmp_path: Path, folder: Path, out: Path,
                           ckpt: Path) -> Iterator[subprocess.Popen]:
    """A tiny run of ``folder`` to the single file ``out``, held at its first commit while
    the block runs, then killed."""
    pauses = Pauses(tmp_path / "pauses", "commit")
    proc = launch_tiny(pauses, folder, str(out), ckpt)
    try:
        pauses.wait("commit", 1, proc=proc)
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_a_run_still_writing_is_not_called_interrupted(tmp_path, small_ckpt):
    """While a run holds its output (paused after its first commit), inspect names it as
    being written, not as an interrupted run to --resume (which would be refused)."""
    folder = tmp_path / "imgs"
    for i in range(4):
        write_image(folder / f"{i:02d}.png", (20 + i, 20))
    out = tmp_path / "o.parquet"
    with paused_at_first_commit(tmp_path, folder, out, small_ckpt) as proc:
        data = json.loads(run("inspect", str(out), "--json").stdout)
        text = " ".join(run("inspect", str(out)).stdout.split())
    # --json gives the writer as data; the terminal names it in words
    assert data["interrupted"] and set(data["writing"]) == {"pid", "host", "since"}
    assert (data["writing"]["pid"], data["writing"]["host"]) == (proc.pid, socket.gethostname())
    assert isinstance(data["writing"]["since"], str) and data["writing"]["since"]
    assert f"(pid {proc.pid} on {socket.gethostname()}, since " in text
    assert "being written" in text and "writing" in progress_text(Summary(**data))
    assert f"pid {proc.pid}" in progress_text(Summary(**data))
    assert "--resume" not in text
    data = json.loads(run("inspect", str(out), "--json").stdout)  # killed: to resume now
    assert data["writing"] is None


def test_a_folder_without_a_dsv4enc_manifest_reads_its_parquet_files(tmp_path, small_ckpt):
    """Another tool's ``_manifest.json`` does not hide a folder's files; a dsv4enc manifest
    lists the committed ones."""
    folder = tmp_path / "imgs"
    for i in range(3):
        write_image(folder / f"{i}.png", (20 + i, 20))
    out = tmp_path / "out"
    encode(str(folder), "--out", f"{out}/", "--part-images", "1", weights=small_ckpt)
    plain = tmp_path / "plain"
    plain.mkdir()
    for part in sorted(out.glob("part-*.parquet")):
        shutil.copy(part, plain / part.name)
    (plain / "_manifest.json").write_text(json.dumps({"parts": {"x": {"file": "x"}}}))
    assert [p for p, _, _ in read_embeddings(plain)] == [p for p, _, _ in read_embeddings(out)]
    assert len(list(read_embeddings(out))) == 3


def one_line(result) -> str:
    """The one line a refused ``inspect`` printed (exit 2, no traceback)."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1
    return result.output.strip()


def test_a_part_file_gone_is_damage_in_one_line_and_update_repairs_it(tmp_path, small_ckpt):
    """A part file the manifest lists, deleted: ``inspect``, ``read_embeddings`` and the
    datasets refuse in one line naming it (the output is damaged, ``--update`` repairs it),
    never the other parts' rows as if they were all; ``--update`` then encodes it again."""
    from dsv4enc.dataset import EmbeddingDataset
    from dsv4enc.errors import UsageError

    folder = tmp_path / "imgs"
    for i in range(3):
        write_image(folder / f"{i}.png", (20 + i, 20))
    out = tmp_path / "out"
    args = (str(folder), "--out", f"{out}/", "--part-images", "1")
    encode(*args, weights=small_ckpt)
    want = [(p, e.tobytes()) for p, e, _ in read_embeddings(out)]
    gone = sorted(out.glob("part-*.parquet"))[1]
    gone.unlink()
    line = one_line(run("inspect", str(out)))
    assert f"{out}/{gone.name}: missing" in line and "damaged" in line and "--update" in line
    assert one_line(run("inspect", str(out), "--errors")) == line
    for read in (lambda: list(read_embeddings(out)), lambda: EmbeddingDataset(out)):
        with pytest.raises(UsageError, match=f"{gone.name}: missing.*damaged.*--update"):
            read()
    encode(*args, "--update", weights=small_ckpt)
    assert [(p, e.tobytes()) for p, e, _ in read_embeddings(out)] == want


def test_a_manifest_entry_not_of_the_format_is_damage_in_one_line(tmp_path, small_ckpt):
    """A part entry edited out of the format (a ``file`` outside the folder, which is never
    followed, a ``start`` that is no integer, ...) is refused by every reader in one line
    naming the manifest, the part and the fault: never a traceback, never a part left out."""
    from dsv4enc.errors import UsageError

    folder = tmp_path / "imgs"
    for i in range(2):
        write_image(folder / f"{i}.png", (20 + i, 20))
    out = tmp_path / "out"
    encode(str(folder), "--out", f"{out}/", "--part-images", "1", weights=small_ckpt)
    document = json.loads((out / "_manifest.json").read_text())
    name = sorted(document["parts"])[0]
    edits = [({"file": "../../etc/passwd"}, 'names "../../etc/passwd", not a part file'),
             ({"file": "sub/part-000000.parquet"}, "not a part file"),
             ({"file": 7}, "'file' 7, not a string"),
             ({"start": None}, "'start' null, not an integer"),
             ({"start": "0"}, "'start' \"0\", not an integer"),
             ({"rows": True}, "'rows' true, not an integer"),
             ({"end": None, "file": None}, "'end' null"),
             ({"start": ...}, "has no 'start'"),
             ({"file": ...}, "names no part file"),
             (None, "is not an object")]
    for number, (edit, says) in enumerate(edits):
        damaged = tmp_path / f"damaged{number}"
        shutil.copytree(out, damaged)
        edited = json.loads(json.dumps(document))
        if edit is None:
            edited["parts"][name] = ["not", "an", "entry"]
        for key, value in (edit or {}).items():
            if value is ...:
                del edited["parts"][name][key]
            else:
                edited["parts"][name][key] = value
        (damaged / "_manifest.json").write_text(json.dumps(edited))
        line = one_line(run("inspect", str(damaged)))
        assert f"{damaged}/_manifest.json: its part {name!r}" in line and says in line, line
        assert "damaged" in line
        with pytest.raises(UsageError, match="the output is damaged"):
            list(read_embeddings(damaged))


def test_a_folder_run_killed_before_its_first_commit_is_shown_as_interrupted(tmp_path,
                                                                           small_ckpt):
    """SIGKILLed while paused before any commit (its lock and a manifest of no part are
    there): ``inspect`` says what it says of a single file's run stopped so, an interrupted
    run of 0 parts to finish with --resume, not "no Parquet files"."""
    folder = tmp_path / "imgs"
    for i in range(4):
        write_image(folder / f"{i}.png", (20 + i, 20))
    from dsv4enc.output.inspect import progress_text, summarize

    said = []
    for number, out in enumerate((f"{tmp_path}/folder/", f"{tmp_path}/single.parquet")):
        pauses = Pauses(tmp_path / f"pauses{number}", "encoded")
        proc = launch_tiny(pauses, folder, out, small_ckpt)
        try:
            pauses.wait("encoded", proc=proc)
        finally:
            proc.kill()
            proc.wait()
        result = run("inspect", out.rstrip("/"))
        assert result.exit_code == 0, result.output
        assert "(an interrupted run: not finished)" in " ".join(result.stdout.split())
        data = json.loads(run("inspect", out.rstrip("/"), "--json").stdout)
        assert data["interrupted"] and (data["parts"], data["images_done"]) == (0, 0)
        assert data["rows"] == data["files"] == 0
        said.append(progress_text(summarize(out.rstrip("/"))))
    assert said[0] == said[1] and said[0].startswith("0 parts, 0 images done") and (
        "--resume" in said[0])


def grids_output(path: Path, grids: list[tuple[int, int]], pooled: bool) -> Path:
    """An output of one image per grid (8 wide), written as a run writes its rows."""
    from dsv4enc.output.parts import Row, output_schema, parquet_options, rows_to_table

    schema = output_schema(8, "float16", {}, pooled=pooled, layout="binary")
    rows = [Row(path=f"{i}.png", width=14 * w, height=14 * h, vit_h=h, vit_w=w, grid_h=h,
                grid_w=w, embedding=np.zeros(8 if pooled else (h * w, 8), np.float16))
            for i, (h, w) in enumerate(grids)]
    pq.write_table(rows_to_table(rows, schema), path, **parquet_options(schema))
    return path


def test_a_pooled_outputs_rows_per_image_are_one(tmp_path):
    """A pooled output holds one embedding row per image: its ``rows per image`` (and
    ``rows_per_image`` in --json) say 1, as ``embedding_rows`` counts them, not the grid's
    cells that the pool averaged; unpooled, they are the grid's cells."""
    grids = [(2, 3), (4, 4), (1, 5)]
    pooled = json.loads(run("inspect", str(grids_output(tmp_path / "p.parquet", grids, True)),
                            "--json").stdout)
    assert pooled["embedding_rows"] == 3
    assert pooled["rows_per_image"] == {"min": 1, "median": 1.0, "mean": 1.0, "max": 1}
    text = " ".join(run("inspect", str(tmp_path / "p.parquet")).stdout.split())
    assert "rows per image │ 1 / 1 / 1 (mean 1)" in text
    full = json.loads(run("inspect", str(grids_output(tmp_path / "f.parquet", grids, False)),
                          "--json").stdout)
    assert full["embedding_rows"] == 6 + 16 + 5
    assert full["rows_per_image"] == {"min": 5, "median": 6.0, "mean": 9.0, "max": 16}


def test_the_commonest_grids_are_numbers_in_json(tmp_path):
    """``top_grids`` in --json is data, ``[grid_h, grid_w, images]``, commonest first; the
    terminal writes each as ``HxW (N)``."""
    out = grids_output(tmp_path / "o.parquet", [(2, 3), (4, 4), (2, 3), (1, 5), (4, 4), (2, 3)],
                       False)
    data = json.loads(run("inspect", str(out), "--json").stdout)
    assert data["top_grids"] == [[2, 3, 3], [4, 4, 2], [1, 5, 1]]
    text = " ".join(run("inspect", str(out)).stdout.split())
    assert "commonest grids │ 2x3 (3), 4x4 (2), 1x5 (1)" in text


def test_a_finished_output_of_no_images_is_shown_as_empty(tmp_path, small_ckpt):
    """A run given no images ends with exit 0 and an output of no rows: a folder output then
    holds its manifest and no part file. ``inspect`` shows both outputs as finished outputs
    of 0 rows, as the readers read them, never "no Parquet files found"."""
    (tmp_path / "none").mkdir()
    for out in (f"{tmp_path}/folder/", f"{tmp_path}/single.parquet"):
        encode(str(tmp_path / "none"), "--out", out, weights=small_ckpt)
        assert list(read_embeddings(out.rstrip("/"), errors="include")) == []
        result = run("inspect", out.rstrip("/"))
        assert result.exit_code == 0, result.output
        assert "interrupted" not in result.stdout and "rows" in result.stdout
        data = json.loads(run("inspect", out.rstrip("/"), "--json").stdout)
        assert (data["rows"], data["failed"], data["interrupted"]) == (0, 0, False)
        assert (data["dtype"], data["layout"], data["pooled"]) == ("float16", "binary", False)
        assert data["metadata"]["tool"] == "dsv4enc"


def test_a_damaged_page_names_its_part_file(tmp_path, small_ckpt):
    """A committed part whose footer reads but whose pages do not (bytes overwritten on the
    disk, a bad copy): ``inspect`` says which part file it cannot read, so that the part can
    be removed and encoded again, not only the output's folder."""
    for i in range(4):
        write_image(tmp_path / "imgs" / f"{i}.png", (20 + i, 20))
    out = tmp_path / "out"
    encode(str(tmp_path / "imgs"), "--out", f"{out}/", "--part-images", "2", weights=small_ckpt)
    part = sorted(out.glob("part-*.parquet"))[-1]
    with open(part, "r+b") as handle:  # the first column chunk's pages, after "PAR1"
        handle.seek(40)
        handle.write(b"\0" * 200)
    result = run("inspect", str(out))
    assert result.exit_code == 1, result.output
    assert f"error: cannot read {part}: " in " ".join(result.output.split())


def test_errors_shows_a_key_with_a_newline_escaped_on_its_own_line(tmp_path):
    """A failed row whose key holds a newline or a tab (a table's or a tar's key may) is one
    line of ``inspect --errors``, its key escaped as error lines show keys (``\\n``); the
    JSON lines keep the key as it is."""
    from dsv4enc.output.parts import Row, output_schema, parquet_options, rows_to_table

    keys = ["a\nb.jpg", "c\td.jpg", "plain.jpg"]
    schema = output_schema(8, "float16", {}, pooled=False, layout="binary")
    out = tmp_path / "emb.parquet"
    pq.write_table(rows_to_table([Row(path=k, error="decode failed: truncated file")
                                  for k in keys], schema), out, **parquet_options(schema))
    listed = run("inspect", str(out), "--errors")
    assert listed.exit_code == 0, listed.output
    assert listed.stdout.splitlines() == [f"{k}\tdecode failed: truncated file" for k in
                                          ["a\\nb.jpg", "c\\td.jpg", "plain.jpg"]]
    as_json = run("inspect", str(out), "--errors", "--json").stdout.splitlines()
    assert [json.loads(line)["path"] for line in as_json] == keys


def test_the_errors_list_names_a_container_once_for_its_failed_rows(tmp_path):
    """A failed row of a tar shard (``SHARD.tar/KEY``), of a table (``TABLE.parquet/NAME``,
    ``TABLE.parquet#ROW``) or of a container's damaged part (``NAME@OFFSET``) is no file that
    ``--files-from`` reads: the list names its container instead (the longest leading part
    of the key that ends in a container's extension), once, where its first failure is; the
    note says how many containers it names. Other keys are listed as they are."""
    from dsv4enc.output.inspect import container_of
    from dsv4enc.output.parts import Row, output_schema, parquet_options, rows_to_table

    keys = ["a/shard.tar/000001", "photo.jpg", "t.parquet#3", "a/shard.tar/000002#2",
            "T.Arrow@512", "x.parquet/sub.tar/7", "t.parquet/img.jpg", "a.tarball/b.jpg",
            "a/shard.tar@1024", "f.feather/c/d.png"]
    assert [container_of(k) for k in keys] == [
        "a/shard.tar", None, "t.parquet", "a/shard.tar", "T.Arrow", "x.parquet/sub.tar",
        "t.parquet", None, "a/shard.tar", "f.feather"]
    schema = output_schema(8, "float16", {}, pooled=False, layout="binary")
    out = tmp_path / "emb.parquet"
    pq.write_table(rows_to_table([Row(path=k, error="decode failed: truncated file")
                                  for k in keys], schema), out, **parquet_options(schema))
    failed = tmp_path / "failed.txt"
    listed = run("inspect", str(out), "--errors-list", str(failed))
    assert listed.exit_code == 0, listed.output
    assert failed.read_text().splitlines() == [
        "a/shard.tar", "photo.jpg", "t.parquet", "T.Arrow", "x.parquet/sub.tar", "a.tarball/b.jpg",
        "f.feather"]
    note = " ".join(listed.output.split())
    assert "wrote 7 failed paths" in note and "(5 containers:" in note, note
    assert run("inspect", str(out), "--errors").stdout.splitlines()[0].startswith(keys[0])


def test_a_damaged_column_chunk_footer_is_damage_in_one_line_not_an_abort(tmp_path, small_ckpt):
    """A part whose footer's ``error`` column chunk metadata pyarrow cannot build (level
    histograms that do not fit its schema): ``inspect`` and ``inspect --errors`` refuse in
    one line naming it, where ``--errors`` aborted the process (asking for the chunk's
    statistics) and ``inspect`` called it a file it cannot read, as for a store down."""
    from helpers import damage_column_chunks, run_probe

    for i in range(4):
        write_image(tmp_path / "imgs" / f"{i}.png", (20 + i, 20))
    out = tmp_path / "out"
    encode(str(tmp_path / "imgs"), "--out", f"{out}/", "--part-images", "2", weights=small_ckpt)
    part = sorted(out.glob("part-*.parquet"))[-1]
    damage_column_chunks(part, "error")
    for flags in ((), ("--errors",)):
        done = run_probe("from dsv4enc.cli import main; main()", "inspect", out, *flags)
        assert done.returncode == 2, done.stderr
        assert done.stderr.startswith(f"error: {part}: not a readable Parquet file ("), done.stderr
        assert len(done.stderr.strip().splitlines()) == 1 and "--update" in done.stderr


def test_errors_of_an_unfinished_single_file_are_refused_not_an_empty_list(tmp_path, small_ckpt):
    """A single-file run killed after its first commit, its failed image among the committed
    rows: inspect --errors and --errors-list, which cannot read its rows (ranges of a growing
    file), say so in one line (exit 2, no list written), as read_embeddings does; they printed
    nothing and wrote an empty list ("wrote 0 failed paths"), as if no image had failed."""
    folder = tmp_path / "imgs"
    (folder / "00.png").parent.mkdir()
    (folder / "00.png").write_bytes(b"not an image")
    for i in range(1, 6):
        write_image(folder / f"{i:02d}.png", (20 + i, 20))
    out = tmp_path / "o.parquet"
    with paused_at_first_commit(tmp_path, folder, out, small_ckpt):
        pass  # killed there
    for where in (out, Path(f"{out}.partial")):
        for flags in (["--errors"], ["--errors-list", str(tmp_path / "failed.txt")]):
            result = run("inspect", str(where), *flags)
            assert result.exit_code == 2 and result.stdout == "", (result.exit_code, result.output)
            assert "--resume" in result.stderr and len(result.stderr.splitlines()) == 1
            assert not (tmp_path / "failed.txt").exists()


def test_a_storage_option_not_key_value_is_refused_for_a_local_output(tmp_path, small_ckpt):
    """inspect --storage-option without KEY=VALUE is one line (exit 2), as encode refuses it,
    whatever the output; for a local output it was ignored without a word."""
    folder = tmp_path / "imgs"
    write_image(folder / "a.png", (20, 20))
    encode(str(folder), "--out", str(tmp_path / "o.parquet"), weights=small_ckpt)
    for flags in ([], ["--errors"]):
        result = run("inspect", str(tmp_path / "o.parquet"), "--storage-option", "noequals",
                     *flags)
        assert result.exit_code == 2 and "--storage-option expects KEY=VALUE" in result.stderr


@pytest.mark.parametrize("target", ["out/", "out.parquet"])
def test_the_errors_list_leaves_out_rows_keyed_by_a_key_column_and_says_how_to_retry(
        tmp_path, small_ckpt, monkeypatch, target):
    """A table's row keyed by ``--key-column`` (its id) names neither its table nor a file:
    the list wrote the id as a path, which ``--files-from`` then could not read back. It is
    left out, and the note says how such rows are retried (the original command with
    ``--update --retry-errors``), which then encodes them: the output equals a clean run's."""
    monkeypatch.chdir(tmp_path)

    def table(broken: bool) -> None:
        cells = []
        for i in range(3):
            write_image(tmp_path / "cell.png", (20 + i, 20))
            cells.append(tmp_path.joinpath("cell.png").read_bytes())
        if broken:
            cells[1] = b"not an image"
        pq.write_table(pa.table({"image": cells, "id": ["a1", "a2", "a3"]}), "t.parquet")
        (tmp_path / "cell.png").unlink()

    table(broken=True)
    Path("bad.jpg").write_bytes(b"\xff\xd8 truncated")
    inputs = ["t.parquet", "bad.jpg", "--key-column", "id"]
    encode(*inputs, "--out", target, weights=small_ckpt)
    failed = tmp_path / "failed.txt"
    listed = run("inspect", target, "--errors-list", str(failed))
    assert listed.exit_code == 0, listed.output
    assert failed.read_text().splitlines() == ["bad.jpg"]  # never "a2", which names no file
    note = " ".join(listed.output.split())
    assert "1 row of a table keyed by --key-column" in note and "--update --retry-errors" in note
    table(broken=False)  # (the image file stays broken)
    encode(*inputs, "--out", target, "--update", "--retry-errors", weights=small_ckpt)
    errors = {p: e for p, e in ((r["path"], r["error"]) for r in
                                read_embeddings(target, ["path", "error"], errors="include"))}
    assert errors["a2"] is None and errors["bad.jpg"] is not None
