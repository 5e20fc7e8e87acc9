"""A store that stops answering: the run ends within a bound that the retry policy sets, with
one line and a non-zero exit, and ``--resume`` finishes once the store is back.

The health record (``storage.StoreHealth``) is tested on a clock of the test's own; the runs
stop a real S3-compatible server of their own (``s3_outage``, tests/objectstore.py) at a
pause point, never at a moment picked by timing."""

from __future__ import annotations

import errno
import http.server
import json
import re
import signal
import socket
import threading
import time
from contextlib import suppress
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from dsv4enc import storage
from dsv4enc.images import decode
from dsv4enc.cli import app
from dsv4enc.images.decode import TRANSIENT_ERRORS

from helpers import Pauses
from objectstore import manifest_parts, noise_images, tiny_run_options

runner = CliRunner()
STORE = "s3://a-bucket"
HANG_GUARD_S = 600  # turns a hung run into a failure; no speed is assumed below it


class Clock:
    """The storage module's clock and sleeps, for a test: time passes only when told."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def wall(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(storage, "time", type("T", (), {"sleep": staticmethod(clock.sleep)}))
    monkeypatch.setattr(storage, "_wall", clock.wall)
    monkeypatch.delenv("DSV4ENC_STORAGE_OUTAGE_S", raising=False)
    storage.reset_health()
    yield clock
    storage.reset_health()


def refused() -> None:
    raise OSError("When reading information for key 'k' in bucket 'b': AWS Error "
                  "NETWORK_CONNECTION during HeadObject operation: curlCode: 7, Could not "
                  "connect to server")


# --------------------------------------------------------------------------- the policy

def test_the_stop_bound_comes_from_the_retry_policy():
    attempt = storage.SDK_ATTEMPTS * (storage.CONNECT_TIMEOUT_S + storage.REQUEST_TIMEOUT_S
                                      + storage.SDK_SLACK_S)
    assert storage.attempt_bound_s({}) == attempt
    bound = storage.stop_bound_s(storage.OUTAGE_S, {})
    assert bound == storage.OUTAGE_S + 3 * attempt
    assert storage.OUTAGE_S <= bound <= 120  # "a minute or two at most" with the defaults
    # the store's own time limits (--storage-option) move it
    assert storage.stop_bound_s(10.0, {"connect_timeout": 2, "request_timeout": 10}) == \
        10.0 + 3 * storage.SDK_ATTEMPTS * (2 + 10 + storage.SDK_SLACK_S)
    shown = runner.invoke(app, ["encode", "--help"], env={"COLUMNS": "250"},
                          terminal_width=250).output
    text = " ".join(shown.replace("│", " ").split())
    assert "--storage-outage-s" in text
    assert f"{storage.stop_bound_s(0.0, {}):g} s of the store's last answer" in text
    assert f"{bound:g} s by default" in text


def test_outage_causes():
    assert storage.outage_cause(OSError("... curlCode: 7, Could not connect to server")) == \
        "connection refused"
    assert storage.outage_cause(ConnectionRefusedError()) == "connection refused"
    assert storage.outage_cause(OSError("AWS Error NETWORK_CONNECTION during GetObject "
                                        "operation: curlCode: 28, Timeout was reached")) == \
        "timed out"
    assert storage.outage_cause(OSError("When reading 'k': AWS Error UNKNOWN (HTTP status "
                                        "503) during GetObject operation")) == \
        "server error (HTTP 503)"
    assert storage.outage_cause(ConnectionResetError("reset by peer")) == "connection lost"
    # answers, however unwelcome: not an outage
    assert storage.outage_cause(FileNotFoundError("s3://b/k: no such object")) is None
    assert storage.outage_cause(OSError("AWS Error ACCESS_DENIED during GetObject")) is None
    assert storage.outage_cause(OSError("AWS Error INVALID_ARGUMENT: bad range")) is None
    # by kind: errno, and a store's answer as botocore reads it
    assert storage.outage_cause(OSError(errno.ECONNREFUSED, "refused")) == "connection refused"
    assert storage.outage_cause(OSError(errno.ETIMEDOUT, "no answer")) == "timed out"
    wrapped = RuntimeError("read failed")
    wrapped.__cause__ = ConnectionResetError()
    assert storage.outage_cause(wrapped) == "connection lost"


# ----------------------------------------------------- the messages of the installed clients

class Busy(http.server.BaseHTTPRequestHandler):
    """Answers every request with S3's 503 SlowDown."""

    def reply(self) -> None:
        body = (b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>SlowDown</Code>"
                b"<Message>Please reduce your request rate.</Message></Error>")
        self.send_response(503)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_HEAD = do_PUT = reply

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def endpoints():
    """Three local endpoints: one that refuses, one that never answers, one that is busy."""
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # the kernel accepts; nothing ever answers
    busy = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Busy)
    thread = threading.Thread(target=busy.serve_forever, daemon=True)
    thread.start()
    yield {"refused": closed.getsockname()[1], "timed out": silent.getsockname()[1],
           "server error": busy.server_address[1]}
    busy.shutdown()
    closed.close()
    silent.close()


