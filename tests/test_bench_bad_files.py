"""``dsv4enc bench`` and ``bench --host`` over a folder with bad files: each is counted as
failed, as ``encode`` counts it (an error row), and the rest are timed; no traceback."""

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from dsv4enc.bench.host import stage_costs
from dsv4enc.bench.throughput import prepare_images, synthetic_images
from dsv4enc import read_embeddings
from dsv4enc.cli import app
from dsv4enc.errors import UsageError
from dsv4enc.tower.config import VisionConfig
from helpers import CONFIGS

TINY = str(CONFIGS / "tiny.json")


@pytest.fixture
def photos(tmp_path) -> Path:
    """Three photos, an empty file and a truncated JPEG, as a real folder may hold."""
    folder = tmp_path / "photos"
    good = synthetic_images(folder, "160x120:3")
    (folder / "empty.jpg").write_bytes(b"")
    (folder / "truncated.jpg").write_bytes(good[0].read_bytes()[:300])
    return folder


def _invoke(args: list[str]):
    threads = torch.get_num_threads()
    try:
        return CliRunner().invoke(app, args)
    finally:
        torch.set_num_threads(threads)  # bench makes its run's settings; later tests keep theirs


def test_prepared_images_leave_the_bad_ones_out(photos):
    cfg = VisionConfig.from_file(TINY)
    prep = prepare_images(sorted(photos.iterdir()), cfg, "aligner")
    assert len(prep.items) == len(prep.paths) == 3
    assert sorted(Path(p).name for p in prep.failed) == ["empty.jpg", "truncated.jpg"]
    assert all(error for error in prep.failed.values())
    costs = stage_costs(sorted(photos.iterdir()), cfg)
    assert (costs.images, costs.failed) == (3, 2) and costs.decode_ms > 0
    bad = [photos / "empty.jpg", photos / "truncated.jpg"]
    assert stage_costs(bad, cfg).failed == 2
    with pytest.raises(UsageError, match="no image could be decoded \\(2 tried; "):
        prepare_images(bad, cfg, "aligner")


def test_bench_host_counts_a_bad_file_as_failed(photos, tmp_path):
    report = tmp_path / "host.json"
    result = _invoke(["bench", "--host", "--config", TINY, "--images", str(photos),
                      "--outputs", "folder", "--workers", "1", "--json", str(report)])
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    assert "5 images (2 failed: error rows)" in " ".join(result.output.split())
    assert "3 sampled; 2 failed, not timed" in " ".join(result.output.split())
    row = json.loads(report.read_text())[0]
    assert (row["images"], row["failed"]) == (5, 2)
    assert (row["costs"]["images"], row["costs"]["failed"]) == (3, 2)


def test_bench_counts_a_bad_file_as_failed(photos, tmp_path):
    """Every row counts the images it encoded, and the whole-run rows (--e2e, --cli) encode
    with the model rows' options (here --features vit), so their ratios compare like work."""
    report, work = tmp_path / "bench.json", tmp_path / "work"
    result = _invoke(["bench", "--config", TINY, "--images", str(photos), "--device", "cpu",
                      "--dtype", "float32", "--repeat", "1", "--batch-tokens", "2048",
                      "--features", "vit", "--e2e", "--cli", "--outputs", "folder",
                      "--workers", "1", "--workdir", str(work), "--json", str(report)])
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    assert "3 images (2 failed, not timed)" in result.output
    rows = {row["mode"]: row for row in json.loads(report.read_text())}
    assert (rows["meta"]["images"], rows["meta"]["failed"]) == (3, 2)
    assert rows["model"]["images"] == rows["naive"]["images"] == 3
    assert (rows["e2e"]["images"], rows["e2e"]["failed"]) == (3, 2)
    assert (rows["cli"]["images"], rows["cli"]["failed"]) == (3, 2)
    width = VisionConfig.from_file(TINY).output_width("vit")
    for written in list(work.rglob("bench_parts")) + list(work.rglob("bench-cli.parquet")):
        assert {embedding.shape[-1] for _, embedding, _ in read_embeddings(written)} == {width}


def test_bench_of_only_bad_files_is_one_line(tmp_path):
    folder = tmp_path / "bad"
    folder.mkdir()
    (folder / "empty.jpg").write_bytes(b"")
    result = _invoke(["bench", "--config", TINY, "--images", str(folder), "--device", "cpu",
                      "--repeat", "1"])
    assert result.exit_code == 2
    assert "no image could be decoded (1 tried; " in result.output
    assert "Traceback" not in result.output


def test_bench_cli_does_not_time_another_configs_saved_checkpoint(photos, tmp_path):
    """--cli saves its random checkpoint once in --workdir; a later bench of another config
    in the same workdir times that config, not the checkpoint an earlier one saved there
    (whose config.json it read, so the row timed another tower)."""
    from dsv4enc.bench.throughput import bench_cli

    work = tmp_path / "work"
    paths = sorted(photos.glob("img*.jpg"))
    for name in ("tiny", "tiny-v41"):
        cfg = VisionConfig.from_file(CONFIGS / f"{name}.json")
        bench_cli(cfg, paths, "cpu", "float32", 2048, work, workers=0)
        assert VisionConfig.from_file(work / "bench-checkpoint" / "config.json") == cfg


def test_bench_cli_whose_encode_fails_is_one_line(tmp_path):
    """--cli whose encode run fails (here: a user's file where it writes in --workdir, which
    encode refuses to replace) ends in one line naming encode's own, the file left as it is;
    it was a RuntimeError traceback once the other rows were timed."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "bench-cli.parquet").write_bytes(b"mine")
    result = _invoke(["bench", "--config", TINY, "--images", "synthetic:30x30:1", "--device",
                      "cpu", "--repeat", "1", "--cli", "--workdir", str(work)])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert "dsv4enc encode failed" in result.output and "not a dsv4enc output" in result.output
    assert (work / "bench-cli.parquet").read_bytes() == b"mine"
