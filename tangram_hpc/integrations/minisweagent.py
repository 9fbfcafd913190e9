"""mini-swe-agent's commands as tangram sandbox actions.

In mini-swe-agent's config (YAML)::

    environment:
      environment_class: tangram_hpc.integrations.minisweagent.TangramEnvironment
      connection_file: /shared/run/connection.json   # or $TANGRAM_CONNECTION_FILE
      timeout: 60            # per command, seconds
      cwd: ""                # relative to the environment's directory, or absolute inside the sandbox
      env: {PAGER: cat}      # variables of every command
      template: project      # what a new environment is made from (the worker's templates)
      cores: 1               # or [1, 4]: a command may grow to 4 cores when they are free

Each agent gets its own tangram environment (``env_id``, a new one by default): a stateful
directory whose files persist from one command to the next.  Each ``execute`` is one sandbox
action in it, so the agent holds a core only while a command runs, not while its model thinks;
the environment lives on one worker and follows it if the scheduler moves it.

The output has the shape of mini-swe-agent's own environments: ``{"output", "returncode",
"exception_info"}`` (stdout and stderr together, as a shell shows them), with ``extra`` when the
command did not finish, and :class:`~minisweagent.exceptions.Submitted` raised for its
completion marker.  Importing this module needs the ``mini-swe-agent`` package.
"""
from __future__ import annotations

import dataclasses
import platform
import shlex
import uuid
from typing import Any

from minisweagent.exceptions import Submitted
from minisweagent.utils.serialize import recursive_merge

from tangram_hpc.actions import ActionResult, Status, sandbox
from tangram_hpc.integrations.clients import shared_client

__all__ = ["TangramEnvironment", "TangramEnvironmentConfig", "SUBMIT_MARKER"]

#: The first line of a command's output that ends the agent's run (mini-swe-agent's protocol).
SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
#: Seconds an action may take beyond its command's timeout: environment set-up, files.
_GRACE_S = 60.0


@dataclasses.dataclass
class TangramEnvironmentConfig:
    connection_file: str = ""
    #: the tangram environment of this agent ("" : a new one)
    env_id: str = ""
    cwd: str = ""
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    timeout: int = 30
    template: str | None = None
    cores: int | list[int] = 1
    mem_mb: int = 0
    #: the sandbox limits of each command beyond its timeout (docs/sandbox.md), e.g. {"memory_mb": 4096}
    limits: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: how long to wait for a command's result, queueing included, beyond its timeout
    wait_s: float = 3600.0


class TangramEnvironment:
    """A mini-swe-agent environment whose commands run in one tangram sandbox environment."""

    def __init__(self, *, config_class: type = TangramEnvironmentConfig, **kwargs: Any):
        self.config = config_class(**kwargs)
        if not self.config.env_id:
            self.config.env_id = f"mini-{uuid.uuid4().hex[:16]}"
        self._client = shared_client(self.config.connection_file or None, "minisweagent")
        self._steps = 0
        #: the :class:`~tangram_hpc.actions.ActionResult` of the last command (its worker, its timings)
        self.last_result: ActionResult | None = None

    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        """Run ``action["command"]`` by ``/bin/sh`` in this agent's environment."""
        command = action.get("command", "")
        cwd = cwd or self.config.cwd
        timeout = timeout or self.config.timeout
        script = "exec 2>&1\n"  # one stream, in order, as the agent reads a terminal
        if cwd:
            script += f"cd -- {shlex.quote(cwd)} || exit 1\n"
        cores = self.config.cores
        spec = sandbox(script + command, env=self.config.env_id,
                       cores=tuple(cores) if isinstance(cores, list) else cores, mem_mb=self.config.mem_mb,
                       environ=self.config.env or None, template=self.config.template,
                       limits={**self.config.limits, "timeout_s": timeout}, timeout=timeout + _GRACE_S,
                       trajectory=self.config.env_id, step=self._steps, label="minisweagent")
        self._steps += 1
        res = self.last_result = self._client.submit(spec).result(timeout + _GRACE_S + self.config.wait_s)
        out = res.output if isinstance(res.output, dict) else {}
        text = out.get("stdout", "")
        if res.status in (Status.OK, Status.FAILED) and out.get("returncode") is not None:
            output = {"output": text, "returncode": out["returncode"], "exception_info": ""}
        else:
            what = (f"the command timed out after {timeout} seconds" if res.status == Status.TIMEOUT
                    else f"the command did not complete ({res.status})")
            output = {"output": text, "returncode": -1,
                      "exception_info": f"An error occurred while executing the command: {what}: {res.error}",
                      "extra": {"exception_type": str(res.status), "exception": res.error or ""}}
        self._check_finished(output)
        return output

    def _check_finished(self, output: dict) -> None:
        lines = output["output"].lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT_MARKER and output["returncode"] == 0:
            submission = "".join(lines[1:])
            raise Submitted({"role": "exit", "content": submission,
                             "extra": {"exit_status": "Submitted", "submission": submission}})

    def cleanup(self) -> None:
        """End the environment: its files are removed once its commands have finished."""
        self._client.close_env(self.config.env_id)

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        # uname of this machine: the workers of a Slurm cluster run the same system
        return recursive_merge(dataclasses.asdict(self.config), platform.uname()._asdict(), kwargs)

    def serialize(self) -> dict:
        return {"info": {"config": {"environment": dataclasses.asdict(self.config),
                                    "environment_type": f"{type(self).__module__}.{type(self).__name__}"}}}
