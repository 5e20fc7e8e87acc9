"""Fused elementwise work around the GEMMs (``--fused``): torch.compile of the model's own
functions, installed from outside so that ``model.py`` stays the eager reference.

Fused: float32 RMSNorm (with the residual add before the second norm), RoPE on q and k, and
SwiGLU; GEMMs and attention stay as they are. Results equal the eager functions to float
rounding (a fused kernel may keep a value in float32 in a register)."""

from __future__ import annotations

import functools
import logging
import os
import platform
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import UsageError
from .compile_cache import INDUCTOR_CACHE_ENV, use_compile_cache
from .model import VisionTower, add_rms_norm, rms_norm, rope_formula, swiglu

log = logging.getLogger(__name__)


#: The vector width in bits of each of ATen's CPU kernel levels
#: (``torch.backends.cpu.get_cpu_capability()``), as inductor's ``cpp.simdlen`` takes it.
SIMD_BITS = {"AVX512": 512, "AVX2": 256, "DEFAULT": 0}


def pin_cpu_vector_width() -> None:
    """Under ``ATEN_CPU_CAPABILITY``, tell inductor the capped level's vector width unless it
    was set: with ATen's CPU kernels capped below the CPU's, inductor's shape-generic kernels
    can come out wrong (NaN from SwiGLU on a Zen 5 capped to avx2); built for an explicit
    vector width, they are right."""
    from torch._inductor import config

    if config.cpp.simdlen is not None or not os.environ.get("ATEN_CPU_CAPABILITY"):
        return
    level = str(torch.backends.cpu.get_cpu_capability()).upper()
    if level in SIMD_BITS:
        config.cpp.simdlen = SIMD_BITS[level]
        log.info("inductor's CPU vector width pinned to %d bits (ATEN_CPU_CAPABILITY=%s)",
                 SIMD_BITS[level], os.environ["ATEN_CPU_CAPABILITY"])


#: The file, in a tower's compile-cache folder, that says inductor's probe found every vector
#: ISA this CPU reports building and loading on this host (named after it: a shared home may
#: hold hosts with other compilers).
ISA_RECORD = "vec_isa_ok-{host}"


def trust_vector_isas(folder: Path | None, device: torch.device) -> None:
    """On the CPU, set inductor's cpp.vec_isa_ok once its own probe has found, on this host,
    that every vector ISA the CPU reports builds and loads: the probe (a build and a child
    Python per ISA, over a second even with every kernel cached) then runs once per cache
    folder, not in every process, and inductor picks the same ISA from the same list. The
    setting is part of inductor's cache key, so the probing run sets it too; nothing is set
    where the user set it, there is no folder, or an ISA failed. It stays for the process."""
    if device.type != "cpu" or folder is None:
        return
    from torch._inductor import config

    try:  # inductor's internals: where this torch has them otherwise, it probes as it would
        from torch._inductor.cpu_vec_isa import valid_vec_isa_list

        if config.cpp.vec_isa_ok is not None:  # the user's own setting
            return
    except (ImportError, AttributeError):
        return
    record = folder / ISA_RECORD.format(host=platform.node() or "host")
    if not record.exists():
        unprobed = getattr(valid_vec_isa_list, "__wrapped__", None)  # its cached answer's source
        if unprobed is None:
            return
        probed = [str(isa) for isa in valid_vec_isa_list()]
        with config.patch({"cpp.vec_isa_ok": True}):
            reported = [str(isa) for isa in unprobed()]
        if probed != reported:
            return
        try:
            record.touch()
        except OSError:  # a read-only cache: probe again next time
            pass
    config.cpp.vec_isa_ok = True


def compiled(fn: Callable, dynamic: bool = True) -> Callable:
    """``fn`` compiled by inductor (no graph breaks): for any row count (``dynamic``), or
    specialized to each shape it meets. It compiles at its first call, mid-run: a compile that
    fails there (no C++ compiler, a full or unwritable cache) is a UsageError line."""
    from torch._dynamo.exc import BackendCompilerFailed

    built = torch.compile(fn, dynamic=dynamic, fullgraph=True)

    @functools.wraps(fn)
    def run(*args: Any) -> Any:
        try:
            return built(*args)
        except BackendCompilerFailed as exc:
            raise cannot_compile(exc.inner_exception) from None

    return run


def cannot_compile(cause: BaseException) -> UsageError:
    """The line for a compile that ``cause`` stopped (naming the cache folder for an OSError)."""
    text = (str(cause).strip().splitlines() or [""])[0]
    if isinstance(cause, OSError):
        text += f" (compiled kernels are kept in {os.environ.get(INDUCTOR_CACHE_ENV)})"
    return UsageError(f"--fused: the fused kernels cannot be compiled: {type(cause).__name__}: "
                      f"{text}; rerun with --no-fused")


def fuse_elementwise(model: VisionTower, dynamic: bool = True) -> VisionTower:
    """Install compiled elementwise functions on every block of ``model`` (in place; they
    compile at the first forward), kept in this tower's ``compile_cache`` folder. ``dynamic``:
    one shape-generic kernel for every row count, so a row's value never depends on its batch;
    False: specialized to an Engine that runs every batch at one shape
    (``engine.runs_one_shape``). UsageError when this torch cannot compile."""
    try:
        import torch._inductor  # noqa: F401  (the backend torch.compile uses)
    except Exception as exc:  # pragma: no cover - depends on the torch build
        raise UsageError(f"--fused needs torch.compile's inductor backend ({exc})") from None
    pin_cpu_vector_width()
    from torch._inductor.exc import InvalidCxxCompiler

    try:
        trust_vector_isas(use_compile_cache(model.cfg, model.device, model.dtype), model.device)
    except InvalidCxxCompiler as exc:
        raise cannot_compile(exc) from None
    norm, add_norm, rope, act = (compiled(f, dynamic) for f in (rms_norm, add_rms_norm,
                                                                rope_formula, swiglu))
    model.vision.norm.norm_fn = norm
    for block in model.vision.blocks:
        block.norm1.norm_fn = norm
        block.norm2.norm_fn = norm
        block.add_norm_fn = add_norm
        block.attn.rope_fn = rope
        block.mlp.act_fn = act
    model.fused = True
    log.info("fused elementwise kernels installed (compiled at the first batch)")
    return model
