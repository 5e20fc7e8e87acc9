"""What ``--out``, ``--overwrite`` and ``--resume`` may touch (issue: data safety).

- ``--overwrite`` deletes only files that are provably dsv4enc's (its manifest format, its
  part names, its temporaries) and never an input; an ``--out`` that is an input, holds one,
  or holds files dsv4enc did not write is refused in one line before anything is touched.
- One run at a time writes an output: a lock in the parts folder, held for the whole run; a
  second run refuses with the holder's pid and host.
- ``--resume`` reuses a part only for the same inputs as they are now (sizes, times, ...) and
  the same row-deciding options: a changed input is encoded again, a changed option refused.

Runs are in-process (tiny random tower, no decode workers) except where two processes must
overlap.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import itertools
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image
from typer.testing import CliRunner

from dsv4enc.output import parts as writer
from dsv4enc.output.files import STAMPS_FILE
from dsv4enc.output.read import load_manifest
from dsv4enc.cli import app
from dsv4enc.errors import OutputError, UsageError, output_os_error
from dsv4enc.output.files import LOCK_NAME
from dsv4enc.run.pipeline import EncodeOptions, run_encode

from helpers import CONFIGS, REPO_ROOT, Pauses, parts_of, table_rows

CONFIG = str(CONFIGS / "tiny.json")
PART = 3
N_IMAGES = 8
#: The parts the images' keys (img0.png ... img7.png) are cut into
PARTS = parts_of([f"img{i}.png" for i in range(N_IMAGES)], PART)
COMMON = ["--config", CONFIG, "--random-init", "--device", "cpu", "--part-images", str(PART),
          "--batch-tokens", "1500", "--workers", "0", "-q"]
runner = CliRunner()


def noise_png(path: Path, seed: int, size: tuple[int, int] = (20, 16)) -> Path:
    rng = np.random.default_rng(seed)
    w, h = size
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path, format="PNG")
    return path


@pytest.fixture
def data(tmp_path) -> Path:
    """``tmp_path/data``: N_IMAGES small PNGs; the project folder around it holds notes."""
    folder = tmp_path / "data"
    folder.mkdir()
    for i in range(N_IMAGES):
        noise_png(folder / f"img{i}.png", i)
    (tmp_path / "notes.txt").write_text("my notes\n")
    return folder


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (links not followed) and its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and not p.is_symlink()}


def encode(*args: str):
    return runner.invoke(app, ["encode", *args, *COMMON],
                         env={"DSV4ENC_WEIGHTS": None, "COLUMNS": "300"})


def one_line_error(result, code: int = 1) -> str:
    assert result.exit_code == code, (result.exit_code, result.output)
    assert result.exception is None or isinstance(result.exception, SystemExit)
    text = result.stderr.strip()
    assert "Traceback" not in result.output and len(text.splitlines()) == 1, text
    return text


def options(inputs: list[Path], out: Path | str, **changes) -> EncodeOptions:
    base = dict(inputs=[str(p) for p in inputs], out=str(out), config=CONFIG,
                random_init=True, device="cpu", part_images=PART, batch_tokens=1500,
                workers=0, progress=False)
    return EncodeOptions(**{**base, **changes})


def rows(path: Path) -> list[dict]:
    return table_rows(pq.read_table(path))


# --------------------------------------------------------------------------- 1. --overwrite

def test_out_dot_over_a_project_with_its_inputs_is_refused(data, monkeypatch):
    """The reported case: ``--out ./ --overwrite`` in a folder holding the inputs, notes and
    an unrelated ``_manifest.json`` deleted all of them."""
    project = data.parent
    (project / "_manifest.json").write_text('{"my": "own manifest"}')
    before = snapshot(project)
    monkeypatch.chdir(project)
    for out in ("./", ".", str(project)):
        line = one_line_error(encode("data", "--out", out, "--overwrite"))
        assert "contains the input data" in line
    assert snapshot(project) == before


def test_out_beside_the_inputs_with_an_unrelated_manifest_is_refused(data):
    """Not an input overlap: a folder whose ``_manifest.json`` is not dsv4enc's is not
    dsv4enc's output, whatever the file's name."""
    out = data.parent / "other"
    out.mkdir()
    (out / "_manifest.json").write_text(json.dumps({"settings": {}, "parts": {}}))
    (out / "part-000000.parquet").write_bytes(b"someone else's")
    before = snapshot(out)
    line = one_line_error(encode(str(data), "--out", f"{out}/", "--overwrite"))
    assert "holds no dsv4enc output" in line
    assert snapshot(out) == before


@pytest.mark.parametrize("out", ["data", "data/", "data/img0.png"])
def test_out_that_is_an_input_is_refused(data, monkeypatch, out):
    monkeypatch.chdir(data.parent)
    before = snapshot(data)
    for extra in ([], ["--overwrite"], ["--resume"]):
        line = one_line_error(encode("data", "--out", out, *extra))
        assert "input" in line and "--out" in line
    assert snapshot(data) == before


def test_out_that_is_an_input_file_or_the_path_list_is_refused(data, tmp_path):
    image = data / "img3.png"
    before = image.read_bytes()
    line = one_line_error(encode(str(image), "--out", str(image), "--overwrite"))
    assert "is the input" in line
    listing = tmp_path / "list.txt"
    listing.write_text(f"{image}\n")
    line = one_line_error(encode("--files-from", str(listing), "--out", str(listing),
                                 "--overwrite"))
    assert "is the input" in line
    assert image.read_bytes() == before and listing.read_text() == f"{image}\n"


def test_out_that_links_to_an_input_is_refused(data, tmp_path):
    (tmp_path / "emb.parquet").symlink_to(data / "img1.png")
    (tmp_path / "linked").symlink_to(data, target_is_directory=True)
    before = snapshot(data)
    line = one_line_error(encode(str(data), "--out", str(tmp_path / "emb.parquet"),
                                 "--overwrite"))
    assert "is an input" in line
    line = one_line_error(encode(str(data), "--out", str(tmp_path / "linked"), "--overwrite"))
    assert "is the input" in line
    assert snapshot(data) == before


def test_a_new_image_name_inside_an_input_folder_is_refused(data):
    """It would be read as an input (a broken image) by the next run over the folder."""
    line = one_line_error(encode(str(data), "--out", str(data / "new.png")))
    assert "input folder" in line
    assert not (data / "new.png").exists()


@pytest.mark.parametrize("out", ["s3:/bucket/emb/", "s3:/bucket/emb.parquet", "x:y/"])
def test_a_relative_out_with_a_colon_in_its_first_name_is_refused(data, tmp_path, monkeypatch,
                                                                  out):
    """A URL missing a slash (pyarrow would read the path as a URI once the run has encoded
    everything): one line before anything is written."""
    monkeypatch.chdir(tmp_path)
    line = one_line_error(encode(str(data), "--out", out))
    assert "names no store" in line and "absolute" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "notes.txt"]


@pytest.mark.parametrize("name", ["y" * 300 + ".parquet", "y" * 300 + "/",
                                  "/".join(["y" * 250] * 20) + "/e.parquet"])
def test_an_out_past_the_file_system_s_name_limits_is_one_line(data, tmp_path, name):
    """A name longer than a folder entry may be (255 bytes), or a path past PATH_MAX: one
    line that names the cause, nothing written (it was a traceback)."""
    line = one_line_error(encode(str(data), "--out", f"{tmp_path}/{name}"))
    assert line.startswith(f"error: cannot use --out {tmp_path}/yyy"), line
    assert line.endswith(": File name too long"), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "notes.txt"]


def test_a_summary_path_that_is_not_a_summary_is_refused(data, tmp_path):
    """``--summary-json`` onto an input, the output (there or not yet), a path inside a
    folder output, or a folder: one line before the run, and nothing is touched."""
    out, folder_out = str(tmp_path / "emb.parquet"), f"{tmp_path / 'emb'}/"
    assert encode(str(data), "--out", folder_out).exit_code == 0
    before = {**snapshot(data), **snapshot(tmp_path / "emb")}
    for given, summary, why in [([out], data / "img0.png", "not a dsv4enc summary"),
                                ([out], out, "is the output"),
                                ([folder_out, "--resume"], f"{folder_out}s.json", "lies in it"),
                                ([out], data, "not a dsv4enc summary")]:
        line = one_line_error(encode(str(data), "--out", *given, "--summary-json",
                                     str(summary)), code=2)
        assert why in line, line
    assert {**snapshot(data), **snapshot(tmp_path / "emb")} == before
    assert not Path(out).exists()


def test_a_summary_name_too_long_for_the_file_system_is_one_line(data, tmp_path):
    """A --summary-json name over 255 bytes: one line before the run (it was a traceback)."""
    summary = tmp_path / ("s" * 300 + ".json")
    line = one_line_error(encode(str(data), "--out", str(tmp_path / "e.parquet"),
                                 "--summary-json", str(summary)), 2)
    assert line == f"error: --summary-json {summary}: File name too long", line
    assert not (tmp_path / "e.parquet").exists()


def test_a_summary_of_an_earlier_run_is_replaced(data, tmp_path):
    summary = tmp_path / "reports" / "summary.json"
    for round_ in range(2):
        result = encode(str(data), "--out", str(tmp_path / f"e{round_}.parquet"),
                        "--summary-json", str(summary))
        assert result.exit_code == 0, result.output
        assert json.loads(summary.read_text())["output"].endswith(f"e{round_}.parquet")
    assert sorted(p.name for p in summary.parent.iterdir()) == ["summary.json"]


def test_overwrite_replaces_only_a_dsv4enc_file(data, tmp_path):
    """A single-file --out that is not dsv4enc's (another tool's Parquet, a text file) is
    never replaced, --overwrite or not."""
    theirs = tmp_path / "theirs.parquet"
    pq.write_table(pa.table({"x": [1, 2]}), theirs)
    text = tmp_path / "notes.txt"
    for target in (theirs, text):
        before = target.read_bytes()
        line = one_line_error(encode(str(data), "--out", str(target), "--overwrite"))
        assert "not a dsv4enc output" in line
        assert target.read_bytes() == before
    mine = tmp_path / "mine.parquet"
    assert encode(str(data), "--out", str(mine)).exit_code == 0
    result = encode(str(data), "--out", str(mine), "--overwrite")
    assert result.exit_code == 0, result.output
    assert pq.read_table(mine).num_rows == N_IMAGES


def test_a_single_file_out_that_is_a_symbolic_link_is_refused(data, tmp_path):
    """The finished file would replace the link itself: a link (dangling, or to a dsv4enc
    file) is refused, naming what it points to; a link to a folder is that folder."""
    mine = tmp_path / "mine.parquet"
    assert encode(str(data), "--out", str(mine)).exit_code == 0
    for target, flags in (("nowhere/x.parquet", []), (str(mine), ["--overwrite"])):
        link = tmp_path / "link.parquet"
        link.unlink(missing_ok=True)
        link.symlink_to(target)
        line = one_line_error(encode(str(data), "--out", str(link), *flags))
        assert f"is a symbolic link (to {target})" in line
        assert link.is_symlink() and os.readlink(link) == target
    assert pq.read_table(mine).num_rows == N_IMAGES
    (tmp_path / "folder").mkdir()
    (tmp_path / "to_folder").symlink_to(tmp_path / "folder")
    result = encode(str(data), "--out", str(tmp_path / "to_folder"))
    assert result.exit_code == 0, result.output
    assert (tmp_path / "folder" / "_manifest.json").exists()


def test_overwrite_of_a_folder_output_keeps_what_dsv4enc_did_not_write(data, tmp_path):
    out = tmp_path / "out"
    assert encode(str(data), "--out", f"{out}/").exit_code == 0
    ours = sorted(p.name for p in out.iterdir())
    stamps = [name for name in ours if STAMPS_FILE.fullmatch(name)]  # for --update
    assert len(stamps) == 1
    assert [name for name in ours if name not in stamps] == [  # parts cut by the keys
        "_manifest.json", "part-000000.parquet", "part-000000_000002.parquet",
        "part-000001_000001.parquet", "part-000002_000001.parquet"]
    # A user's files in the output folder: the run refuses before deleting anything.
    (out / "README.txt").write_text("mine")
    (out / "extra.parquet").write_bytes(b"mine too")
    (out / "sub").mkdir()
    (out / "sub" / "x.png").write_bytes(b"x")
    before = snapshot(out)
    for extra in (["--overwrite"], ["--resume"]):
        line = one_line_error(encode(str(data), "--out", f"{out}/", *extra))
        assert "did not write" in line and "README.txt" in line
    assert snapshot(out) == before
    # Hidden files are passed over (kept, never in the way); the user's others moved away.
    for name in ("README.txt", "extra.parquet"):
        (out / name).unlink()
    (out / "sub" / "x.png").unlink()
    (out / "sub").rmdir()
    (out / ".DS_Store").write_bytes(b"finder")
    (out / ".part-000007.parquet.123-0badcafe.tmp").write_bytes(b"torn, from a killed run")
    result = encode(str(data), "--out", f"{out}/", "--overwrite")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == [".DS_Store", *ours]
    assert (out / ".DS_Store").read_bytes() == b"finder"


def test_a_file_under_a_part_name_that_dsv4enc_did_not_write_is_kept(data, tmp_path):
    """A part file name no manifest lists is dsv4enc's only where its footer says so (a killed
    run's part, which --resume deletes): any other file under such a name makes --resume,
    --update and --overwrite refuse, naming it."""
    out = tmp_path / "out"
    assert encode(str(data), "--out", f"{out}/").exit_code == 0
    (out / "part-000042.parquet").write_text("my notes")
    before = snapshot(out)
    for extra in (["--overwrite"], ["--resume"], ["--update"]):
        line = one_line_error(encode(str(data), "--out", f"{out}/", *extra))
        assert "did not write" in line and "part-000042.parquet" in line
    assert snapshot(out) == before
    (out / "part-000042.parquet").write_bytes((out / "part-000000.parquet").read_bytes())
    result = encode(str(data), "--out", f"{out}/", "--resume")  # dsv4enc's, uncommitted
    assert result.exit_code == 0, result.output
    assert not (out / "part-000042.parquet").exists()


#: Names dsv4enc gives files beside its parts, other than part files.
OTHER_NAMES = ["_manifest-rank001.json", "_stamps-deadbeefdeadbeef.bin", "_manifest.journal",
               "_manifest-rank000.journal", "_growing.parquet"]


@pytest.mark.parametrize("name", OTHER_NAMES)
def test_a_file_under_another_dsv4enc_name_that_dsv4enc_did_not_write_is_kept(data, tmp_path,
                                                                              name):
    """A manifest, journal, stamps or growing file is dsv4enc's by its content, not its name:
    a file of the user's under such a name makes every flag refuse, naming it."""
    out = tmp_path / "out"
    assert encode(str(data), "--out", f"{out}/").exit_code == 0
    (out / name).write_text("user data\n")
    before = snapshot(out)
    for extra in (["--overwrite"], ["--update"], ["--resume"]):
        line = one_line_error(encode(str(data), "--out", f"{out}/", *extra))
        assert "did not write" in line and name in line
    assert snapshot(out) == before


