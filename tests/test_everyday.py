"""Everyday mistakes get a word: an empty input folder, comments in --files-from, a misspelled
config key, a Hub id without network, --help as documented, --resume of a finished output."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import typer
from typer.testing import CliRunner

from dsv4enc.tower import hub
from dsv4enc.cli import app
from dsv4enc.tower.config import VisionConfig
from dsv4enc.errors import WeightsError
from dsv4enc.images.discover import discover, read_path_list
from dsv4enc.output.read import load_manifest
from dsv4enc.run.encoding import PartEncoder

from helpers import CONFIGS, parts_of, signal_after_first_part, write_image

runner = CliRunner()


def encode(*args: str, env: dict | None = None):
    return runner.invoke(app, ["encode", *args, "--device", "cpu", "--workers", "0"],
                         env={"DSV4ENC_WEIGHTS": None, "COLUMNS": "200", **(env or {})})


def test_an_empty_folder_warns_and_exits_0(tmp_path, small_ckpt, caplog):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("no images here\n")
    out = tmp_path / "e.parquet"
    with caplog.at_level(logging.WARNING, logger="dsv4enc"):
        result = encode(str(empty), "--out", str(out), "--weights", str(small_ckpt))
    assert result.exit_code == 0, result.output
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and re.search(r"no images found in .*empty \(1 other files "
                                            r"skipped\)", warnings[0]), warnings
    assert pq.read_table(out).num_rows == 0


def test_quiet_never_hides_that_nothing_was_found(tmp_path, small_ckpt):
    """``-q`` prints only the output path and errors, but an empty run still says so."""
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("no images here\n")
    out = tmp_path / "e.parquet"
    result = encode(str(empty), "--out", str(out), "--weights", str(small_ckpt), "-q")
    assert result.exit_code == 0, result.output
    assert re.search(r"no images found in .*empty \(1 other files skipped\)", result.stderr)
    assert result.stdout.strip() == str(out)


def test_a_folder_of_shards_is_encoded(tmp_path, small_ckpt):
    """The WebDataset layout given as a folder: its shards' images, keyed under each shard."""
    import tarfile

    shards = tmp_path / "shards"
    shards.mkdir()
    for n in range(2):
        image = write_image(tmp_path / f"{n}.png", (20 + n, 20))
        with tarfile.open(shards / f"train-{n:05d}.tar", "w") as archive:
            archive.add(image, arcname="000000.png")
    out = shards / "e.parquet"  # beside the shards: an output is never read as an input
    for again in ([], ["--overwrite"]):
        result = encode(str(shards), "--out", str(out), "--weights", str(small_ckpt), "-q",
                        *again)
        assert result.exit_code == 0 and not result.stderr, result.output
        assert pq.read_table(out).column("path").to_pylist() == [
            "train-00000.tar/000000", "train-00001.tar/000000"]


@pytest.mark.parametrize("out_name", ["emb/", "emb.parquet"])
def test_an_output_in_its_input_folder_is_not_read_back_as_input(tmp_path, small_ckpt, caplog,
                                                                 out_name):
    """An update of ``--out`` inside the folder it encodes: its part files and manifest are
    neither counted as skipped inputs nor named as tables to encode."""
    images = tmp_path / "images"
    images.mkdir()
    for name in ("a.png", "b.png"):
        write_image(images / name, (20, 20))
    out = str(images / out_name)
    for again in ([], ["--update"]):
        with caplog.at_level(logging.WARNING, logger="dsv4enc"):
            result = encode(str(images), "--out", out, "--weights", str(small_ckpt), *again)
        assert result.exit_code == 0, result.output
        assert re.search(r"skipped \(not images\) +│ 0 ", result.output), result.output
        assert not caplog.records, [r.getMessage() for r in caplog.records]
    assert pq.read_table(out.rstrip("/")).column("path").to_pylist() == ["a.png", "b.png"]


