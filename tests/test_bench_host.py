"""dsv4enc bench --host: the real pipeline with the model replaced by a null stage."""

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from dsv4enc.tower.config import VisionConfig
from dsv4enc.bench.host import NULL_FINGERPRINT, NullStage, run_host_bench
from dsv4enc.run.options import EncodeOptions
from dsv4enc.run.pipeline import run_encode
from dsv4enc.output.read import read_embeddings
from helpers import CONFIGS

TINY = str(CONFIGS / "tiny.json")


def _options(inputs, out, **kw) -> EncodeOptions:
    return EncodeOptions(inputs=[str(inputs)], out=str(out), config=TINY, random_init=True,
                         device="cpu", dtype="float32", workers=1, overwrite=True,
                         progress=False, **kw)


@pytest.mark.parametrize("folder_output", [False, True])
def test_null_stage_output_has_the_real_schema_rows_and_shapes(tmp_path, make_images,
                                                                folder_output):
    images = tmp_path / "images"
    make_images(folder=images)
    (images / "broken.jpg").write_bytes(b"not an image")  # an error row in both
    suffix = "" if folder_output else ".parquet"
    real_out, null_out = tmp_path / f"real{suffix}", tmp_path / f"null{suffix}"
    slash = "/" if folder_output else ""  # a folder output is named with a trailing slash
    real = run_encode(_options(images, f"{real_out}{slash}"))
    null = run_encode(_options(images, f"{null_out}{slash}"),
                      stand_in=NullStage(VisionConfig.from_file(TINY)))
    assert null_out.is_dir() == folder_output
    assert (null.encoded, null.failed) == (real.encoded, real.failed)
    assert null.encoded > 0 and null.failed == 1
    real_table = pq.read_table(real_out).drop_columns(["embedding"])
    null_table = pq.read_table(null_out).drop_columns(["embedding"])
    assert null_table.schema.remove_metadata() == real_table.schema.remove_metadata()
    assert null_table.equals(real_table)  # paths, sizes, grids, errors: the same rows
    real_rows = {path: emb for path, emb, _ in read_embeddings(real_out)}
    null_rows = {path: emb for path, emb, _ in read_embeddings(null_out)}
    assert null_rows.keys() == real_rows.keys()
    for path, emb in null_rows.items():
        assert emb.shape == real_rows[path].shape and emb.dtype == real_rows[path].dtype
        assert not emb.any()  # zeros: the null stage computes nothing
    metadata = pq.read_schema(sorted(null_out.glob("*.parquet"))[0]
                              if folder_output else null_out).metadata
    assert NULL_FINGERPRINT.encode() in b"".join(metadata.values())


def test_host_bench_reports_sane_fields(tmp_path):
    results = run_host_bench(TINY, "synthetic:320x240:5", outputs=("file", "folder"), workers=1,
                             workdir=str(tmp_path), sample=2)
    assert [r.output for r in results] == ["file", "folder"]
    for r in results:
        assert r.images == 5 and r.workers == 1 and r.cores >= 1
        assert r.total_s >= r.seconds > 0
        assert r.img_s == pytest.approx(5 / r.total_s) and r.loop_img_s >= r.img_s
        assert r.img_s_per_core == pytest.approx(r.img_s / r.cores)
        assert r.img_per_cpu_s == pytest.approx(5 / r.cpu_s)
        assert 0 <= r.decode_wait_s <= r.seconds and r.write_s >= 0 and r.stage_s >= 0
        assert r.total_s >= r.seconds and r.cpu_s > 0 and r.out_bytes > 0
        c = r.costs
        assert c.images == 2 and c.decode_ms > 0 and c.transform_ms > 0 and c.pack_ms > 0
    assert (tmp_path / "host.parquet").is_file() and (tmp_path / "host-folder").is_dir()


@pytest.mark.parametrize("folder_output", [False, True])
def test_null_stage_rows_are_the_same_with_the_transform_on_the_device(tmp_path, make_images,
                                                                        folder_output):
    """The device placement's host work: the workers ship pixels, the null engine stages them
    and its patches stand on the meta device; the rows are those of the host placement."""
    images = tmp_path / "images"
    make_images(folder=images)
    (images / "broken.jpg").write_bytes(b"not an image")
    slash = "/" if folder_output else ""
    tables = []
    for transform in ("host", "device"):
        out = tmp_path / f"{transform}{'' if folder_output else '.parquet'}"
        summary = run_encode(_options(images, f"{out}{slash}", transform=transform),
                             stand_in=NullStage(VisionConfig.from_file(TINY)))
        assert summary.failed == 1 and summary.encoded > 0
        tables.append(pq.read_table(out).sort_by("path").replace_schema_metadata(None))
    assert tables[0].equals(tables[1])


def test_host_bench_refuses_an_unknown_output_kind(tmp_path):
    with pytest.raises(ValueError, match="file or folder"):
        run_host_bench(TINY, "synthetic:320x240:1", outputs=("disk",), workdir=str(tmp_path))


def test_cli_bench_host(tmp_path):
    from typer.testing import CliRunner

    from dsv4enc.cli import app

    report = tmp_path / "host.json"
    threads = torch.get_num_threads()
    try:
        result = CliRunner().invoke(app, ["bench", "--host", "--config", TINY, "--images",
                                          "synthetic:320x240:3", "--outputs", "folder",
                                          "--workers", "1", "--json", str(report)])
    finally:
        torch.set_num_threads(threads)  # it makes a GPU run's settings; later tests keep theirs
    assert result.exit_code == 0, result.output
    assert "img/s" in result.output
    rows = json.loads(report.read_text())
    assert [(row["output"], row["transform"]) for row in rows] == [("folder", "host"),
                                                                   ("folder", "device")]
    assert all(row["images"] == 3 and np.isfinite(row["img_s_per_core"]) for row in rows)
    assert "transform on the device" in result.output


def test_host_bench_steady_state_subtracts_a_shorter_run(tmp_path):
    """With 16 images or more, each output also runs on an eighth of them: the steady rate is
    the extra images over the extra CPU seconds."""
    results = run_host_bench(TINY, "synthetic:160x120:16", outputs=("folder",), workers=1,
                             workdir=str(tmp_path), sample=1)
    (r,) = results
    assert r.images == 16 and r.steady_base == 2
    assert r.steady_img_per_cpu_s is not None and r.steady_img_per_cpu_s > 0
    quiet = run_host_bench(TINY, "synthetic:160x120:16", outputs=("folder",), workers=1,
                           workdir=str(tmp_path), sample=1, steady=False)
    assert quiet[0].steady_img_per_cpu_s is None and quiet[0].steady_base == 0