def test_what_a_killed_single_file_run_leaves_is_recognised_as_dsv4enc_s(data, tmp_path):
    """A journal with its header only, one created empty, a growing file with a torn part
    at its end or created empty: what a kill leaves is dsv4enc's (--resume finishes it,
    --overwrite deletes it); another tool's Parquet file under the growing file's name is
    not."""
    out, partial = tmp_path / "e.parquet", tmp_path / "e.parquet.partial"
    clean = tmp_path / "clean.parquet"
    run_encode(options([data], clean))
    journal, growing = partial / "_manifest.journal", partial / "_growing.parquet"
    with pytest.raises(OutputError, match="no space"):
        _fail_after_parts(data, out, 2)
    journal.write_bytes(journal.read_bytes().split(b"\n")[0] + b"\n")  # its header only
    with open(growing, "ab") as handle:
        handle.write(b"torn half of a part")
    assert encode(str(data), "--out", str(out), "--resume").exit_code == 0
    assert rows(out) == rows(clean) and not partial.exists()
    with pytest.raises(OutputError, match="no space"):
        _fail_after_parts(data, out, 2, overwrite=True)
    pq.write_table(pa.table({"x": [1, 2]}), growing)  # another tool's
    theirs = growing.read_bytes()
    line = one_line_error(encode(str(data), "--out", str(out), "--resume"))
    assert "did not write" in line and "_growing.parquet" in line
    assert growing.read_bytes() == theirs
    journal.write_bytes(b"")
    growing.write_bytes(b"")
    assert encode(str(data), "--out", str(out), "--overwrite").exit_code == 0
    assert rows(out) == rows(clean) and not partial.exists()


