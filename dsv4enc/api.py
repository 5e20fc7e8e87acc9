"""The Python API: ``Encoder`` turns images into embeddings in memory, with the command line's
packed engine and exact transform, decoding in the calling process (optionally on a few
threads) and returning torch tensors::

    enc = Encoder.from_pretrained("/path/to/checkpoint", device="cpu", dtype="float32")
    embeddings = enc.encode([pil_image, "photo.jpg", png_bytes, uint8_array])
    for key, emb in enc.encode_iter(paths):       # streams, bounded memory
        ...

``read_embeddings`` (re-exported here) streams an encode run's Parquet output back as numpy."""

from __future__ import annotations

import numbers
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Callable, Iterable, Iterator, Mapping, Union

import numpy as np
import torch
from PIL import Image

from .errors import SettingsError, check_choice, check_positive, check_seed
from .process import available_cpus
from .tower.checkpoint import Checkpoint, load_checkpoint, random_checkpoint
from .tower.config import Attention, VisionConfig
from .tower.transform import plan_canvas
from .images.formats import DEFAULT_MAX_PIXELS
from .images.prepare import Prepared, image_source, prepare
from .engine.defaults import (DEFAULT_FEATURES, DEFAULT_MAX_IMAGES, DEFAULT_POOL, FEATURES,
                              POOLS, Features, Pool)
from .engine.settings import EngineSettings
from .engine.device import resolve_device, resolve_dtype, resolve_out_dtype
from .engine.batching import BatchLoop
from .engine.bins import pack_bins
from .engine.engine import Engine, NonFiniteOutput
from .engine.factory import build_model
from .engine.packing import output_grid
from .output.read import read_embeddings

__all__ = ["Encoder", "EncodeError", "ImageInput", "image_source", "read_embeddings"]

#: What ``Encoder.encode`` takes per image: a PIL image, an HxW / HxWx{1,3,4} uint8 array, a
#: file path, the encoded file's bytes, or a Hugging Face ``{"bytes": ..., "path": ...}`` dict.
ImageInput = Union[Image.Image, np.ndarray, str, os.PathLike, bytes, Mapping[str, Any]]


class EncodeError(ValueError):
    """An input that cannot be encoded. ``index``: its position in the input; ``key``: its
    path (for paths) or the key given with it; ``reason``: what went wrong."""

    def __init__(self, index: int, key: Any, reason: str) -> None:
        named = f"image {index}" if key == index else f"image {index} ({key!r})"
        super().__init__(f"{named}: {reason}")
        self.index, self.key, self.reason = index, key, reason