def test_files_from_comments_and_blank_lines(tmp_path):
    images = [write_image(tmp_path / name, (20, 20)) for name in ("a.png", "#b.png")]
    listing = tmp_path / "list.txt"
    listing.write_text(f"# images for the run\n\n{images[0]}\n   # indented comment\n"
                       f"./{images[1].relative_to(tmp_path)}\n  \r\n")
    assert list(read_path_list(str(listing))) == [str(images[0]), "./#b.png"]
    import os

    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        found = discover([], str(listing))
    finally:
        os.chdir(cwd)
    assert [item.key for item in found.items] == [str(images[0]), "./#b.png"]
    assert found.skipped == 0  # comments are not counted as skipped non-images


def test_an_unknown_vision_key_warns_with_the_closest_known_one(caplog):
    raw = json.loads((CONFIGS / "tiny.json").read_text())
    raw["vision_max_wh_raito"] = raw.pop("vision_max_wh_ratio")
    with caplog.at_level(logging.WARNING, logger="dsv4enc"):
        cfg = VisionConfig.from_dict(raw, source="my.json")
    assert cfg.max_wh_ratio is None
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["my.json: unknown key 'vision_max_wh_raito' is ignored; did you mean "
                        "'vision_max_wh_ratio'?"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dsv4enc"):
        VisionConfig.from_file(CONFIGS / "tiny.json")  # the shipped configs are clean
    assert not caplog.records


PROXY_VARIABLES = ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "no_proxy",
                   "NO_PROXY", "all_proxy", "ALL_PROXY")


@pytest.fixture
def no_proxy(monkeypatch):
    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def test_a_hub_id_without_network_fails_fast_in_one_line(tmp_path, monkeypatch, no_proxy):
    pytest.importorskip("huggingface_hub")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: refused at once
    began = time.perf_counter()
    with pytest.raises(WeightsError) as caught:
        hub.resolve_weights("someone/some-model")
    assert time.perf_counter() - began < hub.CONNECT_TIMEOUT_S + 2
    message = str(caught.value)
    assert "cannot reach the Hub" in message and "HF_HUB_OFFLINE=1" in message
    assert "local checkpoint folder" in message and "\n" not in message
    # through the CLI: one line, nothing from huggingface_hub's logger
    image = write_image(tmp_path / "x.png", (20, 20))
    result = encode(str(image), "--out", str(tmp_path / "e.parquet"), "--weights",
                    "someone/some-model")
    assert result.exit_code == 1
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_unreachable_reason(monkeypatch, no_proxy):
    import socket

    assert hub.unreachable_reason("http://127.0.0.1:9", timeout=1) is not None
    assert hub.unreachable_reason("not a url") is not None
    with socket.socket() as server:  # something listening: reachable
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert hub.unreachable_reason(f"http://127.0.0.1:{port}", timeout=1) is None
        # behind a proxy, the proxy is what must be reachable
        monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{port}")
        assert hub.unreachable_reason("http://example.invalid:9", timeout=1) is None


def test_help_shows_flags_choices_and_usage():
    """What the help says, not how Typer draws it (its markers for a value's type changed
    with Typer 0.26, and dsv4enc takes any Typer from 0.12 on): the usage, every choice of a
    choice option, and the flags that take no value (no value is asked of them)."""
    result = runner.invoke(app, ["encode", "--help"], env={"COLUMNS": "250"},
                           terminal_width=250)
    assert result.exit_code == 0
    text = result.output
    assert re.search(r"Usage: .*encode \[OPTIONS\] \[INPUTS\]\.\.\.", text, re.IGNORECASE)
    from dsv4enc.tower.config import ATTENTION_BACKENDS

    for choices in ("[none|mean]", "[aligner|vit]", "[float16|float32]",
                    "[auto|float32|bfloat16|float16]", f"[{'|'.join(ATTENTION_BACKENDS)}]",
                    "[data|weights]", "[patches|flops]"):
        assert choices in text, choices
    assert "--log-every" in text and "--summary-json" in text
    encode_cmd = typer.main.get_command(app).commands["encode"]
    flags = {opt: param.is_flag for param in encode_cmd.params
             if param.param_type_name == "option" for opt in param.opts}
    for flag in ("--overwrite", "--resume", "--random-init", "--shard-output", "--quiet"):
        assert flags[flag], flag
    inspect = runner.invoke(app, ["inspect", "--help"], terminal_width=200)
    assert re.search(r"inspect \[OPTIONS\] \W?OUTPUT\b", inspect.output, re.IGNORECASE)
    inspect_cmd = typer.main.get_command(app).commands["inspect"]
    assert next(p for p in inspect_cmd.params if "--json" in p.opts).is_flag