def test_a_manifest_entry_edited_out_of_the_format_is_one_line_for_resume_and_update(data,
                                                                                     tmp_path):
    """A part entry whose start is no integer: --resume and --update refuse in one line that
    calls the output damaged, leaving it as it is; --overwrite starts over."""
    out = tmp_path / "out"
    assert encode(str(data), "--out", f"{out}/").exit_code == 0
    manifest = out / "_manifest.json"
    doc = json.loads(manifest.read_text())
    next(iter(doc["parts"].values()))["start"] = None
    manifest.write_text(json.dumps(doc))
    before = snapshot(out)
    for flag in ("--resume", "--update"):
        line = one_line_error(encode(str(data), "--out", f"{out}/", flag), 2)
        assert "'start' null, not an integer: the output is damaged" in line, line
        assert snapshot(out) == before
    assert encode(str(data), "--out", f"{out}/", "--overwrite").exit_code == 0
    assert len(rows(out)) == N_IMAGES


def test_a_manifest_that_is_not_json_is_named_and_the_way_on_is_a_new_out(data, tmp_path):
    """A folder output whose manifest was cut short: a reader calls it damaged and names the
    way on that works (a new --out: --overwrite replaces no folder whose manifest is not
    provably dsv4enc's); every flag refuses naming the manifest, and keeps the folder."""
    from dsv4enc import read_embeddings

    out = tmp_path / "out"
    assert encode(str(data), "--out", f"{out}/").exit_code == 0
    manifest = out / "_manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:20])
    with pytest.raises(UsageError, match="not JSON: the output is damaged; encode it again "
                                         "into a new --out .--overwrite keeps"):
        list(read_embeddings(out))
    before = snapshot(out)
    for extra in (["--overwrite"], ["--resume"], ["--update"]):
        line = one_line_error(encode(str(data), "--out", f"{out}/", *extra))
        assert "its _manifest.json is no dsv4enc manifest: another tool's, or damaged" in line
    assert snapshot(out) == before
    result = encode(str(data), "--out", str(tmp_path / "new") + "/")
    assert result.exit_code == 0, result.output


