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
import os
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
