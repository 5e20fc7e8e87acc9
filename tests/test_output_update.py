"""``encode --update``: an output brought up to date with inputs that grew, changed and shrank
equals a clean run over the current inputs row for row, and only the new and changed images
are encoded; for a single file, a folder and a bucket output, after a SIGKILL midway too; and
the refusals (other settings, an output that recorded no stamps)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image
from typer.testing import CliRunner

from dsv4enc.cli import app
from dsv4enc.columns import utf8_text
from dsv4enc.errors import UsageError
from dsv4enc.output.read import load_manifest, output_files
from dsv4enc.output.files import STAMPS_FILE
from dsv4enc.output.update import STAMPS_KEY
from dsv4enc.run.pipeline import EncodeOptions, run_encode

from helpers import CONFIGS, Pauses, reaped, torch_threads

CONFIG = str(CONFIGS / "tiny.json")
PART = 3
N_OLD = 10
runner = CliRunner()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    yield from torch_threads(1)


def noise(path: Path, seed: int, size: tuple[int, int] = (16, 12)) -> None:
    rng = np.random.default_rng(seed)
    w, h = size
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)


def old_images(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(N_OLD):
        noise(folder / f"img{i:03d}.png", i, (16 + i % 5, 12 + i % 3))
    return folder


def grow_change_shrink(folder: Path) -> None:
    """3 new images (one sorts first, one in the middle, one last), 1 changed, 1 gone."""
    for name, seed in (("aaa.png", 101), ("img004b.png", 102), ("zzz.png", 103)):
        noise(folder / name, seed)
    noise(folder / "img002.png", 104, (20, 14))  # changed: other pixels, size and time
    (folder / "img007.png").unlink()


def options(images: Path, out, **changes) -> EncodeOptions:
    base = dict(inputs=[str(images)], out=str(out), config=CONFIG, random_init=True,
                device="cpu", part_images=PART, batch_tokens=1500, workers=0, progress=False)
    return EncodeOptions(**{**base, **changes})


def output_path(root: Path, kind: str) -> Path:
    return root / "e.parquet" if kind == "file" else root / "emb"


def table_of(out: Path) -> list[dict]:
    return [row for path in output_files(out) for row in pq.read_table(path).to_pylist()]


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> tuple[Path, list[dict]]:
    """The current inputs (after the changes) and a clean run's rows over them."""
    images = old_images(tmp_path_factory.mktemp("upd_images") / "in")
    grow_change_shrink(images)
    out = tmp_path_factory.mktemp("upd_clean") / "e.parquet"
    summary = run_encode(options(images, out))
    assert summary.encoded == N_OLD + 3 - 1
    return images, table_of(out)


def assert_clean(out: Path, clean_rows: list[dict]) -> None:
    got = table_of(out)
    assert [r["path"] for r in got] == [r["path"] for r in clean_rows]
    for a, b in zip(got, clean_rows):
        assert a == b, a["path"]  # sizes, grids, errors, embedding bytes


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_update_equals_a_clean_run_and_encodes_only_new_and_changed(kind, tmp_path, clean):
    images = old_images(tmp_path / "in")
    out = output_path(tmp_path, kind)
    given = str(out) + ("/" if kind == "folder" else "")  # a folder output: the slash says so
    first = run_encode(options(images, given))
    assert first.encoded == N_OLD
    first_files = {p.name for p in out.glob("*.parquet")} if kind == "folder" else set()
    grow_change_shrink(images)
    report = tmp_path / "summary.json"
    result = runner.invoke(app, ["encode", str(images), "--out", given, "--config", CONFIG,
                                 "--random-init", "--device", "cpu", "--workers", "0",
                                 "--part-images", str(PART), "--batch-tokens", "1500",
                                 "--update", "--prune", "--summary-json", str(report)])
    assert result.exit_code == 0, result.output
    counts = json.loads(report.read_text())["images"]
    assert (counts["encoded"], counts["reused"], counts["dropped"]) == (4, 8, 1)
    assert "reused from the output" in result.output and "dropped" in result.output
    assert_clean(out, clean[1])
    if kind == "folder":  # the old generation's parts and stamps are gone, no staging left
        names = sorted(p.name for p in out.iterdir())
        listed = {p["file"] for p in load_manifest(out / "_manifest.json")["parts"].values()}
        # the new generation, and old parts kept as they are: no other part file
        assert {n for n in names if n.endswith(".parquet")} == listed, names
        assert all(".g1." in n or n in first_files for n in listed), names
        assert len([n for n in names if STAMPS_FILE.fullmatch(n)]) == 1
        assert sorted(os.listdir(tmp_path)) == ["emb", "in", "summary.json"]  # no staging
    else:
        assert not out.with_name("e.parquet.partial").exists()
    # Nothing changed since: everything is kept, nothing encoded, and still a clean run's rows;
    # a single file is not even written again.
    before = (out.stat().st_ino, out.stat().st_mtime_ns) if kind == "file" else None
    again = run_encode(options(images, given, update=True))  # nothing dropped: no --prune
    assert (again.encoded, again.reused, again.dropped) == (0, N_OLD + 2, 0)
    assert_clean(out, clean[1])
    if kind == "file":
        assert (out.stat().st_ino, out.stat().st_mtime_ns) == before
        assert sorted(os.listdir(tmp_path)) == ["e.parquet", "in", "summary.json"]


def test_a_folder_update_keeps_its_unchanged_parts_as_they_are(tmp_path):
    """Images added after the last and one changed: the parts that hold neither are kept as
    they are (the same files, untouched), only the changed one and the new ones are written,
    and the folder equals a clean run over the current inputs."""
    images = old_images(tmp_path / "in")
    out = tmp_path / "emb"
    run_encode(options(images, f"{out}/"))
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.glob("*.parquet")}
    # the keys cut parts 0-1, 2-3, 4-5, 6-8 and 9 (tests/test_run_parts.py pins the rule)
    assert sorted(before) == ["part-000000.parquet", "part-000000_000002.parquet",
                              "part-000001_000001.parquet", "part-000002.parquet",
                              "part-000003.parquet"]
    noise(images / "img004.png", 104, (20, 14))  # changed, in the third part (4-5)
    for i in range(N_OLD, N_OLD + 2):  # new, sorting after every old image
        noise(images / f"img{i:03d}.png", 200 + i)
    summary = run_encode(options(images, f"{out}/", update=True))
    assert (summary.encoded, summary.reused, summary.dropped) == (3, N_OLD - 1, 0)
    after = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.glob("*.parquet")}
    kept = [name for name in after if name in before]
    # whole parts of the old run's and this one's cut (the last one, 9, is now cut 9-10)
    assert sorted(kept) == ["part-000000.parquet", "part-000000_000002.parquet",
                            "part-000002.parquet"]
    assert "part-000001_000001.parquet" not in kept  # it holds the changed image
    assert all(after[name] == before[name] for name in kept)  # not even rewritten
    assert all(".g1." in name for name in after if name not in kept)
    clean_out = tmp_path / "clean.parquet"
    run_encode(options(images, clean_out))
    assert_clean(out, table_of(clean_out))
    again = run_encode(options(images, f"{out}/", update=True))  # nothing changed since
    assert (again.encoded, again.reused) == (0, N_OLD + 2)
    assert_clean(out, table_of(clean_out))