def test_resume_of_a_finished_output_agrees_for_files_and_folders(tmp_path, small_ckpt):
    """A file and a folder alike: a note, and a --summary-json whose rows are all reused."""
    image = write_image(tmp_path / "imgs" / "x.png", (30, 20))
    (image.parent / "broken.png").write_bytes(b"not a png")
    (image.parent / "notes.txt").write_text("not an image")
    common = ("--weights", str(small_ckpt))
    report = tmp_path / "s.json"
    for out in (str(tmp_path / "one.parquet"), f"{tmp_path}/folder/"):  # (a Path drops the /)
        first = encode(str(image.parent), "--out", out, *common)
        assert first.exit_code == 0, first.output
        again = encode(str(image.parent), "--out", out, *common, "--resume",
                       "--summary-json", str(report))
        assert again.exit_code == 0, (out, again.output)
        notes = [line for line in again.stderr.splitlines() if line.startswith("note:")]
        assert len(notes) == 1 and "already complete" in notes[0], again.stderr
        done = json.loads(report.read_text())
        assert (done["status"], done["output"]) == ("completed", out), done
        assert done["images"] == {**done["images"], "encoded": 0, "failed": 0, "reused": 2,
                                  "reused_failed": 1, "skipped_not_images": 1}, done
        quiet = encode(str(image.parent), "--out", out, *common, "--resume", "-q")
        assert quiet.exit_code == 0 and quiet.stderr == "", quiet.output
        assert Path(quiet.stdout.strip()) == Path(out)


def test_resume_after_the_last_commit_says_the_output_was_finished_now(tmp_path, small_ckpt,
                                                                       monkeypatch):
    """A run stopped once its last part is committed, before its end (the single file not
    yet written, the folder's stamps not yet): --resume finishes it, and says so, a file and
    a folder alike; 'already complete' was said, as if the output had been done before."""
    image = write_image(tmp_path / "imgs" / "x.png", (30, 20))
    common = ("--weights", str(small_ckpt))
    for out in (str(tmp_path / "one.parquet"), f"{tmp_path}/folder/"):
        signal_after_first_part(monkeypatch)  # the first part is the last
        stopped = encode(str(image.parent), "--out", out, *common)
        assert stopped.exit_code == 143, stopped.output
        monkeypatch.undo()
        again = encode(str(image.parent), "--out", out, *common, "--resume")
        assert again.exit_code == 0, (out, again.output)
        notes = [line for line in again.stderr.splitlines() if line.startswith("note:")]
        assert notes == [f"note: nothing was left to encode: {out} was finished from the "
                         "parts an earlier run committed"], again.stderr
        assert pq.read_table(out).num_rows == 1