def pyarrow_error(port: int) -> OSError:
    import pyarrow.fs as pafs

    fs = pafs.S3FileSystem(access_key="k", secret_key="s", scheme="http",
                           endpoint_override=f"127.0.0.1:{port}", connect_timeout=0.5,
                           request_timeout=0.5,
                           retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=1))
    with pytest.raises(OSError) as raised:
        with fs.open_input_stream("a-bucket/k") as stream:
            stream.read()
    return raised.value


def test_pyarrow_messages_name_their_outage(endpoints):
    """pyarrow's S3 client gives only a message: the fallback reads the installed pyarrow's."""
    assert storage.outage_cause(pyarrow_error(endpoints["refused"])) == "connection refused"
    assert storage.outage_cause(pyarrow_error(endpoints["timed out"])) == "timed out"
    assert storage.outage_cause(pyarrow_error(endpoints["server error"])).startswith(
        "server error")


def test_botocore_answers_are_read_by_their_status(endpoints):
    botocore_session = pytest.importorskip("botocore.session")
    import botocore.config

    client = botocore_session.get_session().create_client(
        "s3", endpoint_url=f"http://127.0.0.1:{endpoints['server error']}", region_name="us-east-1",
        aws_access_key_id="k", aws_secret_access_key="s",
        config=botocore.config.Config(retries={"max_attempts": 1, "mode": "standard"}))
    with pytest.raises(Exception) as raised:
        client.get_object(Bucket="a-bucket", Key="k")
    assert storage.outage_cause(raised.value) == "server error (slow down)"
    busy = storage.ServerError("s3://a-bucket/k: throttled", "server error (throttling)")
    assert storage.outage_cause(busy) == "server error (throttling)"


def test_a_store_that_keeps_failing_is_down_after_the_outage_time(clock):
    storage.set_outage_s(10.0)
    calls: list[float] = []

    def failing() -> None:
        calls.append(clock.now)
        refused()

    with pytest.raises(storage.StoreUnavailable) as info:
        storage.retrying(failing, store=STORE)
    assert len(calls) == storage.ATTEMPTS  # every retry spent first
    assert str(info.value) == f"{storage.UNAVAILABLE}: {STORE}: connection refused"
    assert info.value.since == calls[0]
    storage.check_stores()  # failing for less than --storage-outage-s: not down
    assert storage.failing_store() is not None
    assert storage.retrying(lambda: "ok", store=STORE) == "ok"  # an answer clears it
    assert storage.failing_store() is None
    with pytest.raises(FileNotFoundError):  # a missing object is an answer, not an outage
        storage.retrying(lambda: (_ for _ in ()).throw(FileNotFoundError("gone")), store=STORE)
    assert storage.failing_store() is None

    with pytest.raises(storage.StoreUnavailable):
        storage.retrying(failing, store=STORE)
    clock.now = calls[-storage.ATTEMPTS] + 10.0
    with pytest.raises(storage.StoreDown) as down:
        storage.check_stores()
    line = str(down.value)
    assert line.startswith(f"{STORE}: the store stopped answering (connection refused) for "
                           "10 s;") and "--resume" in line and "\n" not in line
    down.value.keep(3, f"{STORE}/out")
    assert str(down.value).endswith(f"3 finished parts are kept in {STORE}/out; rerun with "
                                    "--resume when it is back")
    # nothing kept: --resume still works (it starts afresh), and the same command may not
    down.value.keep(0, f"{STORE}/out")
    assert str(down.value).endswith("no part was finished; rerun with --resume when it is back")
    down.value.keep(0, f"{STORE}/out", "--update")  # an --update is finished by --update
    assert str(down.value).endswith("rerun with --update when it is back")
    made = len(calls)
    with pytest.raises(storage.StoreUnavailable):  # down: at once, no attempt, no sleep
        storage.retrying(failing, store=STORE)
    assert len(calls) == made and clock.now == calls[-storage.ATTEMPTS] + 10.0
    clock.now += 10.0  # once per --storage-outage-s one attempt goes through: it is back
    assert storage.retrying(lambda: "back", store=STORE) == "back"
    storage.check_stores()
    assert storage.failing_store() is None