class Encoder:
    """Embeddings of images from the DeepSeek-V4 vision tower, in memory: build one with
    ``from_pretrained`` or ``from_config`` (random weights); their options are docs/api.md's.
    ``settings``: the engine's settings as one ``engine/settings.EngineSettings``, in place of
    those given by name. Results are CPU tensors in input order, each ``(grid_h*grid_w,
    width)`` (``(width,)`` pooled). Not thread-safe: use one Encoder per thread."""

    def __init__(self, checkpoint: Checkpoint, device: str | torch.device = "auto", *,
                 features: Features = DEFAULT_FEATURES, pool: Pool = DEFAULT_POOL,
                 out_dtype: str | torch.dtype = torch.float32, batch_tokens: int | None = None,
                 max_images: int = DEFAULT_MAX_IMAGES, decode_threads: int | None = None,
                 max_pixels: int = DEFAULT_MAX_PIXELS, attention: Attention = "auto",
                 cuda_graphs: bool | None = None, deterministic: bool = True,
                 fused: bool | None = None, settings: EngineSettings | None = None) -> None:
        self.checkpoint, self.config = checkpoint, checkpoint.config
        self.fingerprint = checkpoint.fingerprint  # as ``encode`` writes it to the metadata
        self.device = resolve_device(device)
        named = EngineSettings(
            features=features, attention=attention, cuda_graphs=cuda_graphs,
            batch_tokens=batch_tokens, max_images=max_images, deterministic=deterministic,
            fused=fused)
        if settings is not None and not isinstance(settings, EngineSettings):  # not unnamed
            raise SettingsError(f"settings must be an EngineSettings, got a "
                                f"{type(settings).__name__}")
        if settings is not None and named != EngineSettings():
            raise SettingsError("give the engine's settings by name or as settings=, not both")
        self.settings = (settings or named).check().for_device(self.device.type)
        self.pool = check_choice("pool", pool, POOLS)
        self.out_dtype = resolve_out_dtype(out_dtype)
        if decode_threads is None:
            decode_threads = 0 if self.device.type == "cpu" else min(8, available_cpus())
        elif not isinstance(decode_threads, numbers.Integral):  # named, not a failed max()
            raise SettingsError(f"decode_threads must be a whole number, got {decode_threads!r}")
        elif decode_threads < 0:  # as --workers: refused, not taken as 0
            raise SettingsError(f"decode_threads must be 0 or more, got {decode_threads}")
        self.decode_threads = decode_threads
        self.max_pixels = check_positive("max_pixels", max_pixels)
        self.model = build_model(checkpoint, self.device, fused=self.settings.fused,
                                 deterministic=self.settings.deterministic)
        self.dtype: torch.dtype = self.model.dtype  # the compute dtype
        self.engines: dict[str, Engine] = {}  # per features, built on first use (read-only)
        self._engine(self.features)  # a bad attention or cuda_graphs refuses here, not per call

    # -- construction ------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path_or_hub_id: str | os.PathLike, device: str | torch.device = "auto",
                        dtype: str | torch.dtype = "auto", **options: Any) -> "Encoder":
        """Load a checkpoint folder (only the tower's tensors are read) or a Hugging Face Hub
        id such as ``deepseek-ai/DeepSeek-V4-Flash-Vision-Exp`` (needs ``dsv4enc[hub]``).
        ``dtype``: compute dtype, ``"auto"`` (as ``--dtype auto``), a name or a ``torch.dtype``."""
        from .tower.hub import resolve_weights

        resolved = resolve_device(device)
        return cls(load_checkpoint(resolve_weights(path_or_hub_id),
                                   resolve_dtype(dtype, resolved)), resolved, **options)

    @classmethod
    def from_config(cls, config: VisionConfig | str | os.PathLike | Mapping[str, Any],
                    seed: int = 0, device: str | torch.device = "auto",
                    dtype: str | torch.dtype = "auto", **options: Any) -> "Encoder":
        """A tower with random weights (seeded) of ``config``'s shape: a ``VisionConfig``, a
        config.json path, or a dict in either layout. ``seed``: as ``--seed`` takes it."""
        check_seed("seed", seed)  # in one line, not torch's error as it seeds
        if isinstance(config, Mapping):
            config = VisionConfig.from_dict(dict(config))
        elif not isinstance(config, VisionConfig):
            config = VisionConfig.from_file(config)
        resolved = resolve_device(device)
        return cls(random_checkpoint(config, seed, resolve_dtype(dtype, resolved)), resolved,
                   **options)

    # -- properties ----------------------------------------------------------------------
    @property
    def features(self) -> str:
        """The rows an image gives when a call names none (``settings.features``)."""
        return self.settings.features

    @property
    def batch_tokens(self) -> int:
        """Patches per packed forward when a call names none (``settings.batch_tokens``)."""
        return self.settings.batch_tokens

    @property
    def max_images(self) -> int:
        return self.settings.max_images

    @property
    def deterministic(self) -> bool:
        return self.settings.deterministic

    def width(self, features: str | None = None) -> int:
        """Width of one embedding row for ``features`` (default: this encoder's)."""
        return self.config.output_width(self._features(features))

    def _features(self, features: str | None) -> str:
        """``features`` checked, None the encoder's own: any other value that is no choice
        (``""`` too) refuses, rather than the default or the vit's shape taking its place."""
        return check_choice("features", self.features if features is None else features,
                            FEATURES)

    def __repr__(self) -> str:
        return (f"Encoder({self.checkpoint.source!r}, device={str(self.device)!r}, "
                f"dtype={str(self.dtype).removeprefix('torch.')}, features={self.features!r}, "
                f"pool={self.pool!r})")

    # -- encoding ----------------------------------------------------------------------
    def encode(self, images: ImageInput | Iterable[ImageInput], *, features: str | None = None,
               pool: str | None = None, batch_tokens: int | None = None,
               ) -> list[torch.Tensor] | torch.Tensor:
        """Embeddings of ``images``, one CPU tensor per image, in input order.

        ``images``: an iterable of ``ImageInput``, or an (N, H, W, C) uint8 array; or one
        image, which returns one tensor. Raises ``EncodeError`` naming the first image that
        cannot be read (``TypeError`` for an unsupported kind of input) before encoding
        anything after it, or one whose embedding is not finite in ``out_dtype`` (float16
        overflows past 65504): inf or NaN is never returned."""
        if isinstance(images, np.ndarray) and images.ndim == 4:
            images = list(images)  # a stacked batch (N, H, W, C)
        elif self._is_single(images):
            return self.encode([images], features=features, pool=pool,
                               batch_tokens=batch_tokens)[0]
        return [emb for _, emb in self._stream(images, features, pool, batch_tokens,
                                               raise_errors=True)]

    def encode_iter(self, images: Iterable[ImageInput | tuple[Any, ImageInput]], *,
                    batch_tokens: int | None = None, features: str | None = None,
                    pool: str | None = None) -> Iterator[tuple[Any, torch.Tensor | str]]:
        """Stream ``(key, embedding)`` pairs in input order, with bounded memory.

        Items are images as for ``encode``, or ``(key, image)`` tuples. The key is the given
        one, else the name ``image_source`` finds, else the item's index. An image that cannot
        be read yields ``(key, error)``, the Parquet ``error`` column's text, and the stream
        goes on; an embedding not finite in ``out_dtype`` raises ``EncodeError`` (a setting to
        change, not one image's fault). Images are read about ``2 * batch_tokens`` patches
        ahead of the device."""
        return self._stream(images, features, pool, batch_tokens, raise_errors=False)

    # -- internals ---------------------------------------------------------------------
    @staticmethod
    def _is_single(images: Any) -> bool:
        """One input, not several: an array is one image unless it is a 1-D array of paths,
        bytes or objects (a DataFrame column as numpy), which holds several."""
        if isinstance(images, np.ndarray):
            return not (images.ndim == 1 and images.dtype.kind in "OUS")
        return isinstance(images, (Image.Image, str, os.PathLike, bytes, bytearray, memoryview,
                                   Mapping))

    def _engine(self, features: str) -> Engine:
        if features not in self.engines:
            self.engines[features] = Engine(
                self.model, out_dtype=self.out_dtype,
                settings=replace(self.settings, features=features))
        return self.engines[features]

    def _prepare(self, index: int, entry: Any) -> Prepared:
        """Split off the key and prepare one input (runs on decode threads)."""
        key, image = entry if isinstance(entry, tuple) and len(entry) == 2 else (None, entry)
        source, name = image_source(image)
        item = Prepared(key if key is not None else name if name is not None else index, index)
        if isinstance(image, Mapping) and source is None:  # datasets' Image(decode=False)
            return item.failed("ValueError: dict holds neither 'bytes' nor 'path'")
        return prepare(source, self.config, self.max_pixels, item)

    def prepared(self, entries: Iterable[Any],
                 prepare_one: Callable[[int, Any], Prepared]) -> Iterator[Prepared]:
        """``prepare_one(index, entry)`` over ``entries`` in order, on threads when
        ``decode_threads`` > 0."""
        if self.decode_threads <= 0:
            yield from (prepare_one(index, entry) for index, entry in enumerate(entries))
            return
        with ThreadPoolExecutor(self.decode_threads, thread_name_prefix="dsv4enc-decode") as pool:
            futures: deque = deque()
            for index, entry in enumerate(entries):
                futures.append(pool.submit(prepare_one, index, entry))
                if len(futures) >= 4 * self.decode_threads:  # decoded ahead of the device
                    yield futures.popleft().result()
            while futures:
                yield futures.popleft().result()

    def stream(self, items: Iterable[Prepared], features: str | None = None,
               pool: str | None = None, batch_tokens: int | None = None,
               raise_errors: bool = False) -> Iterator[tuple[Prepared, Any]]:
        """``(item, embedding or error text)`` of prepared ``items``, in order, encoded in
        nearly full packed batches about ``2 * batch_tokens`` patches at a time."""
        # None is the encoder's own setting; any other value is checked (0 is no default)
        features = self._features(features)
        pool = check_choice("pool", self.pool if pool is None else pool, POOLS)
        capacity = check_positive("batch_tokens", self.batch_tokens if batch_tokens is None
                                  else batch_tokens)
        engine = self._engine(features)
        window: list[Prepared] = []
        tokens = 0
        for item in items:
            if item.error is not None and raise_errors:
                if item.wrong_type:
                    raise TypeError(str(EncodeError(item.index, item.key,
                                                    item.error.removeprefix("TypeError: "))))
                raise EncodeError(item.index, item.key, item.error)
            window.append(item)
            tokens += item.tokens
            # Error rows count too: a long run of them flushes, rather than piling up unyielded.
            if tokens >= 2 * capacity or len(window) >= 2 * self.max_images:
                yield from self._flush(engine, window, pool, capacity)
                window, tokens = [], 0
        yield from self._flush(engine, window, pool, capacity)

    def _stream(self, images: Iterable[Any], features: str | None, pool: str | None,
                batch_tokens: int | None, raise_errors: bool) -> Iterator[tuple[Any, Any]]:
        if self._is_single(images):
            raise TypeError("encode_iter takes an iterable of images, not one image")
        if not isinstance(images, Iterable):
            raise TypeError(f"expected images (paths, URLs, bytes, PIL images, arrays, or an "
                            f"iterable of them), got {type(images).__name__}")
        for item, out in self.stream(self.prepared(images, self._prepare), features, pool,
                                     batch_tokens, raise_errors):
            yield item.key, out

    def _flush(self, engine: Engine, window: list[Prepared], pool: str,
               capacity: int) -> Iterator[tuple[Prepared, Any]]:
        """Encode the window's images in nearly full packed batches; yield all in order."""
        loop = BatchLoop(engine, pool, name_of=lambda item: "this image",
                         remedy="use out_dtype='float32'")
        good = [w for w in window if w.error is None]
        results: dict[int, torch.Tensor] = {}
        if good:
            bins = pack_bins([w.tokens for w in good], capacity, self.max_images)
            batches = (([good[j] for j in b], [(good[j].patches, good[j].n_h, good[j].n_w)
                                              for j in b]) for b in bins)
            try:
                for done in loop.run(batches):
                    results.update((id(item), out) for item, out in done)
            except NonFiniteOutput as exc:
                raise EncodeError(exc.tag.index, exc.tag.key, str(exc)) from None
        for w in window:
            yield w, (w.error if w.error is not None else results.pop(id(w)))

    def grid_for(self, size: tuple[int, int], features: str | None = None) -> tuple[int, int]:
        """``(grid_h, grid_w)`` of the embedding rows of an image of ``size`` = (width,
        height) pixels (``PIL.Image.Image.size``): a result reshaped with it is the 2D grid."""
        canvas = plan_canvas(size[0], size[1], self.config)
        return output_grid(canvas.n_h, canvas.n_w, self.config.downsample_ratio,
                           self._features(features))