def test_overwrite_keeps_foreign_files_in_a_partial_folder(data, tmp_path):
    out = tmp_path / "e.parquet"
    partial = tmp_path / "e.parquet.partial"
    partial.mkdir()
    (partial / "_manifest.json").write_text(json.dumps(writer.manifest_document(
        {"tool": "dsv4enc"}, {})))
    (partial / "diary.txt").write_text("dear diary")
    line = one_line_error(encode(str(data), "--out", str(out), "--overwrite"))
    assert "did not write" in line and "diary.txt" in line
    assert (partial / "diary.txt").read_text() == "dear diary"
    assert not out.exists()


def _entry(i: int) -> dict:
    return {"file": f"part-{i:06d}.parquet", "start": i, "end": i + 1, "digest": "d",
            "rows": 1, "transient": 0}


def test_commits_go_to_the_journal_and_a_torn_line_or_a_stale_journal_is_not_read(tmp_path):
    store = writer.PartStore(tmp_path, {"tool": "dsv4enc"})
    store.create()
    for i in range(2):
        store.adopt(f"part-{i:06d}", _entry(i))
    manifest, journal = tmp_path / "_manifest.json", tmp_path / "_manifest.journal"
    assert json.loads(manifest.read_text())["parts"] == {}  # not rewritten per commit
    assert set(load_manifest(manifest)["parts"]) == {"part-000000", "part-000001"}
    line = json.dumps({"name": "part-000002", "part": _entry(2)}).encode()
    with open(journal, "ab") as handle:
        handle.write(line[:20])  # a commit cut short by a crash
    assert set(load_manifest(manifest)["parts"]) == {"part-000000", "part-000001"}
    old = journal.read_bytes()[:-20] + line + b"\n"  # whole, but of the manifest before
    store.save()
    assert not journal.exists()
    assert set(json.loads(manifest.read_text())["parts"]) == {"part-000000", "part-000001"}
    journal.write_bytes(old)  # left by a crash between the manifest's write and its unlink
    assert set(load_manifest(manifest)["parts"]) == {"part-000000", "part-000001"}


def test_a_manifest_is_recognised_by_its_content():
    doc = writer.manifest_document({"tool": "dsv4enc"}, {"part-000000": {
        "file": "part-000000.parquet", "start": 0, "end": 3}})
    assert writer.is_manifest(doc)
    for foreign in ({"a": 1}, [], {"settings": {}, "parts": {}},
                    {"settings": {"tool": "dsv4enc"}, "parts": {}},  # before 0.1.0: no format
                    {**doc, "parts": {"x": {"file": "../data/img0.png"}}},
                    {**doc, "format": "something else"}):
        assert not writer.is_manifest(foreign)


# --------------------------------------------------------------------------- 2. one run at a time

HOLD_LOCK = """
import sys, time
from pathlib import Path
from dsv4enc.output.lock import OutputLock
lock = OutputLock(Path(sys.argv[1]), Path(sys.argv[2]))
lock.acquire()
print("locked", flush=True)
time.sleep(120)
"""


