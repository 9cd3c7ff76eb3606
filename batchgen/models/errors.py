"""ModelLoadError: every problem found while reading a model directory."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A model directory cannot be loaded; the message names the file/tensor and what to do."""
