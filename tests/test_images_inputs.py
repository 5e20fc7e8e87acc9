"""Input discovery: which files are images, in what order, under which key; symlinks, path
lists, and inputs that do not exist."""

from __future__ import annotations

import io
import os
import signal
import sys
from pathlib import Path

import pytest

from dsv4enc.images.decode import decode_image, probe_image
from dsv4enc.errors import UsageError
from dsv4enc.images.discover import (Discovery, InputItem, discover, is_image_name, iter_folder,
                                     read_path_list)
from dsv4enc.columns import utf8_text
from dsv4enc.output.files import output_paths

from helpers import write_image

needs_symlinks = pytest.mark.skipif(not hasattr(os, "symlink") or sys.platform == "win32",
                                    reason="needs POSIX symlinks")


def touch(path: Path, data: bytes = b"x") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def keys(items: list[InputItem]) -> list[str]:
    return [item.key for item in items]


@pytest.fixture
def no_hang():
    """Fail (rather than hang the suite) if a walk does not finish within 10 s."""
    def expire(signum, frame):
        raise TimeoutError("walk did not finish: a symlink loop is being followed")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(10)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


# --------------------------------------------------------------------------- extensions

@pytest.mark.parametrize("name", ["a.jpg", "a.JPG", "b.Jpeg", "c.TIFF", "d.tif", "e.PnG",
                                  "f.webp", "g.WEBP", "h.bmp", "i.GIF", "dir.x/j.jpeg",
                                  "two.dots.png"])
def test_image_extensions_are_case_insensitive(name):
    assert is_image_name(name)


@pytest.mark.parametrize("name", ["notes.txt", "jpg", "a.jpg.zip", "a.jpgx", "a.pdf",
                                  "Makefile", "a.", "x.jpg/readme.md"])
def test_other_names_are_not_images(name):
    assert not is_image_name(name)


def walk_folder(root: Path) -> tuple[list[InputItem], int]:
    """``iter_folder``'s images as a list, and how many other files were skipped."""
    found = Discovery()
    return list(iter_folder(root, found)), found.skipped


def test_walk_keeps_upper_case_extensions(tmp_path):
    for name in ("a.JPG", "b.Jpeg", "c.TIFF", "d.txt", "e.PNG.bak"):
        touch(tmp_path / name)
    items, skipped = walk_folder(tmp_path)
    assert keys(items) == ["a.JPG", "b.Jpeg", "c.TIFF"]
    assert skipped == 2


def test_hidden_entries_and_excluded_globs_are_left_out_of_a_walk(tmp_path):
    """A folder's walk passes over hidden files and folders (macOS ``._*`` resource files,
    ``.git``) and what an --exclude glob matches by name or by path under the folder (a
    matched folder is not walked); a file given by name is taken as given."""
    for name in ("a.jpg", "._a.jpg", ".hidden.png", ".git/x.png", "raw/b.png", "keep/raw.png",
                 "keep/c.png", "keep/c.tmp.png", "sub/raw/d.png"):
        touch(tmp_path / "data" / name)
    root = str(tmp_path / "data")
    assert keys(discover([root]).items) == ["a.jpg", "keep/c.png", "keep/c.tmp.png",
                                            "keep/raw.png", "raw/b.png", "sub/raw/d.png"]
    found = discover([root], exclude=["*.tmp.png", "raw"])
    assert keys(found.items) == ["a.jpg", "keep/c.png", "keep/raw.png"]
    assert found.skipped == 0  # left out, not counted as "not images"
    assert keys(discover([root], exclude=["sub/*"]).items) == [
        "a.jpg", "keep/c.png", "keep/c.tmp.png", "keep/raw.png", "raw/b.png"]
    hidden = str(tmp_path / "data" / "._a.jpg")
    assert keys(discover([hidden], exclude=["*.jpg"]).items) == [hidden]


