"""Hostile code against the sandbox: privilege escalation through payload variables, FIFOs that
would jam the worker, disk filling, memory without a declared size, nested user namespaces.

Each escape case runs for real (bubblewrap, the worker's own uid, which is root in CI)."""
from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import tangram_hpc.managers.sandbox as sandbox_mod
from tangram_hpc.actions import ActionSpec, Demand, Status
from tangram_hpc.managers import Limits, SandboxManager
from tangram_hpc.managers.bwrap import probe_bwrap
from support import act, py
from tangram_hpc.managers.limits import WRAPPER_ENVIRON, wrapper_argv

pytestmark = [
    pytest.mark.sandbox,
    pytest.mark.skipif(probe_bwrap(shutil.which("bwrap") or "") is not None,
                       reason="bubblewrap missing or unusable here"),
]

CPU = [sorted(os.sched_getaffinity(0))[0]]
ROOT = os.geteuid() == 0

# Loaded into every process that starts with it in LD_PRELOAD: records the process, its uid and
# effective capabilities, then tries to read KEY_PATH from the host by mounting the block device
# behind /sandbox (possible for a process with CAP_SYS_ADMIN and CAP_MKNOD).
PROBE_SO = r"""
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/mount.h>
#include <sys/stat.h>

__attribute__((constructor)) static void probe(void) {
    FILE *log = fopen("/sandbox/probe.log", "a");
    if (!log) return;
    char exe[256] = {0}, line[256], cap[64] = "?";
    readlink("/proc/self/exe", exe, sizeof exe - 1);
    FILE *st = fopen("/proc/self/status", "r");
    while (st && fgets(line, sizeof line, st))
        if (!strncmp(line, "CapEff:", 7)) sscanf(line + 7, "%63s", cap);
    if (st) fclose(st);
    fprintf(log, "exe=%s uid=%d capeff=%s\n", exe, (int)geteuid(), cap);
    const char *key = getenv("KEY_PATH");
    struct stat sb;
    if (key && stat("/sandbox", &sb) == 0) {
        mkdir("/tmp/.p", 0700); mkdir("/tmp/.p/t", 0700); mkdir("/tmp/.p/m", 0700);
        mount("none", "/tmp/.p/t", "tmpfs", 0, NULL);
        mknod("/tmp/.p/t/dev", S_IFBLK | 0600, sb.st_dev);
        const char *fs[] = {"ext4", "xfs", "btrfs", NULL};
        for (int i = 0; fs[i]; i++)
            if (mount("/tmp/.p/t/dev", "/tmp/.p/m", fs[i], 0, NULL) == 0) break;
        char path[1024], buf[256] = {0};
        snprintf(path, sizeof path, "/tmp/.p/m%s", key);
        FILE *k = fopen(path, "r");
        if (k) { fread(buf, 1, sizeof buf - 1, k); fprintf(log, "key=%s\n", buf); fclose(k); }
    }
    fclose(log);
}
"""


@pytest.fixture(params=["per-action", "session", "pre-started"])
def mgr(request, tmp_path):
    """Each case against a sandbox per action, against a live session of its environment, and against
    a session pre-started for no environment that its first action claims (managers/session_pool.py)."""
    prestart = request.param == "pre-started"
    with SandboxManager(tmp_path / "envs", tmp_path / "snapshots", sessions=request.param != "per-action",
                        default_limits=Limits(timeout_s=30, nproc=128), session_prestart=2 if prestart else 0) as m:
        if request.param != "per-action" and m.sessions is None:
            pytest.skip(f"no live sessions here: {m.sessionless_reason}")
        if prestart:
            if m.live.pool is None:
                pytest.skip(f"no pre-started sessions here: {m.unlayered_reason}")
            assert m.live.pool.wait_full(60), "the pool did not fill"
        yield m


def run_bounded_in_thread(fn, timeout_s: float = 20.0):
    """Run ``fn`` on a thread like a worker's executor; fail if it does not return in time."""
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("out", fn()), daemon=True)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), f"the call blocked for more than {timeout_s}s"
    return box["out"]


