"""An environment follows its trajectory: a worker that leaves snapshots it, the next worker restores it."""
import os
import signal
import subprocess
import sys
import time

from tangram_hpc import Client, sandbox
from tangram_hpc.commands import format_status
from tangram_hpc.connection import wait_for_file
from support import kept_state


def _worker(conn, log, cores=1):
    return subprocess.Popen([sys.executable, "-m", "tangram_hpc.worker", "--connection-file", str(conn),
                             "--cores", str(cores)], stdout=open(log, "ab"), stderr=subprocess.STDOUT)


def _coordinator(run_dir, *flags):
    """A coordinator with no backend (workers are started by hand) on ``run_dir``."""
    return subprocess.Popen([sys.executable, "-m", "tangram_hpc.cli", "coordinator", "--run-dir", str(run_dir),
                             "--backend", "none", *flags], stdout=open(run_dir / "coord.log", "ab"),
                            stderr=subprocess.STDOUT)


def test_environment_moves_to_another_worker_when_its_worker_leaves(tmp_path):
    conn = tmp_path / "connection.json"
    coord = _coordinator(tmp_path)
    procs = [coord]
    try:
        wait_for_file(conn, 30)
        a = _worker(conn, tmp_path / "a.log")
        procs.append(a)
        with Client(connection_file=str(conn)) as c:
            deadline = time.time() + 30
            while len(c.status()["workers"]) < 1:
                assert time.time() < deadline
                time.sleep(0.1)
            first = c.submit(sandbox("mkdir -p src && echo 'state of turn 1' > src/notes.txt && echo x > top",
                                     env="traj-9")).result(30)
            assert first.ok, first.error
            worker_a = first.worker
            b = _worker(conn, tmp_path / "b.log")
            procs.append(b)
            while len(c.status()["workers"]) < 2:
                assert time.time() < deadline
                time.sleep(0.1)
            a.send_signal(signal.SIGTERM)      # e.g. Slurm preemption or a drain: it leaves
            assert a.wait(30) == 0
            # Snapshots go to the state directory beside the connection file, which outlives a restart.
            snapshots = tmp_path / "connection.state" / "snapshots"
            snaps = os.listdir(snapshots)
            assert len(snaps) == 1 and snaps[0].endswith(".tar.gz")
            r = c.submit(sandbox("cat src/notes.txt top", env="traj-9")).result(30)
            assert r.ok, r.error
            assert r.worker != worker_a and r.env_state == "restored" and r.attempts == 1
            assert r.output["stdout"] == "state of turn 1\nx\n"
            assert os.listdir(snapshots) == []   # consumed by the restore
    finally:
        for p in procs:
            p.kill()


def _wait_workers(c, n, deadline):
    while len(c.status()["workers"]) < n:
        assert time.time() < deadline, f"{n} workers did not register"
        time.sleep(0.1)


def test_scheduler_moves_an_environment_off_a_busy_worker_with_its_state(tmp_path):
    """Its host's cores are all taken: the action's environment moves to the idle worker, state and all."""
    conn = tmp_path / "connection.json"
    coord = _coordinator(tmp_path, "--env-move-s", "0.01")
    procs = [coord]
    try:
        wait_for_file(conn, 30)
        a = _worker(conn, tmp_path / "a.log")
        procs.append(a)
        with Client(connection_file=str(conn)) as c:
            deadline = time.time() + 60
            _wait_workers(c, 1, deadline)
            # 20 MB that do not compress: its restore takes longer than a short command runs
            first = c.submit(sandbox("echo 'turn 1' > notes.txt && head -c 20000000 /dev/urandom > blob",
                                     env="moved")).result(30)
            busy = c.submit(sandbox("true", env="busy")).result(30)
            assert first.ok and busy.ok, (first.error, busy.error)
            worker_a = first.worker
            b = _worker(conn, tmp_path / "b.log")
            procs.append(b)
            _wait_workers(c, 2, deadline)
            # the only core of A: a long command of another environment hosted there
            long = c.submit(sandbox("sleep 30", env="busy", duration_hint=30.0))
            while c.status()["running"] < 1:
                assert time.time() < deadline
                time.sleep(0.05)
            r = c.submit(sandbox("cat notes.txt && echo 'turn 2' >> notes.txt", env="moved")).result(30)
            assert r.ok, r.error
            assert r.worker != worker_a and r.env_state == "restored"
            assert r.output["stdout"] == "turn 1\n"
            st = c.status()
            assert st["env_moves"] == 1 and st["environments"].get("live") == 2
            assert "1 moved by the scheduler" in format_status(st)
            # the restore is measured: ASSIGN to DONE less the command's own time (which the worker
            # starts once the environment is there), so within the action's life at the coordinator
            # (how it compares with the command's time is the machine's load, not a property)
            assert st["env_restore_s"] is not None and 0 < st["env_restore_s"] <= time.time() - r.submitted
            # and the move was learned from: 0.8 x the first guess (0.01 s) + 0.2 x (its save, twice,
            # as no restore was seen when the save was)
            assert st["env_move_s"] > 0.8 * 0.01
            # one live copy: the next action sees what the moved one wrote, on the same worker
            again = c.submit(sandbox("cat notes.txt", env="moved")).result(30)
            assert again.ok and again.worker == r.worker and again.env_state == kept_state()
            assert again.output["stdout"] == "turn 1\nturn 2\n"
            assert not long.done()          # the busy environment stayed where it runs
    finally:
        for p in procs:
            p.kill()