def test_the_run_s_own_output_is_left_out_of_the_walk_of_its_input_folder(tmp_path):
    """``--out`` inside an input folder, and a single file's parts folder beside it, are never
    inputs (nor counted as skipped); a folder of the same name elsewhere is walked."""
    for name in ("a.jpg", "e.parquet", "e.parquet.partial/part-000000.parquet", "emb/b.jpg",
                 "other/emb/c.jpg", "other/e.parquet.partial/d.jpg"):
        touch(tmp_path / "data" / name)
    root = tmp_path / "data"
    for out, kept in ((root / "e.parquet", ["a.jpg", "emb/b.jpg"]), (root / "emb", ["a.jpg"])):
        found = discover([str(root)], outputs=output_paths(str(out)))
        assert keys(found.items) == kept + ["other/e.parquet.partial/d.jpg", "other/emb/c.jpg"]
        assert found.skipped == (out.name == "emb") * 2  # the file and its parts' table


# --------------------------------------------------------------------------- order and keys

def test_sorted_recursive_order(tmp_path):
    """Depth-first, each folder's entries sorted by name (code points), so that keys come out
    in pathlib order: component by component, not as flat strings ("b/..." before "b-c")."""
    names = ["b.jpg", "b/z.png", "b/a/deep.png", "b-c.gif", "a.png", "Zed.PNG", "é.webp",
             "日本.jpeg", "e\u0301.png", "x.jpg/inner.bmp", "bad/empty.jpg", "10.jpg", "9.jpg"]
    for name in names:
        touch(tmp_path / name)
    touch(tmp_path / "notes.txt")
    touch(tmp_path / "b" / "readme.md")
    items, skipped = walk_folder(tmp_path)
    expected = ["10.jpg", "9.jpg", "Zed.PNG", "a.png", "b/a/deep.png", "b/z.png", "b-c.gif",
                "b.jpg", "bad/empty.jpg", "e\u0301.png", "x.jpg/inner.bmp", "é.webp",
                "日本.jpeg"]
    assert keys(items) == expected
    assert keys(items) == sorted(names, key=lambda k: k.split("/"))
    assert skipped == 2
    # The decoder opens the real file; the key is posix and relative to the folder.
    for item in items:
        assert Path(item.path) == tmp_path / item.key
        assert "\\" not in item.key and not item.key.startswith("/")


def test_folder_named_like_an_image_is_walked_not_encoded(tmp_path):
    touch(tmp_path / "x.jpg" / "y.png")
    (tmp_path / "empty.png").mkdir()
    items, skipped = walk_folder(tmp_path)
    assert keys(items) == ["x.jpg/y.png"]
    assert skipped == 0
    # Given directly, such a folder is walked too, and its keys are relative to it.
    found = discover([str(tmp_path / "x.jpg")])
    assert keys(found.items) == ["y.png"]


def test_inputs_keep_their_order_and_files_keep_their_given_path(tmp_path, monkeypatch):
    touch(tmp_path / "one" / "b.png")
    touch(tmp_path / "one" / "a.png")
    touch(tmp_path / "two" / "c.jpg")
    touch(tmp_path / "loose.WEBP")
    touch(tmp_path / "readme.txt")
    monkeypatch.chdir(tmp_path)
    absolute = str(tmp_path / "loose.WEBP")
    found = discover(["two", "./one/b.png", "one", absolute, "readme.txt"])
    # Two folders: each folder's keys start with the folder as given (unique keys).
    assert keys(found.items) == ["two/c.jpg", "./one/b.png", "one/a.png", "one/b.png", absolute]
    assert found.skipped == 1
    assert [Path(i.path).resolve() for i in found.items] == [
        tmp_path / "two/c.jpg", tmp_path / "one/b.png", tmp_path / "one/a.png",
        tmp_path / "one/b.png", tmp_path / "loose.WEBP"]


def test_non_utf8_file_name_gets_a_text_key(tmp_path):
    """A name that is not valid UTF-8 is found; the decoder opens the real file, and the
    Parquet ``path`` column (UTF-8) shows the bad byte escaped."""
    raw = os.fsencode(tmp_path) + b"/caf\xe9.png"
    try:
        fd = os.open(raw, os.O_WRONLY | os.O_CREAT, 0o644)
    except OSError:
        pytest.skip("file system refuses non-UTF-8 names")
    os.close(fd)
    write_image(Path(os.fsdecode(raw)), (16, 16), seed=0)
    items, _ = walk_folder(tmp_path)
    assert len(items) == 1
    key = items[0].key
    assert os.fsencode(key) == b"caf\xe9.png"
    assert utf8_text(key) == "caf\\xe9.png"  # what the path column holds
    assert utf8_text("日本.jpg") == "日本.jpg"
    assert probe_image(items[0].path).error is None


