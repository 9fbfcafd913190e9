"""Ending environments from the client: close_env and environment handles (sync and asyncio), on local
workers with real sandboxes; what they leave on disk is checked from the outside."""
from __future__ import annotations

import asyncio
import shutil
import time

import pytest

from tangram_hpc import AsyncClient, LocalCluster, sandbox
from tangram_hpc import protocol as P
from tangram_hpc.client_session import ClientSession
from tangram_hpc.managers.bwrap import probe_bwrap
from tangram_hpc.envfiles import env_dirname
from support import kept_state, wait_until

needs_bwrap = pytest.mark.skipif(probe_bwrap(shutil.which("bwrap") or "") is not None,
                                 reason="bubblewrap missing or unusable here")


def test_close_env_goes_out_as_one_frame_after_what_was_submitted_before():
    s = ClientSession("t")
    s.add(sandbox("true", env="e"), object())
    s.close_env(["e", "f"])
    frames = [P.decode(f, P.CLIENT_TYPES) for f in s.frames()]
    assert [t for t, _ in frames] == [P.SUBMIT, P.CLOSE_ENV] and frames[1][1] == ["e", "f"]


def test_a_close_env_body_of_non_ids_is_refused_at_the_edge():
    with pytest.raises(P.ProtocolError):
        P.check_ids(P.CLOSE_ENV, ["ok", 5])
    with pytest.raises(P.ProtocolError):
        P.check_ids(P.CANCEL, ["x" * 200])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with LocalCluster(workers=1, cores=2, run_dir=tmp_path_factory.mktemp("run")) as cl:
        yield cl


def env_dirs(cluster, env: str) -> list:
    return list(cluster.run_dir.glob(f"worker-*/envs/{env_dirname(env)}"))


@pytest.mark.sandbox
@needs_bwrap
def test_an_environment_handle_keeps_files_between_commands_and_ends_the_environment(cluster):
    with cluster.client() as c:
        with c.env("traj-17") as e:
            first = e.run("mkdir src && echo 'def f(): return 1' > src/m.py && echo made")
            assert first.ok and first.output["stdout"] == "made\n" and first.env_state == "created"
            second = e.run("cat src/m.py")
            assert second.output["stdout"] == "def f(): return 1\n" and second.env_state == kept_state()
            futs = [e.submit(f"echo {i} >> log") for i in range(3)]
            assert all(f.result(30).ok for f in futs)
            assert len(env_dirs(cluster, "traj-17")) == 1
        # Leaving the block ended it: its directory goes at once, not after the idle TTL.
        wait_until(lambda: not env_dirs(cluster, "traj-17"), 15, 0.05, "the environment's directory to go")
        st = c.status()
        assert st["envs_closed"] >= 1 and st["environments"].get("live", 0) == 0
        again = c.submit(sandbox("ls -A | wc -l", env="traj-17")).result(30)
        assert again.env_state == "created" and again.output["stdout"].strip() == "0"
        c.close_env("traj-17")


@pytest.mark.sandbox
@needs_bwrap
def test_close_env_waits_for_the_actions_submitted_before_it(cluster):
    with cluster.client() as c:
        slow = c.submit(sandbox("sleep 1; echo done > f; cat f", env="slow"))
        c.close_env("slow")
        r = slow.result(30)
        assert r.ok and r.output["stdout"] == "done\n"
        wait_until(lambda: not env_dirs(cluster, "slow"), 15, 0.05, "the environment's directory to go")


@pytest.mark.sandbox
@needs_bwrap
def test_a_handle_without_an_id_gets_a_new_environment_and_close_false_keeps_it(cluster):
    with cluster.client() as c:
        with c.env(close=False) as e:
            assert e.id.startswith("env-") and e.run("echo kept > f").ok
        time.sleep(0.5)
        assert c.submit(sandbox("cat f", env=e.id)).result(30).output["stdout"] == "kept\n"
        other = c.env()
        assert other.id != e.id
        c.close_env([e.id, other.id, "never-used"])   # ids that never ran are fine
        wait_until(lambda: not env_dirs(cluster, e.id), 15, 0.05, "the kept environment to go")


@pytest.mark.sandbox
@needs_bwrap
def test_the_asyncio_handle(cluster):
    async def main():
        async with AsyncClient(connection_file=str(cluster.connection_file)) as c:
            async with c.env("async-traj", cores=1) as e:
                r = await e.run("echo hi > f && cat f")
                assert r.ok and r.output["stdout"] == "hi\n"
                futs = [e.submit(f"echo {i} >> log") for i in range(3)]
                assert [x.ok for x in await asyncio.gather(*futs)] == [True] * 3
                assert (await e.run("wc -l < log")).output["stdout"].strip() == "3"
            await asyncio.sleep(0)
    asyncio.run(main())
    wait_until(lambda: not env_dirs(cluster, "async-traj"), 15, 0.05, "the environment's directory to go")


@pytest.mark.sandbox
@needs_bwrap
def test_a_template_this_worker_lacks_is_the_requests_error_and_the_environment_can_still_be_made(cluster):
    with cluster.client() as c:
        for i in range(10):     # the next action follows the result at once: the worker's word that
            env = f"tpl-{i}"    # nothing was made must reach the coordinator before the result does
            bad = c.submit(sandbox("echo never", env=env, template="nosuch")).result(30)
            assert bad.status == "error" and "unknown template 'nosuch'" in bad.error and "not created" in bad.error
            # nothing was made, so nothing was lost: the next action creates it
            made = c.submit(sandbox("echo kept > f", env=env)).result(30)
            assert (made.status, made.env_state) == ("ok", "created"), (i, made)
            if i:
                c.close_env(env)
        env = "tpl-0"
        # a template named after the environment exists is ignored, as documented
        again = c.submit(sandbox("cat f", env=env, template="nosuch")).result(30)
        assert (again.status, again.output["stdout"], again.env_state) == ("ok", "kept\n", kept_state()), again
        c.close_env(env)
