"""A real S3-compatible server on 127.0.0.1 for the object storage tests (moto's standalone
server, from the ``dev`` extra), started once per test session and stopped at its end.

``s3_server`` starts it; ``s3`` (per test) points the environment at it (endpoint, dummy
credentials, region: ``monkeypatch``, so only that test sees them) and makes a fresh bucket,
returning ``S3Bucket`` with its ``s3://`` URL. ``s3_outage`` is the same on a server of the
test's own, which the test stops and starts again on the same port (``S3Bucket.server``:
``StoppableServer``): the objects stay, as a real store's do. Nothing here mocks a client: dsv4enc talks to
the server over HTTP with pyarrow's S3 client, as it would to any S3 service.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class S3Server:
    endpoint: str

    def env(self) -> dict[str, str]:
        """The environment that points an S3 client at this server (dummy credentials)."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing-secret", "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_EC2_METADATA_DISABLED": "true", "NO_PROXY": "127.0.0.1,localhost",
                "no_proxy": "127.0.0.1,localhost"}


@dataclass(frozen=True)
class S3Bucket:
    server: S3Server
    name: str

    @property
    def url(self) -> str:
        return f"s3://{self.name}"

    def client(self):
        """A boto3 client for the test's own setup and checks (creating, listing objects)."""
        import boto3

        env = self.server.env()
        return boto3.client("s3", endpoint_url=self.server.endpoint, region_name="us-east-1",
                            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])

    def put(self, key: str, data: bytes) -> str:
        self.client().put_object(Bucket=self.name, Key=key, Body=data)
        return f"{self.url}/{key}"

    def get(self, key: str) -> bytes:
        return self.client().get_object(Bucket=self.name, Key=key)["Body"].read()

    def keys(self, prefix: str = "") -> list[str]:
        """The object keys under ``prefix``, without folder markers (``dir/``: empty objects
        some clients, pyarrow's among them, leave where a folder's last object was deleted)."""
        pages = self.client().get_paginator("list_objects_v2").paginate(
            Bucket=self.name, Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", [])
                      if not o["Key"].endswith("/"))


