"""A user-space lossy link: TUN devices bridged by a forwarder process that delays, drops,
reorders, duplicates and rate-limits real IP packets (this kernel has no `sch_netem`).

    python tools/lossylink.py measure [--json out.json]   # the forwarder's own figures
    python tools/lossylink.py serve                       # the forwarder (LossyLink starts it)

A link has ports: each is a TUN device in a network namespace (or the caller's), with addresses,
routes that send traffic into it, and the address prefixes it owns. The forwarder reads a packet
from one port, sends it to the port that owns its IPv4 destination (longest prefix), and applies
the seeded schedule of tools/lossylink_core.py to packets leaving or entering the one *lossy*
port (`up`: read from it, `down`: written to it; each direction its own random stream). With
two ports it is a point-to-point link; with more it is a small router, so a client namespace can
reach several segment namespaces over one impaired link without IP forwarding in the host.
Non-IPv4 packets and packets no port owns are dropped and counted.

TUN devices are not persistent: they vanish when the forwarder exits (even SIGKILLed), and the
routes through them with them. `LossyLink` (a context manager) starts the forwarder, changes its
schedule while it runs (`set_schedule`), reads its counters (`stats`) and stops it; namespaces it
was asked to create (`netns_add`) are deleted by the caller (`netns_del`, in `finally`).
`leftovers(tag)` lists any device or namespace whose name carries a link's tag.

Control protocol (the forwarder's stdin/stdout, JSON lines): the first line is the spec; then
`{"op": "schedule", "up": {...}, "down": {...}}`, `{"op": "stats"}`, `{"op": "stop"}`; each is
answered with one line. EOF on stdin stops it too (its parent is gone).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import fcntl
import ipaddress
import json
import os
import secrets
import select
import selectors
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lossylink_core import (  # type: ignore[import-not-found]
    LinkDirection,
    LinkQueue,
    LinkSchedule,
)

READY_TIMEOUT_S: Final = 10.0
STOP_TIMEOUT_S: Final = 5.0
CONTROL_TIMEOUT_S: Final = 5.0
READ_BATCH_MAX: Final = 256  # packets read from one device per wake (the others get their turn)
WRITE_BATCH_MAX: Final = 1024  # due packets written per turn of the loop
PACKET_BYTES_MAX: Final = 65_536
IDLE_WAIT_S: Final = 1.0
TXQUEUELEN: Final = 1000  # packets the kernel queues for the forwarder per device before dropping
MTU_DEFAULT: Final = 1500

TUNSETIFF: Final = 0x400454CA
IFF_TUN: Final = 0x0001
IFF_NO_PI: Final = 0x1000
CLONE_NEWNET: Final = 0x40000000
SO_RCVBUFFORCE: Final = 33
_libc = ctypes.CDLL(None, use_errno=True)


# --- namespaces -------------------------------------------------------------------------------


def setns_net(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


@contextlib.contextmanager
def in_netns(name: str | None) -> Iterator[None]:
    """Run the block with the calling thread in network namespace `name` (None: where it is).
    Sockets and threads created inside stay there; the thread comes back afterwards."""
    if name is None:
        yield
        return
    with open("/proc/thread-self/ns/net") as own, open(f"/run/netns/{name}") as target:
        setns_net(target.fileno())
        try:
            yield
        finally:
            setns_net(own.fileno())


def netns_add(name: str) -> None:
    subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
    subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True, capture_output=True)


def netns_del(name: str) -> None:
    subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)


def new_tag() -> str:
    """6 hex digits naming one link's devices (`kl<tag><port>`) and namespaces."""
    return secrets.token_hex(3)


def leftovers(tag: str) -> list[str]:
    """Devices (host and every namespace) and namespaces whose name carries `tag`."""
    found = []
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    found += [f"netns {n}" for n in names if tag in n]
    for ns in [None, *[n for n in names if not n.startswith("(")]]:
        argv = ["ip", "-o", "link"] if ns is None else ["ip", "-n", ns, "-o", "link"]
        out = subprocess.run(argv, capture_output=True, text=True).stdout
        found += [
            f"device {line.split(':')[1].strip()} in {ns or 'host'}"
            for line in out.splitlines()
            if tag in line
        ]
    return found


