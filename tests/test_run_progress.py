"""Progress, logs and summaries as a long run's user sees them: a bar that moves per batch on a
terminal, plain lines on schedule in a log file, ``-q``, ``--summary-json`` (also when a
signal stops the run), and the error breakdown with example paths."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dsv4enc.cli import app
from dsv4enc.run.progress import ProgressCounts, RunProgress, format_duration

from helpers import CONFIGS, Pauses, parts_of, reaped, signal_after_first_part, write_image

runner = CliRunner()
LINE = re.compile(r"^dsv4enc: images (\d+)/(\d+) \([\d.]+%\), tokens ([\d,]+)/([\d,]+), "
                  r"[\d.]+ img/s, [\d,]+ tokens/s, (\d+) failed, encoding for \d+:\d\d:\d\d, "
                  r"eta (\d+:\d\d:\d\d|-:--:--)$")
N_IMAGES = 12


@pytest.fixture
def folder(tmp_path) -> Path:
    """Twelve small images and one broken one (its header is fine, its pixels are not)."""
    root = tmp_path / "images"
    for i in range(N_IMAGES):
        write_image(root / f"img{i:02d}.png", (40 + 4 * i, 36), "RGB")
    whole = write_image(tmp_path / "whole.jpg", (64, 48)).read_bytes()
    (root / "zz_cut.jpg").write_bytes(whole[: len(whole) // 3])
    return root


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "DSV4ENC_WEIGHTS"}
    env.update(OMP_NUM_THREADS="1", COLUMNS="200")
    return env


def _command(folder: Path, out: Path, ckpt: Path, *extra: str) -> list[str]:
    # --batch-tokens 40: one or two images per batch, so a part takes many batches
    return [sys.executable, "-m", "dsv4enc", "encode", str(folder), "--out", str(out),
            "--weights", str(ckpt), "--device", "cpu", "--workers", "0",
            "--batch-tokens", "40", *extra]


# --------------------------------------------------------------------------- the figures

def test_one_definition_of_each_figure():
    counts = ProgressCounts(total_images=100, total_tokens=1000, reused=10, images=20,
                            tokens=200, failed=2, elapsed=10.0)
    assert counts.images_per_s == 2.0 and counts.tokens_per_s == 20.0
    assert counts.eta_s == 40.0  # 800 tokens to go at 20 tokens/s
    assert counts.line() == ("images 30/100 (30.0%), tokens 200/1,000, 2.0 img/s, "
                             "20 tokens/s, 2 failed, encoding for 0:00:10, eta 0:00:40")
    # no token seen yet (only failures): the ETA comes from images
    assert ProgressCounts(total_images=10, images=2, elapsed=1.0).eta_s == 4.0
    assert ProgressCounts(total_images=10).eta_s is None
    assert format_duration(None) == "-:--:--" and format_duration(3725) == "1:02:05"


def test_the_token_total_grows_window_by_window():
    """The plan is made a window at a time: until the last window is planned, the token
    total is of the windows planned so far (shown with a +) and the ETA counts images."""
    progress = RunProgress("off")
    progress.start(total=100, done=10)
    progress.plan_tokens(600)
    progress.advance(20, 200, 2)
    counts = progress.snapshot()
    counts.elapsed = 10.0
    assert counts.total_tokens == 600 and not counts.tokens_known
    assert counts.eta_s == 35.0  # 70 images to go at 2 img/s, not 400 tokens at 20 tokens/s
    assert "tokens 200/600+," in counts.line()
    progress.plan_tokens(400, last=True)
    counts = progress.snapshot()
    counts.elapsed = 10.0
    assert counts.tokens_known and counts.eta_s == 40.0
    assert "tokens 200/1,000," in counts.line()


def test_the_bar_fits_an_80_column_terminal_without_wrapping_a_figure(monkeypatch):
    """On a terminal of 80 columns the bar is one line each time it is drawn: the figures
    that do not fit whole are left out, the most telling (images, ETA, rate) kept."""
    import io

    from rich.console import Console

    from dsv4enc.run import progress as progress_module
    from dsv4enc.run.progress import fitted

    fields = ["1,234/123,456 images", "eta 1:02:03", "12.5 img/s", "45,678 tokens/s"]
    assert fitted(fields, 80) == "  ".join(fields)
    assert fitted(fields, 45) == "1,234/123,456 images  eta 1:02:03  12.5 img/s"
    assert fitted(fields, 44) == "1,234/123,456 images  eta 1:02:03"
    screen = io.StringIO()
    monkeypatch.setattr(progress_module, "stderr_console",
                        Console(file=screen, width=80, force_terminal=True, color_system=None))
    with RunProgress("bar") as progress:
        progress.start(total=123_456, tokens=98_765_432)
        progress.begin_encoding()
        progress.advance(1_234, 456_789, 12)
    drawn = [re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", line).rstrip()
             for line in re.split(r"[\r\n]", screen.getvalue())]
    drawn = [line for line in drawn if line]
    assert drawn and all(len(line) <= 80 for line in drawn)
    # every line drawn is a whole bar: none starts with the wrapped rest of a figure
    assert all(line.startswith(("starting", "encoding")) for line in drawn), drawn
    assert "1234/123456 images  eta " in drawn[-1]


def test_log_lines_come_on_schedule(capsys):
    progress = RunProgress("log", log_every=0.05)
    began = time.perf_counter()
    printed = ""
    with progress:
        progress.start(total=10, tokens=100)
        progress.begin_encoding()
        for _ in range(10):
            progress.advance(1, 10, 0)
            time.sleep(0.04)
        # Lines keep coming while the run goes on (however late a loaded machine wakes the
        # ticker): wait for three, with a guard against a ticker that never prints.
        deadline = time.monotonic() + 600
        while printed.count("\n") < 3:
            assert time.monotonic() < deadline, printed
            time.sleep(0.01)
            printed += capsys.readouterr().err
    seconds = time.perf_counter() - began
    lines = (printed + capsys.readouterr().err).splitlines()
    assert all(LINE.match(line) for line in lines), lines
    # never more than one line per 0.05 s, then the line where the run ended
    assert 3 <= len(lines) - 1 <= seconds / 0.05 + 1, (len(lines), seconds)
    assert LINE.match(lines[-1]).group(1, 3) == ("10", "100")


def test_off_prints_nothing_and_a_short_logged_run_prints_where_it_ended(capsys):
    """``off`` (``-q``, other ranks) prints nothing; a log run that ends before its first
    scheduled line still prints the line where it ended, as the README says."""
    for mode in ("off", "log"):
        progress = RunProgress(mode, log_every=3600)  # no scheduled line comes in this test
        with progress:
            progress.start(total=2, tokens=20)
            progress.begin_encoding()
            progress.advance(2, 20, 0)
        err = capsys.readouterr().err
        if mode == "off":
            assert err == ""
        else:
            lines = err.splitlines()
            assert len(lines) == 1 and LINE.match(lines[0]).group(1, 2, 3) == ("2", "2", "20"), err
    with RunProgress("log", log_every=3600):  # stopped before encoding: no progress line
        pass
    assert capsys.readouterr().err == ""


def test_a_log_file_gets_progress_lines(folder, tmp_path, small_ckpt):
    """stderr is a pipe (nohup, SLURM): plain lines every --log-every seconds, the last one
    where the run ended."""
    out = tmp_path / "e.parquet"
    proc = subprocess.run(_command(folder, out, small_ckpt, "--log-every", "0.01"),
                          capture_output=True, text=True, env=_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("dsv4enc: images")]
    assert lines, proc.stderr
    assert all(LINE.match(line) for line in lines), lines
    done, total, tokens, total_tokens, failed, _ = LINE.match(lines[-1]).groups()
    assert (int(done), int(total), int(failed)) == (N_IMAGES + 1, N_IMAGES + 1, 1)
    # the broken image's header was fine: its planned tokens leave the total when it fails
    assert tokens == total_tokens
    assert "\x1b[" not in proc.stderr  # no terminal control codes in a log


def _run_in_pty(cmd: list[str]) -> tuple[int, str]:
    """Run ``cmd`` with stderr on a pseudo-terminal; return (exit code, what it drew)."""
    import pty

    master, slave = pty.openpty()
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=slave, env=_env(), close_fds=True)
    os.close(slave)
    chunks = []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.5)
        if ready:
            try:
                data = os.read(master, 65536)
            except OSError:  # the terminal closed: the process ended
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    os.close(master)
    code = proc.wait(timeout=60)
    return code, b"".join(chunks).decode(errors="replace")


def test_the_bar_advances_per_batch(folder, tmp_path, small_ckpt):
    """All images sit in one part; the bar must not wait for it to show progress."""
    code, drawn = _run_in_pty(_command(folder, tmp_path / "e.parquet", small_ckpt))
    assert code == 0, drawn[-3000:]
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", drawn)
    seen = {int(n) for n in re.findall(rf"(\d+)/{N_IMAGES + 1} images", plain)}
    assert N_IMAGES + 1 in seen, plain[-2000:]
    between = {n for n in seen if 0 < n < N_IMAGES + 1}
    assert len(between) >= 3, (sorted(seen), plain[-2000:])
    assert "tokens/s" in plain and "eta" in plain


# --------------------------------------------------------------------------- -q, summaries

def encode_in_process(*args: str):
    return runner.invoke(app, ["encode", *args, "--device", "cpu", "--workers", "0"],
                         env={"DSV4ENC_WEIGHTS": None, "COLUMNS": "200"})


def test_quiet_prints_only_the_output_path(folder, tmp_path, small_ckpt):
    out = tmp_path / "e.parquet"
    result = encode_in_process(str(folder), "--out", str(out), "--weights", str(small_ckpt),
                               "-q", "--log-every", "0.001")
    assert result.exit_code == 0, result.output
    assert result.stdout == f"{out}\n" and result.stderr == ""
    empty = tmp_path / "empty"
    empty.mkdir()
    result = encode_in_process(str(empty), "--out", str(tmp_path / "none.parquet"), "--weights",
                               str(small_ckpt), "-q")
    # an empty run is no error, but -q never hides that nothing was found
    assert result.exit_code == 0 and "no images found" in result.stderr
    # errors still show
    result = encode_in_process(str(folder), "--out", str(out), "--weights", str(small_ckpt),
                               "-q")
    assert result.exit_code == 1 and "error:" in result.stderr and result.stdout == ""


@pytest.mark.parametrize("every", ["inf", "1e300"])
def test_a_log_every_past_what_a_wait_takes_prints_only_where_the_run_ended(folder, tmp_path,
                                                                           small_ckpt, every,
                                                                           monkeypatch):
    """``--log-every inf`` (no scheduled line, only the last): the ticker's wait failed in a
    traceback (OverflowError: timestamp out of range) as soon as it started."""
    failed = []
    monkeypatch.setattr(threading, "excepthook", failed.append)  # where a thread's error goes
    result = encode_in_process(str(folder), "--out", str(tmp_path / "e.parquet"), "--weights",
                               str(small_ckpt), "--log-every", every)
    assert result.exit_code == 0, result.output
    assert not failed and "Traceback" not in result.stderr, (failed, result.stderr)
    progress = [line for line in result.stderr.splitlines() if LINE.match(line)]
    assert len(progress) == 1 and LINE.match(progress[0]).group(1, 2) == ("13", "13"), progress


def test_summary_json_and_error_breakdown(folder, tmp_path, small_ckpt):
    for i in range(3):  # three more of the same failure, one of another kind
        (folder / f"zz_cut{i}.jpg").write_bytes((folder / "zz_cut.jpg").read_bytes())
    (folder / "zzz_noise.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    out, report = tmp_path / "e.parquet", tmp_path / "logs" / "summary.json"
    result = encode_in_process(str(folder), "--out", str(out), "--weights", str(small_ckpt),
                               "--summary-json", str(report))
    assert result.exit_code == 0, result.output
    data = json.loads(report.read_text())
    assert data["status"] == "completed" and data["exit_code"] == 0
    assert data["output"] == str(out)
    assert {k: data["images"][k] for k in ("encoded", "failed", "skipped_not_images",
                                           "reused")} == {"encoded": N_IMAGES, "failed": 5,
                                                          "skipped_not_images": 0, "reused": 0}
    assert data["tokens"] > 0 and data["seconds"]["wall"] >= data["seconds"]["encoding"] > 0
    assert data["rates"]["images_per_s"] == pytest.approx(
        (N_IMAGES + 5) / data["seconds"]["encoding"])
    messages = data["failures"]["messages"]
    assert [m["count"] for m in messages] == sorted((m["count"] for m in messages), reverse=True)
    top = messages[0]
    assert top["count"] == 4 and top["example"] in {"zz_cut.jpg"} | {
        f"zz_cut{i}.jpg" for i in range(3)}
    assert sum(t["count"] for t in data["failures"]["by_type"].values()) == 5
    # the table names the commonest message with an example path
    text = re.sub(r"[│\s]+", " ", result.stderr)
    assert f"4 x {top['message']} (e.g. {top['example']})" in text, result.stderr
    assert "wall time" in text and "img/s" in text and "tokens/s" in text


def test_summary_json_when_a_signal_stops_the_run(folder, tmp_path, small_ckpt, monkeypatch):
    signal_after_first_part(monkeypatch)
    out, report = tmp_path / "e.parquet", tmp_path / "summary.json"
    result = encode_in_process(str(folder), "--out", str(out), "--weights", str(small_ckpt),
                               "--part-images", "4", "--summary-json", str(report))
    assert result.exit_code == 143, result.output
    data = json.loads(report.read_text())
    assert data["status"] == "interrupted" and data["exit_code"] == 143
    keys = sorted(p.name for p in folder.iterdir())
    first = parts_of(keys, 4)[0][1]  # the first part's images (it was committed)
    assert first <= data["images"]["encoded"] + data["images"]["failed"] < N_IMAGES + 1


def test_a_stopped_runs_summary_counts_what_it_kept(folder, tmp_path, small_ckpt,
                                                   monkeypatch):
    """A signal after the first part: the batch begun after it is dropped, so the summary's
    tokens are those of the rows kept (the progress line's definition, not the tokens handed
    to the engine), its rates are over them, and the model's seconds so far are reported."""
    from dsv4enc import read_embeddings

    signal_after_first_part(monkeypatch, signal.SIGINT)
    out, report = tmp_path / "out", tmp_path / "summary.json"
    result = encode_in_process(str(folder), "--out", f"{out}/", "--weights", str(small_ckpt),
                               "--part-images", "4", "--summary-json", str(report))
    assert result.exit_code == 130, result.output
    data = json.loads(report.read_text())
    kept = list(read_embeddings(out, errors="include", columns=["vit_h", "vit_w", "error"]))
    assert data["images"]["encoded"] + data["images"]["failed"] == len(kept) < N_IMAGES + 1
    assert data["tokens"] == sum(r["vit_h"] * r["vit_w"] for r in kept if r["error"] is None)
    assert data["rates"]["tokens_per_s"] == pytest.approx(
        data["tokens"] / data["seconds"]["encoding"])
    assert 0 < data["seconds"]["model"] <= data["seconds"]["encoding"]
    shown = re.findall(r"^dsv4enc: images \d+/\d+ .*, tokens ([\d,]+)/", result.stderr, re.M)
    assert shown and int(shown[-1].replace(",", "")) == data["tokens"], result.stderr


