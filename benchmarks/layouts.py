"""Candidate layouts for the ``embedding`` column, measured at real width (SPEC §9).

Synthetic float16 embeddings shaped like a 1024x768 photo's (336 aligner rows x 4096) are
written and read back with each candidate; candidates are interleaved and each figure is the
best of ``--repeats`` (the machine may be shared). Write figures include building the Arrow
table from per-image numpy arrays (what the writer threads do); "per thread" rates divide the
bytes by the CPU time of the writing thread, read rates by the process's CPU time (all of
pyarrow's threads), so they are per core. Files go to ``--dir`` (page cache, no fsync).

``--assembly`` measures the host cost of a single-file output against a folder output:
the same parts committed through ``PartStore`` with and without a ``StreamingAssembler``
(parts joined into the file: a torchrun or object storage output), and through
``AppendingStore`` (parts appended once to the file: a local one of one process).

    python benchmarks/layouts.py --images 64 --repeats 3
    python benchmarks/layouts.py --assembly --images 128 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dsv4enc.output.appending import AppendingStore
from dsv4enc.output.read import read_embeddings
from dsv4enc.output.parts import (PartStore, Row, StreamingAssembler, output_schema, parquet_options,
                            rows_per_group, rows_to_table)


def synthetic_rows(images: int, rows: int, width: int) -> list[Row]:
    rng = np.random.default_rng(0)
    base = rng.standard_normal((rows, width), dtype=np.float32).astype(np.float16)
    out = []
    for i in range(images):  # distinct values per image without generating them all
        out.append(Row(path=f"img/{i:06d}.jpg", width=1024, height=768, vit_h=48, vit_w=64,
                       grid_h=16 if rows == 336 else 1, grid_w=21 if rows == 336 else rows,
                       embedding=np.roll(base, i, axis=0) * np.float16(1 + i / images)))
    return out


def fsb_rows_table(rows: list[Row], width: int) -> pa.Table:
    """Candidate: list<fixed_size_binary[width*2]> (one binary value per embedding row)."""
    flat = np.concatenate([r.embedding for r in rows]).reshape(-1).view(np.uint8)
    item = pa.binary(width * 2)
    vectors = pa.Array.from_buffers(item, len(flat) // (width * 2), [None, pa.py_buffer(flat)])
    counts = np.array([len(r.embedding) for r in rows])
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    emb = pa.Array.from_buffers(pa.list_(item), len(rows), [None, pa.py_buffer(offsets)],
                                children=[vectors])
    base = rows_to_table(rows, output_schema(width, "float16", {}, layout="binary"))
    return base.set_column(base.schema.get_field_index("embedding"), "embedding", emb)


def read_fsb_rows(path: Path, width: int) -> int:
    """numpy arrays out of the list<fixed_size_binary> candidate (copies, like read_embeddings)."""
    n = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=16, columns=["embedding"]):
        col = batch.column(0)
        offsets = col.offsets.to_numpy()
        values = np.frombuffer(col.values.buffers()[1], dtype=np.float16).reshape(-1, width)
        for i in range(len(col)):
            n += values[offsets[i]:offsets[i + 1]].copy().nbytes
    return n


def candidates(width: int) -> dict[str, dict]:
    """name -> how to build the table and the writer's settings."""
    nested = output_schema(width, "float16", {}, layout="nested")
    binary = output_schema(width, "float16", {}, layout="binary")

    def opts(schema, **extra):
        o = parquet_options(schema)
        if "compression" in extra:
            o["compression"] = {**o["compression"], "embedding": extra.pop("compression")}
        return {**o, **extra}
    return {
        "nested, 1 MiB pages (before)": dict(schema=nested,
                                             options=opts(nested, data_page_size=1 << 20)),
        "nested, 8 MiB pages (now)": dict(schema=nested, options=opts(nested)),
        "nested, lz4": dict(schema=nested, options=opts(nested, compression="lz4")),
        "nested, zstd": dict(schema=nested, options=opts(nested, compression="zstd")),
        "list<fixed_size_binary>": dict(schema=None, options=opts(binary)),
        "binary cell": dict(schema=binary, options=opts(binary)),
        "binary cell, lz4": dict(schema=binary, options=opts(binary, compression="lz4")),
        "binary cell, zstd": dict(schema=binary, options=opts(binary, compression="zstd")),
    }


def build(cand: dict, rows: list[Row], width: int) -> pa.Table:
    if cand["schema"] is None:
        return fsb_rows_table(rows, width)
    return rows_to_table(rows, cand["schema"])


