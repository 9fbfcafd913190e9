"""The append-a-line check of stateful environments, through faults, on the loopback Slurm cluster.

    python tests/env_faults.py [--envs 50] [--steps 3] [FAULT ...]

prints, for each fault, how many lines of ok actions the environments lost and how many they hold
twice (the table of issue 11).  ``tests/test_env_faults.py`` runs the same scenarios and asserts
zero of both.

A scenario starts a coordinator the documented way (``scripts/launch-coordinator.sh``: sbatch, Slurm
worker jobs), runs ``envs`` trajectories of ``steps`` sandbox actions each (every action ``sleep``s
and then appends its own id to ``log.txt`` in its environment; a trajectory submits its next action
when the last one has its result), injects its fault while actions run, then reads every
environment's ``log.txt`` back through a last action and compares it with the actions that
reported ``ok``; the environments start as a small checkout (the workers' ``--sandbox-template``), whose
files the last action checks too:

* lost: an ok action whose line is not in its environment's log;
* duplicated: an ok action whose line is there more than once.

The command is ``sleep S && echo ID >> log.txt``: it does its work and records its effect last, and
only if the work succeeded, as a command that wants its effect once should.  An attempt that dies half
way keeps what it did before dying (docs/reliability.md): with ``--half-way`` the command is
``sleep S; echo ID >> log.txt`` instead, whose append survives a signal that killed its ``sleep``
(Slurm signals every process of a job it cancels), and the duplicates it then shows are that
at-least-once property, not a lost or forked environment.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import hashlib
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tangram_hpc import Client, sandbox  # noqa: E402

LAUNCH = REPO / "scripts" / "launch-coordinator.sh"
#: sigstop: SIGSTOP a worker running actions until the coordinator has lost it and retried an action,
#: then SIGCONT; scancel / sigkill: a worker running actions; drain: the first workers reach their
#: time limit under continuous load, which lasts until each of them has left; restart: scancel the
#: coordinator's job and launch it again (a new run directory, as the script does); crash-restart:
#: SIGKILL the coordinator process, then launch it again on the same run directory.
FAULTS = ("sigstop", "scancel", "sigkill", "drain", "restart", "crash-restart")
#: A node lost (on the multi-node cluster of ``scripts/dev-cluster.sh multi``, SLURM_CONF naming it):
#: the coordinator runs on its head node, and the node of a worker running actions loses its slurmd
#: and every process of its jobs at once.
NODE_LOSS = "node-loss"
DEV_CLUSTER = REPO / "scripts" / "dev-cluster.sh"


@dataclass
class Outcome:
    fault: str
    actions: int = 0
    ok: int = 0
    lost: int = 0
    duplicated: int = 0
    envs_lost: int = 0             # environments whose log could not be read back
    statuses: Counter = field(default_factory=Counter)
    env_states: Counter = field(default_factory=Counter)
    attempts: Counter = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)
    counters: dict = field(default_factory=dict)   # the coordinator's, at the end
    leaked_jobs: list[str] = field(default_factory=list)   # jobs of the scenario still there after its stop
    duplicated_ids: list[str] = field(default_factory=list)
    seconds: float = 0.0
    run_dirs: list[Path] = field(default_factory=list)     # the coordinator's (one per launch)
    victim_jobs: list[str] = field(default_factory=list)   # the worker jobs the fault struck

    def row(self) -> str:
        extra = f"{self.envs_lost} envs lost; " if self.envs_lost else ""
        return (f"| {self.fault} | {self.lost} | {self.duplicated} | {self.ok}/{self.actions} ok; {extra}"
                f"env_state {dict(self.env_states)}; attempts {dict(sorted(self.attempts.items()))}; "
                f"{self.seconds:.0f}s |")


class Coordinator:
    """A coordinator started with scripts/launch-coordinator.sh in ``shared``; restartable the same way."""

    def __init__(self, shared: Path, env: dict[str, str], name: str, sbatch_args: tuple[str, ...] = ()):
        self.shared = shared
        self.env = env
        self.name = name
        self.sbatch_args = sbatch_args
        self.job: str | None = None
        self.conn = str(shared / "coordinator.json")

    def launch(self) -> None:
        out = subprocess.run([str(LAUNCH), "--shared", str(self.shared), "--wait", "90", "--",
                              f"--job-name={self.name}", *self.sbatch_args], capture_output=True, text=True,
                             env=self.env,
                             timeout=120)
        if out.returncode != 0:
            raise RuntimeError(f"launch-coordinator.sh failed: {out.stderr}")
        lines = dict(line.split(" ", 1) for line in out.stdout.strip().splitlines())
        self.job, self.conn = lines["job"], lines["connection"]

    def wait_gone(self, wait: float = 60.0) -> None:
        deadline = time.monotonic() + wait
        while self.job is not None and time.monotonic() < deadline and _job_active(self.job):
            time.sleep(0.2)

    def stop(self, wait: float = 90.0) -> None:
        """scancel: the job's trap stops the coordinator, which stops its workers (they save their
        environments) and cancels their jobs."""
        if self.job is None:
            return
        subprocess.run(["scancel", self.job], capture_output=True)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and _job_active(self.job):
            time.sleep(0.5)
        self.job = None


def _job_active(job: str) -> bool:
    out = subprocess.run(["squeue", "-h", "-j", str(job), "-o", "%T"], capture_output=True, text=True)
    return bool(out.stdout.strip())


def _jobs_under(directory: Path) -> list[str]:
    """Active Slurm jobs whose working directory is ``directory`` or below it."""
    out = subprocess.run(["squeue", "-h", "-o", "%i %Z"], capture_output=True, text=True)
    root = str(directory.resolve())
    return [j for j, _, wd in (line.partition(" ") for line in out.stdout.splitlines())
            if wd == root or wd.startswith(root + "/")]


def _leaked_jobs(directory: Path, wait: float = 30.0) -> list[str]:
    """Jobs of a stopped scenario that do not end within ``wait`` seconds (cancelled, and returned)."""
    deadline = time.monotonic() + wait
    while (jobs := _jobs_under(directory)) and time.monotonic() < deadline:
        time.sleep(0.5)
    if jobs:
        subprocess.run(["scancel", *jobs], capture_output=True)   # so that no later test meets them
    return jobs


def _worker_job(handle: str) -> str | None:
    out = subprocess.run(["squeue", "-h", "-n", handle, "-o", "%i"], capture_output=True, text=True)
    return out.stdout.split()[0] if out.stdout.split() else None


def _node_of(job: str) -> str:
    out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%N"], capture_output=True, text=True, check=True)
    return out.stdout.strip()


def _jobs_on(node: str) -> list[str]:
    out = subprocess.run(["squeue", "-h", "-w", node, "-o", "%i"], capture_output=True, text=True, check=True)
    return out.stdout.split()


class Trajectories:
    """``envs`` environments, ``steps`` actions each, one at a time per environment."""

    def __init__(self, client: Client, envs: int, steps: int, sleep_s: float, prefix: str, half_way: bool = False):
        self.client = client
        self.joiner = ";" if half_way else " &&"
        self.steps = steps
        self.sleep_s = sleep_s
        self.env_ids = [f"{prefix}-{i}" for i in range(envs)]
        self.done_steps = {e: 0 for e in self.env_ids}
        self.results: dict[str, list] = {e: [] for e in self.env_ids}   # env -> [(action id, result)]
        self.running: dict[cf.Future, str] = {}

    def _submit(self, env: str) -> None:
        spec = sandbox(f"sleep {self.sleep_s}{self.joiner} echo $TANGRAM_ACTION >> log.txt", env=env)
        spec.payload["environ"] = {"TANGRAM_ACTION": spec.id}
        self.running[self.client.submit(spec)] = (env, spec.id)

    def start(self) -> None:
        for e in self.env_ids:
            self._submit(e)

    def pump_until_every_env_ran(self, timeout: float = 300.0) -> None:
        """Collect results until every environment has run its first action (they are spread over the
        workers by then), without starting trajectories over."""
        deadline = time.monotonic() + timeout
        while min(self.done_steps.values()) < 1 and time.monotonic() < deadline:
            self.pump(min(deadline, time.monotonic() + 0.2), more=False)

    def pump(self, until: float, more: bool = True) -> bool:
        """Collect results until ``until`` (monotonic); start each trajectory's next step.  ``more``:
        loop the trajectories (continuous load) instead of stopping after ``steps``.  True once done."""
        while self.running and time.monotonic() < until:
            done, _ = cf.wait(list(self.running), timeout=max(0.0, min(1.0, until - time.monotonic())),
                              return_when=cf.FIRST_COMPLETED)
            for f in done:
                env, aid = self.running.pop(f)
                self.results[env].append((aid, f.result()))
                self.done_steps[env] += 1
                if more or self.done_steps[env] < self.steps:
                    self._submit(env)
        return not self.running


def make_checkout(path: Path) -> Path:
    """The workers' template: a small checkout whose ``tree.md5`` lists a digest of every file."""
    (path / "src").mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(20):
        text = f"N = {i}\n" * (i + 1)
        (path / "src" / f"m{i}.py").write_text(text)
        lines.append(f"{hashlib.md5(text.encode()).hexdigest()}  src/m{i}.py\n")
    (path / "tree.md5").write_text("".join(lines))
    return path