# -- 1. payload variables never reach a step that runs as root ------------------------------

@pytest.mark.parametrize("var", ["LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT", "GCONV_PATH", "GLIBC_TUNABLES"])
def test_loader_variables_are_refused_with_a_clear_error(mgr, var):
    r = mgr.run(act("echo never", environ={var: "/sandbox/x", "OK_VAR": "1"}), CPU)
    assert r.status == Status.ERROR and r.output is None
    assert f"may not set {var}" in r.error and "dynamic-loader" in r.error


def test_old_env_key_is_refused_naming_the_new_one(mgr):
    r = mgr.run(ActionSpec("sandbox", {"cmd": "echo never", "env": {"A": "1"}}, env="e"), CPU)
    assert r.status == Status.ERROR
    assert "'env' is not accepted" in r.error and "'environ'" in r.error
    ok = mgr.run(act('echo "$A $HOME"', env="e", environ={"A": "from-payload"}), CPU)
    assert ok.status == Status.OK and ok.output["stdout"] == "from-payload /sandbox\n"


def test_wrapper_runs_with_a_fixed_environment_and_the_payload_only_after_the_drop(mgr):
    argv = wrapper_argv(Limits(), 0x6A000001, 0x6A000001, {"PROBE": "x"})
    env_at = argv.index("PROBE=x") - 2
    assert argv[env_at:env_at + 2] == [argv[env_at], "-i"] and argv[env_at].endswith("/env")
    drop = next(i for i, a in enumerate(argv) if a.startswith("--reuid="))
    assert drop < env_at and not any("PROBE" in a for a in argv[:env_at])
    if mgr.layout is not None:
        bw = mgr.layout.argv(Path("/x"), network=False, tmp_mb=16, passwd_fd=3, group_fd=4)
        setenv = {bw[i + 1]: bw[i + 2] for i, a in enumerate(bw) if a == "--setenv"}
        assert setenv == WRAPPER_ENVIRON
        if ROOT:
            assert "--cap-drop" in bw and "CAP_SYS_ADMIN" not in bw


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc to build the preload library")
def test_ld_preload_attack_cannot_reach_a_root_only_key(mgr, tmp_path, monkeypatch):
    key = tmp_path / "client.key_secret"
    key.write_text("KEY-" + os.urandom(8).hex())
    key.chmod(0o600)
    built = mgr.run(act("gcc -shared -fPIC -o p.so probe.c && touch probe.log && chmod 666 probe.log",
                        env="atk", files={"probe.c": PROBE_SO}), CPU)
    assert built.status == Status.OK, built
    attack = act("cat probe.log", env="atk", environ={"LD_PRELOAD": "/sandbox/p.so", "KEY_PATH": str(key)})

    refused = mgr.run(attack, CPU)
    assert refused.status == Status.ERROR and "LD_PRELOAD" in refused.error

    # Second line of defence: even with the refusal switched off, the library only ever runs in
    # the command itself, unprivileged, and the key stays out of reach.
    monkeypatch.setattr(sandbox_mod, "_is_loader_var", lambda name: False)
    r = mgr.run(attack, CPU)
    assert r.status == Status.OK, r
    lines = [ln for ln in r.output["stdout"].splitlines() if ln.startswith("exe=")]
    assert lines, r.output  # the library did load (into the command)
    for ln in lines:
        exe, uid, cap = (kv.split("=", 1)[1] for kv in ln.split())
        assert int(uid) != 0 and int(cap, 16) == 0, ln
        assert not any(exe.endswith(w) for w in ("/prlimit", "/setpriv", "/env")), ln
    assert key.read_text() not in r.output["stdout"]


# -- 2. FIFOs and other non-regular files never block the worker ------------------------------