# --------------------------------------------------------------------------- symlinks

@needs_symlinks
def test_symlink_loop_does_not_repeat_or_hang(tmp_path, no_hang):
    touch(tmp_path / "a.png")
    touch(tmp_path / "sub" / "b.png")
    os.symlink("..", tmp_path / "sub" / "up")  # sub/up -> the root: a loop
    os.symlink(".", tmp_path / "sub" / "self")
    items, skipped = walk_folder(tmp_path)
    assert keys(items) == ["a.png", "sub/b.png"]
    assert skipped == 0


@needs_symlinks
def test_symlinked_file_is_included_once_per_name(tmp_path):
    touch(tmp_path / "a.png")
    os.symlink("a.png", tmp_path / "b.png")
    os.symlink(tmp_path / "a.png", tmp_path / "c.jpg")
    os.symlink("a.png", tmp_path / "d.txt")  # a link to an image, but not an image name
    items, skipped = walk_folder(tmp_path)
    assert keys(items) == ["a.png", "b.png", "c.jpg"]
    assert skipped == 1
    assert len({os.path.realpath(i.path) for i in items}) == 1


@needs_symlinks
def test_dangling_symlink_becomes_an_error_later_not_a_crash(tmp_path):
    touch(tmp_path / "a.png")
    os.symlink(tmp_path / "gone.png", tmp_path / "broken.png")
    os.symlink(tmp_path / "gone.txt", tmp_path / "broken.txt")
    items, skipped = walk_folder(tmp_path)
    assert keys(items) == ["a.png", "broken.png"]
    assert skipped == 1
    probe = probe_image(items[1].path)
    assert probe.width is None and probe.error and "\n" not in probe.error
    from dsv4enc.tower.config import VisionConfig
    from helpers import CONFIGS

    decoded = decode_image(items[1].path, VisionConfig.from_file(CONFIGS / "tiny.json"))
    assert decoded.patches is None and decoded.error
    # Given directly, too.
    found = discover([str(tmp_path / "broken.png")])
    assert keys(found.items) == [str(tmp_path / "broken.png")]


@needs_symlinks
def test_a_container_given_by_name_behind_a_bad_link_is_an_error_row(tmp_path):
    """A ``.tar`` or table given by name that is a dangling link, or a link to a FIFO or a
    device, is one error row (as in a folder), never passed over as if it were no image."""
    os.mkfifo(tmp_path / "fifo")
    os.symlink(tmp_path / "fifo", tmp_path / "fifo.tar")
    os.symlink(tmp_path / "gone.tar", tmp_path / "dangling.tar")
    os.symlink(os.devnull, tmp_path / "null.parquet")
    names = [str(tmp_path / name) for name in ("fifo.tar", "dangling.tar", "null.parquet")]
    found = discover(names)
    assert keys(found.items) == [f"{name}@0" for name in names]
    assert found.skipped == 0
    reasons = [item.member.reason for item in found.items]
    assert "not a regular file" in reasons[0] and "No such file" in reasons[1]
    assert "not a regular file" in reasons[2]


def test_a_folder_not_listed_is_named_on_one_line(caplog):
    """The line for a folder that cannot be listed shows a newline or a non-UTF-8 byte in its
    name escaped (as error lines show keys): one line, never the raw character."""
    from dsv4enc.images.discover import warn_unlisted

    with caplog.at_level("ERROR", logger="dsv4enc"):
        warn_unlisted([(os.fsdecode(b"in/bad\nname\xff"), "Permission denied")])
    [line] = caplog.messages
    assert "\n" not in line and "in/bad\\nname\\xff (Permission denied)" in line, line


