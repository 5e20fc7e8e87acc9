"""Object storage: the ``storage`` facade and URL inputs/outputs, against a real
S3-compatible server on 127.0.0.1 (``tests/objectstore.py``)."""

from __future__ import annotations

import pytest

from dsv4enc import storage
from dsv4enc.errors import UsageError


def test_is_url():
    assert storage.is_url("s3://b/k") and storage.is_url("gs://b") and storage.is_url("memory://x")
    assert not storage.is_url("data/x.jpg") and not storage.is_url("file:///tmp/x")
    assert not storage.is_url("/abs/s3:/x")


def test_parse_option():
    assert storage.parse_option("anonymous=true") == ("anonymous", True)
    assert storage.parse_option("connect_timeout=2.5") == ("connect_timeout", 2.5)
    assert storage.parse_option("region=eu-west-1") == ("region", "eu-west-1")
    with pytest.raises(UsageError):
        storage.parse_option("novalue")


def test_listing_is_sorted_recursive_and_relative(s3):
    for key in ["p/b.jpg", "p/a/z.png", "p/a/b.jpg", "p/c.txt", "other/x.jpg"]:
        s3.put(key, b"x" * 3)
    listed = storage.list_files(f"{s3.url}/p/")
    assert [o.key for o in listed] == ["a/b.jpg", "a/z.png", "b.jpg", "c.txt"]
    assert listed[0].url == f"{s3.url}/p/a/b.jpg" and listed[0].size == 3
    assert storage.kind(f"{s3.url}/p") == "folder"
    assert storage.kind(f"{s3.url}/p/b.jpg") == "file"
    assert storage.kind(f"{s3.url}/nothing") == "missing"


def test_ranges_upload_and_stamp(s3):
    url = s3.put("obj.bin", bytes(range(100)))
    assert storage.read_range(url, 10, 5) == bytes(range(10, 15))
    assert storage.read_bytes(url) == bytes(range(100))
    with storage.open_input(url) as handle:
        handle.seek(90)
        assert handle.read(20) == bytes(range(90, 100))
    new = f"{s3.url}/out/new.bin"
    assert not storage.exists(new)
    storage.upload(new, b"abc")
    assert storage.exists(new) and s3.get("out/new.bin") == b"abc"
    assert storage.stamp(new).startswith("3 ")


def test_missing_bucket_is_one_setup_line_without_secrets(s3):
    with pytest.raises(UsageError) as info:
        storage.list_files("s3://no-such-bucket-here/prefix/")
    message = str(info.value)
    assert "bucket not found" in message and "\n" not in message
    assert "testing-secret" not in message