def test_fifo_at_a_payload_file_path_is_refused_without_blocking(mgr):
    made = mgr.run(act("mkfifo jam && mkdir -p d && mkfifo d/jam2", env="fifo"), CPU)
    assert made.status == Status.OK, made
    for path in ("jam", "d/jam2"):
        r = run_bounded_in_thread(lambda: mgr.run(act("echo ran", env="fifo", files={path: "x"}), CPU))
        assert r.status == Status.ERROR and "FIFO" in r.error and path in r.error
    # A reader waiting on the FIFO does not make the host write it either.
    r = run_bounded_in_thread(lambda: mgr.run(
        act("(cat jam > got &) ; sleep 0.5; echo ran", env="fifo", files={"jam": "x"}), CPU))
    assert r.status == Status.ERROR and "FIFO" in r.error
    ok = mgr.run(act("cat f", env="fifo", files={"f": "regular\n"}), CPU)
    assert ok.status == Status.OK and ok.output["stdout"] == "regular\n"


def test_fifo_at_run_code_main_py_is_refused_without_blocking(mgr):
    made = mgr.run(act("mkdir -p .run_code && mkfifo .run_code/main.py", env="rc"), CPU)
    assert made.status == Status.OK, made
    r = run_bounded_in_thread(lambda: mgr.run(
        ActionSpec("sandbox", {"language": "python", "code": "print(1)"}, env="rc"), CPU))
    assert r.status == Status.ERROR and "FIFO" in r.error
    assert r.output["status"] == "SandboxError"
    # Cleaning up inside the environment makes it usable again.
    mgr.run(act("rm .run_code/main.py", env="rc"), CPU)
    again = mgr.run(ActionSpec("sandbox", {"language": "python", "code": "print(1)"}, env="rc"), CPU)
    assert again.output["run_result"]["stdout"] == "1\n"


def test_fetching_a_fifo_or_a_symlink_returns_nothing_without_blocking(mgr):
    made = mgr.run(act("mkfifo out.txt && ln -s /etc/hostname host.txt && echo ok > real.txt", env="fetch"), CPU)
    assert made.status == Status.OK, made
    r = run_bounded_in_thread(lambda: mgr.run(ActionSpec("sandbox", {
        "language": "bash", "code": "true", "fetch_files": ["out.txt", "host.txt", "real.txt"]}, env="fetch"), CPU))
    assert r.status == Status.OK, r
    assert set(r.output["files"]) == {"real.txt"}
    assert base64.b64decode(r.output["files"]["real.txt"]) == b"ok\n"


def test_snapshot_of_an_environment_with_fifos_and_links_restores_without_them(mgr, tmp_path):
    made = mgr.run(act("mkfifo pipe && echo data > f && ln f hard && ln -s /etc/passwd sym && "
                       "python3 -c 'import socket; socket.socket(socket.AF_UNIX).bind(\"sock\")'", env="snap"), CPU)
    assert made.status == Status.OK, made
    path = run_bounded_in_thread(lambda: mgr.snapshot("snap"))
    with SandboxManager(tmp_path / "other") as other:
        other.restore("snap", path)
        r = other.run(act("ls -A | sort | tr '\\n' ' '; readlink sym; cat hard; stat -c %h f", env="snap"), CPU)
    assert r.status == Status.OK, r
    assert r.output["stdout"] == "f hard sym /etc/passwd\ndata\n2\n"


def test_symlinked_venv_is_not_followed_on_the_host(mgr, tmp_path):
    outside = tmp_path / "fakevenv" / "bin"
    outside.mkdir(parents=True)
    made = mgr.run(act(f"ln -s {outside.parent} .venv", env="venv"), CPU)
    assert made.status == Status.OK, made
    r = mgr.run(act("echo ${VIRTUAL_ENV:-none}", env="venv"), CPU)
    assert r.output["stdout"] == "none\n"
    real = mgr.run(act(f"{sys.executable} -m venv --without-pip .venv2 && mv .venv .venv-link && "
                       "mv .venv2 .venv && true", env="venv"), CPU)
    assert real.status == Status.OK, real
    assert mgr.run(act("echo $VIRTUAL_ENV", env="venv"), CPU).output["stdout"] == "/sandbox/.venv\n"