def test_a_single_file_update_copies_its_unchanged_parts_by_bytes(tmp_path, monkeypatch):
    """As a folder's: the old parts that hold no changed image have their row groups copied
    by bytes, neither encoded nor read row by row (``CarriedRows``), and the file equals a
    clean run over the current inputs; an update that changed nothing copies every part."""
    from dsv4enc.output import update as update_module

    images = old_images(tmp_path / "in")
    out = tmp_path / "e.parquet"
    run_encode(options(images, out))
    noise(images / "img004.png", 104, (20, 14))  # changed, in the third part (4-5)
    for i in range(N_OLD, N_OLD + 2):  # new, sorting after every old image
        noise(images / f"img{i:03d}.png", 200 + i)
    carried = []
    row = update_module.CarriedRows.row
    monkeypatch.setattr(update_module.CarriedRows, "row",
                        lambda self, index, key: carried.append(index) or row(self, index, key))
    summary = run_encode(options(images, out, update=True))
    assert (summary.encoded, summary.reused, summary.dropped) == (3, N_OLD - 1, 0)
    # the changed part's other row, and the last old one, now in a part with a new one
    assert sorted(carried) == [5, 9]
    clean_out = tmp_path / "clean.parquet"
    run_encode(options(images, clean_out))
    assert_clean(out, table_of(clean_out))
    assert pq.read_table(out).equals(pq.read_table(clean_out))
    carried.clear()
    again = run_encode(options(images, out, update=True))  # nothing changed since
    assert (again.encoded, again.reused, carried) == (0, N_OLD + 2, [])
    assert pq.read_table(out).equals(pq.read_table(clean_out))
    # other parts (and so another footer): nothing to copy, every old row is carried
    noise(images / "img999.png", 999)  # (an update that changes nothing leaves the file)
    other = run_encode(options(images, out, update=True, part_images=PART + 1))
    assert (other.encoded, other.reused, len(carried)) == (1, N_OLD + 2, N_OLD + 2)
    run_encode(options(images, clean_out, overwrite=True, part_images=PART + 1))
    assert pq.read_table(out).equals(pq.read_table(clean_out))


