"""What committing a part costs with N parts already committed: one line appended to the
manifest's journal and synced (``PartStore._record``), against writing the whole manifest
(``PartStore.save``: temporary file, fsync, rename), which a run now does only when it
starts, resumes or finishes; and the bytes a whole run writes for its output.

    python benchmarks/manifest_cost.py [--parts 10,1000,100000] [--commits 50]
    python benchmarks/manifest_cost.py --run 4000 [--part-images 2]
    python benchmarks/manifest_cost.py --run 2005 --part-images 50 --update 1,5 [--out-kind file]
        [--new-at first,middle,last]
    python benchmarks/manifest_cost.py --cut 300000 [--part-images 50]
    python benchmarks/manifest_cost.py --mirror [--parts 1000,10000,100000] [--commits 50]
    python benchmarks/manifest_cost.py --plan 100000 [--part-images 50]

Bytes are this process's, from /proc/self/io: ``wchar`` (bytes handed to write calls) and
``write_bytes`` (bytes sent to the disk, less ``cancelled_write_bytes``). A single file's update
copies its kept parts' bytes into the new file (``copy_file_range``: counted in ``wchar``, and
written to the disk unless the file system shares extents, as XFS and btrfs do).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from dsv4enc.output.parts import PartStore


def io_bytes() -> tuple[int, int]:
    """(wchar, write_bytes - cancelled_write_bytes) of this process so far."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return (int(fields["wchar"]),
            int(fields["write_bytes"]) - int(fields["cancelled_write_bytes"]))


def entry(i: int) -> dict:
    return {"file": f"part-{i:06d}.parquet", "start": i * 1024, "end": (i + 1) * 1024,
            "digest": "a" * 24 + "." + "b" * 24, "rows": 1024, "transient": 0}


def commit_cost(parts: list[int], commits: int, repeat: int) -> None:
    folder = Path(tempfile.mkdtemp(prefix="dsv4enc-manifest-"))
    settings = {"tool": "dsv4enc", "part_images": 1024, "config": {"k": 1}}
    for n in parts:
        store = PartStore(folder, settings)
        store.parts = {f"part-{i:06d}": entry(i) for i in range(n)}
        saves = []
        for _ in range(repeat):
            began = time.perf_counter()
            store.save()
            saves.append(time.perf_counter() - began)
        size = store.manifest_path.stat().st_size
        times = []
        wrote = io_bytes()[0]
        for i in range(n, n + commits):
            began = time.perf_counter()
            store._record(f"part-{i:06d}", entry(i))
            times.append(time.perf_counter() - began)
        per_commit = (io_bytes()[0] - wrote) / commits
        print(f"{n:>7} parts committed: commit median {statistics.median(times) * 1e3:.2f} ms, "
              f"{per_commit:.0f} bytes written; whole manifest {size / 1024:.0f} KiB, "
              f"save median {statistics.median(saves) * 1e3:.1f} ms", flush=True)


def noise_png(path: Path, seed: int) -> None:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(path)


def measured_run(what: str, data: Path, out: Path, part_images: int, **more) -> None:
    """One run of ``data`` into ``out`` (a folder, or a single file where it ends with
    ``.parquet``): its bytes written against the output's."""
    from dsv4enc.run.pipeline import EncodeOptions, run_encode

    config = Path(__file__).resolve().parent.parent / "configs" / "tiny.json"
    wchar, disk = io_bytes()
    began = time.perf_counter()
    folder = out.suffix != ".parquet"
    summary = run_encode(EncodeOptions(inputs=[str(data)], out=f"{out}/" if folder else str(out),
                                       config=str(config),
                                       random_init=True, device="cpu", workers=0,
                                       part_images=part_images, progress=False, **more))
    seconds = time.perf_counter() - began
    wchar, disk = io_bytes()[0] - wchar, io_bytes()[1] - disk
    if folder:
        size = sum(p.stat().st_size for p in out.iterdir())
        parts = f"{sum(1 for p in out.glob('*.parquet'))} parts"
    else:
        import pyarrow.parquet as pq

        size = out.stat().st_size
        parts = f"{pq.read_metadata(out).num_row_groups} row groups"
    print(f"{what}: {summary.encoded} encoded, {summary.reused} reused, {parts}, "
          f"{seconds:.1f} s: output {size / 1e6:.1f} MB, wrote {wchar / 1e6:.2f} MB "
          f"({wchar / size:.1%}; to disk {disk / 1e6:.2f} MB, {disk / size:.1%})", flush=True)