# -- 3. disk quota, default memory limit, syscall filter --------------------------------------

WRITE_FOREVER = """
    import os
    i = 0
    while True:
        with open(f"fill{i}", "wb") as f:
            for _ in range(4):
                f.write(b"x" * (1 << 20))
        i += 1
"""


def test_filling_the_disk_is_stopped_at_the_quota_and_reported(tmp_path):
    with SandboxManager(tmp_path / "envs", default_limits=Limits(timeout_s=60, disk_mb=64)) as m:
        r = m.run(act(py(WRITE_FOREVER), env="fill"), CPU)
        assert r.status == Status.FAILED, r
        assert "disk quota exceeded" in r.error and "64 MiB" in r.error and "disk_mb" in r.error
        assert r.output["wall_s"] < 30
        # Stopped close to the quota: at most one check interval of writing beyond it.
        assert 64 < r.output["disk_used_mb"] < 64 + 512
        assert r.output["enforced"]["disk"] == "watched"
        # The environment is kept, and an action that cleans up is allowed to run.
        clean = m.run(act("rm -f fill* && echo cleaned", env="fill"), CPU)
        assert clean.status == Status.OK and clean.output["stdout"] == "cleaned\n", clean
        assert clean.output["disk_used_mb"] < 1


def test_a_burst_faster_than_the_check_fails_at_the_end(tmp_path, monkeypatch):
    from tangram_hpc.managers import diskquota
    # the burst must beat the periodic check however slow this machine is right now
    monkeypatch.setattr(diskquota.QuotaWatch, "interval", lambda self: 3600.0)
    with SandboxManager(tmp_path / "envs", default_limits=Limits(timeout_s=60, disk_mb=20)) as m:
        one = m.run(act("head -c 30000000 /dev/zero > big", env="b"), CPU)
        assert one.status == Status.FAILED  # RLIMIT_FSIZE is capped at the quota
        assert os.path.getsize(m.envs.get("b").path / "big") <= 20 * 1024 * 1024
        m.run(act("rm big", env="b"), CPU)
        many = m.run(act("for i in 1 2 3; do head -c 9000000 /dev/zero > f$i; done", env="b"), CPU)
        assert many.status == Status.FAILED and "disk quota exceeded" in many.error, many
        assert many.output["returncode"] == 0   # the command itself succeeded


def test_large_environments_are_walked_only_when_the_filesystem_grew(tmp_path, monkeypatch):
    from tangram_hpc.managers import diskquota
    monkeypatch.setattr(diskquota, "_CHEAP_WALK_S", 0.0)   # treat every tree as large
    walks = []
    real = diskquota.measure
    monkeypatch.setattr(diskquota, "measure", lambda root: walks.append(root) or real(root))
    with SandboxManager(tmp_path / "roomy", default_limits=Limits(timeout_s=60)) as m:
        m.run(act("seq 1000 | xargs touch", env="big"), CPU)
        walks.clear()
        for _ in range(3):
            assert m.run(act("true", env="big"), CPU).status == Status.OK
        assert walks == []   # 10 GiB of headroom: the filesystem did not grow by that much
    with SandboxManager(tmp_path / "tight", default_limits=Limits(timeout_s=60, disk_mb=20)) as m:
        m.run(act("true", env="b"), CPU)
        walks.clear()
        r = m.run(act("for i in 1 2 3; do head -c 9000000 /dev/zero > f$i; done", env="b"), CPU)
        assert r.status == Status.FAILED and "disk quota exceeded" in r.error and walks

def test_run_code_over_the_disk_quota_fails_and_says_why(tmp_path):
    code = "for i in range(3):\n    open(f'f{i}', 'wb').write(b'x' * 9_000_000)\n"
    with SandboxManager(tmp_path / "envs", default_limits=Limits(timeout_s=60, disk_mb=20)) as m:
        r = m.run(ActionSpec("sandbox", {"language": "python", "code": code}, env="rc"), CPU)
    assert r.status == Status.FAILED and "disk quota exceeded" in r.error, r
    assert r.output["status"] == "SandboxError" and r.output["message"] == r.error
    # The watcher stops the code mid-write (killed) or, when it wrote faster, the walk after it
    # catches the growth (it ran to its end): either way the step's own result is there.
    assert r.output["run_result"]["return_code"] in (0, -9)

