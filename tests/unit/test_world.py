"""discover_world / export_env / resolve_timeout against the environments the launchers really set."""

from __future__ import annotations

from datetime import timedelta

import pytest

from dsclip.engine.world import discovery
from dsclip.engine.world.discovery import WorldDiscoveryError, discover_world, export_env
from dsclip.engine.world.process_group import resolve_timeout

# What `deepspeed --num_gpus 2 ...` gives rank 1 (launch.py), plus --local_rank=1 in argv.
DEEPSPEED = dict(
    RANK="1",
    LOCAL_RANK="1",
    WORLD_SIZE="2",
    LOCAL_SIZE="2",
    CROSS_RANK="0",
    CROSS_SIZE="1",
    MASTER_ADDR="127.0.0.1",
    MASTER_PORT="29500",
)
TORCHRUN = dict(
    RANK="3",
    LOCAL_RANK="1",
    WORLD_SIZE="4",
    LOCAL_WORLD_SIZE="2",
    GROUP_RANK="1",
    TORCHELASTIC_RUN_ID="x",
    MASTER_ADDR="n1",
    MASTER_PORT="29400",
)
# What `srun` (sbatch --nodes=2 --ntasks-per-node=2) gives task 3 — copied from a real step.
SLURM = dict(
    SLURM_JOB_ID="1234",
    SLURM_PROCID="3",
    SLURM_LOCALID="1",
    SLURM_NODEID="1",
    SLURM_NTASKS="4",
    SLURM_NPROCS="4",
    SLURM_NTASKS_PER_NODE="2",
    SLURM_TASKS_PER_NODE="2(x2)",
    SLURM_STEP_ID="0",
    SLURM_STEPID="0",
    SLURM_STEP_NUM_TASKS="4",
    SLURM_STEP_TASKS_PER_NODE="2(x2)",
    SLURM_JOB_NODELIST="gpu[07-08]",
    SLURM_STEP_NODELIST="gpu[07-08]",
)


@pytest.fixture(autouse=True)
def no_scontrol(monkeypatch):
    # unit tests must not depend on a SLURM install: force the built-in hostlist parser
    def fail(*a, **k):
        raise FileNotFoundError("scontrol")

    monkeypatch.setattr(discovery.subprocess, "run", fail)


def test_deepspeed_launcher_env():
    w = discover_world(DEEPSPEED, ["--config", "x.yaml", "--local_rank=1"])
    assert (w.rank, w.local_rank, w.world_size, w.local_world_size) == (1, 1, 2, 2)
    assert (w.master_addr, w.master_port, w.source) == ("127.0.0.1", 29500, "deepspeed")


def test_local_rank_only_in_argv():
    env = {k: v for k, v in DEEPSPEED.items() if k != "LOCAL_RANK"}
    assert discover_world(env, ["--local_rank", "1"]).local_rank == 1
    assert discover_world(env, ["--local-rank=1"]).local_rank == 1


def test_srun_wrapper_env_is_slurm():
    env = {
        **SLURM,
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "LOCAL_SIZE": "2",
        "MASTER_ADDR": "gpu07",
        "MASTER_PORT": "16234",
    }
    w = discover_world(env, [])
    assert (w.rank, w.local_world_size, w.source) == (3, 2, "slurm")
    assert discover_world({**env, "SLURM_PROCID": "0"}, []).source == "env"


def test_torchrun_env():
    w = discover_world(TORCHRUN, [])
    assert (w.rank, w.local_rank, w.world_size, w.local_world_size, w.source) == (3, 1, 4, 2, "torchrun")


