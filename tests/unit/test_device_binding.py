"""Which GPU each rank binds, for every launcher and CUDA_VISIBLE_DEVICES shape, with CUDA mocked at the
boundary: what index reaches torch.cuda.set_device, DeepSpeed's accelerator.set_device and
deepspeed.initialize(args.device_rank=...). Plus the CPU report (affinity) and the bad-input lines."""

from __future__ import annotations

import os
import socket
import sys

import pytest
import torch

from dsclip.engine.world import cores, devices, discovery, process_group
from dsclip.engine.world.devices import DeviceBindingError, resolve_device
from dsclip.engine.world.discovery import WorldInfo


def info(local: int, lws: int, rank: int | None = None, source: str = "slurm") -> WorldInfo:
    return WorldInfo(local if rank is None else rank, local, max(lws, 8), lws, "127.0.0.1", 29500, source)


# (what launches the rank, CUDA_VISIBLE_DEVICES the task sees, GPUs torch counts, local rank, ranks
#  on the node) -> (index handed to set_device, the node's GPU it names)
CASES = [
    ("deepspeed --num_gpus 8 (launch.py sets 0..7)", "0,1,2,3,4,5,6,7", 8, 3, 8, 3, "3"),
    ("torchrun, CUDA_VISIBLE_DEVICES unset", None, 8, 5, 8, 5, "5"),
    ("srun --gpus-per-task=1: one GPU per task", "5", 1, 5, 8, 0, "5"),
    ("srun --gpu-bind=map_gpu:3,1", "1", 1, 1, 2, 0, "1"),
    ("permuted subset, every task sees all of it", "6,2,4,0", 4, 1, 4, 1, "2"),
    ("--gpu-bind=closest: tasks 4-7 see socket 1's GPUs", "4,5,6,7", 4, 6, 8, 2, "6"),
    ("plain srun --gpus-per-node=2, two tasks", "0,1", 2, 1, 2, 1, "1"),
]


@pytest.mark.parametrize("what,cvd,count,local,lws,index,physical", CASES, ids=[c[0] for c in CASES])
def test_index_is_valid_in_the_tasks_own_view(what, cvd, count, local, lws, index, physical):
    env = {} if cvd is None else {"CUDA_VISIBLE_DEVICES": cvd}
    b = resolve_device(info(local, lws), env, cuda_count=count)
    assert (b.index, b.physical) == (index, physical)
    assert 0 <= b.index < count
    # a CPU-only machine resolves the same index from CUDA_VISIBLE_DEVICES (what the launch tests check)
    cpu = resolve_device(info(local, lws), env, cuda_count=None)
    assert (cpu.index, cpu.physical, cpu.on_gpu) == (index, physical, False)
    if cvd is None:  # no GPU view: nothing would be bound, and the rank line does not pretend otherwise
        assert cpu.describe() == "device cpu"
    else:
        assert f"bind cuda:{index} gpu {physical} " in cpu.describe()


def test_every_task_of_a_node_gets_a_distinct_gpu():
    # --gpus-per-task=1 with 4 tasks: each sees only its own GPU (SLURM's order need not be the task order)
    given = ["2", "0", "3", "1"]
    picked = {
        resolve_device(info(r, 4), {"CUDA_VISIBLE_DEVICES": g}, cuda_count=1).physical for r, g in enumerate(given)
    }
    assert picked == {"0", "1", "2", "3"}
    closest = {
        resolve_device(info(r, 8), {"CUDA_VISIBLE_DEVICES": "0,1,2,3" if r < 4 else "4,5,6,7"}, cuda_count=4).physical
        for r in range(8)
    }
    assert closest == {str(i) for i in range(8)}


def test_per_node_deepspeed_launcher_ids_are_mapped_back_to_slurms_gpus():
    # train_per_node.sbatch: SLURM gave the node's task GPUs 6,7; launch.py then sets 0,1 (hostfile slots)
    env = {"DSCLIP_NODE_GPUS": "6,7", "CUDA_VISIBLE_DEVICES": "1", "RANK": "3"}
    devices.remap_launcher_devices(env)
    assert env["CUDA_VISIBLE_DEVICES"] == "7"
    assert resolve_device(info(1, 2), env, cuda_count=1).physical == "7"
    env = {"DSCLIP_NODE_GPUS": "6,7", "CUDA_VISIBLE_DEVICES": "0,1"}
    devices.remap_launcher_devices(env)
    assert env["CUDA_VISIBLE_DEVICES"] == "6,7"
    # a second call (train/preflight.py translates before its CUDA query, init_distributed again) keeps it
    env = {"DSCLIP_NODE_GPUS": "4,5,6,7", "CUDA_VISIBLE_DEVICES": "1", "RANK": "1"}
    devices.remap_launcher_devices(env)
    devices.remap_launcher_devices(env)
    assert env["CUDA_VISIBLE_DEVICES"] == "5" and env["DSCLIP_LAUNCHER_GPU_IDS"] == "1"