@pytest.mark.skipif(not ROOT, reason="an environment's processes are found by its own uid, given as root")
def test_files_deleted_while_held_open_count_against_the_quota(tmp_path):
    """No directory holds them, so no walk sees them, yet they fill the disk (420 MiB went by a
    64 MiB quota that way)."""
    with SandboxManager(tmp_path / "envs", default_limits=Limits(timeout_s=60, disk_mb=32)) as m:
        r = m.run(act(py("""
            import os, time
            held = []
            for i in range(6):
                f = open(f"hidden{i}", "wb")
                os.unlink(f"hidden{i}")
                for _ in range(30):
                    f.write(b"x" * (1 << 20))
                f.flush()
                held.append(f)
            print("all written", flush=True)
            time.sleep(30)
        """), env="hide"), CPU)
    assert r.status == Status.FAILED and "disk quota exceeded" in r.error, r
    # caught while they were held (the walk after the command finds nothing: they are freed by then)
    assert "deleted but still open" in r.error, r


def test_the_journal_counts_against_the_quota(tmp_path):
    with SandboxManager(tmp_path / "envs", default_limits=Limits(timeout_s=60, disk_mb=2)) as m:
        assert m.run(act("true", env="j"), CPU).status == Status.OK
        m.envs.journal_add("j", ["a1", 1, Status.OK, "x" * (3 << 20), None, 0.0, 1.0])
        r = m.run(act("head -c 1500000 /dev/zero > f", env="j"), CPU)
    assert r.status == Status.FAILED and "disk quota exceeded" in r.error and "journal" in r.error, r


def test_fallocate_is_refused_and_posix_fallocate_still_works(mgr):
    r = mgr.run(act(py("""
        import os, subprocess
        print(subprocess.run(["fallocate", "-l", "1G", "reserved"]).returncode != 0)
        fd = os.open("small", os.O_CREAT | os.O_WRONLY)
        os.posix_fallocate(fd, 0, 1 << 20)   # libc writes the blocks instead
        print(os.fstat(fd).st_size)
    """)), CPU)
    assert r.status == Status.OK, r
    assert r.output["stdout"] == f"True\n{1 << 20}\n"


def test_too_many_files_is_refused(tmp_path):
    with SandboxManager(tmp_path / "envs", default_limits=Limits(timeout_s=60, disk_files=500)) as m:
        r = m.run(act("mkdir d && cd d && i=0; while [ $i -lt 2000 ]; do : > f$i; i=$((i+1)); done", env="n"), CPU)
        assert r.status == Status.FAILED and "500" in r.error and "disk_files" in r.error, r


def test_memory_is_capped_without_mem_mb(tmp_path):
    assert Limits().memory_mb is not None   # a default cap exists
    alloc = py("""
        chunks = [bytearray(16 << 20) for _ in range(20)]   # 320 MiB
        print("allocated")
    """)
    with SandboxManager(tmp_path / "envs", default_limits=Limits(timeout_s=60, memory_mb=160)) as m:
        capped = m.run(act(alloc), CPU)
        assert capped.status == Status.FAILED and "memory limit" in capped.error, capped
        assert capped.output["enforced"]["memory"] in ("cgroup", "rlimit_as")
        # An action that declares its memory gets that instead of the default.
        spec = ActionSpec("sandbox", {"cmd": alloc}, demand=Demand(mem_mb=1024))
        declared = m.run(spec, CPU)
        assert declared.status == Status.OK and declared.output["stdout"] == "allocated\n", declared


UNSHARE = "unshare -U true && echo created || echo refused"


