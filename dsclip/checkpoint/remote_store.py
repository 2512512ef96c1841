"""--remote-sync's remote folder: ``URL/NAME`` on an fsspec file system (s3 through s3fs), every call bounded.

Its own module so that the background sync (dsclip.checkpoint.remote_sync) and the resume from the remote
(dsclip.checkpoint.remote_resume) share one client set-up. fsspec and its protocol packages are imported
only when a store is opened (``dsclip train --help`` stays light).
"""

from __future__ import annotations

import re
from pathlib import Path

from dsclip.checkpoint.layout import COMPLETE
from dsclip.config_base import ConfigError

CKPT = "checkpoints"
_TAG_RE = re.compile(r"step_\d+")
# every remote call is bounded: a remote that hangs costs the sync thread these, never a training step
CONNECT_TIMEOUT_S, READ_TIMEOUT_S, ATTEMPTS = 5, 30, 2


def reason_of(e: BaseException) -> str:
    """A remote error as the one line that reports it: its first line, at most 200 characters."""
    text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return (text if len(text) <= 200 else text[:197] + "...") or type(e).__name__


class Store:
    """The run's remote folder ``URL/NAME`` on an fsspec file system; paths relative to it, '/'-separated."""

    def __init__(self, fs, root: str, url: str):
        self.fs, self.root, self.url = fs, root.rstrip("/"), url.rstrip("/")

    def path(self, rel: str = "") -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def put(self, local: Path, rel: str) -> None:
        self.fs.put_file(str(local), self.path(rel))

    def write_text(self, rel: str, text: str) -> None:
        self.fs.pipe_file(self.path(rel), text.encode())

    def read_text(self, rel: str) -> str | None:
        try:
            return self.fs.cat_file(self.path(rel)).decode()
        except FileNotFoundError:
            return None

    def exists(self, rel: str) -> bool:
        return self.fs.exists(self.path(rel))

    def rm(self, rel: str) -> None:
        try:
            self.fs.rm(self.path(rel), recursive=True)
        except FileNotFoundError:
            pass

    def files(self, rel: str) -> dict[str, int]:
        """Every file under ``rel``: its path relative to ``rel`` -> size."""
        base = self.path(rel)
        found = self.fs.find(base, detail=True)
        return {p[len(base) + 1 :]: int(info.get("size") or 0) for p, info in found.items() if p != base}

    def complete_tags(self) -> list[str]:
        """Remote tags with ``COMPLETE`` (an upload that finished), oldest first."""
        found = self.fs.glob(self.path(f"{CKPT}/step_*/{COMPLETE}"))
        tags = {p.rstrip("/").split("/")[-2] for p in found}
        return sorted(t for t in tags if _TAG_RE.fullmatch(t))


def _s3_options() -> dict:
    return {
        "skip_instance_cache": True,
        "use_listings_cache": False,
        "config_kwargs": {
            "connect_timeout": CONNECT_TIMEOUT_S,
            "read_timeout": READ_TIMEOUT_S,
            "retries": {"max_attempts": ATTEMPTS, "mode": "standard"},
        },
    }


def open_store(url: str, protocol: str, name: str) -> Store:
    """``URL/NAME`` as a Store. The s3 endpoint and credentials come from the usual places (AWS_* variables,
    ~/.aws, FSSPEC_S3_ENDPOINT_URL / AWS_ENDPOINT_URL for S3-compatible stores). A missing client package is
    one ConfigError line naming it."""
    try:
        import fsspec
    except ImportError:
        raise ConfigError("--remote-sync needs fsspec: pip install dsclip[remote] (fsspec, s3fs)") from None
    full = f"{url.rstrip('/')}/{name}"
    s3 = full.startswith("s3://")
    try:
        fs, root = fsspec.core.url_to_fs(full, **(_s3_options() if s3 else {"skip_instance_cache": True}))
    except ImportError as e:
        raise ConfigError(f"--remote-sync {url}: its fsspec client is not installed ({reason_of(e)})") from None
    except ValueError as e:
        raise ConfigError(f"--remote-sync {url}: {reason_of(e)}") from None
    if s3:
        fs.retries = ATTEMPTS  # s3fs's own retries on top of botocore's (5 by default): bounded too
    if getattr(fs, "auto_mkdir", True) is False:  # a local or mounted folder: parents are made as files are put
        fs.auto_mkdir = True
    return Store(fs, root, full)