def test_launcher_gpu_id_outside_the_slurm_set_is_one_line_naming_rank_and_fix():
    env = {"DSCLIP_NODE_GPUS": "6,7", "CUDA_VISIBLE_DEVICES": "2", "RANK": "5"}
    with pytest.raises(DeviceBindingError, match=r"^rank 5: .*GPU ids 2 .*6,7.*GPUS_PER_NODE") as e:
        devices.remap_launcher_devices(env)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "cvd,count,lws,needle",
    [
        ("", 0, 2, "no GPU visible to this task"),
        ("NoDevFiles", 0, 2, "no GPU visible to this task"),
        ("0,1,2", 3, 4, "sees 3 GPUs .* for 4 ranks"),
    ],
)
def test_unusable_view_is_one_line_naming_rank_and_fix(cvd, count, lws, needle):
    with pytest.raises(DeviceBindingError, match=rf"^rank 3 \(local 1/{lws}, host .*\): .*{needle}") as e:
        resolve_device(WorldInfo(3, 1, 8, lws, "a", 1, "slurm"), {"CUDA_VISIBLE_DEVICES": cvd}, cuda_count=count)
    msg = str(e.value)
    assert "\n" not in msg and ("--gpus-per-task=1" in msg)


def test_cpu_run_reports_what_it_would_bind_and_never_refuses():
    b = resolve_device(info(1, 2), {}, cuda_count=None)
    # no GPU view at all (a plain CPU machine): the rank line says only "device cpu", never "bind cuda:1"
    assert not b.on_gpu and b.index == 1 and b.describe() == "device cpu"
    # a GPU view on a CPU machine (the fake-GPU cluster's gres): what the rank would bind
    b = resolve_device(info(1, 2), {"CUDA_VISIBLE_DEVICES": "0,1"}, cuda_count=None)
    assert b.describe().startswith("device cpu bind cuda:1 gpu 1 visible 0,1")
    # CUDA_VISIBLE_DEVICES="" is how people force a CPU run; a view GPUs could not serve is no error here
    for cvd, lws in (("", 2), ("0,1,2", 4)):
        b = resolve_device(info(1, lws), {"CUDA_VISIBLE_DEVICES": cvd}, cuda_count=None)
        assert b.index is None and " bind none gpu - " in b.describe()


# ---- init_distributed and build_engine with CUDA mocked -------------------------------------------


@pytest.fixture
def fresh_world(monkeypatch):
    saved = dict(process_group._state)
    saved_env = dict(os.environ)  # init_distributed exports RANK, MASTER_* ... into os.environ itself
    process_group._state.update(info=None, binding=None, atexit=True)  # atexit=True: register no exit hook here
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    for k in [
        k for k in os.environ if k.startswith(("SLURM_", "TORCHELASTIC", "CUDA_VISIBLE", "DSCLIP_NODE", "NCCL_"))
    ]:
        monkeypatch.delenv(k)
    yield
    process_group._state.clear()
    process_group._state.update(saved)
    os.environ.clear()
    os.environ.update(saved_env)


def mock_cuda(monkeypatch, count: int) -> list[int]:
    calls: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.append(int(i)))
    return calls