def read_back(client: Client, env_ids: list[str]) -> dict[str, list[str] | None]:
    """Every environment's log; None where it cannot be read or the checkout it started as is not intact."""
    futs = {e: client.submit(sandbox("md5sum -c --quiet tree.md5 >&2 && cat log.txt", env=e)) for e in env_ids}
    out = {}
    for e, f in futs.items():
        r = f.result(timeout=300)
        out[e] = r.output["stdout"].split() if r.ok else None
    return out


def judge(outcome: Outcome, traj: Trajectories, logs: dict[str, list[str] | None]) -> None:
    for env, results in traj.results.items():
        lines = logs.get(env)
        counts = Counter(lines or [])
        for aid, r in results:
            outcome.actions += 1
            outcome.statuses[r.status] += 1
            outcome.env_states[r.env_state] += 1
            outcome.attempts[r.attempts] += 1
            if not r.ok:
                outcome.notes.append(f"[not ok] {aid}: {r.status} attempts={r.attempts} {r.error}")
                continue
            outcome.ok += 1
            if lines is None:
                outcome.lost += 1
            elif counts[aid] == 0:
                outcome.lost += 1
            elif counts[aid] > 1:
                outcome.duplicated += counts[aid] - 1
                outcome.duplicated_ids.append(aid)
                outcome.notes.append(f"{env}: {aid} x{counts[aid]} (attempts {r.attempts}, {r.env_state} on "
                                     f"{r.worker})")
        if lines is None:
            outcome.envs_lost += 1