def test_an_interrupted_single_file_update_keeps_the_parts_it_copied(tmp_path, monkeypatch):
    """The copied parts are committed like encoded ones: an update that fails at its first
    commit leaves them journaled, and the rerun reuses them (it copies and carries no more)."""
    from dsv4enc.errors import OutputError
    from dsv4enc.output import update as update_module
    from dsv4enc.output.appending import AppendingStore

    images = old_images(tmp_path / "in")
    out = tmp_path / "e.parquet"
    run_encode(options(images, out))
    noise(images / "img004.png", 104, (20, 14))  # changed, in the third part (4-5)

    def full(*args, **kwargs):
        raise OutputError("no space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(AppendingStore, "commit", full)
        with pytest.raises(OutputError):
            run_encode(options(images, out, update=True))
    journal = load_manifest(out.with_name("e.parquet.partial") / "_manifest.json")["parts"]
    assert sorted(part["start"] for part in journal.values()) == [0, 2, 6, 9]
    carried, copied = [], []
    row, copy = update_module.CarriedRows.row, AppendingStore.copy_groups
    monkeypatch.setattr(update_module.CarriedRows, "row",
                        lambda self, index, key: carried.append(index) or row(self, index, key))
    monkeypatch.setattr(AppendingStore, "copy_groups",
                        lambda self, name, *rest: copied.append(name) or copy(self, name, *rest))
    summary = run_encode(options(images, out, update=True))
    assert (summary.encoded, summary.reused, sorted(carried), copied) == (1, N_OLD - 1, [5], [])
    clean_out = tmp_path / "clean.parquet"
    run_encode(options(images, clean_out))
    assert pq.read_table(out).equals(pq.read_table(clean_out))


def test_update_of_a_bucket_output(s3, tmp_path, clean):
    images = old_images(tmp_path / "in")
    for out, key in ((f"{s3.url}/up/e.parquet", "up/e.parquet"), (f"{s3.url}/upf/", None)):
        run_encode(options(images, out))
    grow_change_shrink(images)
    local = tmp_path / "got"
    for out, prefix in ((f"{s3.url}/up/e.parquet", "up/"), (f"{s3.url}/upf/", "upf/")):
        summary = run_encode(options(images, out, update=True, prune=True))
        assert (summary.encoded, summary.reused, summary.dropped) == (4, 8, 1)
        keys = s3.keys(prefix)
        mirror = local / prefix
        mirror.mkdir(parents=True)
        for key in keys:
            (mirror / key[len(prefix):]).write_bytes(s3.get(key))
        if prefix == "up/":
            assert keys == ["up/e.parquet"]
            assert_clean(mirror / "e.parquet", clean[1])
        else:  # only the parts the manifest lists (new ones, unchanged old ones) are left
            listed = {p["file"] for p in json.loads(s3.get("upf/_manifest.json"))["parts"].values()}
            assert {k[len(prefix):] for k in keys if k.endswith(".parquet")} == listed, keys
            assert len([k for k in keys if STAMPS_FILE.fullmatch(k[len(prefix):])]) == 1
            assert_clean(mirror, clean[1])


@pytest.mark.parametrize("where", ["local", "bucket"])
def test_resume_of_a_finished_file_is_complete_only_for_the_same_inputs_and_settings(
        where, request, tmp_path):
    """A single file's parts are gone once it is finished: --resume judges the file itself.
    The same inputs and settings: already complete (exit 0). Another setting, an input added
    or one gone: refused in one line (exit 2) that names --update, the file left as it was."""
    images = old_images(tmp_path / "in")
    if where == "bucket":
        s3 = request.getfixturevalue("s3")
        out = f"{s3.url}/fin/e.parquet"
        content = lambda: (s3.keys("fin/"), s3.get("fin/e.parquet"))  # noqa: E731
    else:
        out = str(tmp_path / "e.parquet")
        content = lambda: (sorted(os.listdir(tmp_path)), Path(out).read_bytes())  # noqa: E731
    args = ["encode", str(images), "--out", out, "--config", CONFIG, "--random-init",
            "--device", "cpu", "--workers", "0", "--part-images", str(PART),
            "--batch-tokens", "1500"]
    assert runner.invoke(app, args).exit_code == 0
    written = content()

    def resumed(*extra: str) -> tuple[int, str]:
        result = runner.invoke(app, [*args, "--resume", *extra])
        assert content() == written, result.output  # nothing written, nothing left behind
        return result.exit_code, " ".join(result.output.split())

    code, said = resumed()
    assert code == 0 and "already complete" in said, said
    code, said = resumed("--out-dtype", "float32")
    assert code == 2 and "cannot resume" in said and "--out-dtype float16" in said, said
    noise(images / "new.png", 300)
    code, said = resumed()
    assert code == 2 and "(1 to encode" in said and "--update" in said, said
    (images / "new.png").unlink()
    (images / "img003.png").unlink()
    code, said = resumed()
    assert code == 2 and "1 of its rows no longer given" in said, said


def test_an_update_of_a_bucket_folder_reads_its_parts_in_place(s3, tmp_path, clean,
                                                               monkeypatch):
    """No part object of the old output is downloaded (its columns are read in ranges where
    rows are needed), and the parts kept are never uploaded again."""
    from objectstore import RequestLog

    from dsv4enc import storage
    from dsv4enc.output.files import PART_FILE

    images = old_images(tmp_path / "in")
    out = f"{s3.url}/inplace/"
    run_encode(options(images, out))
    before = {k for k in s3.keys("inplace/") if PART_FILE.fullmatch(k.split("/", 1)[1])}
    grow_change_shrink(images)
    downloads: list[str] = []
    download = storage.download
    monkeypatch.setattr(storage, "download",
                        lambda url, path: (downloads.append(url), download(url, path))[-1])
    with RequestLog(s3) as log:
        summary = run_encode(options(images, out, update=True, prune=True))
    assert (summary.encoded, summary.reused, summary.dropped) == (4, 8, 1)
    assert not [url for url in downloads if PART_FILE.fullmatch(url.rsplit("/", 1)[1])]
    after = {k for k in s3.keys("inplace/") if PART_FILE.fullmatch(k.split("/", 1)[1])}
    kept = before & after
    assert kept, "no old part was kept whole"
    assert not [path for method, path in log.requests
                if method == "PUT" and path.lstrip("/") in kept]
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    for key in s3.keys("inplace/"):
        (mirror / key.split("/", 1)[1]).write_bytes(s3.get(key))
    assert_clean(mirror, clean[1])



def test_carried_rows_of_a_store_that_stopped_answering_fail_in_one_line(s3_outage, tmp_path):
    """--update reads the rows it carries from the old part objects where they are: a store
    that stops answering makes that read the run's one line about the store (it was a
    traceback of pyarrow's OSError, the read not retried)."""
    from dsv4enc import storage
    from dsv4enc.errors import DsvError
    from dsv4enc.output.files import PART_FILE
    from dsv4enc.output.update import CarriedRows

    s3 = s3_outage
    run_encode(options(old_images(tmp_path / "in"), f"{s3.url}/carried/"))
    key = next(k for k in s3.keys("carried/") if PART_FILE.fullmatch(k.split("/", 1)[1]))
    reader = CarriedRows([(f"{s3.url}/{key}", 1)])
    s3.server.stop()
    try:
        with pytest.raises(DsvError, match=f"^{s3.url}: the store stopped answering"):
            reader.row(0, "a.png")
    finally:
        storage.reset_health()  # the next tests' runs ask no more of this store

def _launch_update(pauses: Pauses, images: Path, out: str):
    """``--update --prune`` of ``images`` into ``out`` in another process, pausing there."""
    return pauses.launch("encode", str(images), "--out", out, "--config", CONFIG,
                         "--random-init", "--device", "cpu", "--workers", "0", "--part-images",
                         str(PART), "--batch-tokens", "1500", "--update", "--prune", "-q")


def _stopped_update(tmp_path: Path, images: Path, out: str, point: str,
                    sig: int = signal.SIGINT) -> tuple[int, str]:
    """``_launch_update`` held at pause point ``point``, sent ``sig`` there, then let go:
    its exit code and stderr."""
    pauses = Pauses(tmp_path / "pauses", point)
    with reaped(_launch_update(pauses, images, out)) as proc:
        pauses.wait(point, proc=proc)
        proc.send_signal(sig)
        pauses.release()
        _, stderr = proc.communicate(timeout=300)
    return proc.returncode, stderr


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_an_update_killed_midway_keeps_the_old_output_and_finishes_with_update(kind, tmp_path,
                                                                               clean):
    images = old_images(tmp_path / "in")
    out = output_path(tmp_path, kind)
    given = str(out) + ("/" if kind == "folder" else "")
    run_encode(options(images, given))
    before = table_of(out)
    grow_change_shrink(images)
    pauses = Pauses(tmp_path / "pauses", "commit")
    with reaped(_launch_update(pauses, images, given)) as proc:
        pauses.wait("commit", proc=proc)  # one part of the update committed, then the kill
        proc.kill()
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert table_of(out) == before  # the old output is whole, untouched
    summary = run_encode(options(images, given, update=True, prune=True))
    assert summary.reused >= PART and summary.encoded < 4 + PART
    assert summary.encoded + summary.reused == N_OLD + 2 and summary.dropped == 1
    assert_clean(out, clean[1])


@pytest.mark.parametrize("point", ["commit", "switch"])
def test_a_stopped_folder_update_names_the_folder_that_holds_its_parts(point, tmp_path, clean):
    """SIGTERM while a folder's update encodes, or at its switch: the line named the output as
    where the finished parts are kept, but they are in the staging folder beside it."""
    from dsv4enc.output.files import staging_folder

    images = old_images(tmp_path / "in")
    out = tmp_path / "emb"
    run_encode(options(images, f"{out}/"))
    grow_change_shrink(images)
    code, stderr = _stopped_update(tmp_path, images, f"{out}/", point, signal.SIGTERM)
    assert code == 143, stderr
    line = stderr.strip().splitlines()[-1]
    assert f"kept in {staging_folder(out)};" in line and "with --update" in line, line
    run_encode(options(images, f"{out}/", update=True, prune=True))
    assert_clean(out, clean[1])


def _bucket_update_stopped_at_commit(s3, tmp_path, name: str) -> tuple[Path, str, str]:
    """A bucket folder output ``name``, its inputs changed, and an --update of it stopped by
    SIGINT once it committed a part: ``(images, out, stderr)``."""
    images = old_images(tmp_path / "in")
    out = f"{s3.url}/{name}/"
    run_encode(options(images, out))
    grow_change_shrink(images)
    code, stderr = _stopped_update(tmp_path, images, out, "commit")  # one part committed
    assert code == 130, stderr
    return images, out, stderr


def _rerun_reuses_the_kept_parts(s3, images, out: str, tmp_path, clean) -> None:
    """An --update of the bucket folder ``out`` after a stopped one encodes only what that one
    left, and the store then holds the clean update's rows."""
    summary = run_encode(options(images, out, update=True, prune=True))
    assert summary.encoded < 4  # an update from the start encodes 4
    assert summary.encoded + summary.reused == N_OLD + 2 and summary.dropped == 1
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    prefix = out.removeprefix(f"{s3.url}/")
    for key in s3.keys(prefix):
        (mirror / key.split("/", 1)[1]).write_bytes(s3.get(key))
    assert_clean(mirror, clean[1])


def test_a_stopped_bucket_folder_update_keeps_its_parts_for_the_next_update(s3, tmp_path,
                                                                            clean):
    """SIGINT while a bucket folder's update encodes: its new parts are staged on this
    machine until the end. The line said they were kept in the bucket, and the staging was
    deleted; it now says where they are, and the next --update on this machine reuses them."""
    images, out, stderr = _bucket_update_stopped_at_commit(s3, tmp_path, "stopped")
    line = " ".join(stderr.strip().splitlines()[-1].split())
    assert "kept on this machine in /" in line and "dsv4enc-update (" in line, line
    assert "rerun the same command with --update" in line and s3.url not in line, line
    _rerun_reuses_the_kept_parts(s3, images, out, tmp_path, clean)


def test_an_update_failing_after_it_took_over_a_stopped_ones_parts_keeps_them(s3, tmp_path,
                                                                               clean):
    """The --update after a stopped one takes over the parts it kept on this machine before
    it lists the output; a listing that fails then (the store stopped answering) ended the
    run with its staging folder deleted, the stopped update's committed parts in it. They
    stay for the next --update, which reuses them and equals a clean run."""
    from helpers import run_probe

    images, out, stderr = _bucket_update_stopped_at_commit(s3, tmp_path, "adopted")
    # in another process, as the next run is: a kept folder of a live process is not taken
    probe = ("import sys\n"
             "from dsv4enc import storage\n"
             "from dsv4enc.cli import main\n"
             "parts, listing = sys.argv[1], storage.list_files\n"
             "def list_files(url):  # the listing after the staging folder is taken over\n"
             "    if url.rstrip('/') == parts:\n"
             "        raise OSError('the store stopped answering')\n"
             "    return listing(url)\n"
             "storage.list_files = list_files\n"
             "sys.argv[1:] = sys.argv[2:]\n"
             "main()\n")
    failed = run_probe(probe, out.rstrip("/"), "encode", images, "--out", out, "--config",
                       CONFIG, "--random-init", "--device", "cpu", "--workers", "0",
                       "--part-images", PART, "--batch-tokens", "1500", "--update",
                       "--prune", "-q")
    assert failed.returncode != 0 and "the store stopped answering" in failed.stderr, \
        failed.stderr
    _rerun_reuses_the_kept_parts(s3, images, out, tmp_path, clean)


@pytest.mark.parametrize("point", ["switch", "switched"])
def test_a_folder_update_stopped_at_its_switch_is_not_encoded_again(point, tmp_path, clean):
    """SIGINT when the new output is complete beside the old one (``switch``): the rerun
    encoded its changed images again, as the staging folder's manifest no longer said which
    output it updates; it now switches the staged output in place. Killed once the switch is
    done (``switched``, where a signal lets it end), the old output left in the staging
    folder is never taken for it."""
    images = old_images(tmp_path / "in")
    out = tmp_path / "emb"
    run_encode(options(images, f"{out}/"))
    grow_change_shrink(images)
    code, stderr = _stopped_update(tmp_path, images, f"{out}/", point,
                                   signal.SIGINT if point == "switch" else signal.SIGKILL)
    assert code == (130 if point == "switch" else -signal.SIGKILL), stderr
    summary = run_encode(options(images, f"{out}/", update=True, prune=True))
    assert (summary.encoded, summary.reused) == (0, N_OLD + 2)
    assert_clean(out, clean[1])
    assert sorted(os.listdir(tmp_path)) == ["emb", "in", "pauses"]


def test_a_bucket_file_update_stopped_while_uploading_reuses_its_parts(s3, tmp_path, clean):
    """SIGINT while the updated single file is uploaded (``upload``): the line says the
    rerun reuses the parts OUT.partial holds, but the parts committed since the last sync
    were removed here before they reached the store (all of them, in a short run), and
    the rerun encoded them again. Every part is in the store before the parts here go."""
    images = old_images(tmp_path / "in")
    out = f"{s3.url}/upl/e.parquet"
    run_encode(options(images, out))
    grow_change_shrink(images)
    pauses = Pauses(tmp_path / "pauses", "upload")
    with reaped(_launch_update(pauses, images, out)) as proc:
        pauses.wait("upload", proc=proc)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr
    line = stderr.strip().splitlines()[-1]
    assert "was not uploaded" in line and "it reuses the parts" in line, line
    summary = run_encode(options(images, out, update=True, prune=True))
    assert (summary.encoded, summary.reused, summary.dropped) == (0, N_OLD + 2, 1)
    assert s3.keys("upl/") == ["upl/e.parquet"]
    got = tmp_path / "got.parquet"
    got.write_bytes(s3.get("upl/e.parquet"))
    assert_clean(got, clean[1])


def test_a_bucket_folder_updated_twice_keeps_the_parts_the_first_kept(s3, tmp_path):
    """The parts an update of a bucket folder keeps whole were listed without their size,
    by which a part object is judged whole: the next update found them damaged and encoded
    their rows again, with nothing changed. They keep their size: nothing is encoded."""
    images = old_images(tmp_path / "in")
    out = f"{s3.url}/twice/"
    run_encode(options(images, out))
    grow_change_shrink(images)
    first = run_encode(options(images, out, update=True, prune=True))
    assert (first.encoded, first.reused) == (4, 8)
    again = run_encode(options(images, out, update=True))
    assert (again.encoded, again.reused, again.dropped) == (0, N_OLD + 2, 0)


@pytest.mark.parametrize("where", ["local", "bucket"])
def test_a_signal_once_a_folder_update_is_switched_in_lets_it_end(where, tmp_path, clean,
                                                                  request):
    """SIGINT once the new output has taken the old one's place (``switched``): the run
    said its parts were kept in the staging folder and asked for a rerun with --update, but
    the update was done, and what that folder held was the old output (left there; in a
    bucket, its new parts uploaded but the old ones not deleted). The output is complete
    there: the run ends as a finished one (exit 0), the old output removed."""
    images = old_images(tmp_path / "in")
    if where == "bucket":
        s3 = request.getfixturevalue("s3")
        out = f"{s3.url}/sw/"
    else:
        out = f"{tmp_path / 'emb'}/"
    run_encode(options(images, out))
    grow_change_shrink(images)
    code, stderr = _stopped_update(tmp_path, images, out, "switched")
    assert code == 0, stderr
    if where == "bucket":
        listed = {p["file"] for p in json.loads(s3.get("sw/_manifest.json"))["parts"].values()}
        keys = [k.split("/", 1)[1] for k in s3.keys("sw/")]
        assert {k for k in keys if k.endswith(".parquet")} == listed, keys
        got = tmp_path / "got"
        got.mkdir()
        for key in keys:
            (got / key).write_bytes(s3.get(f"sw/{key}"))
    else:
        got = tmp_path / "emb"
        assert sorted(os.listdir(tmp_path)) == ["emb", "in", "pauses"]  # the old one is gone
    assert_clean(got, clean[1])
    summary = run_encode(options(images, out, update=True, prune=True))
    assert (summary.encoded, summary.reused) == (0, N_OLD + 2)


def one_line_error(result, code: int) -> str:
    assert result.exit_code == code, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    return lines[0]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("upd_finished")
    images = old_images(root / "in")
    out = root / "e.parquet"
    run_encode(options(images, out))
    return images, out


def cli(images: Path, out: Path, *extra: str):
    return runner.invoke(app, ["encode", str(images), "--out", str(out), "--config", CONFIG,
                               "--random-init", "--device", "cpu", "--workers", "0",
                               "--part-images", str(PART), "-q", *extra])


@pytest.mark.parametrize("change, named", [
    (["--dtype", "other"], "--dtype"), (["--out-dtype", "float32"], "--out-dtype"),
    (["--features", "vit"], "--features"), (["--pool", "mean"], "--pool"),
    (["--max-pixels", "1000000"], "--max-pixels")])
def test_update_with_other_settings_is_refused_in_one_line(finished, change, named):
    images, out = finished
    stamp = out.stat().st_mtime_ns
    if change[1] == "other":  # whatever --dtype auto chose here, ask for another
        made = json.loads(pq.read_metadata(out).metadata[b"dsv4enc"])["compute_dtype"]
        change = ["--dtype", "bfloat16" if made == "float32" else "float32"]
    line = one_line_error(cli(images, out, "--update", *change), 2)
    assert "cannot update" in line and named in line
    assert "--overwrite in place of --update" in line  # beside --update it is refused
    assert out.stat().st_mtime_ns == stamp and not out.with_name("e.parquet.partial").exists()


def test_update_of_an_output_without_stamps_is_refused_in_one_line(finished, tmp_path):
    images, out = finished
    old = tmp_path / "old.parquet"  # as an earlier dsv4enc wrote it: no stamps in the footer
    pq.write_table(pq.read_table(out), old)
    assert STAMPS_KEY not in (pq.read_metadata(old).metadata or {})
    line = one_line_error(cli(images, old, "--update"), 2)
    assert "does not record its input files" in line and "--overwrite" in line


def test_update_without_an_output_is_a_plain_run(finished, tmp_path):
    images, _ = finished
    out = tmp_path / "new.parquet"
    summary = run_encode(options(images, out, update=True))
    assert (summary.encoded, summary.reused, summary.update) == (N_OLD, 0, False)
    assert STAMPS_KEY in pq.read_metadata(out).metadata


def test_update_contradicts_resume_and_overwrite(finished):
    images, out = finished
    for other in ("--resume", "--overwrite"):
        line = one_line_error(cli(images, out, "--update", other), 2)
        assert "--update" in line and other in line


def shard_of(path: Path, seed: int, samples: int = 4) -> Path:
    """A WebDataset shard whose sample keys (``000000``, ...) every such shard repeats."""
    import tarfile

    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as archive:
        for i in range(samples):
            image = path.parent / f".tmp{i}.png"
            noise(image, seed * 100 + i, (16 + i, 12))
            archive.add(image, arcname=f"{i:06d}.png")
            image.unlink()
    return path


@pytest.mark.parametrize("given", ["names", "folder"])
def test_update_with_a_shard_added_keeps_the_unchanged_shards_rows(given, tmp_path):
    """Two shards with the same local keys: each row's key names its shard, so adding shard 3
    before shard 4 leaves shard 4's keys as they were, and --update encodes shard 3 alone."""
    shards = tmp_path / "shards"
    shard_of(shards / "train-00004.tar", 4)
    inputs = (lambda: [str(shards)]) if given == "folder" else (
        lambda: [str(p) for p in sorted(shards.glob("*.tar"))])
    out = tmp_path / "e.parquet"
    first = run_encode(options(shards, out, inputs=inputs()))
    assert first.encoded == 4
    before = {r["path"]: r for r in table_of(out)}
    shard_of(shards / "train-00003.tar", 3)
    update = run_encode(options(shards, out, inputs=inputs(), update=True))
    assert (update.encoded, update.reused) == (4, 4)
    clean = tmp_path / "clean.parquet"
    run_encode(options(shards, clean, inputs=inputs()))
    assert table_of(out) == table_of(clean)
    prefix = "" if given == "folder" else f"{shards}/"
    keys = [r["path"] for r in table_of(out)]
    assert keys == [f"{prefix}train-0000{n}.tar/{i:06d}" for n in (3, 4) for i in range(4)]
    for key, row in before.items():  # shard 4's rows kept their keys and their bytes
        assert {r["path"]: r for r in table_of(out)}[key] == row


def test_update_of_tables_with_kept_columns_equals_a_clean_run(tmp_path):
    """A table added to a run: the unchanged table's rows (its kept columns too) are reused,
    the new one's encoded; the result is a clean run's rows, kept columns included."""
    import io

    import pyarrow as pa

    def table(path: Path, seed: int) -> str:
        images = []
        for i in range(3):
            buffer = io.BytesIO()
            rng = np.random.default_rng(seed * 10 + i)
            Image.fromarray(rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)).save(buffer,
                                                                                    "PNG")
            images.append(buffer.getvalue())
        pq.write_table(pa.table({"id": pa.array([seed * 10 + i for i in range(3)], pa.int64()),
                                 "caption": [f"c{seed}-{i}" for i in range(3)],
                                 "image": images}), path)
        return str(path)

    first = [table(tmp_path / "b.parquet", 2)]
    both = [table(tmp_path / "a.parquet", 1), *first]
    out, clean = tmp_path / "e.parquet", tmp_path / "clean.parquet"
    kept = dict(key_column="id", keep_columns=("caption",))
    run_encode(options(tmp_path, out, inputs=first, **kept))
    update = run_encode(options(tmp_path, out, inputs=both, update=True, **kept))
    assert (update.encoded, update.reused) == (3, 3)
    run_encode(options(tmp_path, clean, inputs=both, **kept))
    assert table_of(out) == table_of(clean)
    assert [r["caption"] for r in table_of(out)] == [f"c{s}-{i}" for s in (1, 2) for i in range(3)]
    with pytest.raises(UsageError, match="--keep-column"):  # other kept columns: other rows
        run_encode(options(tmp_path, out, inputs=both, update=True, key_column="id"))


