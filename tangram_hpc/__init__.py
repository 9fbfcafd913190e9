"""tangram-hpc: action-level elastic scheduling of sandboxes and reward models for agentic RL.

The public API::

    from tangram_hpc import Client, ActionSpec, Demand, sandbox, run_cells, function, reward, LocalCluster
"""
from .native import activate as _activate_native

_activate_native()      # before anything imports a policy: the compiled build when TANGRAM_NATIVE=1 asks for it

from .actions import (ActionFailed, ActionResult, ActionSpec, Demand, EnvState, Status,  # noqa: E402
                      ValidationError, function, register_kind, reward, run_cells, sandbox)
from .client import AsyncClient, Client  # noqa: E402
from .errors import TangramError  # noqa: E402
from .launch import LocalCluster  # noqa: E402

__version__ = "0.1.0"

__all__ = ["ActionSpec", "ActionResult", "ActionFailed", "Demand", "EnvState", "Status", "TangramError",
           "ValidationError", "Client", "AsyncClient", "LocalCluster", "sandbox", "run_cells", "function", "reward", "register_kind"]
