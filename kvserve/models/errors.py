"""Exceptions raised while resolving and loading model weights."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A model file or directory cannot be loaded; the message names the file and the problem."""


class ModelFileNotFoundError(ModelLoadError, FileNotFoundError):
    """A model file or directory (or a file it needs) does not exist."""


def positive_int(value: object, key: str, path: str) -> int:
    """``value`` (a config or metadata entry) as an int >= 1.

    Raises ``ModelLoadError`` naming ``path`` and ``key`` otherwise: a zero head count
    would divide by zero, a zero context length would reach the engine as a bad
    ``max_model_len`` the user never gave.
    """
    # NOTE: a float with an integral value (64.0) is accepted, as int() always did.
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelLoadError(f"{path}: {key!r} must be a positive integer, got {value!r}")
    return value
