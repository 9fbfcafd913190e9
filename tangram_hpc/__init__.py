"""tangram-hpc: action-level elastic scheduling of sandboxes and reward models for agentic RL.

The public API::

    from tangram_hpc import Client, ActionSpec, Demand, sandbox, function, reward, LocalCluster
"""
from .actions import (ActionFailed, ActionResult, ActionSpec, Demand, EnvState, Status, ValidationError,
                      function, register_kind, reward, sandbox)
from .client import AsyncClient, Client
from .errors import TangramError
from .launch import LocalCluster

__version__ = "0.1.0"

__all__ = ["ActionSpec", "ActionResult", "ActionFailed", "Demand", "EnvState", "Status", "TangramError",
           "ValidationError", "Client", "AsyncClient", "LocalCluster", "sandbox", "function", "reward", "register_kind"]