# --- the link, as its caller sees it -----------------------------------------------------------


@dataclass(slots=True)
class Port:
    """One TUN device of a link: where it lives, its addresses (CIDR), the routes that send
    traffic into it (destination, source address to use or None), and what it owns (CIDR:
    packets to these addresses leave through it)."""

    name: str
    netns: str | None
    owns: list[str]
    addrs: list[str] = field(default_factory=list)
    routes: list[tuple[str, str | None]] = field(default_factory=list)
    lossy: bool = False


class LossyLink:
    """A running forwarder (module docstring). Use as a context manager."""

    def __init__(
        self,
        ports: list[Port],
        *,
        schedule: LinkSchedule | None = None,
        seed: str = "1",
        mtu: int = MTU_DEFAULT,
        txqueuelen: int = TXQUEUELEN,
        tag: str | None = None,
    ) -> None:
        if sum(p.lossy for p in ports) > 1:
            raise ValueError("a link has at most one lossy port")
        self.tag = tag or new_tag()
        self.ports = ports
        self.ifnames = {p.name: f"kl{self.tag}{i}" for i, p in enumerate(ports)}
        self.spec = {
            "tag": self.tag,
            "seed": seed,
            "mtu": mtu,
            "txqueuelen": txqueuelen,
            "ports": [dict(asdict(p), ifname=self.ifnames[p.name]) for p in ports],
            "schedule": (schedule or LinkSchedule()).to_dict(),
        }
        self.proc: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()

    def __enter__(self) -> LossyLink:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            reply = self._ask(self.spec, READY_TIMEOUT_S)
        except Exception:
            self.close()
            raise
        if not reply.get("ready"):
            self.close()
            raise RuntimeError(f"lossy link did not start: {reply}")

    def _ask(self, message: dict[str, Any], timeout_s: float = CONTROL_TIMEOUT_S) -> dict[str, Any]:
        proc = self.proc
        if proc is None or proc.stdin is None or proc.stdout is None:
            raise RuntimeError("lossy link not started")
        with self._lock:
            proc.stdin.write(json.dumps(message) + "\n")
            proc.stdin.flush()
            ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
            line = proc.stdout.readline() if ready else ""
        if not line:
            err = ""
            if proc.poll() is not None and proc.stderr is not None:
                err = proc.stderr.read()[-2000:]
            raise RuntimeError(f"lossy link forwarder did not answer {message.get('op', 'spec')}: {err}")
        answer: dict[str, Any] = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"lossy link forwarder: {answer['error']}")
        return answer

    def set_schedule(self, up: LinkSchedule, down: LinkSchedule | None = None) -> None:
        """`up`: packets read from the lossy port; `down`: written to it (default: the same)."""
        self._ask({"op": "schedule", "up": up.to_dict(), "down": (down or up).to_dict()})

    def stats(self) -> dict[str, Any]:
        return self._ask({"op": "stats"})

    def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError, ValueError):
            assert proc.stdin is not None
            proc.stdin.write(json.dumps({"op": "stop"}) + "\n")
            proc.stdin.close()
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_TIMEOUT_S)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def segment_ports(link: dict[str, str]) -> list[Port]:
    """A localcluster segment namespace (`netns_link`: ns, host_ip, ns_ip) joined through the
    link instead of its veth pair: /32 routes on both sides win over the veth's /24, so traffic
    (established connections too: the addresses stay) moves onto the link; the segment's side is
    the lossy port. The veth stays up, unused, and carries the traffic again once the link stops."""
    host_ip, ns_ip = link["host_ip"], link["ns_ip"]
    return [
        Port("host", None, owns=[f"{host_ip}/32"], routes=[(f"{ns_ip}/32", host_ip)]),
        Port("segment", link["ns"], owns=[f"{ns_ip}/32"], routes=[(f"{host_ip}/32", ns_ip)], lossy=True),
    ]


