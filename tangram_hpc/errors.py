"""Every error tangram-hpc raises on purpose derives from :class:`TangramError`."""
from __future__ import annotations


class TangramError(Exception):
    """Base of tangram-hpc's own errors: ``except TangramError`` catches them all."""


class ConfigError(TangramError, ValueError):
    """A configuration file, variable or flag that does not fit the schema (see tangram_hpc.config)."""
