"""Pause points: places where a run waits for a test's go-ahead.

A test that stops, signals, kills or observes a run midway must never bet that the machine
is slow enough (on a faster CPU the run is over before the test looks); it names the points:

    DSV4ENC_PAUSE_AT=commit,encoded  DSV4ENC_PAUSE_DIR=/some/folder

At each named point the run writes ``FOLDER/POINT.N.json`` (N counts from 1 per point; it holds
what the point reports), then waits until ``FOLDER/POINT.N.go`` or ``FOLDER/go`` exists (``go``
releases every later pause too). Without those variables (every real run) a point costs one lookup.

The points: ``commit`` (a part was committed: a kill now loses nothing before it),
``encoded`` (a batch's rows were counted in the progress), ``upload`` (the child that uploads
a single-file output to a store read the next bytes to send; it reports its ``pid`` and the
bytes read, ``sent``),
under ``--engine ray`` ``segment`` (an encoder actor is about to encode a part; it reports
its ``pid``) and ``written`` (an actor wrote a part's file, not yet reported or committed),
at the end of a folder output's ``--update`` ``switch`` (the new output is complete
beside the old one) and ``switched`` (it took the old one's place; the old is not yet removed),
and ``lock`` (a bucket output's run found a stale lock object and is about to take it over;
it reports its ``pid``)."""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

POINTS_VARIABLE = "DSV4ENC_PAUSE_AT"
FOLDER_VARIABLE = "DSV4ENC_PAUSE_DIR"
#: How often a paused run looks for its go-ahead.
POLL_S = 0.005

_counters: dict[str, itertools.count] = {}
_lock = threading.Lock()


def armed(point: str) -> bool:
    """Whether the environment asks the run to wait at ``point`` (a caller computes facts then)."""
    names = os.environ.get(POINTS_VARIABLE)
    return bool(names) and point in names.split(",")


def pause(point: str, **facts: Any) -> None:
    """Wait at ``point`` when the environment asks for it, ``facts`` in its ``.json`` file."""
    if not armed(point):
        return
    folder = Path(os.environ[FOLDER_VARIABLE])
    with _lock:
        n = next(_counters.setdefault(point, itertools.count(1)))
    reached = folder / f"{point}.{n}.json"
    # one temporary per process: torchrun's ranks share the folder and reach a point alike
    temporary = reached.with_suffix(f".{os.getpid()}.tmp")
    temporary.write_text(json.dumps(facts))
    os.replace(temporary, reached)  # the test never reads half a file
    go, release_all = folder / f"{point}.{n}.go", folder / "go"
    while not (go.exists() or release_all.exists()):
        time.sleep(POLL_S)