def timed_write(cand, rows, width, path) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.thread_time()
    table = build(cand, rows, width)
    pq.write_table(table, path, row_group_size=rows_per_group(table.schema, rows)
                   if cand["schema"] is not None else 16, **cand["options"])
    return time.perf_counter() - wall, time.thread_time() - cpu


def timed_read(name, path, width) -> tuple[float, float, int]:
    wall, cpu = time.perf_counter(), time.process_time()
    if name == "list<fixed_size_binary>":
        n = read_fsb_rows(path, width)
    else:
        n = sum(e.nbytes for _, e, _ in read_embeddings(path))
    return time.perf_counter() - wall, time.process_time() - cpu, n


def threaded_write(cand, rows, width, folder, threads) -> float:
    """Aggregate wall MB/s with ``threads`` writers, each writing its share to its own file."""
    shares = [rows[i::threads] for i in range(threads)]
    began = time.perf_counter()
    workers = [threading.Thread(target=timed_write, args=(cand, s, width, folder / f"t{i}.parquet"))
               for i, s in enumerate(shares)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return time.perf_counter() - began


def what_readers_see(path: Path) -> dict[str, str]:
    """The embedding value as each library presents it, and its full-file read time."""
    seen = {}
    began = time.perf_counter()
    try:
        import pandas as pd
        frame = pd.read_parquet(path)
        cell = frame["embedding"].iloc[0]
        inner = f" of {type(cell[0]).__name__}" if hasattr(cell, "__len__") and not isinstance(
            cell, bytes) else ""
        seen["pandas"] = (f"{type(cell).__name__}{inner} "
                          f"({time.perf_counter() - began:.2f} s)")
    except Exception as exc:  # a reader that cannot load it is a finding, not a failure
        seen["pandas"] = f"fails: {type(exc).__name__}: {str(exc)[:80]}"
    began = time.perf_counter()
    try:
        import polars as pl
        frame = pl.read_parquet(path)
        seen["polars"] = f"{frame.schema['embedding']} ({time.perf_counter() - began:.2f} s)"
    except Exception as exc:
        seen["polars"] = f"fails: {type(exc).__name__}: {str(exc)[:80]}"
    began = time.perf_counter()
    try:
        import duckdb
        con = duckdb.connect()
        kind = con.execute(f"SELECT typeof(embedding) FROM read_parquet('{path}') "
                           "LIMIT 1").fetchone()
        con.sql(f"SELECT embedding FROM read_parquet('{path}')").to_arrow_table()
        seen["duckdb"] = f"{kind[0]} ({time.perf_counter() - began:.2f} s)"
    except Exception as exc:
        seen["duckdb"] = f"fails: {type(exc).__name__}: {str(exc)[:80]}"
    return seen


def measure_layouts(args) -> None:
    rows = synthetic_rows(args.images, args.rows, args.width)
    nbytes = sum(r.embedding.nbytes for r in rows)
    cands = candidates(args.width)
    folder = Path(tempfile.mkdtemp(dir=args.dir))
    best: dict[str, dict] = {n: {"w": 1e9, "wc": 1e9, "r": 1e9, "rc": 1e9, "t": 1e9} for n in cands}
    try:
        for _ in range(args.repeats):
            for i, (name, cand) in enumerate(cands.items()):  # interleaved
                path = folder / f"c{i}.parquet"
                w, wc = timed_write(cand, rows, args.width, path)
                r, rc, n = timed_read(name, path, args.width)
                assert n == nbytes, (name, n, nbytes)
                b = best[name]
                b.update(w=min(b["w"], w), wc=min(b["wc"], wc), r=min(b["r"], r),
                         rc=min(b["rc"], rc), size=path.stat().st_size)
                if args.threads > 1 and name in ("nested, 8 MiB pages (now)", "binary cell"):
                    sub = folder / f"threads{i}"
                    sub.mkdir(exist_ok=True)
                    b["t"] = min(b["t"], threaded_write(cand, rows, args.width, sub, args.threads))
        mb = nbytes / 1e6
        print(f"{args.images} images x {args.rows} x {args.width} float16 = {mb:.0f} MB; "
              f"best of {args.repeats}\n")
        print("| candidate | write MB/s per thread (CPU) | write MB/s (wall) | "
              f"{args.threads} writer threads, MB/s (wall) | read MB/s per core (CPU) | "
              "read MB/s (wall) | file size |")
        print("|---|---|---|---|---|---|---|")
        for name, b in best.items():
            threads = f"{mb / b['t']:.0f}" if b["t"] < 1e9 else "-"
            print(f"| {name} | {mb / b['wc']:.0f} | {mb / b['w']:.0f} | {threads} | "
                  f"{mb / b['rc']:.0f} | {mb / b['r']:.0f} | {b['size'] / 1e6:.0f} MB |")
        if args.readers:
            print("\n| candidate | pandas | polars | duckdb |\n|---|---|---|---|")
            for i, name in enumerate(cands):
                if "lz4" in name or "zstd" in name or "before" in name:
                    continue
                seen = what_readers_see(folder / f"c{i}.parquet")
                print(f"| {name} | {seen['pandas']} | {seen['polars']} | {seen['duckdb']} |")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


#: How ``commit_parts`` writes: part files, part files joined into one file, one file.
OUTPUTS = ("folder", "joined", "appended")


def commit_parts(rows, schema, folder: Path, output: str, part_images: int) -> float:
    """Commit ``rows`` as parts like the writer thread does (``output``: one of OUTPUTS);
    returns the process CPU seconds (all threads, the assembler's included) until the output
    is complete."""
    store = (AppendingStore(folder / "parts", {"tool": "dsv4enc"}, schema,
                            folder / "out.parquet") if output == "appended"
             else PartStore(folder / "parts", {"tool": "dsv4enc"}))
    store.create()
    spans = [(s, min(s + part_images, len(rows))) for s in range(0, len(rows), part_images)]
    names = [f"part-{s:06d}" for s, _ in spans]
    cpu = time.process_time()
    assembler = (store if output == "appended" else
                 StreamingAssembler(store, folder / "out.parquet", schema)
                 if output == "joined" else None)
    for name, (start, end) in zip(names, spans):
        table = rows_to_table(rows[start:end], schema)
        group = rows_per_group(schema, rows[start:end])
        store.commit(name, table, group, start, end, "d")
        if assembler is not None:
            assembler.notify()
    if assembler is not None:
        assembler.finish()
    return time.process_time() - cpu


def host_ms_per_image(folder: Path, images: int = 16) -> float:
    """One thread's CPU ms per 1024x768 JPEG for decode, transform, pack and staging (the
    host stages besides the writer), from ``dsv4enc.bench.host.stage_costs``."""
    from dsv4enc.bench.throughput import synthetic_images
    from dsv4enc.tower.config import VisionConfig
    from dsv4enc.bench.host import stage_costs

    cfg = VisionConfig.from_file(Path(__file__).resolve().parents[1] / "configs" /
                                 "deepseek-v4-flash.json")
    paths = synthetic_images(folder / "jpegs", f"1024x768:{images}")
    costs = min((stage_costs(paths, cfg) for _ in range(3)),
                key=lambda c: c.decode_ms + c.transform_ms + c.pack_ms + c.stage_ms)
    return costs.decode_ms + costs.transform_ms + costs.pack_ms + costs.stage_ms


def measure_assembly(args) -> None:
    rows = synthetic_rows(args.images, args.rows, args.width)
    scratch = Path(tempfile.mkdtemp(dir=args.dir))
    try:
        other = host_ms_per_image(scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"{args.images} images, parts of {args.part_images}; writer CPU s (process, all "
          f"threads), best of {args.repeats}; the other host stages (decode, transform, pack, "
          f"staging) cost {other:.1f} ms per 1024x768 JPEG on one thread\n\n"
          "| layout | output | writer CPU s | / folder (writer) | / folder (host per image) |"
          "\n|---|---|---|---|---|")
    for layout in ("binary", "nested"):
        schema = output_schema(args.width, "float16", {"tool": "dsv4enc"}, layout=layout)
        best = dict.fromkeys(OUTPUTS, 1e9)
        for _ in range(args.repeats):
            for output in OUTPUTS:  # interleaved
                folder = Path(tempfile.mkdtemp(dir=args.dir))
                try:
                    best[output] = min(best[output], commit_parts(
                        rows, schema, folder, output, args.part_images))
                finally:
                    shutil.rmtree(folder, ignore_errors=True)
        per_image = {k: v * 1e3 / args.images for k, v in best.items()}
        for output in OUTPUTS:
            host = (other + per_image[output]) / (other + per_image["folder"])
            print(f"| {layout} | {output} | {best[output]:.2f} | "
                  f"{best[output] / best['folder']:.2f} | {host:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--rows", type=int, default=336, help="embedding rows per image")
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="writer threads to compare")
    parser.add_argument("--no-readers", dest="readers", action="store_false",
                        help="skip pandas/polars/duckdb")
    parser.add_argument("--assembly", action="store_true",
                        help="single-file vs folder output host cost instead")
    parser.add_argument("--part-images", type=int, default=32)
    parser.add_argument("--dir", default=os.environ.get("TMPDIR", "/tmp"))
    args = parser.parse_args()
    (measure_assembly if args.assembly else measure_layouts)(args)


if __name__ == "__main__":
    main()