def test_slurm_env_maps_tasks_and_derives_master():
    w = discover_world(SLURM, [])
    assert (w.rank, w.local_rank, w.world_size, w.local_world_size, w.source) == (3, 1, 4, 2, "slurm")
    assert w.master_addr == "gpu07"  # first node of the step, zero padding kept
    assert w.master_port == discovery.slurm_port(1234) == 15000 + 1234
    # all ranks of a job agree on the port; another job gets another one
    rank0 = discover_world({**SLURM, "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}, [])
    assert rank0.master_port == w.master_port
    assert discover_world({**SLURM, "SLURM_JOB_ID": "1235"}, []).master_port != w.master_port


def test_slurm_master_from_env_wins():
    w = discover_world({**SLURM, "MASTER_ADDR": "head", "MASTER_PORT": "23456"}, [])
    assert (w.master_addr, w.master_port) == ("head", 23456)


def test_slurm_uneven_tasks_per_node():
    env = {**SLURM, "SLURM_STEP_TASKS_PER_NODE": "3,1", "SLURM_NODEID": "1", "SLURM_PROCID": "3", "SLURM_LOCALID": "0"}
    assert discover_world(env, []).local_world_size == 1


def test_scontrol_used_when_available(monkeypatch):
    class R:
        stdout = "first\nsecond\n"

    monkeypatch.setattr(discovery.subprocess, "run", lambda *a, **k: R())
    assert discover_world(SLURM, []).master_addr == "first"


def test_launcher_env_wins_over_slurm():
    # srun --ntasks-per-node=1 deepspeed --no_ssh --node_rank=$SLURM_NODEID: every rank sees SLURM_*
    # of its (single) task per node, and the launcher's RANK/WORLD_SIZE are the truth.
    env = {
        **SLURM,
        "SLURM_PROCID": "1",
        "SLURM_LOCALID": "0",
        "SLURM_NTASKS": "2",
        **DEEPSPEED,
        "RANK": "3",
        "WORLD_SIZE": "4",
    }
    w = discover_world(env, ["--local_rank=1"])
    assert (w.rank, w.world_size, w.source) == (3, 4, "deepspeed")


def test_single_process_defaults():
    w = discover_world({}, [])
    assert (w.rank, w.local_rank, w.world_size, w.local_world_size, w.source) == (0, 0, 1, 1, "single")
    assert w.master_addr == "127.0.0.1" and 0 < w.master_port < 65536


def test_slurm_batch_script_single_task_is_single():
    env = {k: v for k, v in SLURM.items() if "STEP" not in k}
    env.update(SLURM_NTASKS="1", SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_TASKS_PER_NODE="1")
    assert discover_world(env, []).source == "single"


def test_slurm_batch_script_without_srun_is_an_error():
    env = {k: v for k, v in SLURM.items() if "STEP" not in k}
    with pytest.raises(WorldDiscoveryError, match="not under srun"):
        discover_world(env, [])


@pytest.mark.parametrize("drop", ["WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RANK"])
def test_partial_launcher_env_names_missing(drop):
    env = {k: v for k, v in DEEPSPEED.items() if k != drop}
    with pytest.raises(WorldDiscoveryError, match=drop):
        discover_world(env, ["--local_rank=1"])


def test_partial_launcher_env_missing_local_rank():
    env = {k: v for k, v in DEEPSPEED.items() if k != "LOCAL_RANK"}
    with pytest.raises(WorldDiscoveryError, match="LOCAL_RANK"):
        discover_world(env, [])


def test_local_rank_flag_alone_names_everything_missing():
    with pytest.raises(WorldDiscoveryError) as e:
        discover_world({}, ["--local_rank=0"])
    for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        assert v in str(e.value)


@pytest.mark.parametrize("drop", ["SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_NODELIST"])
def test_partial_slurm_env_names_missing(drop):
    env = {k: v for k, v in SLURM.items() if k != drop and not k.startswith("SLURM_STEP_")}
    env["SLURM_STEP_ID"] = "0"
    with pytest.raises(WorldDiscoveryError, match=drop):
        discover_world(env, [])


def test_slurm_without_job_id_needs_master_port():
    env = {k: v for k, v in SLURM.items() if k != "SLURM_JOB_ID"}
    with pytest.raises(WorldDiscoveryError, match="SLURM_JOB_ID"):
        discover_world(env, [])
    assert discover_world({**env, "MASTER_PORT": "20001"}, []).master_port == 20001


def test_bad_values_are_errors():
    with pytest.raises(WorldDiscoveryError, match="not an integer"):
        discover_world({**DEEPSPEED, "RANK": "one"}, [])
    with pytest.raises(WorldDiscoveryError, match="outside world"):
        discover_world({**DEEPSPEED, "RANK": "2"}, [])


def test_export_env_round_trip():
    env: dict[str, str] = {}
    info = discover_world(SLURM, [])
    export_env(info, env)
    assert env["RANK"] == "3" and env["LOCAL_RANK"] == "1" and env["WORLD_SIZE"] == "4"
    assert env["MASTER_ADDR"] == "gpu07" and env["MASTER_PORT"] == str(info.master_port)
    # what deepspeed.init_distributed checks before it falls back to mpi4py
    assert {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"} <= env.keys()
    again = discover_world({**SLURM, **env}, [])
    assert (again.rank, again.world_size, again.master_addr) == (3, 4, "gpu07")
    assert again.master_port == info.master_port


@pytest.mark.parametrize(
    "nodelist,hosts",
    [
        ("n1", ["n1"]),
        ("node[1-2]", ["node1", "node2"]),
        ("gpu[007-009,011],cpu3", ["gpu007", "gpu008", "gpu009", "gpu011", "cpu3"]),
        ("a[1-2]-ib,b", ["a1-ib", "a2-ib", "b"]),
    ],
)
def test_expand_nodelist(nodelist, hosts):
    assert discovery.expand_nodelist(nodelist) == hosts


def test_resolve_timeout_precedence():
    assert resolve_timeout(None, {}) == timedelta(minutes=30)
    assert resolve_timeout(90, {}) == timedelta(seconds=90)
    assert resolve_timeout(90, {"DEEPSPEED_TIMEOUT": "2"}) == timedelta(minutes=2)
    both = {"DEEPSPEED_TIMEOUT": "2", "DSCLIP_DIST_TIMEOUT": "15"}
    assert resolve_timeout(90, both) == timedelta(seconds=15)