# --------------------------------------------------------------------------- errors, lists

def test_missing_input_is_a_one_line_usage_error(tmp_path):
    touch(tmp_path / "a.png")
    with pytest.raises(UsageError) as info:
        discover([str(tmp_path), str(tmp_path / "nope")])
    message = str(info.value)
    assert "\n" not in message and "nope" in message and "not found" in message
    assert info.value.exit_code == 2


def test_files_from_reads_paths_as_given(tmp_path):
    touch(tmp_path / "a.png")
    (tmp_path / "dir.jpg").mkdir()
    listing = tmp_path / "list.txt"
    listing.write_text(f"  {tmp_path / 'a.png'}  \n\nmissing.jpg\r\nnotes.txt\n"
                       f"{tmp_path / 'dir.jpg'}\n")
    found = discover([], str(listing))
    # A listed path that does not exist is kept (an error row later); the others are skipped.
    assert keys(found.items) == [str(tmp_path / "a.png"), "missing.jpg"]
    assert found.skipped == 2


def test_a_files_from_line_too_long_for_the_file_system_is_kept_for_its_error_row(tmp_path):
    """A listed name over 255 bytes cannot be looked at (ENAMETOOLONG): kept, as a missing
    path is, for its error row, never a traceback that ends the listing."""
    touch(tmp_path / "a.png")
    long = str(tmp_path / ("y" * 300 + ".png"))
    listing = tmp_path / "list.txt"
    listing.write_text(f"{tmp_path / 'a.png'}\n{long}\n")
    assert keys(discover([], str(listing)).items) == [str(tmp_path / "a.png"), long]


def test_a_folder_line_in_files_from_is_named_as_not_walked(tmp_path, caplog):
    """A list's line is read as a file: a folder it names is not walked, which the run says
    at error level (``-q`` shows it), rather than leave its images silently out."""
    write_image(tmp_path / "imgs" / "a.png", (20, 10))
    listing = tmp_path / "list.txt"
    listing.write_text(f"{tmp_path / 'imgs'}\n{tmp_path / 'imgs' / 'a.png'}\n{tmp_path}\n")
    with caplog.at_level("ERROR", logger="dsv4enc"):
        found = discover([], str(listing))
    assert keys(found.items) == [str(tmp_path / "imgs" / "a.png")]
    [record] = [r for r in caplog.records if "folder" in r.getMessage()]
    assert record.levelname == "ERROR" and str(tmp_path / "imgs") in record.getMessage()
    assert "not walked" in record.getMessage()


def test_files_from_lists_tar_shards_and_tables_as_their_images(tmp_path):
    """A list of shards (``ls shards/*.tar > list.txt``, past the shell's argument limit) is
    read as given by name: each container's images, keyed under the line."""
    import tarfile

    import pyarrow as pa
    import pyarrow.parquet as pq

    image = write_image(tmp_path / "a.png", (20, 10))
    with tarfile.open(tmp_path / "s.tar", "w") as archive:
        archive.add(image, "0001.png")
    pq.write_table(pa.table({"image": [image.read_bytes()]}), tmp_path / "t.parquet")
    listing = tmp_path / "list.txt"
    listing.write_text(f"{tmp_path / 's.tar'}\n{tmp_path / 't.parquet'}\n{image}\n")
    found = discover([], str(listing))
    assert keys(found.items) == [f"{tmp_path / 's.tar'}/0001", f"{tmp_path / 't.parquet'}#0",
                                 str(image)]
    assert found.skipped == 0 and found.shards == 1 and found.tables == 1
    only_shards = tmp_path / "shards.txt"
    only_shards.write_text(f"{tmp_path / 's.tar'}\n")
    assert keys(discover([], str(only_shards)).items) == [f"{tmp_path / 's.tar'}/0001"]