def _log_lines(shared: Path, needle: str, limit: int = 10) -> list[str]:
    """Lines of the scenario's job logs (workers and coordinator) that mention ``needle``."""
    out = []
    for path in sorted(shared.rglob("*_log.err")) + sorted(shared.glob("*.out")):
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        out += [f"{path.name}: {line.strip()}" for line in text.splitlines() if needle in line]
    return out[:limit]


def _busy_worker(client: Client, timeout: float = 120.0) -> dict:
    """The worker holding the most environments among those running actions now."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        busy = [w for w in client.status().get("workers", [])
                if w.get("running", 0) >= 1 and w.get("state") == "ok" and w.get("pid")]
        if busy:
            return max(busy, key=lambda w: (w.get("envs", 0), w["running"]))
        time.sleep(0.1)
    raise AssertionError("no worker ran actions within the timeout")


def _pump_while(traj: Trajectories, going, timeout: float) -> None:
    """Keep the trajectories going (continuous load) while ``going()`` holds, ``timeout`` at most."""
    deadline = time.monotonic() + timeout
    while going() and time.monotonic() < deadline:
        traj.pump(min(deadline, time.monotonic() + 0.5))


def _lost_and_retried(client: Client) -> dict | None:
    """The coordinator's status once it has lost a worker and retried an action, else None."""
    st = client.status()
    return st if st["workers_lost"] >= 1 and st["retried"] >= 1 else None


