"""SkyRL-gym's code-execution tool on tangram sandboxes.

:class:`TangramPythonToolGroup` keeps the contract of SkyRL-gym's ``PythonCodeExecutorToolGroup``
(a ``python`` tool: code in, stdout out, ``"Error executing Python code: ..."`` on stderr or a
timeout) but runs each call as a sandbox action in the episode's own tangram environment, so a
file one call writes is there for the next, the code runs isolated on the cluster's workers, and
a core is held only while the code runs.  :func:`use_tangram` swaps it into an environment that
uses SkyRL-gym's local executor::

    import skyrl_gym
    from tangram_hpc.integrations.skyrl import use_tangram
    env = use_tangram(skyrl_gym.make("searchcode", extras=extras), connection_file="/shared/run/connection.json")

and :func:`register_envs` registers ``tangram_searchcode`` (SkyRL-gym's ``searchcode`` so built) for
a trainer that makes its environments by id; its ``env_config`` may name ``connection_file``
(default ``$TANGRAM_CONNECTION_FILE``).  Importing this module needs the ``skyrl-gym`` package.
"""
from __future__ import annotations

import uuid
from typing import Any

from skyrl_gym.tools import PythonCodeExecutorToolGroup
from skyrl_gym.tools.core import ToolGroup, tool

from tangram_hpc.actions import Status, sandbox
from tangram_hpc.integrations.clients import shared_client

__all__ = ["TangramPythonToolGroup", "use_tangram", "register_envs"]

_ERROR = "Error executing Python code: "
#: Seconds an action may take beyond the code's timeout: environment set-up.
_GRACE_S = 60.0


class TangramPythonToolGroup(ToolGroup):
    """The ``python`` tool, run in the tangram environment ``env_id`` (a new one by default)."""

    def __init__(self, timeout: float = 10.0, *, connection_file: str | None = None, env_id: str | None = None,
                 cores: int | tuple[int, int] = 1, template: str | None = None,
                 limits: dict[str, Any] | None = None, wait_s: float = 3600.0):
        self.timeout = timeout
        self.env_id = env_id or f"skyrl-{uuid.uuid4().hex[:16]}"
        self.cores, self.template, self.limits, self.wait_s = cores, template, dict(limits or {}), wait_s
        self.calls = 0
        self._client = shared_client(connection_file, "skyrl")
        super().__init__(name="TangramPythonToolGroup")

    @tool
    def python(self, code: str) -> str:
        spec = sandbox(["python", "-c", code], env=self.env_id, cores=self.cores, template=self.template,
                       limits={**self.limits, "timeout_s": self.timeout}, timeout=self.timeout + _GRACE_S,
                       trajectory=self.env_id, step=self.calls, label="skyrl:python")
        self.calls += 1
        res = self._client.submit(spec).result(self.timeout + _GRACE_S + self.wait_s)
        if res.status == Status.TIMEOUT:
            return f"{_ERROR}Execution timed out after {self.timeout} seconds."
        out = res.output if isinstance(res.output, dict) else None
        if res.status not in (Status.OK, Status.FAILED) or out is None:
            return f"{_ERROR}{res.error or res.status}"
        if out["stderr"]:
            return f"{_ERROR}{out['stderr'].strip()}"
        return out["stdout"].strip()

    def close(self) -> None:
        """End the environment: its files are removed once its calls have finished."""
        self._client.close_env(self.env_id)


def use_tangram(env: Any, **options: Any) -> Any:
    """``env`` with each of its local Python executors replaced by a :class:`TangramPythonToolGroup`
    (same timeout; ``options`` are its keyword arguments); its ``close`` also ends the tangram
    environment."""
    groups = [TangramPythonToolGroup(g.timeout, **options) if isinstance(g, PythonCodeExecutorToolGroup) else g
              for g in env.tool_groups]
    env.init_tool_groups(groups)
    close = env.close

    def close_all() -> None:
        for g in groups:
            if isinstance(g, TangramPythonToolGroup):
                g.close()
        close()

    env.close = close_all
    return env


def _searchcode(env_config: Any = None, extras: dict[str, Any] | None = None) -> Any:
    from skyrl_gym.envs.searchcode.env import SearchCodeEnv

    connection_file = env_config.get("connection_file") if env_config is not None else None
    return use_tangram(SearchCodeEnv(env_config, extras or {}), connection_file=connection_file)


def register_envs() -> None:
    """Register ``tangram_searchcode`` with SkyRL-gym (once)."""
    import skyrl_gym

    if "tangram_searchcode" not in skyrl_gym.registry:
        skyrl_gym.register(id="tangram_searchcode", entry_point=_searchcode)