def test_a_run_stopped_mid_part_ends_its_progress_at_the_summary_s_count(folder, tmp_path,
                                                                         small_ckpt):
    """A signal while the first segment is encoded: the run stops before the next one is
    committed, whose unreadable images (each image has a twin whose header does not read,
    counted as a segment starts) the progress had counted. The last progress line (printed
    as the run stops) claims no image done that the summary does not count as written."""
    for i in range(N_IMAGES):
        (folder / f"img{i:02d}b.png").write_bytes(b"not a png")
    out, report = tmp_path / "e.parquet", tmp_path / "summary.json"
    pauses = Pauses(tmp_path / "pauses", "encoded")
    command = _command(folder, out, small_ckpt, "--part-images", str(4 * N_IMAGES),
                       "--log-every", "3600", "--summary-json", str(report))[3:]
    with reaped(pauses.launch(*command, extra_env={"COLUMNS": "200"})) as proc:
        facts = pauses.wait("encoded", proc=proc)
        assert 0 < facts["done"] < 2 * N_IMAGES + 1, facts  # the progress counted a batch
        proc.send_signal(signal.SIGTERM)
        pauses.release()
        _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 143, stderr
    data = json.loads(report.read_text())
    written = data["images"]["encoded"] + data["images"]["failed"] + data["images"]["reused"]
    assert 0 < written < 2 * N_IMAGES + 1, data["images"]
    # the totals may still be growing (``+``): the last window was not planned
    shown = re.findall(r"^dsv4enc: images (\d+)/\d+.*, tokens ([\d,]+)/.*, (\d+) failed,",
                       stderr, re.M)
    assert shown, stderr
    done, tokens, failed = shown[-1]
    assert (int(done), int(tokens.replace(",", "")), int(failed)) == (
        written, data["tokens"], data["images"]["failed"]), stderr


