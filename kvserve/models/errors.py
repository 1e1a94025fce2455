"""Exceptions raised while resolving and loading model weights."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A model file or directory cannot be loaded; the message names the file and the problem."""


class ModelFileNotFoundError(ModelLoadError, FileNotFoundError):
    """A model file or directory (or a file it needs) does not exist."""
