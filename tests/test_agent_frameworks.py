"""Agent frameworks on tangram sandboxes, driven by the real packages: mini-swe-agent's
DefaultAgent with its own deterministic test model, and SkyRL-gym's tool-executing environments.
Many agents share one coordinator, each in its own environment."""
from __future__ import annotations

import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tangram_hpc.launch import LocalCluster
from tangram_hpc.managers.bwrap import probe_bwrap

pytestmark = [
    pytest.mark.sandbox, pytest.mark.slow,
    pytest.mark.skipif(probe_bwrap(shutil.which("bwrap") or "") is not None,
                       reason="bubblewrap missing or unusable here"),
]

AGENTS = 16
CORES = 2


@pytest.fixture(scope="module", autouse=True)
def _mini_swe_agent_config(tmp_path_factory):
    """mini-swe-agent makes its global config directory when first imported: a temporary one."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MSWEA_GLOBAL_CONFIG_DIR", str(tmp_path_factory.mktemp("mswea")))
        mp.setenv("MSWEA_SILENT_STARTUP", "1")
        yield


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with LocalCluster(workers=1, cores=CORES, run_dir=tmp_path_factory.mktemp("agents-run")) as cl:
        yield cl


# -- mini-swe-agent ----------------------------------------------------------------------------------

def _agent_run(connection_file: str, i: int) -> tuple[dict, list[dict], str]:
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.environments import get_environment
    from minisweagent.models.test_models import DeterministicModel, make_output

    def say(command: str) -> dict:
        return make_output(f"step: {command}", [{"command": command}])

    outputs = [
        say(f"echo agent-{i} > note.txt; echo to-stderr >&2; pwd"),
        make_output("thinking", [{"command": "/sleep 0.2"}]),     # the model's think time: no core held
        say("mkdir -p sub && cd sub && echo in-sub > f && cat ../note.txt"),
        say("cat note.txt sub/f; exit 3"),
    ]
    if i % 4 == 0:
        outputs.append(say("sleep 120"))                         # cut off at the command timeout
    outputs.append(say("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; cat note.txt sub/f"))
    # as mini-swe-agent builds it from its YAML config
    env = get_environment({"environment_class": "tangram_hpc.integrations.minisweagent.TangramEnvironment",
                           "connection_file": connection_file, "timeout": 4, "env": {"GREETING": f"hi-{i}"}})
    agent = DefaultAgent(DeterministicModel(outputs=outputs), env, system_template="You are agent {{task}}.",
                         instance_template="Task: {{task}}", step_limit=20, cost_limit=100.0)
    result = agent.run(task=str(i))
    observations = [m["content"] for m in agent.messages if m.get("role") == "user"][1:]
    return result, observations, env.config.env_id


def test_many_mini_swe_agents_share_one_coordinator(cluster):
    with ThreadPoolExecutor(AGENTS) as pool:
        runs = list(pool.map(lambda i: _agent_run(str(cluster.connection_file), i), range(AGENTS)))
    with cluster.client() as c:
        # every agent's files live on the one 2-core worker at once, and no core is bound now; a
        # worker reports its environments with its heartbeats, so status shows them a beat later
        deadline = time.monotonic() + 60
        while True:
            st = c.status()
            if sum(w["envs"] for w in st["workers"]) == AGENTS and st["running"] == 0:
                break
            assert time.monotonic() < deadline, st
            time.sleep(0.2)
        env_ids = [env_id for _, _, env_id in runs]
        assert len(set(env_ids)) == AGENTS
        c.close_env(env_ids)
    for i, (result, obs, _) in enumerate(runs):
        assert result["exit_status"] == "Submitted", (i, result, obs)
        assert result["submission"] == f"agent-{i}\nin-sub\n", (i, result)
        first, second, third = obs[:3]
        assert "<returncode>0</returncode>" in first and "to-stderr\n/sandbox\n" in first, first
        assert f"agent-{i}\n" in second and "<returncode>0</returncode>" in second, second
        assert "<returncode>3</returncode>" in third and f"agent-{i}\nin-sub\n" in third, third
        if i % 4 == 0:
            assert "<returncode>-1</returncode>" in obs[3] and "timed out after 4 seconds" in obs[3], obs[3]
        assert len(obs) == 3 + (i % 4 == 0)


def test_mini_swe_agent_environment_cwd_variables_and_errors(cluster, monkeypatch):
    from minisweagent.environments import get_environment
    from tangram_hpc.integrations.minisweagent import TangramEnvironment

    monkeypatch.setenv("TANGRAM_CONNECTION_FILE", str(cluster.connection_file))  # the config names none
    env = get_environment({"environment_class": "tangram_hpc.integrations.minisweagent.TangramEnvironment",
                           "cwd": "work", "env": {"GREETING": "hello"}, "timeout": 10})
    assert isinstance(env, TangramEnvironment)
    missing = env.execute({"command": "pwd"})
    assert missing["returncode"] == 1 and "can't cd" in missing["output"], missing
    made = env.execute({"command": "mkdir work && pwd"}, cwd="/sandbox")
    assert made == {"output": "/sandbox\n", "returncode": 0, "exception_info": ""}
    there = env.execute({"command": 'pwd; echo "$GREETING"'})
    assert there["output"] == "/sandbox/work\nhello\n" and there["returncode"] == 0
    assert env.get_template_vars(extra=1)["cwd"] == "work" and env.get_template_vars()["system"]
    assert env.serialize()["info"]["config"]["environment_type"].endswith("minisweagent.TangramEnvironment")
    env.cleanup()


# -- SkyRL-gym ---------------------------------------------------------------------------------------------

def _episode(connection_file: str, i: int) -> tuple[list, float, bool]:
    import skyrl_gym
    from tangram_hpc.integrations.skyrl import register_envs

    register_envs()
    env = skyrl_gym.make("tangram_searchcode", env_config={"connection_file": connection_file},
                         extras={"reward_spec": {"ground_truth": str(i * 11)}, "max_turns": 6})
    env.init([{"role": "user", "content": f"compute {i} * 11"}])
    seen = []
    for action in [f"<tool><python>open('x.txt', 'w').write(str({i} * 11)); print({i} * 11)</python></tool>",
                   "<tool><python>print(open('x.txt').read() + '!')</python></tool>",
                   "<tool><python>import sys; sys.exit('boom')</python></tool>"]:
        out = env.step(action)
        seen.append(out["observations"][0]["content"])
    done = env.step(f"<solution>#### {i * 11}</solution>")  # gsm8k-style scoring of searchcode
    env.close()
    return seen, done["reward"], done["done"]


def test_skyrl_gym_searchcode_runs_its_python_tool_in_tangram(cluster):
    with ThreadPoolExecutor(AGENTS) as pool:
        episodes = list(pool.map(lambda i: _episode(str(cluster.connection_file), i), range(AGENTS)))
    for i, (seen, reward, done) in enumerate(episodes):
        assert seen == [str(i * 11), f"{i * 11}!", "Error executing Python code: boom"], (i, seen)
        assert done and reward == 1.0, (i, reward)


def test_skyrl_python_tool_timeout_and_isolation(cluster):
    from tangram_hpc.integrations.skyrl import TangramPythonToolGroup

    a = TangramPythonToolGroup(timeout=2, connection_file=str(cluster.connection_file))
    b = TangramPythonToolGroup(connection_file=str(cluster.connection_file))
    assert a.get_tool_names() == ["python"]
    assert a.execute_tool("python", "import time; time.sleep(60)") == \
        "Error executing Python code: Execution timed out after 2 seconds."
    assert a.execute_tool("python", "open('mine', 'w').write('a'); import os; print(os.getcwd())") == "/sandbox"
    assert "FileNotFoundError" in b.execute_tool("python", "print(open('mine').read())")  # its own environment
    assert a.execute_tool("python", "print(open('mine').read())") == "a"
    a.close()
    b.close()