def client_ports(ns: str, subnet: int, segment_links: list[dict[str, str]]) -> tuple[list[Port], str]:
    """A client namespace `ns` reaching the host (address 10.232.<subnet>.1, where nats-server
    listens on every interface) and every segment namespace of `segment_links` through one link
    whose client side is lossy. Returns the ports and the host address the client dials."""
    client_ip, host_ip = f"10.232.{subnet}.2", f"10.232.{subnet}.1"
    seg_ips = [s["ns_ip"] for s in segment_links]
    ports = [
        Port(
            "client",
            ns,
            owns=[f"{client_ip}/32"],
            addrs=[f"{client_ip}/32"],
            routes=[(f"{ip}/32", client_ip) for ip in [host_ip, *seg_ips]],
            lossy=True,
        ),
        Port(
            "host",
            None,
            owns=[f"{host_ip}/32"],
            addrs=[f"{host_ip}/32"],
            routes=[(f"{client_ip}/32", host_ip)],
        ),
    ]
    for i, s in enumerate(segment_links):
        ports.append(
            Port(f"seg{i}", s["ns"], owns=[f"{s['ns_ip']}/32"], routes=[(f"{client_ip}/32", s["ns_ip"])])
        )
    return ports, host_ip


# --- the forwarder -----------------------------------------------------------------------------


def open_tun(ifname: str, netns: str | None) -> int:
    """A non-persistent TUN device (IFF_TUN, no packet info) created in `netns`: it lives as long
    as the returned descriptor."""
    with in_netns(netns):
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", ifname.encode(), IFF_TUN | IFF_NO_PI))
        except OSError:
            os.close(fd)
            raise
    return fd


def ip(netns: str | None, *args: str) -> None:
    argv = ["ip", *(["-n", netns] if netns else []), *args]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")


def configure(port: dict[str, Any], mtu: int, txqueuelen: int) -> None:
    ns, ifname = port["netns"], port["ifname"]
    ip(ns, "link", "set", "dev", ifname, "mtu", str(mtu), "txqueuelen", str(txqueuelen), "up")
    for addr in port["addrs"]:
        ip(ns, "addr", "add", addr, "dev", ifname)
    for dst, src in port["routes"]:
        ip(ns, "route", "add", dst, "dev", ifname, *(["src", src] if src else []))


class Router:
    """Longest-prefix match of an IPv4 destination to a port index (cached per address)."""

    def __init__(self, owns: list[list[str]]) -> None:
        table = []
        for port, prefixes in enumerate(owns):
            for prefix in prefixes:
                net = ipaddress.IPv4Network(prefix)
                table.append((net.prefixlen, int(net.network_address), int(net.netmask), port))
        self.table = sorted(table, reverse=True)
        self.cache: dict[bytes, int | None] = {}

    def port_of(self, dst: bytes) -> int | None:
        hit = self.cache.get(dst, -1)
        if hit != -1:
            return hit
        addr = int.from_bytes(dst, "big")
        port = next((p for _, net, mask, p in self.table if addr & mask == net), None)
        if len(self.cache) < 4096:
            self.cache[dst] = port
        return port