class StoppableServer:
    """A moto server of one test's own, on a fixed port of 127.0.0.1, that it can stop (an
    outage: connections are refused) and start again. moto keeps objects in the process, so
    a restarted server holds what the stopped one held."""

    env = S3Server.env

    def __init__(self) -> None:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._server = None
        self.start()

    def start(self) -> None:
        from moto.server import ThreadedMotoServer

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port,
                                          verbose=False)
        self._server.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server on a free port of 127.0.0.1, for the whole session."""
    server_module = pytest.importorskip("moto.server", reason="needs moto[server] (dev extra)")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
    server = server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    record_ranges(server)
    host, port = server.get_host_and_port()
    try:
        yield S3Server(endpoint=f"http://{host}:{port}")
    finally:
        server.stop()


@pytest.fixture
def s3(s3_server: S3Server, monkeypatch) -> S3Bucket:
    """A fresh, empty bucket on the session's server, with this test's environment pointed
    at it (and no storage options left over from another test)."""
    return _fresh_bucket(s3_server, monkeypatch)


def _fresh_bucket(server: S3Server, monkeypatch) -> S3Bucket:
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3",
                 "DSV4ENC_STORAGE_OPTIONS"):
        monkeypatch.delenv(name, raising=False)
    bucket = S3Bucket(server=server, name=f"dsv4enc-{uuid.uuid4().hex[:12]}")
    bucket.client().create_bucket(Bucket=bucket.name)
    from dsv4enc import storage

    storage.configure(None)  # file systems made for another server are dropped
    return bucket


@pytest.fixture
def s3_outage(monkeypatch) -> S3Bucket:
    """``s3`` on a server of this test's own (``StoppableServer``: ``s3_outage.server.stop()``,
    ``.start()``), stopped at the end of the test."""
    pytest.importorskip("moto.server", reason="needs moto[server] (dev extra)")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = StoppableServer()
    try:
        yield _fresh_bucket(server, monkeypatch)
    finally:
        server.stop()


# --------------------------------------------------------------------------- test inputs

def tiny_run_options() -> list[str]:
    """``encode`` options for a tiny random tower on the CPU, in parts of 3 images."""
    from helpers import CONFIGS

    return ["--config", str(CONFIGS / "tiny.json"), "--random-init", "--device", "cpu",
            "--part-images", "3", "--batch-tokens", "1500"]


def noise_images(s3: "S3Bucket", prefix: str, count: int, tmp_path) -> tuple:
    """``count`` small noise PNGs, in ``tmp_path/prefix`` and under the bucket's prefix;
    returns (that folder, the prefix's ``s3://`` URL)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    folder = tmp_path / prefix
    folder.mkdir()
    for i in range(count):
        path = folder / f"img{i:03d}.png"
        Image.fromarray(rng.integers(0, 256, (12 + i % 5, 16 + i % 7, 3),
                                     dtype=np.uint8)).save(path)
        s3.put(f"{prefix}/{path.name}", path.read_bytes())
    return folder, f"{s3.url}/{prefix}/"


def manifest_parts(s3: "S3Bucket", key: str) -> dict:
    """The parts the commit record of the manifest object ``key`` lists (the manifest, its
    journal's segments applied, as every reader reads it); {} while it is not uploaded yet."""
    from dsv4enc import storage
    from dsv4enc.output.read import load_manifest

    folder = key.rsplit("/", 1)[0] + "/"
    fs, path = storage.filesystem(f"{s3.url}/{key}")
    segments = [storage.filesystem(f"{s3.url}/{k}")[1] for k in s3.keys(folder)]
    try:
        return load_manifest(path, fs, segments)["parts"]
    except Exception:  # not uploaded yet (or a segment merged meanwhile: ask again)
        return {}



# --------------------------------------------------------------------------- request counts

_LOGS: list["RequestLog"] = []  # the logs open now, which ``record_ranges`` tells of each GET


def record_ranges(server) -> None:
    """Have the session's server tell each open ``RequestLog`` every GET it receives, with
    its ``Range`` header (werkzeug's log line has none): the server's WSGI application is
    wrapped, so every process's requests are seen, as the server received them."""
    app = server._server.app

    def recording(environ, start_response):
        if environ.get("REQUEST_METHOD") == "GET":
            for log in list(_LOGS):
                log.got(environ.get("PATH_INFO", ""), environ.get("HTTP_RANGE"))
        return app(environ, start_response)

    server._server.app = recording


class RequestLog:
    """The S3 server's own request log, counted: moto's server is werkzeug's, which logs one
    ``"METHOD /path HTTP/1.1" status size`` record per request it answers on the
    ``werkzeug`` logger. Within ``with RequestLog(bucket) as log:``, ``log.counts`` holds
    the requests to ``bucket`` by method (those of every process: the server counts them),
    ``log.requests`` each one's method and path, and (on the session's server, ``s3``)
    ``log.ranges`` each GET of an object as ``(key, Range header or None)``."""

    def __init__(self, bucket: S3Bucket) -> None:
        import collections

        self.prefix = f"/{bucket.name}"
        self.counts: collections.Counter = collections.Counter()
        self.requests: list[tuple[str, str]] = []  # (method, path below the bucket)
        self.ranges: list[tuple[str, str | None]] = []  # (object key, Range header) per GET
        self._handler = logging.Handler(logging.INFO)
        self._handler.emit = self._record
        self._saved: tuple[int, bool] | None = None

    def _record(self, record: logging.LogRecord) -> None:
        import re

        if not isinstance(record.args, tuple) or not record.args:
            return
        line = re.sub(r"\x1b\[[0-9;]*m", "", str(record.args[0])).split()
        if len(line) >= 2 and line[1].startswith(self.prefix):
            self.counts[line[0]] += 1
            self.requests.append((line[0], line[1][len(self.prefix):]))

    def got(self, path: str, byte_range: str | None) -> None:
        """A GET the server received (``record_ranges``): an object's, kept in ``ranges``
        (a listing's, of the bucket itself, is not)."""
        if path.startswith(self.prefix + "/") and len(path) > len(self.prefix) + 1:
            self.ranges.append((path[len(self.prefix) + 1:], byte_range))

    def reads(self) -> int:
        """GET and HEAD requests so far."""
        return self.counts["GET"] + self.counts["HEAD"]

    def __enter__(self) -> "RequestLog":
        logger = logging.getLogger("werkzeug")
        self._saved = logger.level, logger.propagate
        logger.setLevel(logging.INFO)
        logger.propagate = False  # counted here, not shown in the test's report
        logger.addHandler(self._handler)
        _LOGS.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _LOGS.remove(self)
        logger = logging.getLogger("werkzeug")
        logger.removeHandler(self._handler)
        logger.setLevel(self._saved[0])
        logger.propagate = self._saved[1]
