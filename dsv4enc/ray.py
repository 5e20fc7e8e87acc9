"""Ray Data (docs/api.md, "Ray Data"): ``RayEncoder``, a callable class for
``ray.data.Dataset.map_batches``, and ``encode_dataset``, which makes that call with the right
arguments (needs ``dsv4enc[ray]``). A bad image is an error row, never a failed block, so no
``max_errored_blocks`` should be set (Ray drops a failed block's rows whole)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pyarrow as pa

from .batch import BatchEncoder

__all__ = ["RayEncoder", "encode_dataset", "ray_device"]


def ray_device() -> str:
    """``cuda`` when Ray gave this worker (a task or actor) a GPU, else ``cpu`` (Ray hides the
    GPUs it did not give: CUDA_VISIBLE_DEVICES holds only this worker's); ``auto`` outside one."""
    import ray

    if not ray.is_initialized():
        return "auto"
    worker = getattr(ray.get_runtime_context(), "worker", None)
    if worker is None or worker.mode != ray.WORKER_MODE:
        return "auto"  # the driver (or a plain call): Ray gave it nothing, auto decides
    return "cuda" if ray.get_gpu_ids() else "cpu"


class RayEncoder:
    """The batch function of ``BatchEncoder`` as a Ray actor class: built once per actor
    (weights loaded once), called per batch. Takes ``BatchEncoder``'s arguments; ``device``
    defaults to what Ray gave the actor (``ray_device``). The actor's process is dsv4enc's, so
    Pillow's settings are made as ``dsv4enc encode`` makes them: its rows, error rows included,
    are the command's."""

    def __init__(self, weights: Any = None, *, device: str | None = None,
                 **options: Any) -> None:
        from .process import own_process_pillow_settings

        own_process_pillow_settings()
        self.embed = BatchEncoder(weights, device=device or ray_device(), **options)
        self.schema: pa.Schema = self.embed.schema

    def __call__(self, batch: Any) -> pa.Table:
        """The batch's rows, of any format Ray hands over, as ``BatchEncoder.table`` gives;
        a numpy or pandas batch's kept columns as Ray itself turns them into a block, so that
        a tensor column (a mask, a second image; fixed or ragged in shape) stays one, where
        pyarrow alone fails the block, its images encoded, on any array of more than one
        dimension."""
        if isinstance(batch, (pa.Table, pa.RecordBatch)):
            return self.embed.table(batch)
        _, table, kept = self.embed.encoded(batch)  # (refuses a kind that is no batch)
        if kept:
            from ray.data.block import BlockAccessor

            part = ({name: batch[name] for name in kept} if isinstance(batch, Mapping)
                    else batch[kept].reset_index(drop=True))  # pandas: no index column
            block = BlockAccessor.for_block(BlockAccessor.batch_to_block(part)).to_arrow()
            for name in kept:
                table = table.append_column(name, block.column(name))
        return table


def encode_dataset(ds, weights: Any = None, *, concurrency: int | tuple[int, int] = 1,
                   num_gpus: float = 0, num_cpus: float | None = None,
                   batch_size: int | None = 64, **options: Any):
    """``ds.map_batches(RayEncoder, ...)``: ``concurrency`` actors (a number, or (min, max)
    for an autoscaling pool), each with ``num_gpus`` GPUs (1: one per actor) and ``num_cpus``
    CPUs; ``options``: ``BatchEncoder``'s (``image_column``, ``key_column``, ``config``,
    ``out_dtype``, ``keep_columns``, ...). Returns the lazy dataset of rows."""
    from ray.data import ActorPoolStrategy

    pool = (ActorPoolStrategy(min_size=concurrency[0], max_size=concurrency[1])
            if isinstance(concurrency, tuple) else ActorPoolStrategy(size=concurrency))
    cpus = {} if num_cpus is None else {"num_cpus": num_cpus}
    return ds.map_batches(RayEncoder, fn_constructor_kwargs={"weights": weights, **options},
                          batch_format="pyarrow", batch_size=batch_size, compute=pool,
                          num_gpus=num_gpus, **cpus)
