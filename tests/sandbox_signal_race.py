"""Signal every process under this one, as Slurm does to a job, while a sandboxed command starts.

Run as a script (its own process tree): for each delay it starts ``sleep 0.3 && echo x >> log``
in a fresh environment, sends SIGTERM to all of its own descendants after the delay, and prints
one JSON line per run: the outcome's status and the lines in ``log`` 0.5 s after the run ended.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tangram_hpc.actions import ActionSpec  # noqa: E402
from tangram_hpc.managers import SandboxManager  # noqa: E402


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, stack = [], [root]
    while stack:
        for k in children.get(stack.pop(), []):
            out.append(k)
            stack.append(k)
    return out


def main() -> None:
    # the worker itself handles SIGTERM and carries on (a handler, not SIG_IGN: children must not inherit it)
    signal.signal(signal.SIGTERM, lambda *_: None)
    cpu = [sorted(os.sched_getaffinity(0))[0]]
    tmp = Path(tempfile.mkdtemp())
    mgr = SandboxManager(tmp / "envs", tmp / "snapshots")
    for k, delay in enumerate(float(x) for x in sys.argv[1:]):
        env = f"e{k}"
        spec = ActionSpec("sandbox", {"cmd": "sleep 0.3 && echo x >> log"}, env=env)
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("o", mgr.run(spec, cpu)))
        t.start()
        time.sleep(delay)
        for pid in descendants(os.getpid()):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        t.join()
        time.sleep(0.5)            # anything still running in the sandbox would write by now
        check = mgr.run(ActionSpec("sandbox", {"cmd": "cat log 2>/dev/null | wc -l"}, env=env), cpu)
        print(json.dumps({"delay": delay, "status": out["o"].status, "error": out["o"].error,
                          "lines": int(check.output["stdout"].strip())}), flush=True)
    mgr.close()


if __name__ == "__main__":
    main()
