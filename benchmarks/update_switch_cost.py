"""What a folder output's ``--update`` spends beside encoding, per part of the output: the
footer check of each old part (``parts.part_intact``: a damaged part is repaired), the hard
link of each kept part into the staging folder, the switch (``update.switch``) and the
removal of the old folder (``update.remove_old_output``).

    python benchmarks/update_switch_cost.py [--parts 100,2000,20000] [--folder /tmp]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from dsv4enc.output.parts import part_intact
from dsv4enc.output.update import link_or_copy, remove_old_output, staging_folder, switch

ROWS = 50  # rows per part file (small: the costs measured are per file, not per byte)


def measure(parts: int, root: Path) -> str:
    out = root / f"emb{parts}"
    out.mkdir()
    table = pa.table({"path": [f"img{i}.png" for i in range(ROWS)],
                      "embedding": [b"\0" * 1024] * ROWS})
    names = [f"part-{i:06d}.parquet" for i in range(parts)]
    for name in names:
        pq.write_table(table, out / name)
    began = time.perf_counter()
    assert all(part_intact(out / name, ROWS) for name in names)
    checked = time.perf_counter()
    staging = staging_folder(out)
    staging.mkdir()
    for name in names:
        link_or_copy(out / name, staging / name)
    linked = time.perf_counter()
    old = switch(staging, out)
    switched = time.perf_counter()
    remove_old_output(old, out)
    removed = time.perf_counter()
    each = lambda a, b: f"{(b - a) * 1e3:.1f} ms ({(b - a) / parts * 1e6:.0f} us a part)"
    return (f"{parts:>6} parts: footer checks {each(began, checked)}, links "
            f"{each(checked, linked)}, switch {(switched - linked) * 1e3:.2f} ms, "
            f"old folder removed {each(switched, removed)}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parts", default="100,2000,20000")
    parser.add_argument("--folder", default=None, help="where the scratch outputs go")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.folder) as root:
        for parts in (int(n) for n in args.parts.split(",")):
            print(measure(parts, Path(root)), flush=True)


if __name__ == "__main__":
    main()
