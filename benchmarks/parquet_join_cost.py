"""The single output file from committed parts: byte join against a Parquet re-encode.

Issue 31 item 5 asks whether the hand-written join (``output/parquet_join.ParquetJoiner``,
used by ``output/parts.StreamingAssembler``) is worth keeping against ``pq.ParquetWriter``
writing the same file from the parts' row groups. Parts are written the way a run writes
them (``output/parts.write_part``: the run's schema, row groups and Parquet options) at the
real config's width, then joined into one file, in turns:

- ``join``: ``ParquetJoiner.append`` of each part in input order, ``close`` with the footer's
  key-value metadata, fsync (what ``StreamingAssembler`` does, a part per commit);
- ``writer``: ``pq.ParquetWriter`` with the schema (key-value metadata included) and
  ``parquet_options``, each part's row groups read back (``read_row_group``) and written,
  fsync (what the assembler falls back to for parts it cannot join).

CPU is the process's (all threads, user and system; ``getrusage``, children included) and
wall; the two alternate within each round, the order flipping each round, so load on a
shared machine hits both alike. Both files are checked to read back equal (tables and
footer key-value metadata). Prints one JSON line per run and a Markdown table.

    python benchmarks/parquet_join_cost.py --rounds 4
    python benchmarks/parquet_join_cost.py --parts 4 --part-images 256 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from dsv4enc.output.parquet_join import ParquetJoiner
from dsv4enc.output.parts import (Row, output_schema, parquet_options, rows_per_group,
                                  rows_to_table, write_part)
from dsv4enc.run.plan import MAX_PART_IMAGES, PART_BYTES
from dsv4enc.tower.config import VisionConfig

ROOT = Path(__file__).resolve().parent.parent


def part_rows(first: int, images: int, tokens: int, width: int, dtype: str,
              pooled: bool) -> list[Row]:
    """``images`` rows of distinct near-random embeddings, shaped like a 1024x768 photo's."""
    rng = np.random.default_rng(first)
    shape = (width,) if pooled else (tokens, width)
    return [Row(path=f"img/{first + i:07d}.jpg", width=1024, height=768, vit_h=48, vit_w=63,
                grid_h=1 if pooled else 16, grid_w=1 if pooled else tokens // 16,
                embedding=rng.standard_normal(shape, dtype=np.float32).astype(dtype))
            for i in range(images)]


def write_parts(folder: Path, args, schema) -> list[Path]:
    paths = []
    for k in range(args.parts):
        first = k * args.part_images
        rows = part_rows(first, args.part_images, args.tokens, args.width, args.out_dtype,
                         args.pooled)
        table = rows_to_table(rows, schema)
        entry = write_part(folder, f"part-{first:06d}", table, rows_per_group(schema, rows),
                           first, first + len(rows), "0" * 16)
        paths.append(folder / entry["file"])
    return paths


def by_join(parts: list[Path], out: Path, schema, key_values: dict[bytes, bytes]) -> None:
    joiner = ParquetJoiner(out)
    try:
        for path in parts:
            joiner.append(path)
        joiner.close(key_values)
    finally:
        joiner.abort()
    with open(out, "rb+") as handle:
        os.fsync(handle.fileno())


def by_writer(parts: list[Path], out: Path, schema, key_values: dict[bytes, bytes]) -> None:
    full = schema.with_metadata({**(schema.metadata or {}), **key_values})
    with pq.ParquetWriter(out, full, **parquet_options(full)) as writer:
        for path in parts:
            handle = pq.ParquetFile(path)
            for group in range(handle.num_row_groups):
                writer.write_table(handle.read_row_group(group).replace_schema_metadata(
                    full.metadata))
    with open(out, "rb+") as handle:
        os.fsync(handle.fileno())


WAYS = {"join": by_join, "writer": by_writer}


def timed(way: str, parts: list[Path], out: Path, schema, key_values) -> tuple[float, float]:
    out.unlink(missing_ok=True)
    before, began = cpu_seconds(), time.perf_counter()
    WAYS[way](parts, out, schema, key_values)
    return cpu_seconds() - before, time.perf_counter() - began