def test_the_summary_shows_every_kind_of_error_or_says_how_many_more(tmp_path, small_ckpt):
    """Eight kinds of error: the summary shows the commonest five and says that three more
    kinds (of three images) are left out, and that --summary-json lists them all; it does."""
    folder = tmp_path / "imgs"
    for i in range(8):  # each over --max-pixels by another size: eight distinct messages
        write_image(folder / f"{i}.png", (11 + i, 10))
    write_image(folder / "ok.png", (5, 5))
    report = tmp_path / "s.json"
    result = encode(str(folder), "--out", str(tmp_path / "e.parquet"), "--weights",
                    str(small_ckpt), "--max-pixels", "100", "--summary-json", str(report))
    assert result.exit_code == 0, result.output
    shown = [line for line in result.stderr.splitlines() if "more than --max-pixels" in line]
    assert len(shown) == 5, result.stderr
    assert "and 3 more kinds of error (3 images); --summary-json lists them all" in (
        result.stderr), result.stderr
    assert len(json.loads(report.read_text())["failures"]["messages"]) == 8
    few = encode(str(folder / "0.png"), str(folder / "1.png"), "--out",
                 str(tmp_path / "f.parquet"), "--weights", str(small_ckpt), "--max-pixels",
                 "100")
    assert few.exit_code == 0 and "more kind" not in few.stderr, few.stderr


@pytest.mark.parametrize("suffix, mode", [(".tar.gz", "w:gz"), (".tgz", "w:gz"),
                                          (".tar.bz2", "w:bz2"), (".tar.xz", "w:xz")])
def test_a_compressed_tar_given_by_name_is_refused_in_one_line(tmp_path, small_ckpt, suffix,
                                                               mode):
    """Never "no images found", an empty output and exit 0: one line that says to
    decompress it, exit 2, nothing written."""
    import tarfile

    image = write_image(tmp_path / "x.png", (20, 20))
    shard = tmp_path / f"shard{suffix}"
    with tarfile.open(shard, mode) as archive:
        archive.add(image, arcname="0001.png")
    out = tmp_path / "e.parquet"
    result = encode(str(shard), "--out", str(out), "--weights", str(small_ckpt))
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "compressed tar shard" in lines[0], result.stderr
    assert "decompress it first" in lines[0] and "Traceback" not in result.output
    assert not out.exists() and not Path(f"{out}.partial").exists()


def test_inputs_given_by_name_without_an_image_are_refused(tmp_path, small_ckpt):
    """Files given by name (and list lines) that hold no image at all are a usage error,
    never an empty success; an empty folder stays a warning (see above)."""
    import io
    import tarfile

    notes = tmp_path / "notes.txt"
    notes.write_text("no image\n")
    sidecars = tmp_path / "meta.tar"  # samples with no image member
    with tarfile.open(sidecars, "w") as archive:
        info = tarfile.TarInfo("0001.json")
        info.size = 2
        archive.addfile(info, io.BytesIO(b"{}"))
    listing = tmp_path / "list.txt"
    listing.write_text(f"{notes}\n")
    for args in ([str(notes)], [str(sidecars)], ["--files-from", str(listing)]):
        out = tmp_path / "e.parquet"
        result = encode(*args, "--out", str(out), "--weights", str(small_ckpt))
        assert result.exit_code == 2, (args, result.output)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "no image in the inputs given" in lines[0], result.stderr
        assert not out.exists()


