"""Worker-side resource managers: sandboxes on CPU workers."""
from .env_templates import EmptyTemplate, PythonEnvTemplate, TreeTemplate
from .limits import Limits
from .sandbox import BwrapUnavailable, SandboxManager, SandboxOutcome

__all__ = ["SandboxManager", "SandboxOutcome", "Limits", "BwrapUnavailable",
           "EmptyTemplate", "TreeTemplate", "PythonEnvTemplate"]
