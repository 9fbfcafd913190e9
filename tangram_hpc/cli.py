"""``tangram-hpc``: the command line.

Each subcommand lives with the code it drives and exposes
``add_arguments(parser)`` and ``main(args) -> int``; this module only wires
them together, so ``tangram-hpc X --help`` is documented where X is built.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import re
import sys

from . import native
from .errors import ConfigError

#: subcommand -> (module, one-line help)
COMMANDS = {
    "coordinator": ("tangram_hpc.launch", "run a coordinator (and its workers, through a backend)"),
    "worker": ("tangram_hpc.worker", "run a worker that joins a coordinator"),
    "submit": ("tangram_hpc.commands", "submit one action from the shell and print its result"),
    "status": ("tangram_hpc.commands", "show a coordinator's workers, queue, counters and worker jobs"),
    "top": ("tangram_hpc.top", "live view of a coordinator: workers, queues, ACT percentiles, pool decisions"),
    "pool": ("tangram_hpc.commands", "pause or resume a coordinator's worker launches"),
    "report": ("tangram_hpc.report", "usage report of a run: sacct records joined with the action log"),
    "bench": ("tangram_hpc.bench", "simulate a workload under tangram and the baselines; print ACT, step time, resources"),
    "fidelity": ("tangram_hpc.fidelity", "run a small workload live on local workers and in the simulator; compare ACT"),
    "demo": ("tangram_hpc.demo", "run a synthetic agentic-RL step on a local coordinator and print ACT statistics"),
    "config": ("tangram_hpc.config_cli", "show the effective configuration (defaults, file, environment) and its sources"),
    "native": ("tangram_hpc.native", "compile the policies and the simulator for bench (about 2x faster; TANGRAM_NATIVE=1 runs it), or show whether a build matches"),
    "serve": ("tangram_hpc.serve.command", "HTTP in front of a coordinator: SandboxFusion's /run_code and /run_jupyter, and OpenRLHF's remote reward (/reward/SERVICE)"),
}

_ENTRY = {  # modules hosting several subcommands name their functions per command
    "submit": ("add_submit_arguments", "submit_main"),
    "status": ("add_status_arguments", "status_main"),
    "pool": ("add_pool_arguments", "pool_main"),
    "coordinator": ("add_coordinator_arguments", "coordinator_main"),
    "config": ("add_config_arguments", "config_main"),
    "worker": ("add_arguments", "worker_main"),
}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; only the chosen command's module is imported (start-up stays fast)."""
    chosen = next((a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")), None)
    p = argparse.ArgumentParser(
        prog="tangram-hpc",
        description="Action-level elastic scheduling of sandboxes and reward models for agentic RL.",
        epilog="Run 'tangram-hpc COMMAND --help' for the options of a command.")
    p.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    # The global options work after the command too (tangram-hpc status -v); SUPPRESS keeps a
    # subcommand that does not see one from resetting what was given before it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="log at debug level")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_, description=help_[0].upper() + help_[1:] + ".", parents=[common])
        if name == chosen:
            add_name, _ = _ENTRY.get(name, ("add_arguments", "main"))
            getattr(importlib.import_module(module), add_name)(sp)
        sp.set_defaults(_module=module, _command=name)
    return p


#: A value such as "-30m" (thirty minutes ago) that argparse would take for an option.
_RELATIVE_TIME = re.compile(r"-\d+(\.\d+)?[smhd]")


def _attach_relative_times(argv: list[str]) -> list[str]:
    """``--since -30m`` -> ``--since=-30m``, so a relative time after an option is its value."""
    out: list[str] = []
    for a in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and _RELATIVE_TIME.fullmatch(a):
            out[-1] += "=" + a
        else:
            out.append(a)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = _attach_relative_times(sys.argv[1:] if argv is None else list(argv))
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "_module", None):
        parser.print_help()
        return 2
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    refused = native.refuse_live(args._command)
    if refused:
        print(f"tangram-hpc {args._command}: error: {refused}", file=sys.stderr)
        return 2
    _, main_name = _ENTRY.get(args._command, ("add_arguments", "main"))
    mod = importlib.import_module(args._module)
    try:
        rc = int(getattr(mod, main_name)(args) or 0)
        sys.stdout.flush()          # a reader that went away shows here, not in Python's exit
        return rc
    except ConfigError as e:
        print(f"tangram-hpc {args._command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # the reader went away (``| head``): stop quietly, and send what is still buffered, which
        # Python flushes at exit, nowhere
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