def start_lock_holder(folder: Path, out: Path) -> subprocess.Popen:
    """Another process holding the output lock of ``out`` in ``folder`` (kill it when done)."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(folder), str(out)],
                              stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert holder.stdout.readline().strip() == "locked"
    return holder


def test_a_second_run_refuses_while_the_lock_is_held(data, tmp_path):
    out = tmp_path / "e.parquet"
    partial = tmp_path / "e.parquet.partial"
    partial.mkdir()
    holder = start_lock_holder(partial, out)
    try:
        for extra in ([], ["--overwrite"], ["--resume"]):
            line = one_line_error(encode(str(data), "--out", str(out), *extra))
            assert f"another dsv4enc run is writing {out}" in line
            assert f"pid {holder.pid} on {os.uname().nodename}" in line
        assert not out.exists()
    finally:
        holder.kill()
        holder.wait()
    # The holder was killed: the kernel released its lock, and its stale file is no obstacle.
    assert (partial / LOCK_NAME).exists()
    result = encode(str(data), "--out", str(out))
    assert result.exit_code == 0, result.output
    assert not partial.exists()


@pytest.mark.parametrize("kind", ["folder", "single file"])
def test_a_link_under_the_lock_s_name_never_overwrites_its_target(data, tmp_path, kind):
    """A symbolic link planted as the lock file (a shared folder) points at a user's file:
    the run refuses in one line, and the file keeps its bytes (the lock was written through
    the link, over them)."""
    precious = tmp_path / "notes.txt"
    out = tmp_path / ("out" if kind == "folder" else "e.parquet")
    parts = out if kind == "folder" else tmp_path / "e.parquet.partial"
    parts.mkdir()
    (parts / LOCK_NAME).symlink_to(precious)
    line = one_line_error(encode(str(data), "--out", f"{out}/" if kind == "folder" else str(out)))
    assert f"{parts / LOCK_NAME} is a symbolic link" in line, line
    assert precious.read_text() == "my notes\n"
    assert (parts / LOCK_NAME).is_symlink()


def test_a_folder_run_refuses_while_a_single_file_of_its_name_is_written(data, tmp_path):
    """``OUT/`` and the single file ``OUT`` (locked in ``OUT.partial/``) are one path: a folder
    run refuses while a live run writes the file, and leaves no folder behind; a killed
    run's lock file is no obstacle."""
    out, partial = tmp_path / "a.parquet", tmp_path / "a.parquet.partial"
    holder = start_lock_holder(partial, out)
    try:
        line = one_line_error(encode(str(data), "--out", f"{out}/"))
        assert f"another dsv4enc run is writing {out} as a single file" in line
        assert f"pid {holder.pid}" in line
        assert not out.exists() and sorted(p.name for p in partial.iterdir()) == [LOCK_NAME]
    finally:
        holder.kill()
        holder.wait()
    result = encode(str(data), "--out", f"{out}/")
    assert result.exit_code == 0, result.output
    assert out.is_dir()


def test_a_single_file_run_refuses_once_a_folder_of_its_name_is_written(data, tmp_path):
    """A single-file run that took ``OUT`` for a file, then finds a live run writing a folder
    there as it takes its lock, refuses (of two such runs started at once, one refuses)."""
    from dsv4enc.output.layout import OutputLayout

    out = tmp_path / "a.parquet"
    layout = OutputLayout(str(out), shard_output=False)
    assert not layout.folder_mode
    holders, acquire = [], layout.lock.acquire

    def folder_run_then_acquire():  # the folder run starts after this run's checks
        out.mkdir()
        holders.append(start_lock_holder(out, out))
        acquire()

    layout.lock.acquire = folder_run_then_acquire
    try:
        with pytest.raises(OutputError, match=f"writing {out} as a folder .pid ") as refused:
            layout.prepare([str(data)], None, overwrite=False, resume=False)
        assert f"pid {holders[0].pid} on" in str(refused.value)
    finally:
        for holder in holders:
            holder.kill()
            holder.wait()
    assert not (tmp_path / "a.parquet.partial").exists()


def test_two_runs_on_one_out_at_once(data, tmp_path):
    """A real run in another process, and this one started while it works: this one
    refuses (plain or with --overwrite), the other completes a readable file."""
    for i in range(N_IMAGES, 40):
        noise_png(data / f"img{i}.png", i, (40, 32))
    out = tmp_path / "e.parquet"
    pauses = Pauses(tmp_path / "pauses", "commit")
    first = pauses.launch("encode", str(data), "--out", str(out), *COMMON[:-3],
                          "--workers", "1", "-q")
    try:
        pauses.wait("commit", proc=first)  # it holds the lock and waits until released
        refusals = [encode(str(data), "--out", str(out), *extra)
                    for extra in ([], ["--overwrite"])]
        assert first.poll() is None
        pauses.release()
        _, err = first.communicate(timeout=600)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, err
    for result in refusals:
        assert "another dsv4enc run is writing" in one_line_error(result)
    assert [r["path"] for r in rows(out)] == sorted(p.name for p in data.iterdir())
    assert not (tmp_path / "e.parquet.partial").exists()


def test_a_torchrun_job_refuses_on_every_rank_while_the_lock_is_held(data, tmp_path):
    """Rank 0 takes the lock for the job (with --shard-output too, where every rank writes
    into the folder): a held lock stops all ranks before any of them writes."""
    import socket

    out = tmp_path / "shards"
    out.mkdir()
    holder = start_lock_holder(out, out)
    try:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
        env.pop("DSV4ENC_WEIGHTS", None)
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
             "--master-addr=127.0.0.1", f"--master-port={port}", "-m", "dsv4enc", "encode",
             str(data), "--out", f"{out}/", "--shard-output", *COMMON, "--timeout", "60"],
            capture_output=True, text=True, env=env, timeout=300)
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode != 0
    refusals = [line for line in proc.stderr.splitlines()
                if f"another dsv4enc run is writing {out}" in line]
    assert len(refusals) == 2 and f"pid {holder.pid}" in refusals[0], proc.stderr[-3000:]
    assert "dsv4enc/" not in proc.stderr  # no rank's traceback (torchrun prints its own)
    assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]  # the holder's, nothing else


def test_a_file_system_without_locking_warns_and_runs(data, tmp_path, monkeypatch, caplog):
    import fcntl

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    out = tmp_path / "e.parquet"
    with caplog.at_level(logging.WARNING, logger="dsv4enc"):
        run_encode(options([data], out))
    assert "file locking is off" in caplog.text and "No locks available" in caplog.text
    assert pq.read_table(out).num_rows == N_IMAGES


def test_temporary_names_are_unique_per_run_and_call(tmp_path):
    target = tmp_path / "part-000000.parquet"
    names = {writer.temp_path(target).name for _ in range(100)}
    assert len(names) == 100
    assert all(f".{target.name}.{os.getpid()}-" in name and name.endswith(".tmp")
               for name in names)


