"""The exceptions devmap raises: one base class, each kind carrying the CLI exit code it maps to."""

from __future__ import annotations


class DevmapError(ValueError):
    """Base class of every error devmap raises on purpose; the message says what was wrong and how to fix it."""

    exit_code: int = 1


class UsageError(DevmapError):
    """The caller passed a bad value: an unknown name, a malformed size, an impossible combination."""

    exit_code = 2


class SourceError(UsageError):
    """A model source that devmap cannot resolve: unknown preset, missing or unreadable config.json, hub id."""


class DoesNotFitError(UsageError):
    """The model does not fit in the memory budgets given."""


class CheckpointError(DevmapError):
    """A checkpoint on disk is missing, truncated, corrupted or does not match the model."""


class PipelineError(DevmapError):
    """A pipeline stage failed or a model cannot be split into stages."""