class _FirstWorkers:
    """The workers that registered before any of them began to drain (or left), and whether each
    of them has left since: the drain scenario keeps the load on until then."""

    def __init__(self, client: Client):
        self.client = client
        self.ids: set[str] = set()
        self.frozen = False

    def not_all_left(self) -> bool:
        workers = self.client.status()["workers"]
        here = {w["id"] for w in workers}
        if not self.frozen:
            if any(w["state"] != "ok" for w in workers if w["id"] in self.ids) or self.ids - here:
                self.frozen = True        # the first drain began: later workers are its replacements
            else:
                self.ids |= {w["id"] for w in workers if w["state"] == "ok"}
        return not self.frozen or bool(self.ids & here)


def run_fault(fault: str, workdir: Path, *, envs: int = 50, steps: int = 3, sleep_s: float = 0.5,
              half_way: bool = False, keep: bool = False, log=print) -> Outcome:
    """One scenario; ``workdir`` must be on a filesystem the Slurm jobs see (the loopback cluster: any)."""
    assert fault in FAULTS or fault == NODE_LOSS, fault
    t0 = time.monotonic()
    shared = workdir / fault
    shared.mkdir(parents=True, exist_ok=True)
    # not the variables of a Slurm job this may run in; the cluster's configuration file, though
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
    # environments start as a checkout, so the moves of scancel, drain and the restarts are deltas over it;
    # the workers the coordinator launches read its configuration file
    config = shared / "tangram.toml"
    config.write_text(f'[sandbox]\ntemplate = "{make_checkout(shared / "checkout")}"\n')
    with_config = f"--config {config}"
    env.update(TANGRAM_WORKER_CORES="2", TANGRAM_MAX_WORKERS="3", TANGRAM_IDLE="60", TANGRAM_STOP_GRACE="40",
               TANGRAM_EXTRA_ARGS=f"--slurm-startup 5 {with_config}")
    env.pop("TANGRAM_CONNECTION_FILE", None)
    if fault == "drain":
        # Each worker drains 65 s into its 4-minute job (175 s before its end: Slurm's warning signal
        # comes 90 s before the end, or up to 60 s earlier, which leaves the drain 25 s on a loaded
        # machine), under continuous load; its replacement takes its environments.
        env.update(TANGRAM_WORKER_TIME="4", TANGRAM_EXTRA_ARGS=f"--slurm-startup 5 --slurm-replace-before 175 {with_config}")
    if fault == "crash-restart":
        env.update(TANGRAM_RUN_DIR=str(shared / "runs" / "fixed"))
    coord = Coordinator(shared, env, f"tgenv-{fault}", ("--partition=head",) if fault == NODE_LOSS else ())
    coord.launch()
    outcome = Outcome(fault)
    client = Client(connection_file=coord.conn)
    try:
        traj = Trajectories(client, envs, steps, sleep_s, prefix=fault, half_way=half_way)
        traj.start()
        if fault != "drain":
            traj.pump_until_every_env_ran()   # the faults strike workers that hold environments
        if fault in ("sigstop", "scancel", "sigkill", NODE_LOSS):
            # Strike while the victim's commands sleep, not as they end: the first actions of all
            # environments end together, right as the pump above returns, and a command killed
            # between its append and its journal record runs again (the at-least-once window of
            # docs/reliability.md), which is not what these scenarios check.
            traj.pump(time.monotonic() + sleep_s / 2, more=False)
            victim = _busy_worker(client)
            log(f"[{fault}] victim {victim['id']} pid {victim['pid']} running {victim['running']}, "
                f"holding {victim.get('envs')} environments")
            if fault == "sigstop":
                os.kill(victim["pid"], signal.SIGSTOP)
                _pump_while(traj, lambda: _lost_and_retried(client) is None, 120)
                os.kill(victim["pid"], signal.SIGCONT)
            elif fault == "scancel":
                job = _worker_job(victim["handle"])
                outcome.victim_jobs = [job]
                subprocess.run(["scancel", job], check=True)
            elif fault == NODE_LOSS:
                node = _node_of(_worker_job(victim["handle"]))
                outcome.victim_jobs = _jobs_on(node)       # every worker there is lost with it
                log(f"[{fault}] node {node} lost, with jobs {outcome.victim_jobs}")
                subprocess.run([str(DEV_CLUSTER), "multi", "kill-node", node], check=True, capture_output=True)
            else:
                os.kill(victim["pid"], signal.SIGKILL)
            traj.pump(time.monotonic() + 300, more=False)
        elif fault == "drain":
            _pump_while(traj, _FirstWorkers(client).not_all_left, 240)   # past the first workers' drains
            st = client.status()
            log(f"[drain] after {time.monotonic() - t0:.0f}s: {len(st['workers'])} workers, lost "
                f"{st['workers_lost']}, environments {st['environments']}")
            traj.pump(time.monotonic() + 300, more=False)
        else:
            _busy_worker(client)                                                 # part way through
            log(f"[{fault}] restarting the coordinator (job {coord.job})")
            if fault == "crash-restart":
                # Its job's script ends by itself, its trap cancelling the workers (they save what they
                # hold with nobody to tell); a scancel now could cut that trap short.
                os.kill(client.status()["pid"], signal.SIGKILL)
                coord.wait_gone()
            coord.stop()
            coord.launch()
            traj.pump(time.monotonic() + 300, more=False)
        if traj.running:
            outcome.notes.append(f"{len(traj.running)} actions without a result after 300 s")
        logs = read_back(client, traj.env_ids)
        judge(outcome, traj, logs)
        for aid in outcome.duplicated_ids:      # what the workers said of its attempts, for the report
            outcome.notes += [f"[log] {line}" for line in _log_lines(shared, aid)]
        st = client.status()
        outcome.counters = {k: st[k] for k in ("workers_lost", "retried", "replayed", "stale_results")}
        outcome.notes.append(f"workers lost {st['workers_lost']}, retried {st['retried']}, replayed "
                             f"{st['replayed']}, stale {st['stale_results']}")
        if not keep:
            client.close_env(traj.env_ids)
    finally:
        client.close()
        coord.stop()
        outcome.run_dirs = sorted(p.parent for p in shared.glob("runs/*/slurm_jobs.log"))
        outcome.leaked_jobs = _leaked_jobs(shared)
        if outcome.leaked_jobs:
            outcome.notes.append(f"worker jobs left running after the coordinator stopped: {outcome.leaked_jobs}")
    outcome.seconds = time.monotonic() - t0
    return outcome


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("faults", nargs="*", default=list(FAULTS),
                    help=f"some of {', '.join(FAULTS)} (default: all), or {NODE_LOSS} (SLURM_CONF: the multi-node cluster)")
    ap.add_argument("--envs", type=int, default=50)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--sleep", type=float, default=0.5, help="seconds each action sleeps before its append")
    ap.add_argument("--workdir", default=None, help="where the scenarios' shared directories go")
    ap.add_argument("--half-way", action="store_true", help="'sleep; echo' instead of 'sleep && echo'")
    ap.add_argument("--keep", action="store_true", help="leave the environments (do not close them) to look into")
    a = ap.parse_args(argv)
    unknown = set(a.faults) - set(FAULTS) - {NODE_LOSS}
    if unknown:
        ap.error(f"unknown faults {sorted(unknown)}; choose from {', '.join(FAULTS)}")
    import tempfile
    workdir = Path(a.workdir or tempfile.mkdtemp(prefix="tangram-env-faults-"))
    rows = []
    for fault in a.faults:
        o = run_fault(fault, workdir, envs=a.envs, steps=a.steps, sleep_s=a.sleep, half_way=a.half_way, keep=a.keep)
        rows.append(o)
        print(o.row(), " ".join(o.notes), flush=True)
    cmd = f"sleep {a.sleep}{';' if a.half_way else ' &&'} echo ID >> log.txt"
    print(f"\n{a.envs} environments x {a.steps} actions of '{cmd}' (sigstop and drain: continuous load); "
          f"work in {workdir}\n")
    print("| fault | env lines lost | duplicated | notes |\n|---|---|---|---|")
    for o in rows:
        print(o.row())
    return 0 if all(o.lost == 0 and o.duplicated == 0 and o.envs_lost == 0 for o in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
