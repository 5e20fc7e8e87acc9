"""``dsv4enc encode --engine ray`` against a real local Ray on the CPU: the local run's rows
(every image once, the same bytes and metadata) from folders, tars and tables; a driver
killed after its first commit and then ``--resume``d gives each image once; an encoder actor
killed mid-run loses and doubles nothing; a cluster that cannot be joined, a signal and
actors the cluster cannot hold end the run in one line. Runs stop at pause points the test
controls (``helpers.Pauses``) or at a line the run prints, never at a time it guesses."""

from __future__ import annotations

import io
import json
import os
import queue
import signal
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dsv4enc.output.files import MANIFEST_NAME
from dsv4enc.process import available_cpus

from helpers import Pauses, reaped, write_image

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

SPECS = [("a.jpg", (64, 48), "RGB"), ("b.png", (30, 90), "RGBA"), ("c.png", (120, 12), "L"),
         ("d/e.gif", (50, 50), "P"), ("d/f.bmp", (17, 33), "RGB"), ("g.webp", (200, 20), "RGB"),
         ("h.jpg", (80, 60), "RGB"), ("i.png", (40, 40), "RGB"), ("j.jpg", (33, 77), "RGB")]

#: The test cluster is this machine's alone: no token to hand around.
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled"}
#: A process that owns a small local Ray (2 CPUs, a 200 MB object store, no dashboard) and
#: prints its address; the cluster ends with it.
CLUSTER = """
import sys, time, ray
ray.init(address="local", num_cpus=2, object_store_memory=200 << 20,
         include_dashboard=False, log_to_driver=False)
print(ray.get_runtime_context().gcs_address, flush=True)
sys.stdin.read()
"""