def containers(folder: Path, broken: bool) -> None:
    """A shard ``s.tar`` and a table ``t.parquet`` of 3 images each (``broken``: the shard's
    second member and the table's last cell are not images), and a shard ``u.tar``."""
    import io
    import tarfile

    import pyarrow as pa

    def png(seed: int) -> bytes:
        noise(folder / ".tmp.png", seed)
        return (folder / ".tmp.png").read_bytes()

    folder.mkdir(parents=True, exist_ok=True)
    with tarfile.open(folder / "s.tar", "w") as archive:
        for i in range(3):
            data = b"\x89PNG cut short" if broken and i == 1 else png(i)
            info = tarfile.TarInfo(f"{i:06d}.png")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    cells = [png(10), png(11), b"not an image" if broken else png(12)]
    pq.write_table(pa.table({"image": cells}), folder / "t.parquet")
    (folder / ".tmp.png").unlink()
    shard_of(folder / "u.tar", 7, samples=2)


@pytest.mark.parametrize("given", ["folder", "names"])
def test_failed_container_rows_are_retried_from_the_errors_list(given, tmp_path, monkeypatch):
    """A shard with a bad member and a table with a bad cell, in a folder or given by name:
    ``inspect --errors-list`` names each container (its rows' keys are no files), and once
    they are fixed, ``--files-from LIST --update --keep-unlisted`` encodes their rows again
    in place: the output equals a clean run's, the untouched shard's rows kept."""
    monkeypatch.chdir(tmp_path)
    containers(Path("data"), broken=True)
    inputs = ["data"] if given == "folder" else ["data/s.tar", "data/t.parquet", "data/u.tar"]
    prefix = "" if given == "folder" else "data/"
    base = ["--config", CONFIG, "--random-init", "--device", "cpu", "--workers", "0", "-q"]
    out = tmp_path / "e.parquet"
    assert runner.invoke(app, ["encode", *inputs, "--out", str(out), *base]).exit_code == 0
    failed = [r["path"] for r in table_of(out) if r["error"]]
    assert failed == [f"{prefix}s.tar/000001", f"{prefix}t.parquet#2"]
    listed = runner.invoke(app, ["inspect", str(out), "--errors-list", str(tmp_path / "f.txt")])
    assert listed.exit_code == 0 and "(2 containers:" in listed.output, listed.output
    lines = (tmp_path / "f.txt").read_text().splitlines()
    assert lines == [f"{prefix}s.tar", f"{prefix}t.parquet"]
    kept = {r["path"]: r for r in table_of(out) if r["path"].startswith(f"{prefix}u.tar")}
    containers(Path("data"), broken=False)
    monkeypatch.chdir(tmp_path / "data" if given == "folder" else tmp_path)
    retried = runner.invoke(app, ["encode", "--files-from", str(tmp_path / "f.txt"), "--out",
                                  str(out), "--update", "--keep-unlisted", *base])
    assert retried.exit_code == 0, retried.output
    monkeypatch.chdir(tmp_path)
    clean = tmp_path / "clean.parquet"
    assert runner.invoke(app, ["encode", *inputs, "--out", str(clean), *base]).exit_code == 0
    assert table_of(out) == table_of(clean)
    assert all(kept[r["path"]] == r for r in table_of(out) if r["path"] in kept) and kept


