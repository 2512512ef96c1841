"""Faults a cluster job meets (issue 32), each as a user meets it through the CLI: demo model, few steps."""

from __future__ import annotations

import socket
import subprocess

from tests.e2e.test_train_cli import PY, ROOT, assert_one_error_line, env, run_cli


def _tiny(tmp_path, name, *extra):
    return ["train", "--config", "tiny", "--logs", str(tmp_path), "--name", name, "--max-steps", "2",
            "--save-frequency", "0", *extra]  # fmt: skip


# another run's rank 0, as dsclip's lock looks from outside: an flock on RUN/.lock recording host and PID
HOLD = """import fcntl, os, socket, sys
os.makedirs(sys.argv[1], exist_ok=True)
f = open(os.path.join(sys.argv[1], ".lock"), "w")
fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
f.write(f"host {socket.gethostname()} pid {os.getpid()}"); f.flush()
print("held", flush=True); sys.stdin.read()"""


def test_second_writer_refused_and_dead_holder_is_free(tmp_path):
    """A run folder held by a live run refuses a second one (one line naming host and PID, nothing written);
    once the holder is gone (its lock released by the kernel) the same command runs."""
    run_dir = tmp_path / "twice"
    holder = subprocess.Popen(
        [PY, "-c", HOLD, str(run_dir)],
        cwd=ROOT, env=env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        p = run_cli(_tiny(tmp_path, "twice"), check=False)
        assert p.returncode == 2, p.stderr[-3000:]
        assert_one_error_line(p.stderr, f"pid {holder.pid}")
        assert socket.gethostname() in p.stderr
        assert not (run_dir / "run_config.yaml").exists() and not (run_dir / "metrics.jsonl").exists()
    finally:
        holder.communicate("")  # the holder exits: the kernel drops its lock, the stale record stays
    assert f"pid {holder.pid}" in (run_dir / ".lock").read_text()
    run_cli(_tiny(tmp_path, "twice"))
    assert (run_dir / "run_config.yaml").exists()
    record = (run_dir / ".lock").read_text()
    assert record.startswith(f"host {socket.gethostname()} pid ") and f"pid {holder.pid}" not in record