@pytest.mark.parametrize("outage", [storage.OUTAGE_S, 10.0])
def test_the_bound_holds_when_every_attempt_takes_the_longest(clock, monkeypatch, outage):
    """Each attempt times out as late as the policy allows; calls are made back to back, as
    the run's threads do. The run's check finds the store down, and the clean-up's calls
    fail at once, within ``stop_bound_s``: with a --storage-outage-s shorter than a call's
    retries too (a call stops retrying once the outage has lasted that long)."""
    monkeypatch.setenv("DSV4ENC_STORAGE_OUTAGE_S", repr(outage))
    attempt = storage.attempt_bound_s({})

    def timing_out() -> None:
        clock.now += attempt
        raise OSError("AWS Error NETWORK_CONNECTION: curlCode: 28, Timeout was reached")

    stopped = clock.now  # the store's last answer
    while True:
        try:
            storage.check_stores()
        except storage.StoreDown:
            break
        with suppress(storage.StoreUnavailable):
            storage.retrying(timing_out, store=STORE)
        assert clock.now - stopped < 10 * storage.stop_bound_s(), "never found down"
    for _ in range(3):  # the clean-up: abandon's sync, its manifest, the lock object
        with pytest.raises(storage.StoreUnavailable):
            storage.retrying(timing_out, store=STORE)
    assert clock.now - stopped <= storage.stop_bound_s(outage, {})


def test_outage_rows_are_transient_and_a_missing_object_is_not(clock):
    url = f"{STORE}/img/a.jpg"
    error, since = decode.read_failure(storage.StoreUnavailable(STORE, "timed out", 5.0), url)
    assert error == f"{storage.UNAVAILABLE}: {STORE}: timed out" and since == 5.0
    assert error.startswith(TRANSIENT_ERRORS)
    # a read of an object already open fails on an outage (not retried): transient too,
    # and the store's health record knows it
    error, since = decode.read_failure(OSError("curlCode: 56, Failure when receiving data"),
                                       url)
    assert error.startswith(TRANSIENT_ERRORS) and since == clock.now
    assert storage.failing_store() is not None
    error, since = decode.read_failure(FileNotFoundError(f"{url}: no such object"), url)
    assert error == f"FileNotFoundError: {url}: no such object" and since is None
    assert not error.startswith(TRANSIENT_ERRORS)
    # what decode workers report feeds the collecting process's record
    storage.reset_health()
    storage.note_row(url, f"{storage.UNAVAILABLE}: {STORE}: timed out", since=clock.now - 70)
    with pytest.raises(storage.StoreDown, match="timed out"):
        storage.check_stores()
    storage.note_row(url, None)
    storage.check_stores()


def test_a_folder_output_s_part_upload_outlasts_a_shorter_outage(s3_outage, clock,
                                                                  monkeypatch):
    """A part uploaded straight to a bucket folder is tried again while the store has failed
    for less than --storage-outage-s (it gave up after one round of retries, a few seconds,
    and ended the run); once the store is down it gives up. The server comes back at a
    point of the test's clock, never at a moment picked by timing."""
    s3, folder = s3_outage, f"{s3_outage.url}/out"
    storage.set_outage_s(30.0)
    back_at = [clock.now + 10.0]  # less than --storage-outage-s

    def sleep(seconds: float) -> None:
        clock.now += seconds
        if clock.now >= back_at[0]:
            back_at[0] = float("inf")
            s3.server.start()

    monkeypatch.setattr(storage, "time", type("T", (), {"sleep": staticmethod(sleep)}))
    s3.server.stop()
    assert storage.upload_written(folder, "part-000000.parquet",
                                  lambda tmp: Path(tmp).write_bytes(b"rows")) == 4
    assert s3.get("out/part-000000.parquet") == b"rows" and back_at == [float("inf")]

    s3.server.stop()  # for good now: the upload gives up once the store is down
    began = clock.now
    with pytest.raises(storage.StoreUnavailable):
        storage.upload_written(folder, "part-000001.parquet",
                               lambda tmp: Path(tmp).write_bytes(b"rows"))
    assert 30.0 <= clock.now - began < 30.0 + 10 * storage.ATTEMPTS


def test_store_down_crosses_ranks_whole():
    import pickle

    exc = storage.StoreDown(STORE, "connection refused", 61.0)
    exc.keep(2, f"{STORE}/o")
    again = pickle.loads(pickle.dumps(exc))
    assert str(again) == str(exc) and again.store == STORE and again.kept == exc.kept


# --------------------------------------------------------------------------- stopping a server

TINY = tiny_run_options()


def output_rows(s3, out: str, tmp_path: Path) -> list[dict]:
    """The rows of an output, local or in the bucket (its objects mirrored first)."""
    if not storage.is_url(out):
        return pq.read_table(out).to_pylist()
    prefix = out.split("://", 1)[1].split("/", 1)[1]
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    for key in s3.keys(prefix):
        name = key[len(prefix):]
        assert "/" not in name and ".dsv4enc.lock" != name, s3.keys(prefix)
        (mirror / name).write_bytes(s3.get(key))
    return [row for part in sorted(mirror.glob("*.parquet"))
            for row in pq.read_table(part).to_pylist()]


