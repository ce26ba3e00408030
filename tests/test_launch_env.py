"""The launcher/rank environment contract in one place: gpucomm.bootstrap.launch_env."""

from __future__ import annotations

from gpucomm.bootstrap import launch_env
from gpucomm.bootstrap.placement import Placement
from gpucomm.bootstrap.world import detect_world
from gpucomm.runner import mpi_rank
from gpucomm.runner.worker_env import job_env


def test_mpi_rank_wrapper_keeps_the_same_rank_variables():
    # mpi_rank.py runs by path without gpucomm, so it keeps its own copy of the tuple
    assert mpi_rank.RANK_VARS == launch_env.MPI_RANK_VARS


def test_mpi_launcher_detection():
    assert launch_env.mpi_launcher({}) is None
    for var in launch_env.OPENMPI_MARKERS:
        assert launch_env.mpi_launcher({var: "0"}) == "openmpi"
    for var in launch_env.MPICH_MARKERS:
        assert launch_env.mpi_launcher({var: "0"}) == "mpich"
    # every rank variable the wrapper reads marks a launcher
    assert set(launch_env.MPI_RANK_VARS) <= set(launch_env.OPENMPI_MARKERS + launch_env.MPICH_MARKERS)


def test_rendezvous_env_is_read_back_by_world():
    secret = bytes(range(32))
    env = job_env(Placement("h", 1, 2, 1, 2, 0, 1), rendezvous_addr="10.0.0.1", rendezvous_port=1234,
                  secret=secret, run_id="abc")
    assert {k: env[k] for k in launch_env.rendezvous_env("10.0.0.1", 1234, secret, "abc")} == \
        launch_env.rendezvous_env("10.0.0.1", 1234, secret, "abc")
    world = detect_world(env)
    assert (world.rendezvous_addr, world.rendezvous_port, world.rendezvous_hosted) == ("10.0.0.1", 1234, True)
    assert (world.secret, world.run_id, world.rank, world.size) == (secret, "abc", 1, 2)


def test_elastic_worker_env_names():
    env = launch_env.elastic_worker_env("h:0", "h", 30.0)
    assert env[launch_env.GPUCOMM_ELASTIC_WORKER] == "h:0"
    assert env[launch_env.GPUCOMM_ELASTIC_TIMEOUT] == env[launch_env.HOROVOD_ELASTIC_TIMEOUT] == "30"
    assert env[launch_env.GPUCOMM_ELASTIC] == env[launch_env.HOROVOD_ELASTIC] == "1"