def test_environments_moved_under_load_keep_every_ok_action_once_in_order(tmp_path):
    """Many moves between two busy workers: each environment's log holds its actions' lines once, in order."""
    conn = tmp_path / "connection.json"
    coord = _coordinator(tmp_path, "--env-move-s", "0.01")
    procs = [coord]
    envs = [f"e{k}" for k in range(10)]
    try:
        wait_for_file(conn, 30)
        for name in ("a", "b"):
            procs.append(_worker(conn, tmp_path / f"{name}.log", cores=2))
        with Client(connection_file=str(conn)) as c:
            _wait_workers(c, 2, time.time() + 60)
            written: dict[str, list[str]] = {e: [] for e in envs}
            restored = 0
            for turn in range(6):
                # uneven lengths: a worker runs dry while the other's environments still queue
                futs = {e: c.submit(sandbox(f"sleep {0.05 + 0.3 * ((k + turn) % 4 == 0)} && echo {e}-{turn} >> log.txt",
                                            env=e, duration_hint=0.05 + 0.3 * ((k + turn) % 4 == 0)))
                        for k, e in enumerate(envs)}
                for e, f in futs.items():
                    r = f.result(60)
                    assert r.ok, (e, turn, r.error)
                    written[e].append(f"{e}-{turn}")
                    restored += r.env_state == "restored"
            moves = c.status()["env_moves"]
            for e in envs:
                r = c.submit(sandbox("cat log.txt", env=e)).result(60)
                assert r.ok and r.output["stdout"].split() == written[e], (e, r.output, r.env_state)
                restored += r.env_state == "restored"
        assert moves > 0, "no environment moved: the scenario did not exercise moves"
        # every move went through a snapshot and a restore; where the restore ran depends on which
        # worker freed a core first (the move to another worker with its state: the test above)
        assert restored >= moves, (restored, moves)
    finally:
        for p in procs:
            p.kill()


def test_an_environment_made_from_the_workers_template_moves_with_its_changes(tmp_path):
    """Workers whose environments start as a copy of a checkout: a move saves the changes over the
    checkout once saved beside the snapshots, and the next worker has every file, changed or not."""
    repo = tmp_path / "repo"
    (repo / "src").mkdir(parents=True)
    for i in range(30):
        (repo / "src" / f"mod{i}.py").write_text(f"N = {i}\n")
    conn = tmp_path / "connection.json"
    coord = _coordinator(tmp_path)
    procs = [coord]

    def worker(name):
        return subprocess.Popen([sys.executable, "-m", "tangram_hpc.worker", "--connection-file", str(conn),
                                 "--cores", "1", "--sandbox-template", str(repo)],
                                stdout=open(tmp_path / f"{name}.log", "ab"), stderr=subprocess.STDOUT)
    try:
        wait_for_file(conn, 30)
        a = worker("a")
        procs.append(a)
        with Client(connection_file=str(conn)) as c:
            deadline = time.time() + 60
            _wait_workers(c, 1, deadline)
            first = c.submit(sandbox("cat src/mod7.py && echo 'N = 70' > src/mod7.py && rm src/mod8.py && "
                                     "echo notes > notes.txt", env="traj")).result(30)
            assert first.ok and first.output["stdout"] == "N = 7\n", first
            b = worker("b")
            procs.append(b)
            _wait_workers(c, 2, deadline)
            a.send_signal(signal.SIGTERM)
            assert a.wait(30) == 0
            snapshots = tmp_path / "connection.state" / "snapshots"
            assert len(os.listdir(snapshots / "bases")) == 1       # the checkout, saved once
            r = c.submit(sandbox("cat src/mod7.py src/mod9.py notes.txt && ls src | wc -l && "
                                 "test ! -e src/mod8.py", env="traj")).result(30)
            assert r.ok and r.worker != first.worker and r.env_state == "restored", r
            assert r.output["stdout"] == "N = 70\nN = 9\nnotes\n29\n"
            fresh = c.submit(sandbox("cat src/mod8.py", env="another")).result(30)
            assert fresh.ok and fresh.output["stdout"] == "N = 8\n"
    finally:
        for p in procs:
            p.kill()