def test_a_compressed_tar_in_files_from_is_refused_as_by_name(tmp_path):
    """A ``.tar.gz`` line is refused in one line that says to decompress it, as the shard
    given by name is, not passed over as a file that is no image (its images silently lost)."""
    import tarfile

    image = write_image(tmp_path / "a.png", (20, 10))
    for name, mode in (("s.tar", "w"), ("t.tar.gz", "w:gz")):
        with tarfile.open(tmp_path / name, mode) as archive:
            archive.add(image, "0001.png")
    listing = tmp_path / "list.txt"
    listing.write_text(f"{tmp_path / 's.tar'}\n{tmp_path / 't.tar.gz'}\n")
    with pytest.raises(UsageError, match="gzip-compressed tar shard.*decompress it first"):
        discover([], str(listing))


def test_files_from_stdin_and_undecodable_bytes(tmp_path, monkeypatch):
    raw = b"one.png\n caf\xe9.jpg \n\n"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(raw)))
    paths = list(read_path_list("-"))
    assert paths[0] == "one.png"
    assert os.fsencode(paths[1]) == b"caf\xe9.jpg"  # the file system's own bytes
    listing = tmp_path / "list.txt"
    listing.write_bytes(raw)
    assert list(read_path_list(str(listing))) == paths
    listing.write_bytes(b"\xef\xbb\xbf" + raw)  # as Notepad saves it
    assert list(read_path_list(str(listing))) == paths


def test_a_utf16_files_from_list_is_refused_as_such(tmp_path):
    """A list saved as UTF-16 (Windows PowerShell's ``>``) says so in one line, not that none
    of its paths (read as bytes full of NULs) exists."""
    listing = tmp_path / "list.txt"
    for encoding in ("utf-16", "utf-16-be"):
        listing.write_bytes(("\ufeff" if encoding.endswith("be") else "")
                            .encode(encoding) + "a.png\r\nb.png\r\n".encode(encoding))
        with pytest.raises(UsageError, match="UTF-16") as info:
            list(read_path_list(str(listing)))
        assert "\n" not in str(info.value) and "UTF-8" in str(info.value)


def test_unreadable_files_from_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError) as info:
        list(read_path_list(str(tmp_path / "no-such-list.txt")))
    assert "\n" not in str(info.value) and "--files-from" in str(info.value)


@pytest.mark.skipif(sys.platform == "win32", reason="needs a POSIX terminal")
def test_files_from_stdin_that_is_a_terminal_is_refused(monkeypatch):
    """``--files-from -`` with no list piped in (standard input a terminal) is refused in one
    line, as a terminal named by its path is: it would wait for typed paths, with no prompt."""
    import pty

    main, side = pty.openpty()
    os.write(main, b"a.png\n\x04")  # typed: a path, then end-of-file (Ctrl-D)
    with os.fdopen(side, "r") as terminal:
        monkeypatch.setattr(sys, "stdin", terminal)
        with pytest.raises(UsageError, match="standard input is a terminal"):
            list(read_path_list("-"))
    os.close(main)


# --------------------------------------------------------------------------- streaming

TRICKY = ["a.png", "a/b.png", "a.b/c.png", "a-b.png", "a b/c.jpg", ".hidden.png", "..dots.png",
          "x/.y/z.png", "é.webp", "e\u0301.png", "日本/a.jpg", "日本.jpeg", "A.PNG", "#1.png",
          "a/b/c/d.png", "a/b.c.png", "ab/c.png", "a0.png", "a/0.png"]


def test_streamed_walk_is_the_sorted_order(tmp_path):
    """The walk yields as it goes, in the order of the paths sorted component by component
    (each folder's entries by name): the folder "a" comes before "a.png", as the name "a"
    sorts before "a.png", though as whole strings "a.png" < "a/b.png". It is the order the
    keys' ``#N`` numbers and the parts' bounds were always cut from."""
    from dsv4enc.images.discover import Discovery, iter_folder

    for name in TRICKY:
        touch(tmp_path / name)
    touch(tmp_path / "a" / "notes.txt")
    found = Discovery(items=[])
    streamed = keys(iter_folder(tmp_path, found))
    visible = [k for k in TRICKY if not any(part.startswith(".") for part in k.split("/"))]
    assert streamed == sorted(visible, key=lambda k: k.split("/"))  # hidden ones left out
    assert found.skipped == 1
    # the whole-list discovery gives the same keys in the same order
    assert keys(discover([str(tmp_path)]).items) == streamed