def serve() -> int:
    """The forwarder process (module docstring): spec on the first stdin line, then control."""
    spec = json.loads(sys.stdin.readline())
    ports = spec["ports"]
    fds: list[int] = []
    try:
        for p in ports:
            fds.append(open_tun(p["ifname"], p["netns"]))
        for p in ports:
            configure(p, int(spec["mtu"]), int(spec["txqueuelen"]))
    except Exception as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        return 1
    lossy = next((i for i, p in enumerate(ports) if p["lossy"]), None)
    schedule = LinkSchedule.from_dict(spec["schedule"])
    up = LinkDirection(schedule, f"{spec['seed']}:up")
    down = LinkDirection(schedule, f"{spec['seed']}:down")
    router = Router([p["owns"] for p in ports])
    queue = LinkQueue()
    forwarded = [0] * len(ports)  # packets written to each port
    counts = {"no_route": 0, "not_ipv4": 0, "write_errors": 0, "looped": 0}
    sel = selectors.DefaultSelector()
    for i, fd in enumerate(fds):
        sel.register(fd, selectors.EVENT_READ, i)
    stdin_fd = sys.stdin.fileno()
    os.set_blocking(stdin_fd, False)
    sel.register(stdin_fd, selectors.EVENT_READ, -1)
    print(json.dumps({"ready": True, "ifnames": [p["ifname"] for p in ports]}), flush=True)
    control = b""

    def write(port: int, packet: bytes) -> None:
        try:
            os.write(fds[port], packet)
            forwarded[port] += 1
        except OSError:
            counts["write_errors"] += 1

    def answer(msg: dict[str, Any]) -> bool:
        """Handle one control message; False: stop."""
        op = msg.get("op")
        if op == "stop":
            print(json.dumps({"stopped": True}), flush=True)
            return False
        if op == "schedule":
            try:
                new_up = LinkSchedule.from_dict(msg.get("up", {}))
                new_down = LinkSchedule.from_dict(msg.get("down", msg.get("up", {})))
            except (ValueError, TypeError) as exc:
                print(json.dumps({"error": str(exc)}), flush=True)
                return True
            up.set_schedule(new_up)
            down.set_schedule(new_down)
            print(json.dumps({"ok": True}), flush=True)
            return True
        if op == "stats":
            print(
                json.dumps(
                    dict(
                        counts,
                        forwarded=forwarded,
                        up=asdict(up.stats),
                        down=asdict(down.stats),
                        in_flight=len(queue),
                        overflow_dropped=queue.overflow_dropped,
                    )
                ),
                flush=True,
            )
            return True
        print(json.dumps({"error": f"unknown op {op!r}"}), flush=True)
        return True

    while True:
        now_ms = time.monotonic() * 1000.0
        nxt = queue.next_release_ms()
        timeout_s = IDLE_WAIT_S if nxt is None else max(0.0, (nxt - now_ms) / 1000.0)
        for key, _ in sel.select(timeout_s):
            src = key.data
            if src == -1:
                chunk = os.read(stdin_fd, 65_536)
                if not chunk:
                    return 0  # the parent is gone
                control += chunk
                while b"\n" in control:
                    line, control = control.split(b"\n", 1)
                    if line.strip() and not answer(json.loads(line)):
                        return 0
                continue
            for _ in range(READ_BATCH_MAX):
                try:
                    packet = os.read(key.fd, PACKET_BYTES_MAX)
                except BlockingIOError:
                    break
                except OSError as exc:
                    if exc.errno == errno.EINTR:
                        continue
                    raise
                if len(packet) < 20 or packet[0] >> 4 != 4:
                    counts["not_ipv4"] += 1
                    continue
                out = router.port_of(packet[16:20])
                if out is None:
                    counts["no_route"] += 1
                    continue
                if out == src:
                    counts["looped"] += 1
                    continue
                direction = up if src == lossy else down if out == lossy else None
                if direction is None:
                    write(out, packet)
                    continue
                now_ms = time.monotonic() * 1000.0
                for release_ms in direction.offer(len(packet), now_ms):
                    if release_ms <= now_ms and not len(queue):
                        write(out, packet)  # nothing ahead of it: no detour through the queue
                    else:
                        queue.push(release_ms, out, packet)
        for port, packet in queue.pop_due(time.monotonic() * 1000.0, WRITE_BATCH_MAX):
            write(port, packet)


# --- measurement (python tools/lossylink.py measure; tests) ------------------------------------


@dataclass(slots=True)
class Blast:
    sent: int
    received: int  # distinct sequence numbers that arrived
    duplicates: int
    reordered: int  # arrivals with a sequence number below one seen before
    elapsed_s: float  # first send to last arrival

    @property
    def loss_p(self) -> float:
        return 1.0 - self.received / self.sent if self.sent else 0.0


def udp_blast(
    src_ns: str | None,
    dst_ns: str | None,
    dst_ip: str,
    count: int,
    size: int = 200,
    pps: float = 0.0,
    port: int = 47_001,
    linger_s: float = 1.0,
) -> Blast:
    """Send `count` numbered UDP datagrams of `size` bytes from `src_ns` to `dst_ip` in `dst_ns`
    (`pps` 0: as fast as possible) and count what arrives, until `linger_s` without a packet."""
    with in_netns(dst_ns):
        rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 32 << 20)  # root: past rmem_max, no socket drops
    rx.bind((dst_ip, port))
    rx.settimeout(linger_s)
    seen: set[int] = set()
    dups = reordered = 0
    last_arrival = 0.0
    highest = -1

    def receive() -> None:
        nonlocal dups, reordered, last_arrival, highest
        while True:
            try:
                data = rx.recv(PACKET_BYTES_MAX)
            except TimeoutError:
                return
            seq = int.from_bytes(data[:8], "big")
            last_arrival = time.monotonic()
            if seq in seen:
                dups += 1
            seen.add(seq)
            if seq < highest:
                reordered += 1
            highest = max(highest, seq)

    receiver = threading.Thread(target=receive)
    receiver.start()
    with in_netns(src_ns):
        tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    pad = b"\0" * max(0, size - 8)
    started = time.monotonic()
    for seq in range(count):
        if pps:
            wait_s = started + seq / pps - time.monotonic()
            if wait_s > 0:
                time.sleep(wait_s)
        while True:
            try:
                tx.sendto(seq.to_bytes(8, "big") + pad, (dst_ip, port))
                break
            except OSError as exc:  # ENOBUFS: the device queue is full, wait a little
                if exc.errno != errno.ENOBUFS:
                    raise
                time.sleep(0.0005)
    receiver.join()
    tx.close()
    rx.close()
    return Blast(count, len(seen), dups, reordered, max(0.0, last_arrival - started))