def test_init_distributed_binds_the_index_of_the_tasks_view(monkeypatch, capsys, fresh_world):
    import deepspeed

    # srun --gpus-per-task=1, task 3 of node 2 (local 3 of 4): SLURM shows it only GPU 3
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    for k, v in dict(
        SLURM_PROCID="7", SLURM_LOCALID="3", SLURM_NODEID="1", SLURM_NTASKS="8", SLURM_STEP_ID="0",
        SLURM_STEP_NUM_TASKS="8", SLURM_STEP_TASKS_PER_NODE="4(x2)", SLURM_JOB_NODELIST="n[1-2]",
        MASTER_ADDR="n1", MASTER_PORT="23456", CUDA_VISIBLE_DEVICES="3", DSCLIP_LOG_WORLD="1", NCCL_DEBUG="WARN",
        OMP_NUM_THREADS="1",
    ).items():  # fmt: skip
        monkeypatch.setenv(k, v)
    set_device = mock_cuda(monkeypatch, 1)
    seen = {}
    monkeypatch.setattr(deepspeed, "init_distributed", lambda **kw: seen.update(kw))
    monkeypatch.setattr(process_group, "release_shm_workspace", lambda: False)
    got = process_group.init_distributed()
    assert got.local_rank == 3 and set_device == [0]  # not 3: the task sees one GPU
    assert process_group.device_rank() == 0 and seen["dist_backend"] == "nccl"
    line = [x for x in capsys.readouterr().err.splitlines() if x.startswith("[dsclip] rank 7/8")][0]
    assert "device cuda bind cuda:0 gpu 3 visible 3 " in line
    cpus = sorted(os.sched_getaffinity(0))
    cpus_part = f"cpus {cores.format_cpus(cpus)} ({len(cpus)})"
    assert line.endswith(f"{cpus_part} net NCCL_DEBUG=WARN threads 1 (OMP_NUM_THREADS)")  # GPU


@pytest.mark.parametrize(
    "own, peers, default, expect",
    [
        ({0, 1}, [{0, 1}, {0, 1}], 2, 1),  # deepspeed --num_gpus 2 on 2 cores: one thread each, not two
        (set(range(64)), [set(range(64))] * 8, 32, 8),  # 8 ranks on a 64-cpu host: 8 each
        (set(range(64)), [set(range(64))] * 2, 16, 16),  # never above torch's own default (physical cores)
        ({0, 1, 2, 3}, [{0, 1, 2, 3}, {4, 5, 6, 7}], 32, 4),  # bound to disjoint cores: nothing shared
        ({0}, [{0}] * 4, 8, 1),  # more ranks than cores: at least one thread
        (set(range(8)), [set(range(8)), set(range(4, 12))], 8, 4),  # overlapping masks count as sharing
    ],
)
def test_threads_divide_the_cores_the_local_ranks_share(own, peers, default, expect):
    assert cores.threads_for_shared_cores(own, peers, default) == expect


def test_host_identity_is_the_machines_boot_id_else_the_hostname(monkeypatch):
    """Ranks count as sharing cores by machine, not by hostname (containers of one machine share its cores
    under different names; machines can share a name)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            expect = f.read().strip()
    except OSError:
        expect = socket.gethostname()
    assert cores.host_identity() == expect

    def no_proc(*args, **kwargs):
        raise OSError("no /proc here")

    monkeypatch.setattr(cores, "open", no_proc, raising=False)  # the module's open(): no boot id to read
    assert cores.host_identity() == socket.gethostname()


def test_init_distributed_divides_the_hosts_cores_when_omp_num_threads_is_unset(monkeypatch, capsys, fresh_world):
    """4 ranks of a launcher on an 8-cpu host, OMP_NUM_THREADS unset: torch's default (here 32) in every
    rank would be 128 threads on 8 cpus; each rank gets 2 and exports it. An explicit value is kept."""
    import deepspeed

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for k, v in dict(RANK="1", LOCAL_RANK="1", WORLD_SIZE="4", LOCAL_SIZE="4", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT="23456", DSCLIP_LOG_WORLD="1").items():  # fmt: skip
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(deepspeed, "init_distributed", lambda **kw: None)  # no process group: LOCAL_SIZE counts
    monkeypatch.setattr(process_group, "release_shm_workspace", lambda: False)
    monkeypatch.setattr(discovery, "check_master_port", lambda info: None)
    monkeypatch.setattr(cores, "cpu_affinity", lambda: list(range(8)))
    set_threads = []
    monkeypatch.setattr(torch, "get_num_threads", lambda: 32)
    monkeypatch.setattr(torch, "set_num_threads", set_threads.append)
    process_group.init_distributed()
    assert set_threads == [2] and os.environ["OMP_NUM_THREADS"] == "2"
    line = [x for x in capsys.readouterr().err.splitlines() if x.startswith("[dsclip] rank 1/4")][0]
    assert line.endswith("threads 2 (8 cpus / 4 local ranks, OMP_NUM_THREADS unset)"), line

    assert cores.share_cores(process_group.world_info(), env={"OMP_NUM_THREADS": "3"}) == "threads 32 (OMP_NUM_THREADS)"
    assert set_threads == [2]  # an explicit OMP_NUM_THREADS is left alone


def test_engine_gets_device_rank_and_deepspeed_binds_it(monkeypatch, fresh_world, tmp_path):
    """A real deepspeed.initialize (world of 1, gloo) with the accelerator's set_device recorded:
    LOCAL_RANK=3 must not reach it once the rank sees a single GPU."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    from dsclip.config import make_run_config
    from dsclip.engine.build import build_engine
    from dsclip.engine.ds_config import load_ds_json, resolve_ds_config
    from dsclip.model import create_model, get_model_config

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    process_group._state["binding"] = devices.DeviceBinding(0, 1, ("3",), True)  # what init_distributed resolved
    recorded: list[int] = []
    acc = get_accelerator()
    monkeypatch.setattr(acc, "set_device", lambda i: recorded.append(i), raising=False)
    handed = {}
    real_init = deepspeed.initialize

    def spy(**kw):
        handed.update(kw)
        return real_init(**kw)

    monkeypatch.setattr(deepspeed, "initialize", spy)
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    try:
        cfg = make_run_config({"name": "t", "batch_size": 2, "precision": "fp32", "model": "tiny"})
        ds = resolve_ds_config(load_ds_json("zero2_fp32"), cfg.train, cfg.optim, world_size=1, device_type="cpu")
        mcfg = get_model_config("tiny")
        bundle = build_engine(
            ds,
            cfg.train,
            cfg.optim,
            lambda: create_model(mcfg, vocab_size=64, eos_id=2, pad_id=0),
            total_steps=1,
            steps_per_epoch=1,
        )
    finally:
        dist.destroy_process_group()
    assert handed["args"].device_rank == 0
    assert recorded and set(recorded) == {0}, recorded  # DeepSpeed's own set_device got 0, never LOCAL_RANK 3
    assert bundle.engine.local_rank == 3  # the rank itself is unchanged


