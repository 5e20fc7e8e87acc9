"""A bucket output's commit record: the manifest object, then its journal as segment objects
(an object store has no append). A sync uploads its new commits as one segment, two segments
that cover as many syncs are merged, and every reader applies them as it applies a journal."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from dsv4enc import storage
from dsv4enc.output.files import SEGMENT_FILE, segment_chain, segment_name
from dsv4enc.output.read import SegmentGone, find_output, load_manifest

TOKEN = "0123456789abcdef"


def test_the_chain_takes_the_furthest_reaching_segment_and_stops_at_a_gap():
    names = [segment_name("_manifest.json", TOKEN, a, b) for a, b in
             [(1, 1), (2, 2), (1, 2), (3, 3), (5, 5)]]
    names += [segment_name("_manifest-rank001.json", TOKEN, 4, 4),  # another manifest's
              segment_name("_manifest.json", "f" * 16, 4, 4),  # another token's
              "_manifest.json", "part-000000.parquet"]
    assert segment_chain("_manifest.json", TOKEN, [f"b/out/{n}" for n in names]) == [
        f"b/out/{segment_name('_manifest.json', TOKEN, 1, 2)}",
        f"b/out/{segment_name('_manifest.json', TOKEN, 3, 3)}"]  # 5 follows a gap: not yet
    assert all(SEGMENT_FILE.fullmatch(n) for n in names[:6])


def _journal(entries: list[tuple[str, int]], token: str = TOKEN) -> bytes:
    lines = [{"format": "dsv4enc-journal", "manifest": token}]
    lines += [{"name": name, "part": {"file": f"{name}.parquet", "start": start}}
              for name, start in entries]
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def test_a_reader_applies_the_segments_in_order_and_is_told_when_one_went(tmp_path):
    manifest = tmp_path / "_manifest.json"
    manifest.write_text(json.dumps({"settings": {"tool": "dsv4enc"}, "journal": TOKEN,
                                    "parts": {"a": {"file": "a.parquet", "start": 0}}}))
    first = tmp_path / segment_name("_manifest.json", TOKEN, 1, 2)
    first.write_bytes(_journal([("b", 1), ("c", 2)]))
    second = tmp_path / segment_name("_manifest.json", TOKEN, 3, 3)
    second.write_bytes(_journal([("c", 9)]))  # a later commit of the same name wins
    stale = tmp_path / segment_name("_manifest.json", "f" * 16, 4, 4)
    stale.write_bytes(_journal([("x", 5)], "f" * 16))
    listed = [str(p) for p in tmp_path.iterdir()]
    parts = load_manifest(manifest, None, listed)["parts"]
    assert {name: part["start"] for name, part in parts.items()} == {"a": 0, "b": 1, "c": 9}
    assert set(load_manifest(manifest)["parts"]) == {"a"}  # no listing: no segments
    first.unlink()  # merged away after the listing: the reader lists again
    with pytest.raises(SegmentGone):
        load_manifest(manifest, None, listed)


def _started(remote):
    """The run's part store in ``remote``'s staging folder, its manifest in the bucket."""
    from dsv4enc.output.parts import PartStore

    remote.pull()
    store = PartStore(remote.local_parts, {"tool": "dsv4enc"})
    store.create()
    remote.attach(store, written_elsewhere=False)
    remote.sync()
    return store


def _commit(store, number: int) -> None:
    table = pa.table({"path": [f"img{number}.png"], "error": pa.array([None], pa.string())})
    store.commit(f"part-{number:06d}", table, 1, number, number + 1, f"d{number}")


def test_a_sync_uploads_only_its_new_commits_and_readers_see_each_commit(s3, monkeypatch):
    """Each sync after the first uploads one segment of its own commits, and merges: after k
    syncs the store holds one segment per bit of k. The manifest object is not written
    again until the run writes its manifest whole (the end compacts it)."""
    from dsv4enc.output.remote import RemoteOutput

    uploads: list[tuple[str, int]] = []
    upload = storage.upload
    monkeypatch.setattr(storage, "upload", lambda url, data: (uploads.append((url, len(data))),
                                                              upload(url, data))[1])
    remote = RemoteOutput(f"{s3.url}/seg/", writer=True)
    try:
        store = _started(remote)
        token = json.loads(store.manifest_path.read_text())["journal"]
        syncs = 13
        for k in range(1, syncs + 1):
            _commit(store, k)
            uploads.clear()
            remote.sync()
            names = [url.rsplit("/", 1)[-1] for url, _ in uploads]
            assert "_manifest.json" not in names  # the manifest stays as it was written
            assert names[0] == segment_name("_manifest.json", token, k, k)
            assert uploads[0][1] < 600  # this sync's one commit, however many came before
            spans = [tuple(map(int, SEGMENT_FILE.fullmatch(key.rsplit("/", 1)[-1]).group(3, 4)))
                     for key in s3.keys("seg/") if SEGMENT_FILE.fullmatch(key.rsplit("/", 1)[-1])]
            assert len(spans) == bin(k).count("1")  # merged: O(log syncs) for a reader
            assert set(find_output(f"{s3.url}/seg/").manifests[0]["parts"]) == set(store.parts)
        store.compact()  # the run's end: the manifest written whole, the segments gone
        remote.sync()
        keys = s3.keys("seg/")
        assert not [k for k in keys if SEGMENT_FILE.fullmatch(k.rsplit("/", 1)[-1])]
        recorded = json.loads(s3.get("seg/_manifest.json"))["parts"]
        assert set(recorded) == set(store.parts) and len(recorded) == syncs
    finally:
        remote.close()


def test_a_reader_lists_again_when_a_segment_was_merged_away(tmp_path, monkeypatch):
    """``find_output`` lists the folder again when a segment it listed was replaced by a
    merged one before it was read, and says so in one line if that keeps happening."""
    from dsv4enc.errors import UsageError
    from dsv4enc.output import read

    (tmp_path / "_manifest.json").write_text(json.dumps(
        {"settings": {"tool": "dsv4enc"}, "journal": TOKEN, "parts": {}}))
    real, calls = read.load_manifest, []

    def merged_meanwhile(path, fs=None, listed=()):
        calls.append(path)
        if len(calls) < gone_for:
            raise SegmentGone(f"{path}: merged")
        return real(path, fs, listed)

    monkeypatch.setattr(read, "load_manifest", merged_meanwhile)
    gone_for = 2
    assert find_output(tmp_path).manifests[0]["parts"] == {} and len(calls) == 2
    calls.clear()
    gone_for = read.LISTINGS + 1
    with pytest.raises(UsageError, match="kept changing while it was read"):
        find_output(tmp_path)


def test_a_reader_beside_syncs_and_merges_sees_each_time_a_prefix_of_the_commits(s3):
    """A reader reading over and over while the run commits, syncs and merges segments (no
    timing assumed: any interleaving) finds each time the parts of the first m commits, m
    never going back, and each part it finds is in the store."""
    import threading

    from dsv4enc.errors import UsageError
    from dsv4enc.output.remote import RemoteOutput

    url = f"{s3.url}/busy/"
    remote = RemoteOutput(url, writer=True)
    seen: list[tuple[list[str], int]] = []  # the parts found, and how many of them are there
    done = threading.Event()

    def read() -> None:
        while not done.is_set() or not seen:
            try:
                found = find_output(url)
            except UsageError:  # merged away at each of its listings: it says so; again
                continue
            if found.manifests:
                seen.append((sorted(found.manifests[0]["parts"]), len(found.paths)))

    try:
        store = _started(remote)
        reader = threading.Thread(target=read)
        reader.start()
        for k in range(24):
            _commit(store, k)
            remote.sync()
        done.set()
        reader.join()
    finally:
        remote.close()
    counts = [len(names) for names, _ in seen]
    assert all(names == [f"part-{i:06d}" for i in range(len(names))] for names, _ in seen)
    assert all(there == len(names) for names, there in seen)
    assert counts == sorted(counts)