def udp_rtt_ms(
    src_ns: str | None,
    dst_ns: str | None,
    dst_ip: str,
    count: int,
    port: int = 47_002,
    timeout_s: float = 2.0,
) -> list[float]:
    """Round trips (ms) of `count` UDP pings from `src_ns` to an echo in `dst_ns`, one at a time
    (lost ones are left out)."""
    with in_netns(dst_ns):
        echo = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    echo.bind((dst_ip, port))
    echo.settimeout(timeout_s)

    def serve_echo() -> None:
        with contextlib.suppress(TimeoutError, OSError):
            while True:
                data, peer = echo.recvfrom(2048)
                if data == b"stop":
                    return
                echo.sendto(data, peer)

    t = threading.Thread(target=serve_echo)
    t.start()
    with in_netns(src_ns):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(timeout_s)
    rtts = []
    for i in range(count):
        t0 = time.perf_counter()
        s.sendto(i.to_bytes(8, "big"), (dst_ip, port))
        try:
            while int.from_bytes(s.recv(2048)[:8], "big") != i:
                pass
        except TimeoutError:
            continue
        rtts.append((time.perf_counter() - t0) * 1000.0)
    s.sendto(b"stop", (dst_ip, port))
    t.join()
    s.close()
    echo.close()
    return rtts


