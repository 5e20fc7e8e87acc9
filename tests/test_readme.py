"""README.md and the pages of docs/ run as written: their ```python and ```bash blocks, in
order, in one folder that holds what a reader has after cloning (``examples/``,
``configs/``), against the Quickstart's own images and a tiny random checkpoint.

The README runs first, in that folder. Each docs page then runs in its own copy of the
folder as the README left it (the Quickstart's ``examples/images/`` and ``emb.parquet`` are
there), so a page may build on the Quickstart but never on another page.

A block that needs what a test machine lacks (CUDA, GPUs, the network, other nodes, real
weights) is marked with an HTML comment on the line before its opening fence,
``<!-- skip-test: why -->``, and exactly those are skipped. The checkpoint paths the pages
use as placeholders (``/path/to/checkpoint``) name the tiny checkpoint here. The python
blocks of one page share one namespace, as in a notebook (the API block's ``enc`` is used by
later blocks); each page starts with a fresh one.

Beside running them: every fence of every page is one the runner sees (a block it cannot
see would silently never run), and every relative link between the pages resolves, anchors
included.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from helpers import REPO_ROOT

README = REPO_ROOT / "README.md"
DOCS = REPO_ROOT / "docs"
FENCE = re.compile(r"^```(\w*)\s*$")
SKIP = re.compile(r"^<!--\s*skip-test:\s*(.+?)\s*-->\s*$")
PLACEHOLDER_WEIGHTS = ("/path/to/checkpoint",)
RUN = ("python", "bash")  # the languages that are run
NOT_RUN = ("text", "json", "toml", "yaml")  # what a page may show without running it


@dataclass
class Block:
    language: str
    code: str
    line: int  # of the opening fence, 1-based
    skip: str | None  # why it is not run


def readme_blocks(text: str) -> list[Block]:
    """Every fenced block, with the skip-test reason written just before it (if any)."""
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match or not match.group(1):
            i += 1
            continue
        start, body = i, []
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        previous = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        reason = SKIP.match(previous)
        blocks.append(Block(match.group(1), "\n".join(body) + "\n", start + 1,
                            reason.group(1) if reason else None))
        i += 1
    return blocks


def doc_pages() -> list[Path]:
    """Every page under docs/, in a fixed order."""
    return sorted(DOCS.rglob("*.md"))


def _name(page: Path) -> str:
    return page.relative_to(REPO_ROOT).as_posix()


def test_the_parser_reads_markers():
    text = ("intro\n<!-- skip-test: needs CUDA -->\n```bash\nnvidia-smi\n```\n\n"
            "```python\nx = 1\n```\n```text\nnot code\n```\n")
    blocks = readme_blocks(text)
    assert [(b.language, b.code, b.skip) for b in blocks] == [
        ("bash", "nvidia-smi\n", "needs CUDA"), ("python", "x = 1\n", None),
        ("text", "not code\n", None)]


# --- running the blocks ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def reader_folder(tmp_path_factory) -> Path:
    """What a reader has after cloning: examples/ (without generated images) and configs/."""
    root = tmp_path_factory.mktemp("readme")
    shutil.copytree(REPO_ROOT / "configs", root / "configs")
    shutil.copytree(REPO_ROOT / "examples", root / "examples",
                    ignore=shutil.ignore_patterns("images", "__pycache__"))
    return root


@pytest.fixture(scope="module")
def tiny_weights(tmp_path_factory) -> Path:
    """configs/tiny.json saved as a checkpoint folder (random weights)."""
    from dsv4enc.tower.checkpoint import random_state_dict, save_checkpoint
    from dsv4enc.tower.config import VisionConfig

    cfg = VisionConfig.from_file(REPO_ROOT / "configs" / "tiny.json")
    folder = tmp_path_factory.mktemp("readme_ckpt")
    save_checkpoint(folder, cfg, random_state_dict(cfg, seed=3))
    return folder


def _env(weights: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.update(DSV4ENC_WEIGHTS=str(weights), COLUMNS="120", OMP_NUM_THREADS="2")
    return env


def _with_weights(code: str, weights: Path) -> str:
    for placeholder in PLACEHOLDER_WEIGHTS:
        code = code.replace(placeholder, str(weights))
    return code


@dataclass
class PageRun:
    folder: Path
    namespace: dict
    ran: int
    skipped: int


def run_page(page: Path, folder: Path, weights: Path) -> PageRun:
    """Run the page's unskipped python and bash blocks in order, in ``folder``: bash in a
    fresh ``bash -e -o pipefail``, python in one namespace for the whole page."""
    blocks = [b for b in readme_blocks(page.read_text()) if b.language in RUN]
    env = _env(weights)
    namespace: dict = {"__name__": "__readme__"}
    ran = skipped = 0
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(folder)
        mp.setenv("DSV4ENC_WEIGHTS", str(weights))  # as a user may have it set
        for block in blocks:
            if block.skip is not None:
                skipped += 1
                continue
            code = _with_weights(block.code, weights)
            where = f"{_name(page)} line {block.line}"
            if block.language == "bash":
                proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", code], env=env,
                                      cwd=folder, capture_output=True, text=True,
                                      timeout=300)
                assert proc.returncode == 0, (f"{where}: exit {proc.returncode}\n{code}\n"
                                              f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
            else:
                try:
                    exec(compile(code, where, "exec"), namespace)
                except Exception as exc:  # name the block, not this test's line
                    pytest.fail(f"{where}: {type(exc).__name__}: {exc}\n{code}")
            ran += 1
    assert ran + skipped == len(blocks)
    return PageRun(folder, namespace, ran, skipped)


@pytest.fixture(scope="module")
def readme_run(reader_folder, tiny_weights) -> PageRun:
    """The README, run once; the docs pages start where it ends."""
    return run_page(README, reader_folder, tiny_weights)


def test_readme_blocks_run(readme_run):
    blocks = [b for b in readme_blocks(README.read_text()) if b.language in RUN]
    assert any(b.skip is None and b.language == "bash" for b in blocks)
    assert any(b.skip is None and b.language == "python" for b in blocks)
    assert readme_run.ran >= 4
    # what the blocks promise
    folder, namespace = readme_run.folder, readme_run.namespace
    assert (folder / "emb.parquet").is_file()
    assert (folder / "summary.json").is_file()
    assert len(namespace["embs"]) == 2
    assert namespace["rows"]["error"].to_pylist()[0] is None
    assert namespace["rows"]["error"].to_pylist()[1].startswith("OSError")
    assert namespace["rows"].column_names[-2:] == ["error", "caption"]  # kept columns follow


def _api_promises(run: PageRun) -> None:
    # the loop mirrors the folders; the pipeline recipes give the broken image's error row
    assert (run.folder / "out" / "cat.jpg.npy").is_file()
    assert (run.folder / "out" / "nested" / "holiday" / "beach.jpg.npy").is_file()
    assert set(run.namespace["errors"]) == {"nested/broken.jpg"}
    out = run.namespace["out"]
    assert list(out.filter(lambda row: row["error"] is not None)["path"]) == [
        "nested/broken.jpg"]
    assert len(out) == len(run.namespace["files"])
    assert out.column_names[:3] == ["image", "key", "caption"]  # kept through datasets.map
    assert list(out["caption"]) == [f"a picture named {Path(p).stem}" for p in out["image"]]
    assert list((run.folder / "ray_emb").glob("*.parquet"))


def _files(*names: str) -> Callable[[PageRun], None]:
    def check(run: PageRun) -> None:
        for name in names:
            assert (run.folder / name).exists(), name
    return check


def _output_format_promises(run: PageRun) -> None:
    # the errors list, retried once the broken image was fixed, left no failed row
    _files("inspect.json", "failed.txt")(run)
    import pyarrow.parquet as pq

    table = pq.read_table(run.folder / "emb.parquet", columns=["path", "error"])
    assert "nested/broken.jpg" in table["path"].to_pylist()
    assert table["error"].null_count == len(table)


#: What each page's blocks leave behind, beyond running without an error.
PROMISES: dict[str, Callable[[PageRun], None]] = {
    "docs/api.md": _api_promises,
    "docs/checkpoints.md": _files("emb41.parquet", "vision-only/config.json",
                                  "emb-vision-only.parquet"),
    "docs/inputs.md": _files("mixed.parquet", "table-emb.parquet"),
    "docs/many-gpus.md": _files("emb-2ranks.parquet"),
    "docs/output-format.md": _output_format_promises,
    "docs/resume-and-safety.md": _files("parts/_manifest.json", "photos.parquet"),
}


@pytest.mark.parametrize("page", doc_pages(), ids=_name)
def test_docs_page_blocks_run(page, readme_run, tiny_weights, tmp_path):
    folder = tmp_path / "reader"
    shutil.copytree(readme_run.folder, folder, symlinks=True)
    run = run_page(page, folder, tiny_weights)
    PROMISES.get(_name(page), lambda run: None)(run)


def test_every_page_is_run_and_every_promise_has_a_page():
    pages = {_name(p) for p in doc_pages()}
    assert {"docs/api.md", "docs/output-format.md", "docs/reproducibility.md",
            "docs/many-gpus.md", "docs/resume-and-safety.md", "docs/object-storage.md",
            "docs/inputs.md", "docs/speed.md"} <= pages
    assert set(PROMISES) <= pages


# --- what the runner would miss -------------------------------------------------------------


def _fence_problems(text: str) -> list[str]:
    """Fences the runner cannot see or will not run: an indented fence, one with no language
    or with a language that is neither run nor known to be output (```sh, ```py, ...)."""
    problems, inside = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if not line.lstrip().startswith("```"):
            continue
        if line != line.lstrip():
            problems.append(f"line {number}: an indented fence is never run")
            continue
        if inside:  # a closing fence
            inside = False
            if line.strip() != "```":
                problems.append(f"line {number}: a closing fence with text after it")
            continue
        inside = True
        match = FENCE.match(line)
        if not match:
            problems.append(f"line {number}: {line!r} is not a fence the runner reads")
        elif match.group(1) not in RUN + NOT_RUN:
            problems.append(f"line {number}: {line!r}: use one of {RUN + NOT_RUN}")
    if inside:
        problems.append("a fence is never closed")
    return problems


def test_the_fence_check_finds_what_the_runner_misses():
    text = ("```py\nx\n```\n  ```bash\nls\n  ```\n```\nplain\n```\n```bash\nok\n```\n"
            "```text\nout\n```\n")
    assert [p.split(":")[0] for p in _fence_problems(text)] == [
        "line 1", "line 4", "line 6", "line 7"]


@pytest.mark.parametrize("page", [README, *doc_pages()], ids=_name)
def test_every_block_is_one_the_runner_sees(page):
    assert _fence_problems(page.read_text()) == [], _name(page)


# --- the set-up the README shows is the one .ci/run runs ------------------------------------


def _commands(text: str) -> list[str]:
    """Shell command lines, without comments, ``-q``, a ``timeout N`` prefix or extra spaces."""
    commands = []
    for line in text.splitlines():
        words = shlex.split(line, comments=True)
        if not words or words[0] in ("set", "cd", "export", "git"):
            continue
        if words[0] == "timeout":
            words = words[2:]
        commands.append(" ".join(w for w in words if w != "-q"))
    return commands


def test_the_setup_block_is_what_ci_runs():
    """.ci/run installs and tests with the README's set-up commands: the same commands, in
    the same order (it adds only -q, a timeout and the thread count)."""
    setup = next(b for b in readme_blocks(README.read_text())
                 if b.language == "bash" and "pip install" in b.code)
    shown = _commands(setup.code)
    assert shown[0] == "python -m venv .venv && . .venv/bin/activate"
    ci = _commands((REPO_ROOT / ".ci" / "run").read_text())
    ci = [c for c in ci if not c.startswith(("python3 -m venv", ".")) and "--upgrade pip" not in c]
    assert shown[1:] == ci
    assert any(c.startswith("python -m pytest") for c in ci)


# --- links between the pages ----------------------------------------------------------------

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    anchors, inside = set(), False
    for line in text.splitlines():
        if line.startswith("```"):
            inside = not inside
        elif not inside and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def _links(text: str) -> list[str]:
    """Link targets outside code blocks and code spans."""
    prose, inside = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            inside = not inside
        elif not inside:
            prose.append(re.sub(r"(`+).*?\1", "", line))
    return LINK.findall("\n".join(prose))


def test_anchors_follow_github():
    assert _anchors("## Output layouts: `--pool mean` and `--features vit`\n"
                    "### Keys (the `path` column)\n# Object storage (s3://, gs://, ...)\n") == {
        "output-layouts---pool-mean-and---features-vit", "keys-the-path-column",
        "object-storage-s3-gs-"}


LINKED_PAGES = [README, REPO_ROOT / "ARCHITECTURE.md", REPO_ROOT / "examples" / "README.md",
                *doc_pages()]


@pytest.mark.parametrize("page", LINKED_PAGES, ids=_name)
def test_links_resolve(page):
    broken = []
    for target in _links(page.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and (file.suffix != ".md" or anchor not in _anchors(file.read_text())):
            broken.append(f"{target}: no such heading")
    assert broken == [], _name(page)


# --- the pages and the tool -----------------------------------------------------------------

#: Flags of other programs the pages show (torchrun's, and pytest's --dist).
OTHER_PROGRAMS_FLAGS = {"--nproc-per-node", "--nnodes", "--node-rank", "--rdzv-backend",
                        "--rdzv-endpoint", "--rdzv-id", "--no-python", "--dist"}
#: Flags the pages name to say that there is no such option ("has no Ray engine").
ABSENT_FLAGS = {"--engine"}


def _command_flags() -> dict[str, set[str]]:
    import typer

    from dsv4enc.cli import app

    group = typer.main.get_command(app)
    flags = {name: {opt for param in command.params for opt in (*param.opts,
                                                                 *param.secondary_opts)
                    if opt.startswith("--")}
             for name, command in group.commands.items()}
    flags[""] = {opt for param in group.params for opt in param.opts if opt.startswith("--")}
    return flags


@pytest.mark.parametrize("page", [README, *doc_pages()], ids=_name)
def test_every_flag_a_page_names_is_an_option_of_its_command(page):
    """A flag named in the README or a docs page belongs to ``encode`` (or inspect, extract,
    the group), to torchrun, or to ``bench`` in a paragraph that speaks of bench: no option
    a command lacks (``--max-images`` is bench's and the API's ``max_images``, not
    encode's)."""
    flags = _command_flags()
    general = set().union(*(f for name, f in flags.items() if name != "bench"), {"--help"})
    wrong = []
    for paragraph in re.split(r"\n\s*\n", page.read_text()):
        for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", paragraph):
            if flag in general or flag in OTHER_PROGRAMS_FLAGS:
                continue
            if flag in ABSENT_FLAGS and "has no" in paragraph:
                continue
            if flag in flags["bench"] and "bench" in paragraph:
                continue
            wrong.append(f"{flag} in: {paragraph.strip()[:80]}")
    assert not wrong, (_name(page), wrong)


def test_the_setup_block_starts_from_a_clone_in_a_venv():
    block = next(b for b in readme_blocks(README.read_text()) if "pip install" in b.code)
    steps = [line.split("#")[0].strip() for line in block.code.splitlines() if line.strip()]
    # a clone named dsv4enc/ would shadow the installed package for scripts run beside it
    clone = steps[0].split()
    assert clone[:2] == ["git", "clone"] and len(clone) == 4 and clone[3] != "dsv4enc"
    assert steps[1] == f"cd {clone[3]}"
    assert steps[2] == "python -m venv .venv && . .venv/bin/activate"
    assert all("pip install" in step or "pytest" in step for step in steps[3:])


def test_the_pandas_recipe_keeps_int32_columns(tmp_path):
    """The output format page says that plain pandas reads failed rows' int32 columns as
    float64, and its recipe (run by test_docs_page_blocks_run) keeps them int32."""
    import pandas as pd
    import pyarrow as pa
    import pyarrow.parquet as pq

    text = (DOCS / "output-format.md").read_text()
    assert "float64" in text and "to_pandas(types_mapper=pd.ArrowDtype)" in text
    table = pa.table({"width": pa.array([640, None], pa.int32()),
                      "embedding": pa.array([b"\0\0", None], pa.large_binary())})
    pq.write_table(table, tmp_path / "t.parquet")
    assert pd.read_parquet(tmp_path / "t.parquet").width.dtype == "float64"  # what it says
    kept = pq.read_table(tmp_path / "t.parquet").to_pandas(types_mapper=pd.ArrowDtype)
    assert str(kept.width.dtype) == "int32[pyarrow]"
    assert kept.width.isna().tolist() == [False, True]
    assert [bytes(b) for b in kept.embedding.dropna()] == [b"\0\0"]


def test_the_pages_start_a_local_ray_with_address_local():
    """A bare ``ray.init(num_cpus=...)`` joins the cluster that an earlier Ray's address file
    names (and then refuses ``num_cpus``): a page that starts its own Ray says
    ``address="local"``."""
    for page in [README, *doc_pages()]:
        for block in readme_blocks(page.read_text()):
            for call in re.findall(r"ray\.init\(([^)]*)\)", block.code):
                if "num_cpus" in call:
                    assert 'address="local"' in call, (_name(page), block.line, call)
