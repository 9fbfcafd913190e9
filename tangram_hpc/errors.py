"""Every error tangram-hpc raises on purpose derives from :class:`TangramError`.

Each keeps the built-in base it had before, so ``except ValueError`` (bad
input) and ``except RuntimeError`` (a failure at run time) still catch what
they caught.  The modules that raise them re-export them where they were
defined before (``tangram_hpc.actions.ValidationError``,
``tangram_hpc.protocol.ProtocolError`` ...); this is the one definition.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .actions import ActionResult

__all__ = ["TangramError", "ValidationError", "ProtocolError", "ConfigError", "ActionFailed", "CoordinatorError",
           "LaunchRefused", "BwrapUnavailable", "SlurmCommandError"]


class TangramError(Exception):
    """Base of tangram-hpc's own errors: ``except TangramError`` catches them all."""


# -- bad input ---------------------------------------------------------------------

class ValidationError(TangramError, ValueError):
    """An action spec or result that does not follow the schema."""


class ProtocolError(TangramError, ValueError):
    """A frame that does not follow the protocol; ``code`` is a short machine-readable tag."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class ConfigError(TangramError, ValueError):
    """A configuration file, variable or flag that does not fit the schema (see tangram_hpc.config)."""


# -- failures at run time ------------------------------------------------------------

class ActionFailed(TangramError, RuntimeError):
    """Raised by ``ActionResult.raise_for_status()`` when an action did not finish ``ok``."""

    def __init__(self, result: ActionResult):
        self.result = result
        super().__init__(f"action {result.id} {result.status}: {result.error or ''}".rstrip(": "))


class CoordinatorError(TangramError, RuntimeError):
    """The coordinator answered with an ERROR frame, or a result it sent could not be read."""


class LaunchRefused(TangramError, RuntimeError):
    """A backend will not launch workers now; the message says why and until when."""


class BwrapUnavailable(TangramError, RuntimeError):
    """bubblewrap is missing or cannot create the namespaces it needs here."""


class SlurmCommandError(TangramError, RuntimeError):
    """A Slurm query failed (controller down, command missing, bad output)."""
