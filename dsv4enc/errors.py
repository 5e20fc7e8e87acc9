"""Domain errors: anything a user can fix (setup, options, weights, output path), which the CLI
prints as one line and a non-zero exit. Bad *images* are rows with an ``error`` value instead."""

from __future__ import annotations

import errno
import numbers
import os
import signal


RESUME_ADVICE = "rerun with --resume"  # how an error's line advises finishing the run
PARTS_KEPT = "committed parts are kept"  # a full disk's line, but at a run's first manifest


def advise(exc: Exception, again: str) -> None:
    """Make ``exc``'s line advise ``again`` where it says ``RESUME_ADVICE`` (an interrupted
    ``--update`` is finished by ``--update``: ``--resume`` would be refused beside it)."""
    if exc.args and isinstance(exc.args[0], str):
        exc.args = (exc.args[0].replace(RESUME_ADVICE, f"rerun with {again}"), *exc.args[1:])


class DsvError(Exception):
    """A setup problem the user can fix. ``exit_code`` is what the CLI exits with."""

    exit_code = 1


class UsageError(DsvError):
    """Options that make no sense (alone or together)."""

    exit_code = 2


class SettingsError(UsageError, ValueError):
    """A setting out of its range or choices: one line on the command line, and a
    ``ValueError`` to the Python API's callers."""


def check_choice(name: str, value: str, allowed: tuple[str, ...]) -> str:
    """``value``, or a SettingsError with ``name``'s choices (the CLI's own check:
    ``run/options.validate``)."""
    if value not in allowed:
        raise SettingsError(f"{name} must be one of {', '.join(map(repr, allowed))}, "
                            f"not {value!r}")
    return value


def check_positive(name: str, value: int, whole: bool = True) -> int:
    """``value``, or a SettingsError when it is not positive, or not a number at all (text
    read from an environment variable would otherwise fail its comparison unnamed), or, for
    a count (``whole``; a time in seconds is not), not a whole number: the command line
    parses a count as an int, and the Python API must not take 2.5 (or True) where it would."""
    if not isinstance(value, numbers.Real):
        raise SettingsError(f"{name} must be a positive number, got {value!r}")
    if whole:
        _check_whole(name, value)
    if not value > 0:  # NaN too
        raise SettingsError(f"{name} must be positive, got {value}")
    return value


def _check_whole(name: str, value: int) -> int:
    """``value``, or a SettingsError when it is no whole number (a bool is none)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise SettingsError(f"{name} must be a whole number, got {value!r}")
    return value


def check_flag(name: str, value: object, optional: bool = False) -> object:
    """``value``, or a SettingsError when it is no flag (True or False; None too where
    ``optional``: the device's default): a flag given as text, "no" or "off", is truthy and
    would turn the setting on. The command line's flags are parsed; the Python API's are not."""
    try:
        ok = (optional and value is None) or value in (True, False)  # numpy's bools too
    except (TypeError, ValueError):  # an array: no one truth
        ok = False
    if not ok:
        raise SettingsError(f"{name} must be True{', False or None' if optional else ' or False'}"
                            f", got {value!r}")
    return value


#: A random tower's seed's range: what ``torch.Generator.manual_seed`` takes (a negative seed
#: is taken modulo 2**64); past it torch raises an overflow instead of seeding.
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)


def check_seed(name: str, value: int) -> int:
    """``value``, or a SettingsError when torch cannot seed with it (``--seed``, and the
    Python API's ``seed=``): not a whole number, or past ``SEED_RANGE``."""
    if not SEED_RANGE[0] <= _check_whole(name, value) <= SEED_RANGE[1]:
        raise SettingsError(f"{name} must be from -2**63 to 2**64-1 (what torch takes), "
                            f"got {value}")
    return value


class ConfigError(DsvError):
    """A model config that is missing keys or inconsistent."""


class WeightsError(DsvError):
    """A checkpoint that is missing, incomplete, or holds the wrong tensors."""


class InsufficientMemory(DsvError):
    """A valid tower that this machine (its RAM, or the device's memory) cannot hold."""


class OutputError(DsvError):
    """An output path that cannot be written, or that already exists."""


def output_os_error(path: os.PathLike | str, exc: OSError) -> OutputError:
    """A one-line OutputError for a failed write (full disk, permissions, ...)."""
    if exc.errno == errno.ENOSPC:
        return OutputError(f"no space left on device writing {path}; {PARTS_KEPT}, "
                           f"free space and {RESUME_ADVICE}")
    return OutputError(f"cannot write {path}: {exc.strerror or exc}")


class StorageError(DsvError):
    """Object storage that cannot be used: a missing bucket, denied access, no answer at setup."""


class AlreadyComplete(DsvError):
    """``--resume`` of an output that is already complete: nothing to do, not a failure."""

    exit_code = 0


class DistributedError(DsvError):
    """A rank failed or timed out."""


class Interrupted(Exception):
    """SIGINT/SIGTERM stopped the run after committing finished parts."""

    def __init__(self, signum: int, resume_hint: str) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}; {resume_hint}")
        self.exit_code = 128 + signum