def test_a_files_from_list_whose_every_path_is_missing(tmp_path, small_ckpt, monkeypatch):
    """The list's paths are relative to the list's folder, the run starts elsewhere: one line
    that says no image could be read and why (paths are taken from the current folder, not
    the list's), exit 2; nothing written."""
    lists = tmp_path / "data"
    for name in ("a.png", "b.png"):
        write_image(lists / "imgs" / name, (20, 20))
    listing = lists / "list.txt"
    listing.write_text("imgs/a.png\nimgs/b.png\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    out = tmp_path / "e.parquet"
    result = encode("--files-from", str(listing), "--out", str(out), "--weights",
                    str(small_ckpt))
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: no image could be read: none of the 2 paths")
    assert f"current folder ({elsewhere})" in lines[0]
    assert f"not from the list's folder ({lists})" in lines[0]
    assert not out.exists()
    monkeypatch.chdir(lists)  # following the hint works
    again = encode("--files-from", str(listing), "--out", str(out), "--weights",
                   str(small_ckpt))
    assert again.exit_code == 0, again.output
    assert pq.read_table(out).column("error").null_count == 2


def test_no_rates_when_nothing_was_encoded(tmp_path, small_ckpt):
    """Every image failed: the summary says nothing was encoded, and gives no img/s."""
    folder = tmp_path / "imgs"
    folder.mkdir()
    whole = write_image(tmp_path / "whole.jpg", (64, 48)).read_bytes()
    for i in range(3):  # headers fine, pixels cut: they fail in the encoding loop
        (folder / f"{i}.jpg").write_bytes(whole[: len(whole) // 3])
    report = tmp_path / "s.json"
    result = encode(str(folder), "--out", str(tmp_path / "e.parquet"), "--weights",
                    str(small_ckpt), "--summary-json", str(report))
    assert result.exit_code == 0, result.output
    loop = next(line for line in result.stderr.splitlines() if "encoding loop" in line)
    assert "nothing was encoded" in loop and "img/s" not in loop, loop
    data = json.loads(report.read_text())
    assert data["images"]["failed"] == 3 and data["images"]["encoded"] == 0
    assert data["rates"] == {"images_per_s": 0.0, "tokens_per_s": 0.0}


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_inspect_of_an_interrupted_run_shows_what_was_committed_and_what_is_left(
        tmp_path, small_ckpt, monkeypatch, kind):
    """A run stopped by SIGTERM after its first part: ``inspect OUT`` (only OUT.partial/
    exists), ``inspect OUT.partial`` and a folder output's ``inspect`` show the committed
    parts, the images done and how many are left; --resume then finishes."""
    folder = tmp_path / "imgs"
    for i in range(13):
        write_image(folder / f"{i:02d}.png", (20 + i, 20))
    signal_after_first_part(monkeypatch)
    out = tmp_path / ("e.parquet" if kind == "file" else "e")
    out_arg = str(out) + ("" if kind == "file" else "/")  # a folder output ends in /
    common = ("--weights", str(small_ckpt), "--part-images", "4")
    stopped = encode(str(folder), "--out", out_arg, *common)
    assert stopped.exit_code == 143, stopped.output
    parts = out.with_name(out.name + ".partial") if kind == "file" else out
    manifest = load_manifest(parts / "_manifest.json")
    done = sum(part["rows"] for part in manifest["parts"].values())
    first = parts_of([f"{i:02d}.png" for i in range(13)], 4)[0][1]  # committed at least
    assert first <= done < 13 and manifest["inputs"] == 13
    wanted = (f"{len(manifest['parts'])} part{'s' if len(manifest['parts']) > 1 else ''}, "
              f"{done} image{'s' if done > 1 else ''} done, {13 - done} of 13 left; rerun "
              "the same command with --resume to finish")
    for target in ([out, parts] if kind == "file" else [out]):
        shown = runner.invoke(app, ["inspect", str(target)], terminal_width=250)
        assert shown.exit_code == 0, shown.output
        text = re.sub(r"[│\s]+", " ", shown.output)  # the table's cells, unwrapped
        assert "an interrupted run: not finished" in text, shown.output
        assert wanted in text, shown.output
        data = json.loads(runner.invoke(app, ["inspect", str(target), "--json"]).output)
        assert data["interrupted"] and (data["parts"], data["images_done"],
                                        data["images_left"]) == (len(manifest["parts"]),
                                                                 done, 13 - done)
    monkeypatch.undo()  # the resume runs unsignalled
    finished = encode(str(folder), "--out", out_arg, *common, "--resume")
    assert finished.exit_code == 0, finished.output
    data = json.loads(runner.invoke(app, ["inspect", str(out), "--json"]).output)
    assert not data["interrupted"] and data["rows"] == 13


def after_first_part(monkeypatch, act) -> None:
    """Make an in-process run call ``act()`` right after its first part is handed to the
    writer (on the encoding loop's thread, the main one): a known point, whatever the speed."""
    original = PartEncoder.run

    def run(self, *args, **kwargs):
        for index, part in enumerate(original(self, *args, **kwargs)):
            yield part
            if index == 0:
                act()

    monkeypatch.setattr(PartEncoder, "run", run)


def one_line(result, code: int) -> str:
    assert result.exit_code == code, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    return lines[0]


def test_a_summary_path_that_cannot_be_made_is_refused_before_the_run(tmp_path, small_ckpt):
    """A --summary-json whose folder is a file, or a link to nothing: one line, exit 2, before
    anything is written (the run would end without the report it was asked for)."""
    image = write_image(tmp_path / "a.png", (20, 20))
    (tmp_path / "s1.json").write_text("{}")
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere" / "deeper")
    out = tmp_path / "e.parquet"
    for summary in (tmp_path / "s1.json" / "x.json", tmp_path / "s1.json" / "d" / "x.json",
                    tmp_path / "gone" / "x.json"):
        line = one_line(encode(str(image), "--out", str(out), "--weights", str(small_ckpt),
                               "--summary-json", str(summary)), 2)
        assert "is not a folder" in line, line
    assert not out.exists() and not (tmp_path / "nowhere").exists()


def test_a_summary_to_standard_output_is_refused(tmp_path, small_ckpt, monkeypatch):
    """--summary-json - reads as standard output (as --files-from - is standard input); it
    wrote a file named '-' in the current folder: one line, exit 2, nothing written."""
    image = write_image(tmp_path / "a.png", (20, 20))
    monkeypatch.chdir(tmp_path)
    line = one_line(encode(str(image), "--out", "e.parquet", "--weights", str(small_ckpt),
                           "--summary-json", "-"), 2)
    assert "--summary-json -" in line and "file" in line, line
    assert sorted(os.listdir(tmp_path)) == ["a.png"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes in any folder")
def test_a_summary_in_a_read_only_folder_is_refused_before_the_run(tmp_path, small_ckpt):
    image = write_image(tmp_path / "a.png", (20, 20))
    locked = tmp_path / "ro"
    locked.mkdir()
    locked.chmod(0o555)
    out = tmp_path / "e.parquet"
    try:
        line = one_line(encode(str(image), "--out", str(out), "--weights", str(small_ckpt),
                               "--summary-json", str(locked / "s.json")), 2)
    finally:
        locked.chmod(0o755)
    assert "cannot be written" in line and not out.exists()


def test_a_summary_that_cannot_be_written_at_the_end_is_one_line(tmp_path, small_ckpt,
                                                                  monkeypatch):
    """The summary's folder became a file while the run went on: the output is complete and
    says so, the missing report is one line (exit 1), never a traceback."""
    folder = tmp_path / "imgs"
    for i in range(6):
        write_image(folder / f"{i}.png", (20 + i, 20))
    reports = tmp_path / "reports"
    after_first_part(monkeypatch, lambda: reports.write_text("not a folder"))
    out = tmp_path / "e.parquet"
    result = encode(str(folder), "--out", str(out), "--weights", str(small_ckpt),
                    "--part-images", "2", "-q", "--summary-json", str(reports / "s.json"))
    line = one_line(result, 1)
    assert f"--summary-json {reports / 's.json'} could not be written" in line, line
    assert f"the output {out} is complete" in line, line
    assert result.stdout.strip() == str(out)
    assert pq.read_table(out).num_rows == 6


def test_a_summary_through_a_link_into_the_output_is_refused(tmp_path, small_ckpt):
    """A --summary-json in a link to the output folder lies in the output: refused before the
    run, so that no foreign file lands there and blocks the next --update."""
    image = write_image(tmp_path / "imgs" / "a.png", (20, 20))
    out = tmp_path / "sy"
    common = (str(image.parent), "--out", f"{out}/", "--weights", str(small_ckpt))
    assert encode(*common).exit_code == 0
    (tmp_path / "syl").symlink_to(out)
    before = sorted(p.name for p in out.iterdir())
    for summary in (tmp_path / "syl" / "summary.json", tmp_path / "syl" / "d" / "s.json"):
        line = one_line(encode(*common, "--update", "--summary-json", str(summary)), 2)
        assert "is the output --out" in line and "lies in it" in line, line
    assert sorted(p.name for p in out.iterdir()) == before
    assert encode(*common, "--update").exit_code == 0


def test_a_second_ctrl_c_writes_the_summary_and_says_what_is_kept(tmp_path, small_ckpt,
                                                                   monkeypatch):
    """Ctrl-C while encoding, then Ctrl-C again (which stops at once): exit 130, a line that
    says the finished parts are kept and how to go on, and --summary-json "interrupted";
    the advised --resume finishes."""
    folder = tmp_path / "imgs"
    for i in range(9):
        write_image(folder / f"{i}.png", (20 + i, 20))

    def twice() -> None:  # each handled before raise_signal returns (the main thread)
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)

    after_first_part(monkeypatch, twice)
    out, report = tmp_path / "e.parquet", tmp_path / "di.json"
    common = (str(folder), "--out", str(out), "--weights", str(small_ckpt), "--part-images",
              "3")
    line = one_line(encode(*common, "-q", "--summary-json", str(report)), 130)
    assert line.startswith("error: interrupted by SIGINT; "), line
    assert f"kept in {out}.partial" in line and "--resume" in line, line
    data = json.loads(report.read_text())
    assert data["status"] == "interrupted" and data["exit_code"] == 130
    assert data["output"] == str(out)
    monkeypatch.undo()
    finished = encode(*common, "--resume")
    assert finished.exit_code == 0, finished.output
    assert pq.read_table(out).num_rows == 9


def test_a_second_ctrl_c_before_the_first_commit_leaves_nothing_behind(tmp_path, small_ckpt,
                                                                       monkeypatch):
    """Two Ctrl-Cs before any part is encoded: exit 130, a line that says nothing was
    committed, no partial folder left, so the same command then runs as it is."""
    folder = tmp_path / "imgs"
    for i in range(4):
        write_image(folder / f"{i}.png", (20 + i, 20))
    original = PartEncoder.run

    def run(self, *args, **kwargs):
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)  # the second stops at once, here
        yield from original(self, *args, **kwargs)

    monkeypatch.setattr(PartEncoder, "run", run)
    out = tmp_path / "e.parquet"
    common = (str(folder), "--out", str(out), "--weights", str(small_ckpt))
    line = one_line(encode(*common, "-q"), 130)
    assert "nothing was committed; rerun the same command" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["imgs"]
    monkeypatch.undo()
    assert encode(*common).exit_code == 0


def test_a_files_from_list_that_is_the_output_is_refused_before_it_is_read(tmp_path,
                                                                          small_ckpt):
    """--files-from naming the output itself: the line says so (exit 1) and the output is
    left as it was; a list that is binary shows its first path escaped, never raw bytes."""
    image = write_image(tmp_path / "a.png", (20, 20))
    out = tmp_path / "dr.parquet"
    assert encode(str(image), "--out", str(out), "--weights", str(small_ckpt)).exit_code == 0
    before = out.read_bytes()
    (tmp_path / "link.parquet").symlink_to(out)
    for listed in (out, tmp_path / "link.parquet"):
        line = one_line(encode("--files-from", str(listed), "--out", str(out), "--weights",
                               str(small_ckpt), "--overwrite"), 1)
        assert f"--out {out} is the input {listed} (the --files-from list)" in line, line
    assert out.read_bytes() == before
    binary = tmp_path / "other.bin"
    binary.write_bytes(b"PAR1\x15\x04\x1b[31m\xa8\xff\nsecond\n")
    line = one_line(encode("--files-from", str(binary), "--out", str(tmp_path / "o.parquet"),
                           "--weights", str(small_ckpt)), 2)
    assert line.isprintable(), line
    assert "(e.g. PAR1\\x15\\x04\\x1b[31m\\xa8\\xff)" in line, line
