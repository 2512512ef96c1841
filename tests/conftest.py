"""Test-session hygiene shared by all suites."""

from __future__ import annotations

import glob
import os
import sys

import pytest
import torch

SHM_PATTERN = "/dev/shm/deepspeed_allreduce_buffer_*"

# Every subprocess (deepspeed launcher, ranks, the launch scripts, which activate the venv) must find
# the venv's ninja first: DeepSpeed JIT-builds its CPU shm op with whichever `ninja` is on PATH, and
# two ninja binaries alternating on one TORCH_EXTENSIONS_DIR rebuild it from scratch each time
# (minutes on 2 cores; longer inside a SLURM task bound to one core).
_venv_bin = os.path.dirname(sys.executable)
if os.environ.get("PATH", "").split(os.pathsep)[0] != _venv_bin:
    os.environ["PATH"] = _venv_bin + os.pathsep + os.environ.get("PATH", "")


def _mapped_files() -> set[str]:
    mapped = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as f:
                mapped.update(line.split(None, 5)[5].strip() for line in f if "/dev/shm/" in line)
        except (OSError, IndexError):
            continue
    return mapped


def _listening_ports() -> set[int]:
    """TCP ports some process on this machine listens on (/proc/net/tcp{,6}: state 0A = LISTEN)."""
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    fields = line.split()
                    if fields[3] == "0A":
                        ports.add(int(fields[1].rsplit(":", 1)[1], 16))
        except (OSError, StopIteration, IndexError, ValueError):
            continue
    return ports


def _job_port(path: str) -> int | None:
    """deepspeed_allreduce_buffer_<uid>_<addr>_<MASTER_PORT>_<rank> (DeepSpeed's shm.cpp) -> MASTER_PORT."""
    try:
        return int(os.path.basename(path).rsplit("_", 2)[1])
    except (IndexError, ValueError):
        return None


@pytest.fixture(autouse=True)
def _remove_leaked_deepspeed_shm():
    """DeepSpeed's CPU shared-memory all-reduce (0.19) never unlinks its ~69 MB segment per rank, and
    /dev/shm is RAM: hundreds of multi-rank runs in one suite would exhaust the machine. After each
    test, delete the segments of jobs that are over. A job is live while its rank 0 serves the
    TCPStore on MASTER_PORT (part of the segment's name); "no process maps it" alone is not enough:
    a rank creates its segment, fills it with write() (69 MB: seconds on a loaded machine) and maps it
    only then, and the other ranks open it by name in a loop. Deleting it in that window (another xdist
    worker's test just ended) left a 2-rank job spinning forever (seen here under -n 2)."""
    yield
    leaked = glob.glob(SHM_PATTERN)
    if not leaked:
        return
    in_use = _mapped_files()
    listening = _listening_ports()
    for path in leaked:
        if path in in_use or _job_port(path) in listening:
            continue
        try:
            os.unlink(path)
        except OSError:
            pass


# ---- pytest-xdist (`make test` runs two workers) ---------------------------------------------------


def pytest_collection_modifyitems(config, items):
    """The launch tests share one SLURM cluster and its two node slots: one xdist worker runs all of them,
    one after another (`--dist loadgroup`); everything else is spread over the workers."""
    for item in items:
        if item.get_closest_marker("launch"):
            item.add_marker(pytest.mark.xdist_group("launch"))
    if getattr(config.option, "loadgroup", False):  # on an xdist worker of `--dist loadgroup`
        _group_node_ids(items)


def _group_node_ids(items) -> None:
    """Append "@group" to the node id of every xdist_group test: what xdist's scheduler groups by.

    xdist 3.8 does this by setting ``item._nodeid``, which pytest 9 no longer reads (it keeps ``item._id``):
    without this, loadgroup silently spreads a group's tests over the workers (each spawning its own
    gloo world for a result that the group's tests share, and the launch tests racing for the cluster).
    """
    for item in items:
        names = sorted(
            {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")}
        )
        if names and "@" not in item.nodeid.rpartition("]")[2]:  # not already done by xdist
            # here, not at the top: pytest < 9 has no _pytest.nodeid, and there xdist's own suffix is in place
            from _pytest.nodeid import coerce_node_id

            item._id = coerce_node_id(f"{item.nodeid}@{'_'.join(names)}")


def pytest_terminal_summary(terminalreporter):
    """Say which CPU kernels the numbers above came from (also under -q, and in every .ci/run leg)."""
    requested = os.environ.get("ATEN_CPU_CAPABILITY", "unset")
    terminalreporter.write_line(
        f"torch CPU kernels: {torch.backends.cpu.get_cpu_capability()} (ATEN_CPU_CAPABILITY={requested}), "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, torch threads {torch.get_num_threads()}"
    )


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory):
    """A folder shared by all xdist workers of this session (plain pytest: this session's temp root).

    Session fixtures are per worker under xdist; a trained run that several tests only read is built
    once into this folder under a file lock (tests/e2e/conftest.py ``shared_build``), and the other worker reuses it."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # pytest-of-user/pytest-N/ is common to the workers; popen-gwK/ is per worker
    d = root / "shared"
    d.mkdir(exist_ok=True)
    return d


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3-compatible store (SeaweedFS, tests/s3_server.py) on localhost for this session's worker,
    stopped by its pid at the end."""
    from tests.s3_server import start

    server = start(tmp_path_factory.mktemp("weed"))
    try:
        server.make_bucket(server.bucket)
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(s3_server, monkeypatch):
    """``BUCKET/PREFIX``: a fresh folder in the session's one bucket of :func:`s3_server` (SeaweedFS gives every
    bucket its own volumes); this process's s3 clients (botocore) reach the server through the environment,
    as a user's would."""
    import uuid

    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    return f"{s3_server.bucket}/t-{uuid.uuid4().hex[:12]}"