@pytest.fixture(scope="module")
def cluster():
    """The address of a local Ray the commands join (``--ray-address``)."""
    proc = subprocess.Popen([sys.executable, "-c", CLUSTER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=ENV)
    address = proc.stdout.readline().strip()
    assert address, "the local Ray did not start"
    yield address
    proc.stdin.close()  # its script ends: ray.shutdown at exit stops the cluster
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> list[str]:
    """A folder (bad images included), a tar shard and a Parquet table of image bytes."""
    root = tmp_path_factory.mktemp("rayengine")
    folder = root / "images"
    for rel, size, mode in SPECS:
        write_image(folder / rel, size, mode)
    (folder / "d" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")
    (folder / "k.jpg").write_bytes((folder / "a.jpg").read_bytes()[:200])
    (folder / "l.png").write_bytes((folder / "a.jpg").read_bytes())  # a JPEG: misnamed
    shard = root / "shard.tar"
    with tarfile.open(shard, "w") as tar:
        for i, size in enumerate([(70, 50), (20, 100)]):
            data = io.BytesIO()
            write_image(root / f"t{i}.png", size)
            data = (root / f"t{i}.png").read_bytes()
            info = tarfile.TarInfo(f"{i:04d}.png")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
            caption = tarfile.TarInfo(f"{i:04d}.txt")  # a sidecar --keep-member carries
            caption.size = len(f"caption {i}")
            tar.addfile(caption, io.BytesIO(f"caption {i}".encode()))
    write_image(root / "cell.jpg", (45, 45))
    table = pa.table({"image": [(root / "cell.jpg").read_bytes(), b"not an image"],
                      "id": ["cell-0", "cell-1"]})
    pq.write_table(table, root / "table.parquet")
    return [str(folder), str(shard), str(root / "table.parquet")]


def command(inputs, out, ckpt, *extra) -> list[str]:
    return [sys.executable, "-m", "dsv4enc", "encode", *inputs, "--out", str(out),
            "--weights", str(ckpt), "--device", "cpu", "--dtype", "float32", "-q",
            "--key-column", "id", "--keep-member", "txt", "--part-images", "3", *extra]


def run(args, env=None, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(args, capture_output=True, text=True, env=env or ENV, timeout=900,
                            **kwargs)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def ray_args(address: str, *extra: str) -> list[str]:
    return ["--engine", "ray", "--ray-address", address, *extra]


def rows_of(out: Path) -> list[dict]:
    return pq.read_table(out).to_pylist()


@pytest.fixture(scope="module")
def local(inputs, small_ckpt, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("rayengine_local") / "emb.parquet"
    run(command(inputs, out, small_ckpt))
    return out


def test_ray_engine_writes_the_local_runs_output(cluster, inputs, small_ckpt, local,
                                                 tmp_path):
    out = tmp_path / "emb.parquet"
    summary = tmp_path / "summary.json"
    run(command(inputs, out, small_ckpt, *ray_args(cluster, "--summary-json", str(summary))))
    want, got = rows_of(local), rows_of(out)
    assert len({r["path"] for r in got}) == len(got) == len(want)  # every image once
    assert got == want  # in order, the same bytes (float16 cells) and error texts
    assert pq.read_schema(out).metadata == pq.read_schema(local).metadata
    errors = {r["path"] for r in got if r["error"]}
    assert {"d/broken.png", "k.jpg", "cell-1"} <= errors
    assert [r["txt"] for r in got if "shard.tar/" in r["path"]] == ["caption 0", "caption 1"]
    report = json.loads(summary.read_text())
    done = report["images"]
    assert done["encoded"] + done["failed"] == len(want)
    # the tokens of the rows kept, as the local engine counts them
    assert report["tokens"] == sum(r["vit_h"] * r["vit_w"] for r in got if r["error"] is None)
    assert done["misnamed"] == 1 and report["misnamed_example"] == "l.png is JPEG"
    # a folder output: parts and a manifest that read_embeddings and inspect read
    from dsv4enc import read_embeddings

    folder = tmp_path / "emb"
    run(command(inputs, str(folder) + "/", small_ckpt, *ray_args(cluster)))
    assert (folder / MANIFEST_NAME).is_file()
    read = {path: emb for path, emb, _ in read_embeddings(folder, errors="include")}
    assert sorted(read) == sorted(r["path"] for r in want)
    inspect = run([sys.executable, "-m", "dsv4enc", "inspect", str(folder), "--json"])
    assert json.loads(inspect.stdout)["rows"] == len(want)


@pytest.fixture
def ray_temp():
    """A private temp folder for Ray (``RAY_TMPDIR``), short enough for Ray's socket paths,
    so that a test's address file never touches a real one."""
    folder = Path(tempfile.mkdtemp(prefix="dsv4ray", dir="/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_a_local_ray_started_for_the_run(inputs, small_ckpt, local, tmp_path, ray_temp):
    """No --ray-address and no RAY_ADDRESS: the command starts its own Ray and stops it, even
    where an earlier Ray left its address file behind (``ray.init()`` would try to join that
    dead cluster); and under -q nothing of Ray's reaches stderr (no token notice: the
    authentication mode is left unset, the token goes to a private home)."""
    (ray_temp / "ray").mkdir()
    (ray_temp / "ray" / "ray_current_cluster").write_text("127.0.0.1:9")  # nothing listens
    env = {k: v for k, v in ENV.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    env.update(RAY_TMPDIR=str(ray_temp), HOME=str(ray_temp))
    out = tmp_path / "emb.parquet"
    result = run(command(inputs, out, small_ckpt, "--engine", "ray",
                         "--ray-object-store-mb", "200"), env=env)
    assert rows_of(out) == rows_of(local)
    assert result.stderr == "" and result.stdout.strip() == str(out)


def test_a_killed_driver_resumes_exactly_once(cluster, inputs, small_ckpt, local, tmp_path):
    """SIGKILL once the first part is committed; --resume --engine ray finishes the run,
    reusing the committed part, with each image once and the local run's rows."""
    out = tmp_path / "emb.parquet"
    pauses = Pauses(tmp_path / "pauses", "commit")
    args = command(inputs, out, small_ckpt, *ray_args(cluster), "--commit-every", "0.001")
    proc = subprocess.Popen(args, env=pauses.env(ENV), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    with reaped(proc):
        committed = pauses.wait("commit", 1, proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    assert not out.exists()
    summary = tmp_path / "summary.json"
    run(args + ["--resume", "--summary-json", str(summary)])
    done = json.loads(summary.read_text())["images"]
    assert done["reused"] >= committed["end"] - committed["start"] > 0
    got = rows_of(out)
    assert len({r["path"] for r in got}) == len(got)
    assert got == rows_of(local)


def kill_the_first_actor_at(point: str, argv: list, tmp_path, check=lambda: None) -> str:
    """Run ``argv``, SIGKILL the first actor that pauses at ``point`` (after ``check``),
    let the restarted actor and the rest go on, and require the run to succeed; returns
    what it printed on stdout."""
    pauses = Pauses(tmp_path / "pauses", point)
    proc = subprocess.Popen(argv, env=pauses.env(ENV), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    with reaped(proc):
        first = pauses.wait(point, 1, proc)
        check()
        os.kill(first["pid"], signal.SIGKILL)
        pauses.release()  # the restarted actor, and every later call, go on
        stdout, stderr = proc.communicate(timeout=900)
        assert proc.returncode == 0, stderr[-3000:]
        return stdout


def test_a_killed_actor_loses_and_doubles_nothing(cluster, inputs, small_ckpt, local,
                                                  tmp_path):
    """The actor is SIGKILLed as it starts its first segment: Ray restarts it and retries
    the call; the output holds every image once, the local run's rows. Under -q, Ray's
    messages about the dead worker and the retried call stay off stdout: only the path."""
    out = tmp_path / "emb.parquet"
    stdout = kill_the_first_actor_at(
        "segment", command(inputs, out, small_ckpt, *ray_args(cluster)), tmp_path)
    assert stdout == f"{out}\n"
    got = rows_of(out)
    assert len({r["path"] for r in got}) == len(got)
    assert got == rows_of(local)


def test_an_actor_killed_after_writing_its_part_commits_nothing_twice(
        cluster, inputs, small_ckpt, local, tmp_path):
    """A folder output: the actor writes its first part (under a temporary name) and is
    SIGKILLed before it reports; the retried call writes the part again and only that one
    is committed. Every image once, the local run's rows, no temporary left."""
    out = tmp_path / "emb"

    def staged_not_committed() -> None:
        assert any(name.endswith(".tmp") for name in os.listdir(out))

    kill_the_first_actor_at("written", command(inputs, str(out) + "/", small_ckpt,
                                               *ray_args(cluster)), tmp_path,
                            staged_not_committed)
    got = pq.read_table(out).to_pylist()
    assert len({r["path"] for r in got}) == len(got)
    assert got == rows_of(local)
    assert not [name for name in os.listdir(out) if name.endswith(".tmp")]
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert sorted(p["file"] for p in manifest["parts"].values()) == sorted(
        name for name in os.listdir(out) if name.endswith(".parquet"))


@pytest.mark.parametrize("folder", [True, False], ids=["folder", "file"])
def test_actors_write_their_parts_to_a_bucket(s3, inputs, small_ckpt, local, tmp_path, folder):
    """A bucket --out (the local S3 server): the actors upload their parts themselves, the
    driver commits the manifest; a folder keeps exactly the parts it lists, a single file
    is the only object left. The local run's rows either way."""
    url = f"{s3.url}/emb/" if folder else f"{s3.url}/emb.parquet"
    env = {**ENV, **s3.server.env()}
    env.pop("RAY_ADDRESS", None)  # a local Ray started by the run: it has this environment
    run(command(inputs, url, small_ckpt, "--engine", "ray", "--ray-object-store-mb", "200"),
        env=env)
    keys = s3.keys()
    if folder:
        manifest = json.loads(s3.get(f"emb/{MANIFEST_NAME}"))
        listed = sorted(f"emb/{p['file']}" for p in manifest["parts"].values())
        assert sorted(k for k in keys if k.endswith(".parquet")) == listed
        got = []
        for key in listed:
            (tmp_path / "part.parquet").write_bytes(s3.get(key))
            got += rows_of(tmp_path / "part.parquet")
    else:
        assert keys == ["emb.parquet"]
        (tmp_path / "got.parquet").write_bytes(s3.get("emb.parquet"))
        got = rows_of(tmp_path / "got.parquet")
    assert got == rows_of(local)


def one_error_line(stderr: str) -> str:
    """The run's only line on stderr, which must be its error."""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr[-3000:]
    return lines[0]


def test_an_address_where_nothing_answers_is_one_line(inputs, small_ckpt, tmp_path):
    """Nothing listens at --ray-address (a port bound, never listening): one line, exit 1,
    at once, rather than Ray's retries for minutes."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        result = subprocess.run(command(inputs, tmp_path / "emb.parquet", small_ckpt,
                                        *ray_args(address)),
                                capture_output=True, text=True, env=ENV, timeout=300)
    assert result.returncode == 1, result.stderr[-3000:]
    assert f"cannot join the Ray cluster at {address}" in one_error_line(result.stderr)
    assert result.stdout == ""


def test_a_ray_that_fails_to_import_is_one_line(inputs, small_ckpt, tmp_path):
    """Ray installed but broken (its import raises: a missing library, a version clash):
    one line naming the cause, exit 2, as when Ray is not installed; no traceback."""
    fake = tmp_path / "site" / "ray"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('raise ImportError("libray.so: cannot open it")\n')
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(fake.parent),
                                                 ENV.get("PYTHONPATH", "")])}
    result = subprocess.run(command(inputs, tmp_path / "emb.parquet", small_ckpt,
                                    "--engine", "ray"),
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    line = one_error_line(result.stderr)
    assert "needs Ray" in line and "libray.so: cannot open it" in line


def test_weights_the_actors_cannot_load_are_the_local_runs_line(cluster, inputs, tmp_path):
    """--weights that is no checkpoint: the local run's line, not "an encoder actor died 5
    times (...WeightsError...); finished parts are kept: rerun with --resume" (the actor's
    set-up raised; no part was begun, and a --resume fails alike)."""
    result = subprocess.run(command(inputs, tmp_path / "emb.parquet", tmp_path / "none",
                                    *ray_args(cluster)),
                            capture_output=True, text=True, env=ENV, timeout=600)
    assert result.returncode == 1, result.stderr[-3000:]
    assert one_error_line(result.stderr) == f"error: weights folder not found: {tmp_path}/none"


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_ray_starts_ends_its_start(monkeypatch, caplog, signum):
    """Ray's start of a local cluster catches any Exception (its dashboard's wait logs it and
    goes on): a signal there was the run's Interrupted, caught, logged by Ray as a second
    line, and the start went on for seconds (past the forced exit on a loaded machine). The
    start now ends at the signal, unlogged, as the run's Interrupted."""
    from dsv4enc.errors import Interrupted
    from dsv4enc.run.ray_engine import RayCluster, RayEngineOptions
    from dsv4enc.run.stopping import StopSignals

    went_on = []

    def init(**kwargs):  # as ray._private.services.start_api_server waits for the dashboard
        try:
            signal.raise_signal(signum)  # (the handler runs before this returns)
            went_on.append(True)
        except Exception as exc:
            ray_logger.error(exc)
        went_on.append(True)

    ray_logger = __import__("logging").getLogger("ray._private.services")
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    stop = StopSignals()
    stop.install()
    try:
        with pytest.raises(Interrupted) as stopped:
            RayCluster(RayEngineOptions(), stop)
    finally:
        stop.restore()
    assert stopped.value.exit_code == 128 + signum
    assert not went_on and not caplog.records


def test_sigterm_stops_the_driver_as_the_local_engine(cluster, inputs, small_ckpt, tmp_path):
    """SIGTERM while an actor encodes (paused as it starts its first segment): exit 143, one
    line, and a --summary-json, as the local engine stops (ray.init's own SIGTERM handler
    does not stay in place of the run's)."""
    out, summary = tmp_path / "emb.parquet", tmp_path / "summary.json"
    pauses = Pauses(tmp_path / "pauses", "segment")
    proc = subprocess.Popen(command(inputs, out, small_ckpt, *ray_args(cluster),
                                    "--summary-json", str(summary)),
                            env=pauses.env(ENV), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        pauses.wait("segment", 1, proc)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        pauses.release()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, stderr[-3000:]
    assert "interrupted by SIGTERM" in one_error_line(stderr)
    assert stdout == ""
    report = json.loads(summary.read_text())
    assert report["status"] == "interrupted" and report["exit_code"] == 143


def test_actors_a_local_ray_cannot_hold_are_refused(inputs, small_ckpt, tmp_path, ray_temp):
    """A Ray started for the run never grows: more actors than its CPUs is one line, exit 2."""
    env = {k: v for k, v in ENV.items() if k != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=str(ray_temp))
    actors = str(available_cpus() + 1)
    result = subprocess.run(command(inputs, tmp_path / "emb.parquet", small_ckpt, "--engine",
                                    "ray", "--ray-object-store-mb", "200",
                                    "--ray-actors", actors),
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"{actors} encoder actors need" in one_error_line(result.stderr)


def test_a_joined_cluster_too_small_waits_until_a_signal(cluster, inputs, small_ckpt,
                                                          tmp_path):
    """A joined cluster may grow (an autoscaler): 3 actors on its 2 CPUs wait, and say so;
    SIGINT during the wait ends the run in one line, exit 130."""
    args = [a for a in command(inputs, tmp_path / "emb.parquet", small_ckpt,
                               *ray_args(cluster, "--ray-actors", "3")) if a != "-q"]
    proc = subprocess.Popen(args, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr] + [lines.put("")],
                     daemon=True).start()
    printed, guard = [], time.monotonic() + 600  # turns a hang into a failure: no speed
    with reaped(proc):
        while not printed or "waiting" not in printed[-1]:
            printed.append(lines.get(timeout=max(0.0, guard - time.monotonic())))
            assert printed[-1], "".join(printed)[-3000:]  # the run ended without waiting
            assert time.monotonic() < guard, "".join(printed)[-3000:]  # it never waited
        assert "they need 3 CPUs (1 each), and the cluster has 2" in printed[-1]
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=300)
    rest = []
    while (line := lines.get(timeout=60)):
        rest.append(line)
    assert proc.returncode == 130, "".join(printed + rest)[-3000:]
    assert one_error_line("".join(rest))


def committed_inputs(parts_dir: Path) -> int:
    """The inputs of the parts that the manifest in ``parts_dir`` (its journal applied)
    records as committed."""
    from dsv4enc.output.read import load_manifest

    parts = load_manifest(parts_dir / MANIFEST_NAME)["parts"].values()
    return sum(part["end"] - part["start"] for part in parts)


@pytest.mark.parametrize("first,then", [("local", "ray"), ("ray", "local")])
@pytest.mark.parametrize("folder", [False, True], ids=["file", "folder"])
def test_a_resume_by_the_other_engine_reuses_the_committed_parts(
        cluster, inputs, small_ckpt, local, tmp_path, folder, first, then):
    """A run stopped (SIGKILL at its first commit) and finished by ``--resume`` with the
    other engine (the settings are the output's) reuses every part the first one committed:
    a single file's too, whose local run appends its parts to one growing file while the
    Ray actors write part files; its rows are a clean run's."""
    out = tmp_path / "emb" if folder else tmp_path / "emb.parquet"
    target = str(out) + "/" if folder else str(out)
    engines = {"local": [], "ray": ray_args(cluster)}
    pauses = Pauses(tmp_path / "pauses", "commit")
    args = command(inputs, target, small_ckpt, "--commit-every", "0.001")
    proc = subprocess.Popen(args + engines[first], env=pauses.env(ENV),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    with reaped(proc):
        pauses.wait("commit", 1, proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    committed = committed_inputs(out if folder else Path(str(out) + ".partial"))
    assert committed > 0
    summary = tmp_path / "summary.json"
    run(args + engines[then] + ["--resume", "--summary-json", str(summary)])
    assert json.loads(summary.read_text())["images"]["reused"] == committed
    assert pq.read_table(out).equals(pq.read_table(local))
