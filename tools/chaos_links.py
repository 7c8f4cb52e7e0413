"""Lossy links for `make chaos` (issue 27): the drill runner's side of tools/lossylink.py.

A drill names its links in `[topology]`:

- `lossy_segments = ["segment-1"]`: each named segment (it must run in its own namespace,
  `netns_segments`) is joined to the host through a lossy link instead of its veth pair (/32
  routes on both sides win over the veth's /24; the addresses stay, so its open connections move
  over). Everything the segment exchanges with the host crosses it: its NATS connection
  (heartbeats, frees), the client's loads and saves, repair's copies.
- `lossy_client = true`: the workload's client runs in a namespace of its own whose one link
  reaches the host (NATS) and every segment namespace (all segments must be in namespaces:
  `netns_segments = segments`); everything the client sends or receives crosses it.

Links are laid after the cluster is up and before the workload, with a clear schedule; the
faults `link` (target `segment-<i>` or `client`, schedule fields as in
tools/lossylink_core.LinkSchedule, optional `up`/`down` tables for one direction each) and
`link_clear` change it mid-traffic. `Links.close()` (in the runner's `finally`) stops every
forwarder (its devices and routes vanish with it), deletes the client namespace, and returns
what it left behind (must be nothing).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lossylink import (  # type: ignore[import-not-found]
    LinkSchedule,
    LossyLink,
    client_ports,
    in_netns,
    leftovers,
    netns_add,
    netns_del,
    new_tag,
    segment_ports,
    setns_net,
)

__all__ = ["Links"]


def schedule_of(fault: dict[str, Any]) -> tuple[LinkSchedule, LinkSchedule]:
    """(up, down) from a `link` fault: its schedule fields apply both ways unless it names
    `up` / `down` tables (up: packets from the impaired side; down: toward it)."""
    both = {k: v for k, v in fault.items() if k not in ("at_s", "action", "target", "up", "down")}
    up = LinkSchedule.from_dict(dict(both, **fault.get("up", {})))
    down = LinkSchedule.from_dict(dict(both, **fault.get("down", {})))
    return up, down


class Links:
    """Every lossy link of one drill."""

    def __init__(self, tag: str | None = None) -> None:
        self.tag = tag or new_tag()
        self.links: dict[str, LossyLink] = {}
        self.client_ns: str | None = None
        self.client_nats_host: str | None = None
        # the client link's addresses: 10.232.<subnet>.1 (host side), .2 (client)
        self.client_subnet = int(hashlib.blake2b(self.tag.encode(), digest_size=1).hexdigest(), 16)
        self._host_ns_fd: int | None = None

    def lay(self, state: dict[str, Any], topo: dict[str, Any], seed: str) -> None:
        """Start the drill's links (module docstring) with a clear schedule."""
        netns: dict[str, dict[str, str]] = state.get("netns") or {}
        for i, target in enumerate(topo.get("lossy_segments", [])):
            if target not in netns:
                raise ValueError(f"lossy segment {target} does not run in its own namespace (netns_segments)")
            link = LossyLink(segment_ports(netns[target]), seed=f"{seed}:{target}", tag=f"{self.tag}{i}")
            link.start()
            self.links[target] = link
        if topo.get("lossy_client", False):
            segments = int(topo.get("segments", 3))
            if len(netns) < segments:
                raise ValueError("lossy_client needs every segment in its own namespace (netns_segments)")
            self.client_ns = f"kvc-{self.tag}"
            netns_add(self.client_ns)
            ports, self.client_nats_host = client_ports(
                self.client_ns, self.client_subnet, [netns[f"segment-{i}"] for i in range(1, segments + 1)]
            )
            link = LossyLink(ports, seed=f"{seed}:client", tag=f"{self.tag}c")
            link.start()
            self.links["client"] = link

    def fire(self, fault: dict[str, Any]) -> str:
        target = fault.get("target", "")
        if target not in self.links:
            raise ValueError(
                f"no lossy link {target!r} in this drill (topology lossy_segments / lossy_client)"
            )
        if fault["action"] == "link_clear":
            self.links[target].set_schedule(LinkSchedule())
            return f"link {target} cleared"
        up, down = schedule_of(fault)
        self.links[target].set_schedule(up, down)
        what = up.describe() if up == down else f"up {up.describe()}; down {down.describe()}"
        return f"link {target}: {what}"

    @contextlib.contextmanager
    def client_side(self) -> Iterator[None]:
        """The calling thread (and every thread and socket it creates meanwhile) in the client's
        namespace, when the drill has one."""
        with open("/proc/thread-self/ns/net") as here:
            self._host_ns_fd = os.dup(here.fileno())
        try:
            with in_netns(self.client_ns):
                yield
        finally:
            os.close(self._host_ns_fd)
            self._host_ns_fd = None

    @contextlib.contextmanager
    def host_side(self) -> Iterator[None]:
        """For a thread started inside `client_side` that must act from the host (fault
        injection): back in the namespace the runner started in."""
        if self._host_ns_fd is None:
            yield
            return
        with open("/proc/thread-self/ns/net") as own:
            setns_net(self._host_ns_fd)
            try:
                yield
            finally:
                setns_net(own.fileno())

    def stats(self) -> dict[str, Any]:
        out = {}
        for target, link in self.links.items():
            with contextlib.suppress(Exception):
                s = link.stats()
                out[target] = {
                    d: {k: s[d][k] for k in ("offered", "lost", "duplicated")} for d in ("up", "down")
                }
        return out

    def close(self) -> list[str]:
        """Stop every forwarder, delete the client namespace; what is left (must be nothing)."""
        for link in self.links.values():
            link.close()
        self.links.clear()
        if self.client_ns is not None:
            netns_del(self.client_ns)
        left: list[str] = leftovers(self.tag)
        return left