def test_summary_json_of_a_run_stopped_before_encoding(tmp_path):
    """A signal during discovery or model loading: the JSON still says what happened."""
    from dsv4enc.cli import write_stopped_summary
    from dsv4enc.errors import Interrupted

    report = tmp_path / "summary.json"
    write_stopped_summary(str(report), Interrupted(signal.SIGTERM, "rerun"), "e.parquet",
                          "interrupted")
    data = json.loads(report.read_text())
    assert data["status"] == "interrupted" and data["exit_code"] == 143
    assert data["output"] == "e.parquet" and data["images"]["encoded"] == 0
    assert data["rates"] == {"images_per_s": 0.0, "tokens_per_s": 0.0}
    assert "error" not in data


def test_summary_json_of_a_setup_error(tmp_path):
    """A run that fails to set up writes ``{"status": "error", ...}`` with its one line (and
    its exit code) for a pipeline to read; the run's own line on stderr is as without it."""
    report = tmp_path / "reports" / "summary.json"
    out = tmp_path / "e.parquet"
    out.write_bytes(b"not dsv4enc's")
    result = CliRunner().invoke(app, ["encode", str(tmp_path / "missing"), "--out", str(out),
                                      "--config", str(CONFIGS / "tiny.json"),
                                      "--random-init", "--summary-json", str(report)])
    assert result.exit_code == 2 and "input not found" in result.output
    data = json.loads(report.read_text())
    assert data["status"] == "error" and data["exit_code"] == 2
    assert data["error"].startswith("input not found") and data["images"]["encoded"] == 0
    image = write_image(tmp_path / "a.png", (20, 20))
    result = CliRunner().invoke(app, ["encode", str(image), "--out", str(out), "--config",
                                      str(CONFIGS / "tiny.json"), "--random-init",
                                      "--summary-json", str(report)])
    assert result.exit_code == 1, result.output
    data = json.loads(report.read_text())
    assert data["status"] == "error" and data["exit_code"] == 1
    assert "choose another --out" in data["error"] and data["output"] == str(out)
