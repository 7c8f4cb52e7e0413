"""A full disk under the JetStream store, for `make chaos` (issue 27).

A drill puts nats-server's store folder (`<run>/nats`, `-sd`) on a small tmpfs of its own:

    [topology]
    nats_store_bytes = 67108864

mounted before the cluster comes up. The fault `fill_store` writes a filler file there until
the file system says ENOSPC (bounded by the mount's size), so every JetStream write fails from
then on (stream appends, KV updates: events, shard leader leases, the segment registry);
`free_store` deletes the filler. `stick_kv` (`bucket`), while the store is full, appends a value
of `STICK_BYTES` under a key of its own to that JetStream KV bucket, so that its store's append
fails and nats-server keeps the error (which store needs a fresh page while the disk is full is
otherwise luck): e.g. the directory's leader-lease bucket. `StoreDisk.close()`, after the
cluster is down (nats-server no longer holds files there), unmounts it and removes what `down`
could not (it cannot remove a mount point); it returns what is left behind (must be nothing).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any, Final

__all__ = ["StoreDisk"]

FILL_BLOCK_BYTES: Final = 1 << 20
FILLER: Final = "kvf-chaos-filler"
STICK_BYTES: Final = 256 << 10
STICK_KEY: Final = "chaos-stick"


def mounted(path: Path) -> bool:
    with open("/proc/self/mounts") as mounts:
        return any(line.split()[1] == str(path) for line in mounts)


class StoreDisk:
    """The JetStream store's tmpfs of one drill (module docstring)."""

    def __init__(self) -> None:
        self.mount: Path | None = None
        self.size_bytes = 0

    def prepare(self, run: Path, topo: dict[str, Any]) -> None:
        size = int(topo.get("nats_store_bytes", 0))
        if not size:
            return
        mount = run / "nats"
        mount.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "kvf-chaos-store", str(mount)],
            check=True,
            capture_output=True,
        )
        self.mount, self.size_bytes = mount, size

    def fire(self, fault: dict[str, Any]) -> str:
        if self.mount is None:
            raise ValueError("no store tmpfs in this drill (topology nats_store_bytes)")
        filler = self.mount / FILLER
        if fault["action"] == "free_store":
            freed = filler.stat().st_size if filler.exists() else 0
            filler.unlink(missing_ok=True)
            return f"store freed ({freed >> 20} MiB filler deleted)"
        written = 0
        block = b"\0" * FILL_BLOCK_BYTES
        with open(filler, "ab", buffering=0) as f:
            while written <= self.size_bytes:  # bounded: the mount cannot hold more
                try:
                    written += f.write(block[: max(4096, min(len(block), self.free_bytes()))]) or 0
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
        return f"store full ({written >> 20} MiB filler, {self.free_bytes()} bytes free)"

    def stick_kv(self, nats_url: str, auth_env: dict[str, str], bucket: str) -> str:
        """`stick_kv`: an append to `bucket` that cannot fit (the store must be full)."""
        import asyncio

        import nats
        import nats.errors

        from kvfabric.cluster.natsauth import nats_auth_from_env

        async def stick() -> str:
            nc = await nats.connect(nats_url, **nats_auth_from_env(auth_env).connect_options())
            try:
                kv = await nc.jetstream(timeout=1.0).key_value(bucket)
                try:
                    await kv.put(STICK_KEY, b"\0" * STICK_BYTES)
                except (TimeoutError, nats.errors.Error) as exc:
                    return f"stick_kv {bucket}: append refused ({type(exc).__name__})"
                return f"stick_kv {bucket}: append taken (the store had room)"
            finally:
                await nc.close()

        return asyncio.run(stick())

    def free_bytes(self) -> int:
        assert self.mount is not None
        st = os.statvfs(self.mount)
        return st.f_bavail * st.f_frsize

    def close(self, run: Path) -> list[str]:
        """After `down`: unmount, remove the run folder's rest. What is left (must be nothing)."""
        if self.mount is None:
            return []
        subprocess.run(["umount", str(self.mount)], check=False, capture_output=True)
        if mounted(self.mount):  # something still holds it: detach it anyway, say so
            subprocess.run(["umount", "-l", str(self.mount)], check=False, capture_output=True)
            left = [f"mount {self.mount} was busy after down (detached lazily)"]
        else:
            left = []
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(run)
        if mounted(self.mount):
            left.append(f"mount {self.mount}")
        self.mount = None
        return left
