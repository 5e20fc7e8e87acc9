"""Time to the first inputs of a streamed listing, against the whole listing, and peak RSS.

For each folder (``benchmarks/first_part.py``'s hard-linked PNG folders, made by it), a fresh
process takes ``images/discover.stream_inputs`` to its first ``--first`` inputs (a part's
worth) and reports the seconds, then (a second fresh process) takes the whole stream, keeping
only a count, and then ``discover`` (the whole list) in a third, and in a fourth what a run
keeps of every input (``run/setup.RunSetup``: each input listed into its ``Planned`` entry,
and stamped); each reports its peak RSS (``ru_maxrss``). ``--code``: the dsv4enc tree to
run (PYTHONPATH), to compare two versions on one machine.

    python benchmarks/listing_stream.py --counts 1000 100000 1000000 [--root /tmp/dsv4enc_first_part]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, resource, sys, time
began = time.perf_counter()
from dsv4enc.images.discover import Discovery, discover, stream_inputs
folder, mode, first = sys.argv[1], sys.argv[2], int(sys.argv[3])
n = 0
if mode == "list":
    n = len(discover([folder]).items)
elif mode == "setup":
    from types import SimpleNamespace
    from dsv4enc.images.headers import input_stamps
    from dsv4enc.run.setup import RunSetup
    setup = RunSetup()
    setup.find_inputs(SimpleNamespace(inputs=[folder], files_from=None, image_column=None,
                                      key_column=None, table_paths_roots=(), keep_columns=()),
                      None)
    if hasattr(setup, "more"):  # a set-up that lists as the run goes: all of it here
        setup.more(None)
        planned = setup.planned
    else:
        planned = setup.entries()
    for start in range(0, len(planned), 1024):  # stamped a part at a time, as a run does
        input_stamps(planned[start:start + 1024])
    n = len(planned)
else:
    found = Discovery(items=[])
    for _ in stream_inputs(found, [folder]):
        n += 1
        if mode == "first" and n == first:
            break
print(json.dumps({"mode": mode, "inputs": n, "s": round(time.perf_counter() - began, 2),
                  "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", type=int, nargs="+", default=[1000, 100_000])
    parser.add_argument("--root", type=Path, default=Path("/tmp/dsv4enc_first_part"))
    parser.add_argument("--first", type=int, default=64)
    parser.add_argument("--modes", nargs="+", default=["first", "stream", "list", "setup"])
    parser.add_argument("--code", type=Path, default=ROOT)
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": str(args.code)}
    for count in args.counts:
        folder = args.root / f"n{count}"
        if not folder.is_dir():
            sys.exit(f"{folder} is missing: make it with benchmarks/first_part.py")
        for mode in args.modes:
            out = subprocess.run([sys.executable, "-c", CHILD, str(folder), mode,
                                  str(args.first)], env=env, check=True, capture_output=True,
                                 text=True, cwd=args.code).stdout  # ``-c`` imports from there first
            print(json.dumps({"count": count, **json.loads(out)}), flush=True)


if __name__ == "__main__":
    main()
