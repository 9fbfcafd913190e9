"""The one configuration schema: defaults, file, environment and command line, in that order."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tangram_hpc import Status, function
from tangram_hpc import config as C
from tangram_hpc.config import ConfigError, load
from tangram_hpc.config_cli import add_arguments, flag_of, settings_from_args
from tangram_hpc.launch import LocalCluster

ROOT = Path(__file__).resolve().parents[1]


def cli(*args, env=None, timeout=60):
    """Run the command line; without ``env``, this environment less any $TANGRAM_CONFIG of the caller's."""
    base = {k: v for k, v in os.environ.items() if k != C.CONFIG_ENV} if env is None else env
    env = dict(base, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "tangram_hpc.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def write(tmp_path: Path, text: str, name: str = "tangram.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def parse(command: str, *argv: str) -> C.Settings:
    p = argparse.ArgumentParser()
    add_arguments(p, command)
    return settings_from_args(p.parse_args(list(argv)))


# -- the schema ----------------------------------------------------------------------

def test_every_key_has_help_and_every_flag_and_variable_is_unambiguous():
    for command, sections in C.COMMAND_SECTIONS.items():
        flags = [flag_of(f, command) for s in sections for f in C.SCHEMA[s].values()]
        assert len(flags) == len(set(flags)), command
    envs: dict[str, list[str]] = {}
    for section, fields in C.SCHEMA.items():
        for f in fields.values():
            assert len(f.key.help) > 10, f.label
            if f.key.env:
                assert f.key.env.startswith("TANGRAM_"), f.label
                envs.setdefault(f.key.env, []).append(section)
    # One variable may name one thing for several commands (the connection file), never two things.
    assert all(len(set(secs)) == len(secs) for secs in envs.values())
    assert sorted(envs[C.CONNECTION_FILE_ENV]) == ["coordinator", "worker"]


def test_defaults_are_the_dataclass_defaults():
    s = load(environ={})
    assert s.coordinator == C.CoordinatorSettings() and s.slurm == C.SlurmSettings()
    assert s.sources == {} and s.file is None
    assert (s.coordinator.heartbeat_s, s.slurm.time_min, s.worker.kinds) == (1.0, 60, ["sandbox", "reward", "function"])


def test_precedence_default_file_env_command_line(tmp_path, monkeypatch):
    path = write(tmp_path, '[coordinator]\nmax_attempts = 5\nheartbeat_s = 2.5\npolicy = "fifo"\n'
                           '[slurm]\npartition = "from-file"\nidle_s = 9\n')
    monkeypatch.setenv(C.CONFIG_ENV, str(path))
    monkeypatch.setenv("TANGRAM_POLICY", "elastic")
    monkeypatch.setenv("TANGRAM_PARTITION", "from-env")
    s = parse("coordinator", "--slurm-partition", "from-cli", "--max-attempts", "7")
    assert s.file == path.resolve()
    assert (s.coordinator.heartbeat_s, s.source("coordinator", "heartbeat_s")) == (2.5, "file")
    assert (s.coordinator.policy, s.source("coordinator", "policy")) == ("elastic", "env TANGRAM_POLICY")
    assert (s.coordinator.max_attempts, s.source("coordinator", "max_attempts")) == (7, "command line")
    assert (s.slurm.partition, s.source("slurm", "partition")) == ("from-cli", "command line")
    assert (s.slurm.idle_s, s.coordinator.worker_timeout_s) == (9.0, 5.0)
    assert s.source("coordinator", "worker_timeout_s") == "default"
    # --config on the command line beats $TANGRAM_CONFIG
    other = tmp_path / "other.toml"
    other.write_text("[coordinator]\nmax_attempts = 2\n")
    assert parse("coordinator", "--config", str(other)).coordinator.max_attempts == 2


def test_lists_and_booleans_from_each_source(tmp_path):
    path = write(tmp_path, '[worker]\nkinds = ["function"]\nhandler = ["x=m:f"]\n[sandbox]\nallow_network = true\n'
                           '[services]\npreload = false\n')
    s = load(path, environ={"TANGRAM_PARTITION": "p"})
    assert (s.worker.kinds, s.worker.handler, s.sandbox.allow_network, s.services.preload) == \
        (["function"], ["x=m:f"], True, False)
    s = parse("worker", "--kinds", "sandbox,function", "--handler", "a=m:f", "--handler", "b=m:g",
              "--unsafe-sandbox", "--no-preload")
    assert (s.worker.kinds, s.worker.handler, s.sandbox.unsafe, s.services.preload) == \
        (["sandbox", "function"], ["a=m:f", "b=m:g"], True, False)


@pytest.mark.parametrize("text, message", [
    ("[cordinator]\nmax_attempts = 2\n", "unknown section 'cordinator'.*did you mean 'coordinator'.*Valid: coordinator, pool"),
    ("[coordinator]\nmax_attempt = 2\n", "unknown key 'max_attempt' in \\[coordinator\\].*did you mean 'max_attempts'"),
    ("[slurm]\nbanana = 1\n", "unknown key 'banana'.*Valid: partition, gpu_partition"),
    ("[coordinator]\nmax_attempts = \"two\"\n", "\\[coordinator\\] max_attempts from file .*expected an integer"),
    ("[coordinator]\nmax_attempts = 0\n", "must be at least 1"),
    ("[coordinator]\nbackend = \"kubernetes\"\n", "must be one of local, slurm, none"),
    ("[coordinator]\ninsecure = 1\n", "expected true or false"),
    ("[worker]\nkinds = \"sandbox\"\n", "expected a list of strings"),
    ("coordinator = 3\n", "\\[coordinator\\] .* must be a table"),
    ("[coordinator\n", "not valid TOML"),
])
def test_a_bad_file_is_a_clear_error(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load(write(tmp_path, text), environ={})


def test_a_bad_variable_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match=r"\[slurm\] time_min from \$TANGRAM_WORKER_TIME: expected an integer"):
        load(environ={"TANGRAM_WORKER_TIME": "an hour"})
    with pytest.raises(ConfigError, match="does not exist"):
        load(environ={C.CONFIG_ENV: str(tmp_path / "missing.toml")})
    assert load(environ={"TANGRAM_WORKER_TIME": ""}).slurm.time_min == 60   # empty: unset


# -- the commands -------------------------------------------------------------------------

def test_bad_flags_and_files_stop_the_command_with_the_reason(tmp_path):
    r = cli("coordinator", "--run-dir", str(tmp_path), "--workers", "-1")
    assert r.returncode == 2 and "--workers: must be at least 0" in r.stderr
    r = cli("coordinator", "--run-dir", str(tmp_path), "--config", str(write(tmp_path, "[pool]\nworkrs = 1\n")))
    assert r.returncode == 2 and "did you mean 'workers'" in r.stderr
    assert not (tmp_path / "connection.json").exists()
    env = {k: v for k, v in os.environ.items() if k not in (C.CONNECTION_FILE_ENV, C.CONFIG_ENV)}
    r = cli("worker", env=env)
    assert r.returncode == 2 and "--connection-file, $TANGRAM_CONNECTION_FILE or [worker] connection_file" in r.stderr


def test_config_show_names_each_source_and_prints_a_file_that_loads_back(tmp_path):
    path = write(tmp_path, '[pool]\nworkers = 4\n[sandbox]\nwarm_pool = 0\n')
    env = dict(os.environ, TANGRAM_CONFIG=str(path), TANGRAM_IDLE="12")
    r = cli("config", "show", "--json", env=env)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["file"] == str(path.resolve())
    pool = doc["sections"]["pool"]["workers"]
    assert (pool["value"], pool["source"], pool["flag"]) == (4, "file", {"coordinator": "--workers"})
    idle = doc["sections"]["slurm"]["idle_s"]
    assert (idle["value"], idle["source"], idle["env"]) == (12.0, "env TANGRAM_IDLE", "TANGRAM_IDLE")
    assert doc["sections"]["worker"]["cores"]["source"] == "default"
    # The plain output is itself a configuration file with the same effective values.
    r = cli("config", "show", env=env)
    assert r.returncode == 0 and "workers = 4" in r.stdout and "(env TANGRAM_IDLE)" in r.stdout
    shown, effective = load(write(tmp_path, r.stdout, "shown.toml"), environ={}), load(path, environ={"TANGRAM_IDLE": "12"})
    assert all(getattr(shown, s) == getattr(effective, s) for s in C.SCHEMA)
    r = cli("config", "show", "--section", "pool", env=env)
    assert "[pool]" in r.stdout and "[slurm]" not in r.stdout


@pytest.mark.slow
def test_workers_a_coordinator_launches_read_its_config_file(tmp_path):
    path = write(tmp_path, "[worker]\nmax_output_bytes = 2000\n")
    with LocalCluster(workers=1, cores=1, run_dir=tmp_path / "run", extra_args=["--config", str(path)]) as cl, \
            cl.client() as c:
        small = c.submit(function("builtins:str", "x" * 100)).result(30)
        big = c.submit(function("builtins:str", "x" * 5000)).result(30)
    assert small.ok and small.output == "x" * 100
    assert big.status == Status.FAILED and "exceeds the limit of 2000" in big.error


def test_sandbox_limits_come_from_the_sandbox_section(tmp_path):
    from tangram_hpc.managers.limits import Limits
    from tangram_hpc.worker import sandbox_limits
    path = write(tmp_path, "[sandbox]\nmemory_mb = 0\ndisk_mb = 512\nseccomp = false\n")
    s = parse("worker", "--config", str(path), "--sandbox-disk-files", "77")
    limits = sandbox_limits(s.sandbox)
    assert limits.memory_mb is None and limits.disk_mb == 512 and limits.disk_files == 77
    assert s.sandbox.seccomp is False and limits.timeout_s == Limits().timeout_s


def test_the_sandbox_template_is_every_new_environments_default_and_must_be_a_directory(tmp_path):
    from tangram_hpc.worker import sandbox_templates
    assert sandbox_templates(parse("worker").sandbox) == {}
    (tmp_path / "repo").mkdir()
    path = write(tmp_path, f"[sandbox]\ntemplate = \"{tmp_path / 'repo'}\"\n")
    opts = sandbox_templates(parse("worker", "--config", str(path)).sandbox)
    assert opts == {"templates": {"project": {"kind": "tree", "source": str(tmp_path / "repo")}},
                    "default_template": "project"}
    with pytest.raises(ConfigError, match="template .*gone is not a directory"):
        sandbox_templates(parse("worker", "--sandbox-template", str(tmp_path / "gone")).sandbox)


def test_environment_moves_are_turned_off_by_their_own_key_not_by_a_zero_cost(tmp_path):
    from tangram_hpc.launch import build_coordinator
    run = ("--run-dir", str(tmp_path / "run"), "--insecure", "--backend", "none")
    on = build_coordinator(parse("coordinator", *run, "--env-move-s", "3"))
    off = build_coordinator(parse("coordinator", *run, "--no-env-moves"))
    try:
        assert on.policy.env_move_s == 3.0 and off.policy.env_move_s is None    # None: the policy never moves one
    finally:
        on.close()
        off.close()
    assert load(write(tmp_path, "[coordinator]\nenv_moves = false\n"), environ={}).coordinator.env_moves is False
    with pytest.raises(ConfigError, match="env_move_s .*must be at least 0.01"):
        load(write(tmp_path, "[coordinator]\nenv_move_s = 0\n"), environ={})


def test_barrier_mode_is_a_coordinator_setting_that_reaches_the_elastic_policy(tmp_path):
    from tangram_hpc.launch import build_coordinator
    run = ("--run-dir", str(tmp_path / "run"), "--insecure", "--backend", "none")
    plain = build_coordinator(parse("coordinator", *run))
    flag = build_coordinator(parse("coordinator", *run, "--barriers"))
    try:
        assert plain.policy.barriers is False and flag.policy.barriers is True
    finally:
        plain.close()
        flag.close()
    assert load(write(tmp_path, "[coordinator]\nbarriers = true\n"), environ={}).coordinator.barriers is True


def test_the_defaults_config_states_are_those_of_the_objects_built_from_it():
    """config imports no policy, manager or backend, so it writes their defaults and variable
    names as plain values: each equals its owner's."""
    from tangram_hpc import config
    from tangram_hpc.backends.base import HANDLE_ENV
    from tangram_hpc.managers import devices
    from tangram_hpc.managers.limits import Limits
    from tangram_hpc.policy.placement import PlacementPolicy
    from tangram_hpc.policy.pool import PoolConfig
    from tangram_hpc.resources import WorkerShape

    limits, pool = Limits(), PoolConfig([WorkerShape(1)])
    assert config._LIMITS_DEFAULTS == {k: getattr(limits, k) for k in config._LIMITS_DEFAULTS}
    assert config._POOL_DEFAULTS == {k: getattr(pool, k) for k in config._POOL_DEFAULTS}
    assert config.PIPELINE_BELOW_S == PlacementPolicy.PIPELINE_BELOW_S
    assert (config.DEFAULT_CPU_BUDGET_MB, config.CPU_BUDGET_ENV) == (devices.DEFAULT_CPU_BUDGET_MB, devices.CPU_BUDGET_ENV)
    assert config.HANDLE_ENV == HANDLE_ENV
    s = config.Settings()
    assert s.sandbox.timeout_s == limits.timeout_s and s.slurm.target_util == pool.target_util