# --------------------------------------------------------------------------- 5. --resume identity

def finish_folder(data: Path, out: Path, **changes):
    """A complete folder output; rerunning it with --resume re-checks every part."""
    return run_encode(options([data], f"{out}/", **changes))


def test_resume_encodes_a_changed_input_again(data, tmp_path, caplog):
    out = tmp_path / "out"
    finish_folder(data, out)
    # Same name, same size, new pixels and a new time: only its part is encoded again.
    changed = data / "img4.png"
    noise_png(changed, 99)
    os.utime(changed, ns=(time.time_ns(), time.time_ns() + 10**9))
    with caplog.at_level(logging.WARNING, logger="dsv4enc"):
        summary = run_encode(options([data], f"{out}/", resume=True))
    (start, end), = [(start, end) for start, end in PARTS if start <= 4 < end]
    assert summary.reused == N_IMAGES - (end - start) and summary.encoded == end - start
    assert "1 finished part is encoded again" in caplog.text
    clean = tmp_path / "clean.parquet"
    run_encode(options([data], clean))
    assert rows(out) == rows(clean)


def test_resume_retries_a_broken_download_replaced_by_a_good_file(data, tmp_path):
    assert PARTS[0][1] >= 2  # img1 is in the first part
    (data / "img1.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated download")
    out = tmp_path / "e.parquet"
    with pytest.raises(OutputError, match="no space"):
        _fail_after_parts(data, out, 1)  # part 0 is kept, with img1's error row
    noise_png(data / "img1.png", 1)  # the download is repaired
    summary = run_encode(options([data], out, resume=True))
    assert summary.reused == 0 and summary.failed == 0
    clean = tmp_path / "clean.parquet"
    run_encode(options([data], clean))
    assert rows(out) == rows(clean)


def _fail_after_parts(data: Path, out: Path, parts: int, **changes) -> None:
    """Run until ``parts`` parts are recorded, then fail as a full disk would."""
    real_record = writer.PartStore._record

    def record(self, name, entry):
        if len(self.parts) >= parts:
            raise output_os_error(self.journal_path,
                                         OSError(errno.ENOSPC, "No space left"))
        return real_record(self, name, entry)

    writer.PartStore._record = record
    try:
        run_encode(options([data], out, **changes))
    finally:
        writer.PartStore._record = real_record


def test_resume_reuses_unchanged_parts_of_an_interrupted_single_file_run(data, tmp_path):
    out = tmp_path / "e.parquet"
    with pytest.raises(OutputError, match="no space"):
        _fail_after_parts(data, out, 2)
    noise_png(data / "img1.png", 77)  # in part 0
    os.utime(data / "img1.png", ns=(time.time_ns(), time.time_ns() + 10**9))
    summary = run_encode(options([data], out, resume=True))
    assert summary.reused == PARTS[1][1] - PARTS[1][0]  # part 1 only
    clean = tmp_path / "clean.parquet"
    run_encode(options([data], clean))
    assert rows(out) == rows(clean)


def test_resume_with_another_max_pixels_is_refused(data, tmp_path):
    out = tmp_path / "out"
    finish_folder(data, out, max_pixels=100)  # every image is refused: error rows
    before = snapshot(out)
    with pytest.raises(UsageError, match="cannot resume: the interrupted run used --max-pixels 100.*rerun with --max-pixels 100") as refused:
        run_encode(options([data], f"{out}/", resume=True))
    # --overwrite beside --resume would be refused: the advice says to put it in its place
    assert "(or --overwrite in place of --resume to start over)" in str(refused.value)
    assert snapshot(out) == before
    summary = run_encode(options([data], f"{out}/", resume=True, max_pixels=100))
    assert summary.reused == N_IMAGES


def test_resume_encodes_again_a_part_with_a_timed_out_row(data, tmp_path):
    """A time limit says nothing about the image: like a clean run, resume tries again."""
    out = tmp_path / "out"
    finish_folder(data, out)
    manifest = out / "_manifest.json"
    doc = json.loads(manifest.read_text())
    part = next(p for p in doc["parts"].values() if p["start"] == PARTS[1][0])  # the second
    table = pq.read_table(out / part["file"])
    errors = table.column("error").to_pylist()
    errors[0] = "decode timed out after 120s"
    table = table.set_column(table.schema.get_field_index("error"), "error",
                             pa.array(errors, pa.string()))
    assert writer.error_counts(table) == {"failed": 1, "transient": 1}
    pq.write_table(table, out / part["file"])
    part["transient"] = 1
    manifest.write_text(json.dumps(doc))
    summary = run_encode(options([data], f"{out}/", resume=True))
    assert summary.reused == N_IMAGES - (PARTS[1][1] - PARTS[1][0])
    assert all(r["error"] is None for r in pq.read_table(out).to_pylist())


@pytest.mark.parametrize("flag", ["resume", "overwrite", "update"])
def test_an_output_from_before_0_1_0_is_refused_in_one_line(data, tmp_path, flag):
    """A manifest without this format's tag (what dsv4enc wrote before 0.1.0) is not read:
    the run is refused, naming it, and the output is left as it was."""
    out = tmp_path / "out"
    finish_folder(data, out)
    manifest = out / "_manifest.json"
    doc = json.loads(manifest.read_text())
    del doc["format"], doc["version"]
    manifest.write_text(json.dumps(doc))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    line = one_line_error(encode(str(data), "--out", f"{out}/", f"--{flag}"))
    assert line.endswith(f"{manifest} was written by a dsv4enc before 0.1.0, whose outputs "
                         "this version does not read; move it away or choose another --out")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def tar_of(images: list[Path], path: Path) -> Path:
    with tarfile.open(path, "w") as archive:
        for image in images:
            archive.add(image, arcname=image.name)
    return path


