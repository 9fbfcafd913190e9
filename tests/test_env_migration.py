"""An environment follows its trajectory: a worker that leaves snapshots it, the next worker restores it."""
import os
import signal
import subprocess
import sys
import time

from tangram_hpc import Client, sandbox
from tangram_hpc.connection import wait_for_file


def _worker(conn, log):
    return subprocess.Popen([sys.executable, "-m", "tangram_hpc.worker", "--connection-file", str(conn),
                             "--cores", "1"], stdout=open(log, "ab"), stderr=subprocess.STDOUT)


def test_environment_moves_to_another_worker_when_its_worker_leaves(tmp_path):
    conn = tmp_path / "connection.json"
    coord = subprocess.Popen([sys.executable, "-m", "tangram_hpc.cli", "coordinator", "--run-dir", str(tmp_path),
                              "--backend", "none"], stdout=open(tmp_path / "coord.log", "ab"),
                             stderr=subprocess.STDOUT)
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