# --------------------------------------------------------------- what an update may drop

def copy_of(out: Path, folder: Path) -> Path:
    import shutil

    folder.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copy2(out, folder / out.name))


def test_an_update_given_part_of_the_inputs_is_refused_in_one_line(finished, tmp_path):
    """One image given where the output holds a folder's ten: every row would go. Refused in
    one line naming the counts and --prune, nothing written; --dry-run says the three counts;
    with --prune it is done."""
    images, shared = finished
    out = copy_of(shared, tmp_path)
    stamp = out.stat().st_mtime_ns
    one = str(images / "img003.png")
    line = one_line_error(cli(one, out, "--update"), 2)
    assert "would drop 10 of the 10 rows" in line and "--prune" in line, line
    assert "img000.png" in line  # the first paths it would drop
    assert out.stat().st_mtime_ns == stamp and sorted(os.listdir(tmp_path)) == ["e.parquet"]
    result = cli(one, out, "--update", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "1 to encode, 0 reused, 10 dropped (img000.png, img001.png, img002.png and 7 more)" \
        "; nothing was written (the update needs --prune to drop them)" in result.output
    assert out.stat().st_mtime_ns == stamp and sorted(os.listdir(tmp_path)) == ["e.parquet"]
    result = cli(one, out, "--update", "--prune")
    assert result.exit_code == 0, result.output
    assert [r["path"] for r in table_of(out)] == [one]


def test_an_update_that_drops_a_share_above_the_limit_needs_prune(tmp_path):
    """A folder given whole with one image of ten gone drops 10% of the rows: refused without
    --prune (the summary then names the dropped path); none gone: no --prune needed."""
    images = old_images(tmp_path / "in")
    out = tmp_path / "e.parquet"
    run_encode(options(images, out))
    (images / "img005.png").unlink()
    with pytest.raises(UsageError, match="would drop 1 of the 10 rows .*more than 1%"):
        run_encode(options(images, out, update=True))
    result = runner.invoke(app, ["encode", str(images), "--out", str(out), "--config", CONFIG,
                                 "--random-init", "--device", "cpu", "--workers", "0",
                                 "--part-images", str(PART), "--update", "--prune"])
    assert result.exit_code == 0, result.output
    assert "1 (img005.png)" in result.output  # the summary's dropped line
    assert len(table_of(out)) == N_OLD - 1


def test_dry_run_of_a_new_output_writes_nothing(finished, tmp_path):
    images, _ = finished
    for out in (tmp_path / "new.parquet", tmp_path / "folder"):
        result = cli(images, out, "--dry-run", *(["--update"] if out.suffix else []))
        assert result.exit_code == 0, result.output
        assert f"dry run for {out}: 10 to encode, 0 reused, 0 dropped; nothing was written" \
            in result.output.replace("\n", "")
    assert os.listdir(tmp_path) == []
    line = one_line_error(cli(images, tmp_path / "x.parquet", "--dry-run", "--overwrite"), 2)
    assert "--dry-run" in line


# --------------------------------------------------------------- error rows: retried or reused

def test_transient_and_permanent_errors_are_told_apart():
    from dsv4enc.images.decode import is_transient

    for error in ("FileNotFoundError: [Errno 2] No such file or directory: '/x/a.png'",
                  "FileNotFoundError: s3://b/a.png: no such object",
                  "OSError: [Errno 5] Input/output error", "TimeoutError: read timed out",
                  "PermissionError: [Errno 13] Permission denied: 'a.png'",
                  "decode timed out after 30 s", "storage unavailable: s3://b: refused"):
        assert is_transient(error), error
    for error in (None, "UnidentifiedImageError: cannot identify image file 'a.png'",
                  "OSError: image file is truncated (3 bytes not processed)",
                  "ValueError: image has 9x9 = 81 pixels, more than --max-pixels 10",
                  "SyntaxError: broken PNG file"):
        assert not is_transient(error), error


def test_update_encodes_a_row_whose_file_was_missing_once_it_is_back(tmp_path, monkeypatch):
    """An image moved away between its header probe and its decode is a FileNotFoundError
    row; once it is back (the same file: same stamp), --update encodes it, and the output
    equals a clean run. A corrupt image's row is carried as it was: reused, not failed again,
    unless --retry-errors asks."""
    from dsv4enc.images import decode

    images = old_images(tmp_path / "in")
    (images / "img006.png").write_bytes(b"\x89PNG\r\n\x1a\n not a png")  # corrupt: permanent
    away = tmp_path / "away.png"
    real = decode.decode_image

    def vanishing(source, *args, **kwargs):
        if str(getattr(source, "path", source)).endswith("img004.png"):
            os.rename(images / "img004.png", away)
        return real(source, *args, **kwargs)

    out = tmp_path / "e.parquet"
    with monkeypatch.context() as patch:
        patch.setattr(decode, "decode_image", vanishing)
        first = run_encode(options(images, out))
    errors = {r["path"]: r["error"] for r in table_of(out) if r["error"]}
    assert sorted(errors) == ["img004.png", "img006.png"], errors
    assert errors["img004.png"].startswith("FileNotFoundError") and first.failed == 2
    os.rename(away, images / "img004.png")  # back, unchanged
    summary = run_encode(options(images, out, update=True))
    assert (summary.encoded, summary.failed, summary.reused, summary.reused_failed) == (
        1, 0, N_OLD - 1, 1)
    clean = tmp_path / "clean.parquet"
    run_encode(options(images, clean))
    assert table_of(out) == table_of(clean)
    retried = run_encode(options(images, out, update=True, retry_errors=True))
    assert (retried.encoded, retried.failed, retried.reused) == (0, 1, N_OLD - 1)
    assert table_of(out) == table_of(clean)


# --------------------------------------------------------------- a damaged output

def test_update_of_a_folder_with_a_part_deleted_and_one_cut_short_repairs_it(tmp_path, caplog):
    images = old_images(tmp_path / "in")
    out = tmp_path / "emb"
    run_encode(options(images, f"{out}/"))
    parts = sorted(load_manifest(out / "_manifest.json")["parts"].values(),
                   key=lambda part: part["start"])
    assert len(parts) >= 3
    gone, cut = out / parts[1]["file"], out / parts[2]["file"]
    gone.unlink()
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    damaged_rows = parts[1]["rows"] + parts[2]["rows"]
    result = runner.invoke(app, ["encode", str(images), "--out", f"{out}/", "--config", CONFIG,
                                 "--random-init", "--device", "cpu", "--workers", "0",
                                 "--part-images", str(PART), "--update"])
    assert result.exit_code == 0, result.output
    assert gone.name in caplog.text and f"encodes their {damaged_rows} rows again" in caplog.text
    clean = tmp_path / "clean.parquet"
    run_encode(options(images, clean))
    assert_clean(out, table_of(clean))
    assert not cut.exists()  # the damaged part's file went with the old generation


def test_update_of_a_folder_with_parts_whose_footers_do_not_fit_their_schema_repairs_it(
        tmp_path, caplog):
    """Parts whose footer's column chunk metadata pyarrow cannot build (level histograms that
    do not fit the schema), which the readers refuse naming --update as the repair: the
    update encodes their rows again, where it kept them (the output as damaged as before)
    or failed with a traceback reading their ``error`` column."""
    from helpers import damage_column_chunks

    images = old_images(tmp_path / "in")
    out = tmp_path / "emb"
    run_encode(options(images, f"{out}/"))
    parts = sorted(load_manifest(out / "_manifest.json")["parts"].values(),
                   key=lambda part: part["start"])
    damage_column_chunks(out / parts[1]["file"], "embedding")
    damage_column_chunks(out / parts[2]["file"], "error")
    result = runner.invoke(app, ["encode", str(images), "--out", f"{out}/", "--config", CONFIG,
                                 "--random-init", "--device", "cpu", "--workers", "0",
                                 "--part-images", str(PART), "--update"])
    assert result.exit_code == 0, result.output
    damaged_rows = parts[1]["rows"] + parts[2]["rows"]
    assert f"encodes their {damaged_rows} rows again" in caplog.text
    clean = tmp_path / "clean.parquet"
    run_encode(options(images, clean))
    assert_clean(out, table_of(clean))


def test_update_of_a_damaged_output_it_cannot_repair_is_refused_in_one_line(finished, tmp_path):
    images, shared = finished
    cut = copy_of(shared, tmp_path / "file")
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    line = one_line_error(cli(images, cut, "--update"), 1)  # no footer: not provably ours
    assert str(cut) in line and "not a dsv4enc output" in line
    folder = tmp_path / "emb"
    run_encode(options(images, f"{folder}/"))
    next(folder.glob("_stamps-*.bin")).unlink()
    line = one_line_error(cli(images, f"{folder}/", "--update"), 2)
    assert "does not record its input files" in line


def test_update_of_a_single_file_whose_footer_does_not_fit_its_schema_is_one_line(finished,
                                                                                  tmp_path):
    """A single file whose footer's column chunk metadata pyarrow cannot build (level
    histograms that do not fit its schema), which --update cannot repair: refused in one line
    naming it, where the update stopped with a traceback reading its rows; --overwrite then
    encodes it again."""
    from helpers import damage_column_chunks

    images, shared = finished
    damaged = copy_of(shared, tmp_path / "file")
    damage_column_chunks(damaged, "error")
    line = one_line_error(cli(images, damaged, "--update"), 2)
    assert line.startswith(f"error: cannot update {damaged}: not a readable Parquet file ("), line
    assert line.endswith("encode it again (--overwrite in place of --update)"), line
    assert cli(images, damaged, "--overwrite").exit_code == 0
    assert table_of(damaged) == table_of(shared)


# --------------------------------------------------------------- what readers see meanwhile

def keys_by_reader(out: Path) -> dict[str, list[str]]:
    """The keys of the rows each documented reader of a folder output sees (those installed)."""
    import contextlib

    import pyarrow.dataset as ds

    from dsv4enc.output.read import read_embeddings

    seen = {"read_embeddings": [row["path"] for row in read_embeddings(out, ["path"],
                                                                       errors="include")],
            "pyarrow.dataset": ds.dataset(out, format="parquet").to_table(
                columns=["path"]).column("path").to_pylist()}
    with contextlib.suppress(ImportError):
        import duckdb

        seen["duckdb"] = [key for (key,) in duckdb.sql(
            f"SELECT path FROM read_parquet('{out}/*.parquet')").fetchall()]
    with contextlib.suppress(ImportError):
        import polars as pl

        seen["polars"] = pl.read_parquet(f"{out}/*.parquet", columns=["path"])["path"].to_list()
    return {reader: sorted(keys) for reader, keys in seen.items()}


def assert_readers_see(out: Path, expected: dict[str, list[str]]) -> None:
    """Every reader sees the ``expected`` keys, and ``dsv4enc inspect`` as many finished rows."""
    from dsv4enc.output.inspect import summarize

    assert keys_by_reader(out) == expected
    shown = summarize(out)
    assert (shown.rows, shown.interrupted) == (len(expected["read_embeddings"]), False)


@pytest.mark.parametrize("point", ["encoded", "commit", "switch", "switched"])
def test_an_update_stopped_anywhere_shows_readers_the_old_rows_or_the_new(point, tmp_path,
                                                                          clean):
    """Paused at each of its pause points, then SIGKILLed there: every reader of the folder
    sees exactly the old output's rows, or exactly the new ones (never both, never a mix);
    the rerun finishes the update."""
    images = old_images(tmp_path / "in")
    out = tmp_path / "emb"
    run_encode(options(images, f"{out}/"))
    old = keys_by_reader(out)
    assert old["pyarrow.dataset"] == sorted(f"img{i:03d}.png" for i in range(N_OLD))
    grow_change_shrink(images)
    new = sorted(row["path"] for row in clean[1])
    pauses = Pauses(tmp_path / "pauses", point)
    expected = {reader: new for reader in old} if point == "switched" else old
    with reaped(_launch_update(pauses, images, f"{out}/")) as proc:
        pauses.wait(point, proc=proc)
        assert_readers_see(out, expected)
        proc.kill()
        proc.wait(timeout=60)
    assert_readers_see(out, expected)
    run_encode(options(images, f"{out}/", update=True, prune=True))
    assert_readers_see(out, {reader: new for reader in old})
    assert_clean(out, clean[1])
    assert sorted(os.listdir(tmp_path)) == ["emb", "in", "pauses"]  # nothing left beside it


def test_a_switch_in_two_renames_where_there_is_no_exchange(tmp_path, monkeypatch, clean):
    """Without an atomic exchange the old output is moved aside, then the new one in; a stop
    between the two leaves the old one aside, which the next update puts back first. A
    hidden file of the user's in the output stays in it."""
    from dsv4enc.output import update as update_module

    images = old_images(tmp_path / "in")
    out = tmp_path / "emb"
    run_encode(options(images, f"{out}/"))
    (out / ".notes").write_text("mine")
    grow_change_shrink(images)
    monkeypatch.setattr(update_module, "exchange", lambda a, b: False)
    os.rename(out, update_module.old_folder(out))  # as a stop between the two renames leaves it
    summary = run_encode(options(images, f"{out}/", update=True, prune=True))
    assert (summary.encoded, summary.reused, summary.dropped) == (4, 8, 1)
    assert_clean(out, clean[1])
    assert (out / ".notes").read_text() == "mine"
    assert sorted(os.listdir(tmp_path)) == ["emb", "in"]


def test_the_share_an_update_may_drop_and_inputs_given_one_by_one(finished, tmp_path):
    """1 row of 1,000 may go when a folder is given; none when files are given one by one
    (image files, or a --files-from list)."""
    from dsv4enc.output.update import OldOutput, Update
    from dsv4enc.run.options import PRUNE_SHARE
    from dsv4enc.run.pipeline import given_one_by_one

    update = Update(OldOutput(tmp_path / "e.parquet", [], {}, None, False))
    update.dropped, update.rows_before, update.dropped_paths = 1, 1000, ["a.png"]
    update.check_drop(PRUNE_SHARE, one_by_one=False)
    with pytest.raises(UsageError, match="drop 1 of the 1,000 rows .*among the files given"):
        update.check_drop(PRUNE_SHARE, one_by_one=True)
    update.dropped = 11
    with pytest.raises(UsageError, match="more than 1%"):
        update.check_drop(PRUNE_SHARE, one_by_one=False)
    images, _ = finished
    one = str(images / "img001.png")
    assert given_one_by_one(options(images, "o", inputs=[one, str(images / "img002.png")]))
    assert given_one_by_one(options(images, "o", inputs=[], files_from=one))
    assert not given_one_by_one(options(images, "o"))  # the folder
    assert not given_one_by_one(options(images, "o", inputs=[str(images), one]))


def test_update_of_a_bucket_shard_output_is_refused_in_one_line(s3, tmp_path):
    """A --shard-output folder in a bucket records no stamps (its ranks uploaded their parts):
    --update says so, and what to run instead; rerunning with --shard-output would not help."""
    images = old_images(tmp_path / "in")
    out = f"{s3.url}/sharded/"
    run_encode(options(images, out))
    key = next(k for k in s3.keys("sharded/") if k.endswith("/_manifest.json"))
    manifest = json.loads(s3.get(key))  # as torchrun ranks leave it: no stamps, a world size
    del manifest["stamps"]
    manifest["settings"]["world_size"] = 2
    s3.put(key, json.dumps(manifest).encode())
    line = one_line_error(cli(images, out, "--update"), 2)
    assert "--shard-output folder in object storage" in line and "--overwrite" in line, line


def test_a_parts_entry_names_the_inputs_its_rows_hold():
    """A --shard-output rank's part holds a share of its range's inputs: its manifest entry
    names them (a bit per input), so that a resumed run's end stamps its rows without reading
    the part back; an entry without it names every input of its range only when it holds as
    many rows (an earlier dsv4enc's share is not known, nor one recorded amiss)."""
    import base64

    import pyarrow as pa

    from dsv4enc.output.parts import part_rows, share_entry

    keys = [f"k{i}" for i in range(11)] + ["caf\udce9.png"]  # a name that is not UTF-8
    inputs = [SimpleNamespace(item=SimpleNamespace(key=key)) for key in keys]
    for held in ([0, 3, 4, 9, 11], [], [7]):
        table = pa.table({"path": pa.array([utf8_text(keys[i]) for i in held], pa.string())})
        entry = {"start": 20, "end": 32, "rows": len(held), **share_entry(table, inputs)}
        assert part_rows(entry).tolist() == held
    whole = pa.table({"path": [utf8_text(key) for key in keys]})
    assert share_entry(whole, inputs) == {}
    assert part_rows({"start": 20, "end": 32, "rows": 12}).tolist() == list(range(12))
    assert part_rows({"start": 20, "end": 32, "rows": 5}) is None
    backwards = pa.table({"path": ["k4", "k3"]})
    assert share_entry(backwards, inputs) == {}  # not in the inputs' order: not recorded
    for amiss in ("not base64!", base64.b64encode(b"\x01").decode(),
                  base64.b64encode(b"\x01\x00").decode()):
        assert part_rows({"start": 20, "end": 32, "rows": 2, "share": amiss}) is None


def test_a_setting_an_earlier_output_did_not_record_is_compared_only_where_recorded():
    """``fused`` (compiled kernels: rows equal the eager tower's to rounding only) is refused
    when it changes, and an output made before it was recorded is not refused for lacking it."""
    from dsv4enc.errors import UsageError
    from dsv4enc.output.update import check_settings

    def check(recorded: dict, now: dict) -> None:
        check_settings(recorded, now, "cannot update o", "it was made with", again="encode it",
                       given="--update")

    check({"pool": "none"}, {"pool": "none", "fused": False})
    check({"pool": "none", "fused": True}, {"pool": "none", "fused": True})
    with pytest.raises(UsageError, match=r"fused kernels .*\(True then, False now\)"):
        check({"pool": "none", "fused": True}, {"pool": "none", "fused": False})


def test_a_damaged_part_of_a_bucket_folder_is_named_by_its_url(s3, tmp_path, caplog):
    """The warning that an update found a part object gone or cut short named the output by
    its local staging folder (a temporary folder of this machine), not by the --out given."""
    images = old_images(tmp_path / "in")
    out = f"{s3.url}/dmg/"
    run_encode(options(images, out))
    part = sorted(p["file"] for p in json.loads(s3.get("dmg/_manifest.json"))["parts"].values())[0]
    s3.put(f"dmg/{part}", s3.get(f"dmg/{part}")[:100])  # cut short
    with caplog.at_level("INFO", logger="dsv4enc"):
        summary = run_encode(options(images, out, update=True))
    assert summary.encoded > 0
    said = [r.getMessage() for r in caplog.records if "cut short" in r.getMessage()]
    assert said and said[0].startswith(f"{s3.url}/dmg"), said
    assert not [r.getMessage() for r in caplog.records if "dsv4enc-staging-" in r.getMessage()]