#: Where ``--new-at`` puts the new images in input order: the name of the k-th of ``images``.
NEW_NAMES = {"first": lambda images, k: f"a-new{k:03d}.png",  # before every img*.png
             "middle": lambda images, k: f"img{images // 2:06d}-new{k:03d}.png",
             "last": lambda images, k: f"img{images + k:06d}.png"}


def run_cost(images: int, part_images: int, update: str | None, kind: str = "folder",
             new_at: str = "last") -> None:
    """A real run of ``images`` small images into a folder (``kind``: or a single file), a
    part per ``part_images``; without ``update`` committing after every segment, with
    ``update`` (``CHANGED,NEW``) then an ``--update`` after that many images changed (from
    the first third on) and added (``new_at``: sorting first, in the middle or last), checked
    against a clean run of the same images."""
    root = Path(tempfile.mkdtemp(prefix="dsv4enc-runcost-"))
    data = root / "images"
    data.mkdir()
    for i in range(images):
        noise_png(data / f"img{i:06d}.png", i)
    out = root / ("out.parquet" if kind == "file" else "out")
    if update is None:
        measured_run("run", data, out, part_images, commit_every=1e-6)
        return
    # no commit by time: the parts are the plan's, whatever the machine's load
    measured_run("first run", data, out, part_images, commit_every=1e9)
    changed, new = (int(v) for v in update.split(","))
    for k in range(changed):
        noise_png(data / f"img{images // 3 + k * part_images:06d}.png", 10**6 + k)
    for k in range(new):
        noise_png(data / NEW_NAMES[new_at](images, k), 2 * 10**6 + k)
    measured_run(f"update ({changed} changed, {new} new {new_at})", data, out, part_images,
                 update=True, commit_every=1e9)
    clean = root / ("clean.parquet" if kind == "file" else "clean")
    measured_run("clean run", data, clean, part_images, commit_every=1e9)
    print(f"update equals the clean run: {'yes' if same_rows(out, clean) else 'NO'}", flush=True)


def same_rows(a: Path, b: Path) -> bool:
    """Whether two outputs hold the same rows, in the same order, byte for byte."""
    from dsv4enc.output.read import read_embeddings

    def rows(out: Path) -> list:
        return [(row["path"], row["error"], None if row["embedding"] is None
                 else row["embedding"].tobytes())
                for row in read_embeddings(out, ["path", "error", "embedding"],
                                           errors="include")]
    return rows(a) == rows(b)


def cut_cost(keys: int, part_images: int) -> None:
    """The CPU time of cutting ``keys`` listed keys into parts (``run/plan.cut_parts``)."""
    from dsv4enc.images.headers import Planned
    from dsv4enc.images.items import InputItem
    from dsv4enc.run.plan import cut_parts

    planned = [Planned(InputItem(f"folder/sub/img{i:08d}.jpg", "x")) for i in range(keys)]
    began = time.process_time()
    parts = sum(1 for _ in cut_parts(planned, part_images))
    print(f"--part-images {part_images}: {parts} parts of {keys} keys, "
          f"{time.process_time() - began:.2f} s CPU", flush=True)