def test_nested_user_namespaces_are_refused(mgr, tmp_path):
    r = mgr.run(act(UNSHARE), CPU)
    assert r.status == Status.OK, r
    assert r.output["stdout"] == "refused\n" and "Operation not permitted" in r.output["stderr"]
    assert r.output["enforced"]["seccomp"] is True
    py_ns = mgr.run(act(py("""
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        print(libc.unshare(0x10000000), os.strerror(ctypes.get_errno()))
    """)), CPU)
    assert py_ns.output["stdout"] == "-1 Operation not permitted\n", py_ns
    # The filter is what refuses it: without it the same command creates one on this host.
    with SandboxManager(tmp_path / "nofilter", seccomp=False) as m:
        open_ = m.run(act(UNSHARE), CPU)
    host_allows = subprocess.run(["unshare", "-U", "true"] if not ROOT else
                                 ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                                  "unshare", "-U", "true"], capture_output=True).returncode == 0
    assert open_.output["enforced"]["seccomp"] is False
    assert open_.output["stdout"] == ("created\n" if host_allows else "refused\n")


def test_filter_programs_assemble_for_the_supported_architectures_only():
    import struct
    from tangram_hpc.managers import seccomp
    for machine in ("x86_64", "aarch64"):
        prog = seccomp.program(machine)
        assert prog and len(prog) % 8 == 0
        insns = [struct.unpack("=HBBI", prog[i:i + 8]) for i in range(0, len(prog), 8)]
        assert insns[0] == (0x20, 0, 0, 4)                       # load the architecture first
        jumps = [(i, jt, jf) for i, (code, jt, jf, _) in enumerate(insns) if code & 0x07 == 0x05]
        assert jumps and all(i + 1 + max(jt, jf) < len(insns) for i, jt, jf in jumps)   # in bounds
        assert insns[-1] == (0x06, 0, 0, 0x7FFF0000)             # ends allowing
    assert seccomp.program("riscv64") is None

def test_threads_processes_and_compilers_work_under_the_filter(mgr):
    r = mgr.run(act(py("""
        import subprocess, threading
        out = []
        ts = [threading.Thread(target=out.append, args=(i,)) for i in range(8)]
        [t.start() for t in ts]; [t.join() for t in ts]
        print(len(out), subprocess.run(["sh", "-c", "echo child"], capture_output=True, text=True).stdout.strip())
    """)), CPU)
    assert r.status == Status.OK and r.output["stdout"] == "8 child\n", r


# -- cpu_time ----------------------------------------------------------------------------------

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3:\n    pass\n"


def test_cpu_time_counts_the_whole_process_tree(mgr):
    py = sys.executable
    # the shell waits for the orphan's marker, not a fixed time: on a loaded machine its burst may
    # take longer than a second of wall time, and the sandbox's end would kill it half way
    orphan = f"(({py} burn.py; touch burnt) &); while [ ! -e burnt ]; do sleep 0.05; done"
    r = mgr.run(act(f"{py} burn.py & {py} burn.py; wait; {orphan}", files={"burn.py": BURN}), CPU)
    assert r.status == Status.OK, r
    # Two children, then an orphaned grandchild: three bursts of 0.3 s of CPU (tick granularity).
    assert r.output["cpu_time"] >= 0.8, r.output
    assert "cpu_s" not in r.output
    idle = mgr.run(act("sleep 0.3"), CPU)
    assert idle.output["cpu_time"] < 0.2


def test_a_command_signalled_as_it_starts_either_ran_or_left_no_trace():
    """Slurm signals every process of a job: a bubblewrap hit while it sets the sandbox up died
    without its child, which ran on unsupervised and wrote after its action was reported failed
    (so its retry wrote again).  Now such a child is killed once bubblewrap has exited: an action
    reported failed left nothing behind, one that ran reports ok."""
    delays = [0.001 * i for i in range(1, 31)]
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("sandbox_signal_race.py")),
                          *map(str, delays)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    runs = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(runs) == len(delays)
    for r in runs:
        assert r["lines"] == (1 if r["status"] == Status.OK else 0), r
    assert any(r["status"] != Status.OK for r in runs)      # the signal did land while it started