def cpu_seconds() -> float:
    """User and system CPU of this process (all threads) and of its children."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(
        resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def same_files(a: Path, b: Path) -> bool:
    """The same table, and the same footer key-value metadata (pyarrow's own schema entry
    aside, which each writer fills in)."""
    ta, tb = pq.read_table(a), pq.read_table(b)
    ka, kb = ({k: v for k, v in pq.read_metadata(p).metadata.items() if k != b"ARROW:schema"}
              for p in (a, b))
    if not (ta.equals(tb) and ka == kb):
        print(f"# differ: tables equal {ta.equals(tb)}, footer keys {sorted(ka)} against "
              f"{sorted(kb)}")
    return ta.equals(tb) and ka == kb


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def default_part_images(cfg: VisionConfig, dtype: str, pooled: bool) -> int:
    """The run's longest part (twice ``run/plan.images_per_part``, less one) for this config."""
    per_image = cfg.hidden_size * (2 if dtype == "float16" else 4) * (1 if pooled
                                                                      else cfg.max_n_token)
    return int(min(MAX_PART_IMAGES, max(16, PART_BYTES // per_image)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs/deepseek-v4-flash.json"))
    parser.add_argument("--out-dtype", default="float16", choices=("float16", "float32"))
    parser.add_argument("--tokens", type=int, default=336,
                        help="embedding rows per image (336: a 1024x768 photo)")
    parser.add_argument("--pooled", action="store_true", help="one pooled row per image")
    parser.add_argument("--part-images", type=int, default=0,
                        help="images per part (0: the run's own size for the config)")
    parser.add_argument("--parts", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=os.environ.get("TMPDIR", "/tmp"))
    args = parser.parse_args()
    cfg = VisionConfig.from_file(args.config)
    args.width = cfg.output_width("aligner")
    args.part_images = args.part_images or default_part_images(cfg, args.out_dtype, args.pooled)
    images = args.parts * args.part_images
    schema = output_schema(args.width, args.out_dtype, {"model": cfg.model_name},
                           pooled=args.pooled)
    # the footer's row stamps: a key and a size/mtime stamp per image, as JSON
    stamps = json.dumps({f"img/{i:07d}.jpg": [123456, 1764633600.0] for i in range(images)})
    key_values = {b"dsv4enc.stamps": stamps.encode()}
    scratch = Path(tempfile.mkdtemp(prefix="join-cost-", dir=args.dir))
    try:
        parts = write_parts(scratch, args, schema)
        size = sum(p.stat().st_size for p in parts)
        print(f"# {images} images in {args.parts} parts of {args.part_images}, width "
              f"{args.width} {args.out_dtype}, {'pooled' if args.pooled else args.tokens} "
              f"rows per image, {size / 1e9:.2f} GB of parts", flush=True)
        outs = {way: scratch / f"out-{way}.parquet" for way in WAYS}
        for way in WAYS:  # warm-up, not counted: pyarrow's first write sets up its pools
            timed(way, parts[:1], outs[way], schema, key_values)
        seen: dict[str, list[tuple[float, float]]] = {way: [] for way in WAYS}
        for r in range(args.rounds):
            order = list(WAYS) if r % 2 == 0 else list(WAYS)[::-1]
            for way in order:
                load = loadavg()
                cpu, wall = timed(way, parts, outs[way], schema, key_values)
                seen[way].append((cpu, wall))
                print(json.dumps({"round": r, "way": way, "cpu_s": round(cpu, 3),
                                  "wall_s": round(wall, 3), "load": load,
                                  "cpu_ms_per_image": round(cpu * 1e3 / images, 3)}),
                      flush=True)
        equal = same_files(outs["join"], outs["writer"])
        print(f"# files read back equal: {equal}\n")
        print("| way | CPU ms per image, median (range) | wall ms per image, median (range) |"
              "\n|---|---|---|")
        med = {}
        for way in WAYS:
            cpus = [c * 1e3 / images for c, _ in seen[way]]
            walls = [w * 1e3 / images for _, w in seen[way]]
            med[way] = statistics.median(cpus)
            print(f"| {way} | {med[way]:.3f} ({min(cpus):.3f}-{max(cpus):.3f}) | "
                  f"{statistics.median(walls):.3f} ({min(walls):.3f}-{max(walls):.3f}) |")
        ratios = [w[0] / j[0] for j, w in zip(seen["join"], seen["writer"])]
        print(f"\nwriter / join CPU: median {statistics.median(ratios):.2f} "
              f"(per round {', '.join(f'{x:.2f}' for x in ratios)})")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