def test_first_inputs_come_before_the_listing_ends(tmp_path, monkeypatch):
    """A folder that cannot be listed yet (its listing stands for a slow file system or a
    bucket's later pages) does not hold back the inputs found before it."""
    from dsv4enc import storage
    from dsv4enc.images.discover import Discovery, stream_inputs

    for name in ["a/1.png", "a/2.png", "b/3.png", "z/4.png"]:
        touch(tmp_path / name)
    real = storage._list_folder
    reached: list[str] = []

    def listing(folder: str):
        reached.append(Path(folder).name)
        if Path(folder).name == "z":
            raise AssertionError("the folder z was listed before the first inputs were taken")
        return real(folder)

    monkeypatch.setattr(storage, "_list_folder", listing)
    found = Discovery(items=[])
    stream = stream_inputs(found, [str(tmp_path)])
    assert [next(stream).key, next(stream).key] == ["a/1.png", "a/2.png"]
    assert "z" not in reached and not found.listed
    monkeypatch.setattr(storage, "_list_folder", real)
    assert keys(stream) == ["b/3.png", "z/4.png"]
    assert found.listed


def test_streamed_keys_are_unique_across_inputs(tmp_path, monkeypatch):
    """The same file given three times: numbered as the inputs come, as a whole list is."""
    from dsv4enc.images.discover import Discovery, stream_inputs

    touch(tmp_path / "a.png")
    monkeypatch.chdir(tmp_path)
    found = Discovery(items=[])
    assert keys(stream_inputs(found, ["a.png", "a.png", "a.png"])) == ["a.png", "a.png#2",
                                                                     "a.png#3"]
    assert keys(discover(["a.png", "a.png", "a.png"]).items) == ["a.png", "a.png#2", "a.png#3"]


def test_a_missing_input_with_a_newline_in_its_name_is_named_on_one_line(tmp_path):
    """The refusal shows a newline or a non-UTF-8 byte of the name escaped: one line."""
    with pytest.raises(UsageError) as info:
        discover([os.fsdecode(bytes(tmp_path) + b"/gone\nname\xff.png")])
    message = str(info.value)
    assert "\n" not in message and "gone\\nname\\xff.png" in message, message