def plan_change(keys: int, part_images: int, new: int = 5) -> None:
    """What an update with ``new`` inputs sorting first and one changed input (a third of the
    way in) costs at plan level: the parts of the new cut (``run/plan.cut_parts``) whose key
    range the old cut lacks, or that hold the changed input, and their rows."""
    from dsv4enc.images.headers import Planned
    from dsv4enc.images.items import InputItem
    from dsv4enc.run.plan import cut_parts

    def ranges(names: list[str]) -> list[tuple[str, str, int]]:
        planned = [Planned(InputItem(name, "x")) for name in names]
        return [(names[p.start], names[p.end - 1], p.end - p.start)
                for p in cut_parts(planned, part_images)]

    old = [f"folder/sub/img{i:08d}.jpg" for i in range(keys)]
    changed = old[keys // 3]
    began = time.process_time()
    before = {(first, last) for first, last, _ in ranges(old)}
    after = ranges(sorted(old + [f"folder/sub/a-new-{k}.jpg" for k in range(new)]))
    redone = [(first, last, rows) for first, last, rows in after
              if (first, last) not in before or first <= changed <= last]
    rows = sum(r for _, _, r in redone)
    print(f"{keys} inputs, {new} new sorting first, 1 changed: {len(redone)} of {len(after)} "
          f"parts encoded or cut anew, {rows} rows ({rows / (keys + new):.3%}); "
          f"{time.process_time() - began:.2f} s CPU for both cuts", flush=True)


def mirror_cost(parts: list[int], commits: int) -> None:
    """What a sync of an object storage output costs with N parts committed: ``commits``
    commits, each followed by a sync (``remote.RemoteOutput.sync``, against moto's S3 server
    on 127.0.0.1): the bytes of the commit record it uploads and the CPU it takes, next to
    what building the whole manifest object for each sync would take (the record written
    whole). Part uploads are not counted (the parts are recorded as in the store)."""
    import json
    import os

    import boto3

    from dsv4enc import storage
    from dsv4enc.output.read import load_manifest
    from dsv4enc.output.remote import RemoteOutput
    from storage_throughput import free_port, start_server

    port = free_port()
    server = start_server(port)
    os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="bench",
                      AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
    boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"]).create_bucket(Bucket="bench")
    sent: list[int] = []
    upload = storage.upload
    storage.upload = lambda url, data: (sent.append(len(data)), upload(url, data))[1]
    try:
        for n in parts:
            remote = RemoteOutput(f"s3://bench/m{n}/", writer=True)
            remote.pull()
            store = PartStore(remote.local_parts, {"tool": "dsv4enc", "part_images": 1024})
            store.parts = {f"part-{i:06d}": entry(i) for i in range(n)}
            store.create()
            for i in range(n + commits):
                remote.adopt_part(entry(i)["file"], remote.local_parts / entry(i)["file"])
            sent.clear()
            remote.sync()  # the manifest, whole: as a run starts
            base = sum(sent)
            cpu, sizes, whole = [], [], []
            for i in range(n, n + commits):
                store.adopt(f"part-{i:06d}", entry(i))
                sent.clear()
                began = time.process_time()
                remote.sync()
                cpu.append(time.process_time() - began)
                sizes.append(sum(sent))
                began = time.process_time()
                document = load_manifest(store.manifest_path)
                json.dumps(document, indent=1, sort_keys=True).encode()
                whole.append(time.process_time() - began)
            remote.close()
            print(f"{n:>7} parts (manifest {base / 1e6:.2f} MB, uploaded once): a sync of one "
                  f"commit uploads {statistics.median(sizes):.0f} B (median; at most "
                  f"{max(sizes) / 1e3:.1f} kB, a merge) in {statistics.median(cpu) * 1e3:.1f} ms "
                  f"CPU; the whole manifest for each sync would take "
                  f"{statistics.median(whole) * 1e3:.1f} ms CPU to build, and upload "
                  f"{base / 1e6:.2f} MB", flush=True)
    finally:
        storage.upload = upload
        server.kill()
        server.wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parts", default="10,1000,100000")
    parser.add_argument("--commits", type=int, default=50)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--run", type=int, default=0, help="images of a real run to measure")
    parser.add_argument("--part-images", type=int, default=2)
    parser.add_argument("--update", help="CHANGED,NEW: measure an --update of the run")
    parser.add_argument("--out-kind", choices=("folder", "file"), default="folder",
                        help="the run's output: a folder or a single file")
    parser.add_argument("--new-at", default="last",
                        help="where the new images sort: first, middle, last (comma-separated)")
    parser.add_argument("--cut", type=int, default=0, help="keys to cut into parts, timed")
    parser.add_argument("--plan", type=int, default=0,
                        help="inputs: an update's new and changed parts at plan level")
    parser.add_argument("--mirror", action="store_true",
                        help="an object storage output's commit record cost per sync")
    args = parser.parse_args()
    if args.plan:
        plan_change(args.plan, args.part_images)
    elif args.mirror:
        mirror_cost([int(v) for v in args.parts.split(",")], args.commits)
    elif args.cut:
        cut_cost(args.cut, args.part_images)
    elif args.run:
        for new_at in args.new_at.split(","):
            run_cost(args.run, args.part_images, args.update, args.out_kind, new_at)
    else:
        commit_cost([int(v) for v in args.parts.split(",")], args.commits, args.repeat)


if __name__ == "__main__":
    main()