def tcp_bulk_mbit_per_s(
    src_ns: str | None, dst_ns: str | None, dst_ip: str, nbytes: int, port: int = 47_003
) -> float:
    """One TCP connection from `src_ns` sending `nbytes` to `dst_ip` in `dst_ns`: Mbit/s, from
    connect to the last byte received."""
    with in_netns(dst_ns):
        server = socket.create_server((dst_ip, port))
    got = 0

    def receive() -> None:
        nonlocal got
        conn, _ = server.accept()
        with conn:
            while chunk := conn.recv(1 << 18):
                got += len(chunk)

    t = threading.Thread(target=receive)
    t.start()
    block = b"x" * (1 << 18)
    t0 = time.perf_counter()
    with in_netns(src_ns):
        client = socket.create_connection((dst_ip, port), timeout=30)
    for _ in range(nbytes // len(block)):
        client.sendall(block)
    client.close()
    t.join(60)
    elapsed_s = time.perf_counter() - t0
    server.close()
    return round(got * 8 / elapsed_s / 1e6, 1)


def pair_ports(ns_a: str, ns_b: str, ip_a: str, ip_b: str) -> list[Port]:
    """Two namespaces joined point to point; b's side is lossy."""
    return [
        Port("a", ns_a, owns=[f"{ip_a}/32"], addrs=[f"{ip_a}/32"], routes=[(f"{ip_b}/32", ip_a)]),
        Port("b", ns_b, owns=[f"{ip_b}/32"], addrs=[f"{ip_b}/32"], routes=[(f"{ip_a}/32", ip_b)], lossy=True),
    ]


def veth_pair(ns_a: str, ns_b: str, ip_a: str, ip_b: str, tag: str) -> None:
    """The kernel's own link between the two namespaces (the baseline for added latency)."""
    a, b = f"kv{tag}a", f"kv{tag}b"
    for argv in (
        ["ip", "link", "add", a, "netns", ns_a, "type", "veth", "peer", "name", b, "netns", ns_b],
        ["ip", "-n", ns_a, "addr", "add", f"{ip_a}/24", "dev", a],
        ["ip", "-n", ns_b, "addr", "add", f"{ip_b}/24", "dev", b],
        ["ip", "-n", ns_a, "link", "set", a, "up"],
        ["ip", "-n", ns_b, "link", "set", b, "up"],
    ):
        subprocess.run(argv, check=True, capture_output=True)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def measure(packets: int) -> dict[str, Any]:
    """The forwarder's own figures between two fresh namespaces: ceiling (packets/s forwarded
    with nothing configured, 64 and 1400 bytes), added round-trip latency at 0 delay against a
    veth pair, a 50 ms delay seen by pings, and measured vs configured loss (independent and
    bursty)."""
    tag = new_tag()
    ns_a, ns_b = f"kll-{tag}-a", f"kll-{tag}-b"
    out: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "packets": packets, "cpus": os.cpu_count()}
    try:
        netns_add(ns_a)
        netns_add(ns_b)
        veth_pair(ns_a, ns_b, "10.234.0.1", "10.234.0.2", tag)
        out["veth_rtt_ms"] = rtt_summary(udp_rtt_ms(ns_a, ns_b, "10.234.0.2", 2000))
        out["veth_tcp_mbit_per_s"] = tcp_bulk_mbit_per_s(ns_a, ns_b, "10.234.0.2", 256 << 20)
        ports = pair_ports(ns_a, ns_b, "10.233.0.1", "10.233.0.2")
        with LossyLink(ports, tag=tag, txqueuelen=10_000) as link:
            out["link_rtt_ms"] = rtt_summary(udp_rtt_ms(ns_a, ns_b, "10.233.0.2", 2000))
            out["added_rtt_ms_p50"] = round(out["link_rtt_ms"]["p50"] - out["veth_rtt_ms"]["p50"], 3)
            out["link_tcp_mbit_per_s"] = tcp_bulk_mbit_per_s(ns_a, ns_b, "10.233.0.2", 64 << 20)
            for size in (64, 1400):
                b = udp_blast(ns_a, ns_b, "10.233.0.2", packets * 5, size=size)
                out[f"ceiling_{size}B"] = {
                    "sent": b.sent,
                    "received": b.received,
                    "packets_per_s": round(b.received / b.elapsed_s) if b.elapsed_s else None,
                    "mbit_per_s": round(b.received * size * 8 / b.elapsed_s / 1e6, 1)
                    if b.elapsed_s
                    else None,
                }
            link.set_schedule(LinkSchedule(delay_ms=50))
            out["delay_50ms_rtt_ms"] = rtt_summary(udp_rtt_ms(ns_a, ns_b, "10.233.0.2", 50))
            for name, sched in (
                ("loss_5pct", LinkSchedule(loss_p=0.05)),
                (
                    "bursty_5pct_burst4",
                    LinkSchedule.from_dict({"bursty": {"loss_p": 0.05, "burst_packets": 4}}),
                ),
            ):
                link.set_schedule(LinkSchedule(), sched)  # lossy toward b only (down: into the lossy port)
                before = link.stats()
                b = udp_blast(ns_a, ns_b, "10.233.0.2", packets, pps=5_000, port=47_010)
                after = link.stats()
                offered = after["down"]["offered"] - before["down"]["offered"]
                out[name] = {
                    "configured": 0.05,
                    "sent": b.sent,
                    "received": b.received,
                    "measured_end_to_end": round(b.loss_p, 4),
                    "measured_by_forwarder": round(
                        (after["down"]["lost"] - before["down"]["lost"]) / offered, 4
                    ),
                }
    finally:
        netns_del(ns_a)
        netns_del(ns_b)
    out["leftovers"] = leftovers(tag)
    return out


def rtt_summary(rtts: list[float]) -> dict[str, float]:
    return {
        "n": len(rtts),
        "p50": round(statistics.median(rtts), 3),
        "p99": round(pct(rtts, 0.99), 3),
        "mean": round(statistics.fmean(rtts), 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("command", choices=["serve", "measure"])
    parser.add_argument("--packets", type=int, default=20_000, help="measure: datagrams per loss run")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.command == "serve":
        return serve()
    result = measure(args.packets)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0 if not result["leftovers"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