def test_resume_encodes_again_the_images_of_a_changed_container(data, tmp_path):
    images = sorted(data.iterdir())
    shard = tar_of(images, tmp_path / "shard.tar")
    out = tmp_path / "out"
    run_encode(options([shard], f"{out}/"))
    assert run_encode(options([shard], f"{out}/", resume=True)).reused == N_IMAGES
    noise_png(images[0], 55)  # same names, new bytes: the shard is rewritten
    tar_of(images, shard)
    os.utime(shard, ns=(time.time_ns(), time.time_ns() + 10**9))
    summary = run_encode(options([shard], f"{out}/", resume=True))
    assert summary.reused == 0
    clean = tmp_path / "clean.parquet"
    run_encode(options([shard], clean))
    assert rows(out) == rows(clean)


# --------------------------------------------------------------------------- work lost to a kill

def test_finished_work_is_committed_every_commit_every_seconds(data, tmp_path):
    """One size-bounded part (--part-images 1000) is committed in pieces as time passes: a
    tiny --commit-every makes each segment (about one batch on a CPU) a part of its own. The pieces
    read back as one dataset in input order, equal to a run committed in one piece."""
    out = tmp_path / "out"
    run_encode(options([data], f"{out}/", part_images=1000, commit_every=1e-6))
    parts = json.loads((out / "_manifest.json").read_text())["parts"]
    assert len(parts) > 1 and "part-000000" in parts
    ranges = sorted((p["start"], p["end"]) for p in parts.values())
    assert ranges[0][0] == 0 and ranges[-1][1] == N_IMAGES
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # consecutive, no overlap
    for name, part in parts.items():
        assert name == (f"part-000000_{part['start']:06d}" if part["start"] else "part-000000")
    whole = tmp_path / "whole.parquet"
    run_encode(options([data], whole, part_images=1000))
    assert rows(out) == rows(whole)
    # Resume keeps the recorded boundaries: an unchanged folder is reused whole...
    assert run_encode(options([data], f"{out}/", resume=True, part_images=1000)).reused == N_IMAGES
    # ...and a changed image costs only the piece that holds it.
    noise_png(data / "img7.png", 70)
    os.utime(data / "img7.png", ns=(time.time_ns(), time.time_ns() + 10**9))
    last = max(parts.values(), key=lambda p: p["start"])
    summary = run_encode(options([data], f"{out}/", resume=True, part_images=1000))
    assert summary.reused == last["start"]
    run_encode(options([data], whole, part_images=1000, overwrite=True))
    assert rows(out) == rows(whole)
    assert len(list(out.glob("*.parquet"))) == len(parts)  # no stale piece beside the new


def test_resume_with_other_batches_keeps_what_still_lines_up(data, tmp_path):
    """Pieces cut for other segment boundaries (another --batch-tokens) that no longer line
    up are encoded again, and their files removed; the result equals a clean run."""
    out = tmp_path / "e.parquet"
    with pytest.raises(OutputError, match="no space"):
        _fail_after_parts(data, out, 2, part_images=1000, commit_every=1e-6)
    summary = run_encode(options([data], out, resume=True, part_images=1000, commit_every=1e-6,
                                 batch_tokens=700))
    assert summary.encoded + summary.failed + summary.reused == N_IMAGES
    clean = tmp_path / "clean.parquet"
    run_encode(options([data], clean, part_images=1000))
    assert rows(out) == rows(clean)
    assert not (tmp_path / "e.parquet.partial").exists()


def test_sigkill_long_before_the_part_ends_loses_at_most_commit_every(data, tmp_path):
    """A real run (one size-bounded part of 40 images) killed as soon as its first piece is
    committed: --resume reuses that piece and finishes equal to a clean run."""
    for i in range(N_IMAGES, 40):
        noise_png(data / f"img{i:02d}.png", i, (40, 32))
    out = tmp_path / "e.parquet"
    partial = tmp_path / "e.parquet.partial"
    args = [a if a != str(PART) else "1000" for a in COMMON[:-3]]
    pauses = Pauses(tmp_path / "pauses", "commit")
    proc = pauses.launch("encode", str(data), "--out", str(out), *args, "--workers", "1", "-q",
                         "--commit-every", "0.2", text=False)
    try:
        first = pauses.wait("commit", proc=proc)  # the run waits there: kill it now
        proc.kill()
    finally:
        proc.kill()
        proc.wait()
    assert not out.exists()
    parts = load_manifest(partial / "_manifest.json")["parts"]
    assert first["name"] in parts and first["end"] < 40  # long before the part's end
    summary = run_encode(options([data], out, resume=True, part_images=1000, commit_every=0.2))
    assert summary.reused >= 1
    assert summary.encoded + summary.failed + summary.reused == 40
    clean = tmp_path / "clean.parquet"
    run_encode(options([data], clean, part_images=1000))
    got, want = rows(out), rows(clean)
    assert [r["path"] for r in got] == [r["path"] for r in want]
    for a, b in zip(got, want):
        assert a["error"] == b["error"] and (a["grid_h"], a["grid_w"]) == (b["grid_h"], b["grid_w"])
        # Rows are batch-invariant: the resumed run's other batches give the same bytes.
        assert np.array_equal(np.array(a["embedding"]), np.array(b["embedding"])), a["path"]