@pytest.mark.slow
@pytest.mark.parametrize("where", ["output", "inputs", "both"])
def test_a_store_that_stops_answering_ends_the_run_and_resume_finishes(s3_outage, tmp_path,
                                                                        where):
    """The server stops once the first part is committed (and, for an output in the bucket,
    uploaded): the run ends with one line naming the store and the cause and exit 1, no
    traceback. With the server back on its port, --resume finishes: every image once, the
    rows of a clean run."""
    s3 = s3_outage
    total = 90
    folder, url = noise_images(s3, "in", total, tmp_path)
    inputs = url if where in ("inputs", "both") else str(folder)
    out = f"{s3.url}/out/" if where in ("output", "both") else str(tmp_path / "o.parquet")
    pauses = Pauses(tmp_path / "pauses", "commit")
    began = time.monotonic()
    # The images are small: their header reads would hold them all for the decode, and the
    # run would need the store no more. Held nothing, each decode reads its image.
    proc = pauses.launch("encode", inputs, "--out", out, *TINY, "--workers", "1", "-q",
                         "--storage-outage-s", "2", extra_env={"DSV4ENC_HOLD_BYTES": "0"})
    try:
        pauses.wait("commit", proc=proc, hang_guard_s=HANG_GUARD_S)
        while storage.is_url(out) and not manifest_parts(s3, "out/_manifest.json"):
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            assert time.monotonic() - began < HANG_GUARD_S, "the first part was never uploaded"
            time.sleep(0.01)
        s3.server.stop()
        pauses.release()
        _, stderr = proc.communicate(timeout=HANG_GUARD_S)
    finally:
        proc.kill()
        proc.wait()
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and len(lines) == 1 and "Traceback" not in stderr, stderr
    line = lines[0]
    assert re.match(rf"error: {re.escape(s3.url)}: the store stopped answering \(connection "
                    r"refused\) for \d+ s; ", line), line
    assert "rerun with --resume when it is back" in line, line
    if storage.is_url(out):
        assert f"kept in {s3.url}/out" in line and "staging" not in line, line

    s3.server.start()
    storage.configure(None)  # this process's view of the store starts afresh
    summary = tmp_path / "s.json"
    result = runner.invoke(app, ["encode", inputs, "--out", out, *TINY, "--workers", "1",
                                 "-q", "--resume", "--summary-json", str(summary)])
    assert result.exit_code == 0, result.output
    reused = json.loads(summary.read_text())["images"]["reused"]
    assert 0 < reused < total  # it stopped midway, and kept what it had finished
    clean = tmp_path / "clean.parquet"
    result = runner.invoke(app, ["encode", str(folder), "--out", str(clean), *TINY,
                                 "--workers", "0", "-q"])
    assert result.exit_code == 0, result.output
    got = output_rows(s3, out, tmp_path)
    want = pq.read_table(clean).to_pylist()
    assert sorted(r["path"] for r in got) == [r["path"] for r in want]  # each image once
    by_path = {r["path"]: r for r in got}
    for row in want:
        assert row["error"] is None and by_path[row["path"]]["error"] is None
        assert by_path[row["path"]]["embedding"] == row["embedding"], row["path"]


@pytest.mark.slow
def test_a_signal_during_an_outage_ends_the_run_naming_the_bucket(s3_outage, tmp_path):
    """SIGINT while the store of a folder output is not answering (its writer rides out the
    outage): the run ends, with exit 130 and one line that names where the parts are kept by
    the output's URL, never the staging folder the run wrote in (removed, or of no use to
    --resume), whether the stop finished or the grace ended the process."""
    s3 = s3_outage
    folder, _ = noise_images(s3, "in", 30, tmp_path)
    out = f"{s3.url}/out/"
    pauses = Pauses(tmp_path / "pauses", "encoded")
    proc = pauses.launch("encode", str(folder), "--out", out, *TINY, "--workers", "0", "-q")
    try:
        pauses.wait("encoded", proc=proc, hang_guard_s=HANG_GUARD_S)
        s3.server.stop()
        proc.send_signal(signal.SIGINT)
        pauses.release()
        _, stderr = proc.communicate(timeout=HANG_GUARD_S)
    finally:
        proc.kill()
        proc.wait()
    lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 130 and len(lines) == 1, stderr
    assert "interrupted by SIGINT" in lines[0] and "staging" not in lines[0], lines[0]
    assert f"{s3.url}/out" in lines[0], lines[0]
