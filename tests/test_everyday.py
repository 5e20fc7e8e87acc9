"""Everyday mistakes get a word: an empty input folder, comments in --files-from, a misspelled
config key, a Hub id without network, --help as documented, --resume of a finished output."""

from __future__ import annotations

import json
import logging
import re
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

from helpers import CONFIGS, write_image

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


def test_files_from_comments_and_blank_lines(tmp_path):
    images = [write_image(tmp_path / name, (20, 20)) for name in ("a.png", "#b.png")]
    listing = tmp_path / "list.txt"
    listing.write_text(f"# images for the run\n\n{images[0]}\n   # indented comment\n"
                       f"./{images[1].relative_to(tmp_path)}\n  \r\n")
    assert read_path_list(str(listing)) == [str(images[0]), "./#b.png"]
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
    result = runner.invoke(app, ["encode", "--help"], env={"COLUMNS": "250"},
                           terminal_width=250)
    assert result.exit_code == 0
    text = result.output
    assert "Usage: " in text and "encode [OPTIONS] [INPUTS]..." in text
    assert "<bool>" not in text and "<str>" not in text and "{" not in text.split("\n", 3)[1]
    for flag in ("--overwrite", "--resume", "--random-init", "--shard-output", "--quiet"):
        line = next(line for line in text.splitlines() if flag in line)
        assert not re.search(re.escape(flag) + r"\s+(TEXT|BOOLEAN|<)", line), line
    for choices in ("[none|mean]", "[aligner|vit]", "[float16|float32]",
                    "[auto|float32|bfloat16|float16]", "[auto|flash|varlen|sdpa]",
                    "[data|weights]", "[patches|flops]"):
        assert choices in text, choices
    assert "--log-every" in text and "--summary-json" in text
    inspect = runner.invoke(app, ["inspect", "--help"], terminal_width=200)
    assert re.search(r"inspect \[OPTIONS\] OUTPUT\b", inspect.output), inspect.output
    json_line = next(line for line in inspect.output.splitlines() if "--json" in line)
    assert "BOOLEAN" not in json_line and "<bool>" not in json_line


def test_typer_is_a_version_with_plain_help():
    major, minor = (int(x) for x in typer.__version__.split(".")[:2])
    assert (major, minor) < (0, 26), typer.__version__  # see pyproject.toml


def test_resume_of_a_finished_output_agrees_for_files_and_folders(tmp_path, small_ckpt):
    image = write_image(tmp_path / "imgs" / "x.png", (30, 20))
    common = ("--weights", str(small_ckpt))
    for out in (tmp_path / "one.parquet", tmp_path / "folder/"):
        first = encode(str(image.parent), "--out", str(out), *common)
        assert first.exit_code == 0, first.output
        again = encode(str(image.parent), "--out", str(out), *common, "--resume")
        assert again.exit_code == 0, (out, again.output)
        notes = [line for line in again.stderr.splitlines() if line.startswith("note:")]
        assert len(notes) == 1 and "already complete" in notes[0], again.stderr
        quiet = encode(str(image.parent), "--out", str(out), *common, "--resume", "-q")
        assert quiet.exit_code == 0 and quiet.stderr == "", quiet.output
        assert Path(quiet.stdout.strip()) == Path(out)