def test_sigkill_at_60_percent_then_resume_encodes_at_most_half_again(tmp_path):
    """Issue 14's measure, scaled in time: commits every 0.05 s on a run of a few seconds
    (the default 30 s on runs of minutes is the same bound). Killed once the progress line
    says 60%, the resumed run encodes at most half of the images again."""
    images = tmp_path / "many"
    images.mkdir()
    total = 160
    for i in range(total):
        noise_png(images / f"img{i:03d}.png", i, (40, 32))
    out = tmp_path / "k.parquet"
    args = [a for a in COMMON if a not in ("-q", "--part-images", str(PART))]
    pauses = Pauses(tmp_path / "pauses", "encoded")
    proc = pauses.launch("encode", str(images), "--out", str(out), *args, "--commit-every",
                         "0.05", "--log-every", "0.05", stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    done = 0
    try:
        # The run stops after each batch is counted until told to go on: kill it at the
        # first count past 60%, as a user would on seeing that progress line.
        for n in itertools.count(1):
            facts = pauses.wait("encoded", n, proc=proc)
            if facts["done"] >= 0.6 * facts["total"]:
                done = facts["done"]
                proc.kill()
                break
            pauses.release("encoded", n)
    finally:
        proc.kill()
        proc.wait()
    assert done < total, "the run ended before it could be killed"
    summary = run_encode(options([images], out, resume=True, part_images=None,
                                 commit_every=0.05))
    assert summary.encoded + summary.failed + summary.reused == total
    assert summary.encoded + summary.failed <= total / 2, (done, summary.reused)


def test_the_interrupt_message_says_what_was_committed(tmp_path):
    from dsv4enc.output.layout import OutputLayout
    from dsv4enc.output.parts import PartStore

    single = OutputLayout(str(tmp_path / "e.parquet"), shard_output=False)
    store = PartStore(single.parts_dir, {"tool": "dsv4enc"})
    assert single.resume_hint(store) == "nothing was committed; rerun the same command"
    store.parts = {"part-000000": {"start": 0, "end": 5, "rows": 5},
                   "part-000000_000005": {"start": 5, "end": 7, "rows": 2}}
    line = single.resume_hint(store)
    assert line.startswith(f"2 finished parts (7 images) kept in {single.parts_dir}")
    assert line.endswith("--resume to finish")
    store.parts = {"part-000000": {"start": 0, "end": 1, "rows": 1}}
    assert single.resume_hint(store).startswith("1 finished part (1 image) kept in ")
    folder = OutputLayout(f"{tmp_path / 'out'}/", shard_output=False)
    assert "--resume" in folder.resume_hint(PartStore(folder.parts_dir, {}))


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_a_stopped_overwrite_advises_a_command_that_runs(data, tmp_path, monkeypatch, kind):
    """A run given --overwrite and stopped after its first part: its line says to rerun with
    --resume in place of --overwrite (the two contradict), and that command finishes."""
    from helpers import signal_after_first_part

    out = str(tmp_path / "o.parquet") if kind == "file" else f"{tmp_path / 'o'}/"
    signal_after_first_part(monkeypatch)
    stopped = encode(str(data), "--out", out, "--overwrite")
    line = one_line_error(stopped, 143)
    assert "rerun the same command with --resume in place of --overwrite" in line, line
    monkeypatch.undo()
    finished = encode(str(data), "--out", out, "--resume")
    assert finished.exit_code == 0, finished.output


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_a_full_disk_at_the_first_manifest_says_nothing_was_committed(data, tmp_path,
                                                                      monkeypatch, kind):
    """The disk is full from the start: the line said 'committed parts are kept' of a run that
    committed none; it says nothing was committed, and its advice (--resume) works."""
    out = str(tmp_path / "o.parquet") if kind == "file" else f"{tmp_path / 'o'}/"

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer, "synced", full)  # the run's first synced write: its manifest
    line = one_line_error(encode(str(data), "--out", out))
    assert "no space left on device writing" in line and "_manifest.json" in line, line
    assert "nothing was committed" in line and "committed parts" not in line, line
    assert "rerun with --resume" in line, line
    monkeypatch.undo()
    assert encode(str(data), "--out", out, "--resume").exit_code == 0


def test_resume_encodes_again_a_part_whose_footer_does_not_fit_its_schema(data, tmp_path,
                                                                         monkeypatch):
    """A stopped run's committed part whose footer's column chunk metadata pyarrow cannot
    build (level histograms that do not fit its schema), which the readers refuse naming
    --resume as its repair: --resume encodes its rows again, as a part cut short, where it
    kept it and finished an output that no reader could read."""
    from dsv4enc import read_embeddings
    from helpers import damage_column_chunks, signal_after_first_part

    out = tmp_path / "o"
    signal_after_first_part(monkeypatch)
    one_line_error(encode(str(data), "--out", f"{out}/"), 143)
    monkeypatch.undo()
    (part,) = out.glob("part-*.parquet")
    damage_column_chunks(part, "embedding")
    assert encode(str(data), "--out", f"{out}/", "--resume").exit_code == 0
    assert encode(str(data), "--out", str(tmp_path / "clean.parquet")).exit_code == 0
    assert ([(p, e.tobytes()) for p, e, _ in read_embeddings(out)]
            == [(p, e.tobytes()) for p, e, _ in read_embeddings(tmp_path / "clean.parquet")])


def test_an_update_stopped_by_a_full_disk_advises_update(data, tmp_path, monkeypatch):
    """Advice to finish with --resume would be refused beside --update: an update's says
    --update (``errors.advise``), as its stop line does."""
    from dsv4enc.errors import advise

    out = tmp_path / "o.parquet"
    assert encode(str(data), "--out", str(out)).exit_code == 0
    noise_png(data / "new.png", 99)

    def full(*args, **kwargs):
        raise output_os_error(tmp_path, OSError(errno.ENOSPC, "No space left on device"))

    monkeypatch.setattr(writer.PartStore, "commit", full)
    from dsv4enc.output import appending
    monkeypatch.setattr(appending.AppendingStore, "commit", full)
    line = one_line_error(encode(str(data), "--out", str(out), "--update"))
    assert "no space left" in line and "rerun with --update" in line, line
    assert "--resume" not in line, line
    exc = OutputError("free space and rerun with --resume")
    advise(exc, "--update")
    assert str(exc) == "free space and rerun with --update"
