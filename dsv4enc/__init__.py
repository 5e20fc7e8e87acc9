"""dsv4enc: batch encoder for the DeepSeek-V4 vision tower.

``from dsv4enc import Encoder, read_embeddings`` is the Python API (``dsv4enc.api``), and
``BatchEncoder`` the batch function for pipelines (``dsv4enc.batch``); all are imported on
first use, so ``import dsv4enc`` stays light."""

from typing import TYPE_CHECKING, Any

from .version import __version__

__all__ = ["BatchEncoder", "Encoder", "EncodeError", "read_embeddings", "__version__"]

_LAZY = {"Encoder": "dsv4enc.api", "EncodeError": "dsv4enc.api",
         "read_embeddings": "dsv4enc.output.read", "BatchEncoder": "dsv4enc.batch"}

if TYPE_CHECKING:
    from .api import EncodeError, Encoder
    from .batch import BatchEncoder
    from .output.read import read_embeddings


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'dsv4enc' has no attribute {name!r}")
    import importlib

    value = globals()[name] = getattr(importlib.import_module(_LAZY[name]), name)
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