def refusal_without_permission(build) -> str:
    """The UsageError text of ``discover`` over the inputs ``build(root)`` makes in a fresh
    folder, as a user who may not read them (a child process that gives up root first:
    root reads anything)."""
    import json
    import shutil
    import subprocess
    import tempfile

    root = Path(tempfile.mkdtemp(dir="/tmp"))
    try:
        root.chmod(0o755)
        inputs = build(root)
        script = ("import json, os, sys\n"
                  "from dsv4enc.errors import UsageError\n"
                  "from dsv4enc.images.discover import discover\n"
                  "if os.geteuid() == 0:\n"
                  "    os.setgid(65534); os.setuid(65534)\n"
                  "try:\n"
                  "    discover(json.loads(sys.argv[1]))\n"
                  "except UsageError as exc:\n"
                  "    print(exc)\n")
        proc = subprocess.run([sys.executable, "-c", script, json.dumps(inputs)], cwd="/",
                              capture_output=True, text=True, timeout=60,
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()
    finally:
        for folder in root.iterdir():
            folder.chmod(0o755)
        shutil.rmtree(root)


@pytest.mark.skipif(not hasattr(os, "geteuid"), reason="POSIX permissions")
def test_an_input_behind_a_folder_without_permission_is_not_called_missing():
    """A file in a folder the user may not enter exists: the refusal says why it cannot be
    read, not that it is not there."""
    def build(root: Path) -> list[str]:
        touch(root / "closed" / "a.png")
        (root / "closed").chmod(0)
        return [str(root / "closed" / "a.png")]

    message = refusal_without_permission(build)
    assert "closed/a.png" in message and "Permission denied" in message, message
    assert "not found" not in message, message


@pytest.mark.skipif(not hasattr(os, "geteuid"), reason="POSIX permissions")
def test_an_input_folder_that_cannot_be_listed_is_refused_not_an_empty_run():
    """A folder given by name that the user may not list is refused in one line before
    anything is listed, like a missing input (not a run of nothing that exits 0)."""
    def build(root: Path) -> list[str]:
        touch(root / "open" / "a.png")
        touch(root / "closed" / "b.png")
        (root / "closed").chmod(0)
        return [str(root / "open"), str(root / "closed")]

    message = refusal_without_permission(build)
    assert message.startswith("cannot list input folder ") and message.endswith(
        "closed: Permission denied"), message


@needs_symlinks
def test_an_input_folder_behind_a_dangling_link_is_refused_as_one(tmp_path):
    """A link given as an input folder whose target is gone (a share not mounted) or a loop
    is refused for what it is, not as an input set without images."""
    (tmp_path / "photos").symlink_to(tmp_path / "mnt" / "photos")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    for name, reason in (("photos", "No such file or directory"),
                         ("loop", "Too many levels of symbolic links")):
        with pytest.raises(UsageError) as info:
            discover([str(tmp_path / name)])
        assert str(info.value) == (f"input {tmp_path / name} is a symbolic link to "
                                   f"{os.readlink(tmp_path / name)}, which cannot be read "
                                   f"({reason})"), info.value


def test_missing_input_is_refused_before_anything_is_listed(tmp_path):
    from dsv4enc.images.discover import Discovery, stream_inputs

    touch(tmp_path / "d" / "a.png")
    stream = stream_inputs(Discovery(items=[]), [str(tmp_path / "d"), str(tmp_path / "gone")])
    with pytest.raises(UsageError, match="input not found"):
        next(stream)


def test_a_listed_input_costs_a_few_dozen_bytes_besides_its_strings():
    """A run holds one item per input listed (10^9 of them in a large dataset): an item and
    its locator keep no ``__dict__`` each (about 72 bytes apiece with slots, 112 without)."""
    import tracemalloc

    from dsv4enc.images.items import TableCell

    key, path, column = "k.png", "t.parquet", "image"
    tracemalloc.start()
    try:
        held = [InputItem(key, path, TableCell(column, 1, 2)) for _ in range(2000)]
        per_item = tracemalloc.get_traced_memory()[0] / len(held)
    finally:
        tracemalloc.stop()
    assert per_item < 180, f"{per_item:.0f} bytes per item and its locator"


def test_a_single_folder_walk_yields_its_items_as_made(tmp_path, monkeypatch):
    """A single folder's items are keyed as walked: none is copied under a new key (a second
    object per input, the walk's commonest case)."""
    from dsv4enc.images import discover as discover_module
    from dsv4enc.images.discover import stream_inputs

    for name in ["a/1.png", "b/2.png", "3.png"]:
        touch(tmp_path / name)
    copies = []
    real = discover_module.replace
    monkeypatch.setattr(discover_module, "replace",
                        lambda item, **changes: copies.append(item) or real(item, **changes))
    assert keys(stream_inputs(Discovery(items=[]), [str(tmp_path)])) == ["3.png", "a/1.png",
                                                                         "b/2.png"]
    assert copies == []


def test_a_tar_shard_is_indexed_without_holding_every_header(tmp_path):
    """Indexing a shard holds its items, not also every member's ``TarInfo`` (which tarfile
    keeps as it reads: about 500 bytes more per member, a GB for a shard of millions)."""
    import tarfile
    import tracemalloc

    from dsv4enc.images.sources import expand_tar

    shard = tmp_path / "s.tar"
    with tarfile.open(shard, "w") as tar:
        for i in range(3000):
            tar.addfile(tarfile.TarInfo(f"s{i:05d}.png"), io.BytesIO(b""))
    expand_tar(str(shard))  # what a first index sets up once (imports, caches) is not measured
    tracemalloc.start()
    try:
        items, _ = expand_tar(str(shard))
        peak = tracemalloc.get_traced_memory()[1] / len(items)
    finally:
        tracemalloc.stop()
    assert len(items) == 3000
    assert peak < 850, f"{peak:.0f} bytes per member at the index's peak"