# ---- CPU cores ---------------------------------------------------------------------------------


def test_format_cpus():
    assert cores.format_cpus([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert cores.format_cpus([3]) == "3"


def test_more_workers_than_cores_warns_once_with_rank_and_fix(monkeypatch, capsys):
    monkeypatch.setattr(cores, "cpu_affinity", lambda: [4, 5])
    assert cores.check_workers(2, rank=1) is None
    msg = cores.check_workers(6, rank=1)
    assert msg and msg.startswith("[dsclip] rank 1: WARNING --workers 6 exceeds the 2 core(s)")
    assert "affinity 4-5" in msg and "--cpus-per-task" in msg and "\n" not in msg
    assert capsys.readouterr().err.strip() == msg


def test_master_port_in_use_is_one_line_before_rendezvous():
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        port = s.getsockname()[1]
        taken = WorldInfo(0, 0, 2, 1, "node1", port, "slurm")
        with pytest.raises(
            discovery.WorldDiscoveryError, match=rf"^rank 0 .*MASTER_PORT {port} is already in use.*free port"
        ):
            discovery.check_master_port(taken, env={})
        discovery.check_master_port(WorldInfo(1, 0, 2, 1, "node1", port, "slurm"), env={})  # only rank 0 listens
        discovery.check_master_port(WorldInfo(0, 0, 2, 1, "node1", port, "torchrun"), env={})  # agent's store
    discovery.check_master_port(taken, env={})  # free again


def test_dsclip_train_with_master_port_taken_exits_with_one_line(tmp_path):
    """Through the CLI: rank 0 of a 2-rank launch whose MASTER_PORT is held says so and exits 2 at once,
    instead of rendezvousing with a stranger's store or waiting out the timeout."""
    import subprocess

    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        port = s.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC", "CUDA_VISIBLE"))}
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        env.update(OMP_NUM_THREADS="1", DSCLIP_LOG_WORLD="1")
        p = subprocess.run(
            [sys.executable, "-m", "dsclip", "train", "--config", "tiny", "--logs", str(tmp_path), "--name", "x"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert p.returncode == 2, p.stderr[-3000:]
    errors = [line for line in p.stderr.splitlines() if "error" in line.lower()]
    want = (
        f"dsclip train: error: rank 0 (host {socket.gethostname()}): MASTER_PORT {port} is already in use on "
        "127.0.0.1 (another job?); set MASTER_PORT to a free port"
    )
    assert errors == [want], p.stderr[-3000:]
    assert "Traceback" not in p.stderr and "[dsclip] rank" not in p.stderr
