"""`make compose-check`: static checks of compose/ (no docker engine here to run it).

- Every service has an image; every `kvfabric:local` service's image is built by some service
  from a Dockerfile that exists, and its `python -m <module>` is a kvfabric service module that
  exists in this repo and whose package the Dockerfile installs.
- Every bind-mounted file or folder exists; every `depends_on` names a service.
- Segments have unique ids, distinct failure domains, and a data host that is their own service
  name; every kvfabric service gets the cluster secret, the NATS url and the metrics port.
- Prometheus scrapes exactly the kvfabric services, on that metrics port, which each serves on a
  non-loopback address (`KVF_METRICS_HOST`; the runtime's default, 127.0.0.1, is unreachable
  from Prometheus's container).
- Authentication (docs/security.md): a one-shot `auth-init` runs `kvctl auth init` into the
  `auth` volume, nats loads `/auth/nats-auth.conf` only after it completed and opens no HTTP
  monitoring port (it lists users and connections without credentials), and every kvfabric
  service connects as its own `svc-<kind>` user with that user's password file; the directory
  reads the tenant grants file.
- Grafana's provisioning points at the dashboard folder; the dashboard parses and uses only
  metric names documented in docs/metrics.md.
Exit 0 when all hold, else 1 with one line per problem.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from kvfabric.runtime.config import STOP_DEADLINE_MS_DEFAULT

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "compose"
IMAGE = "kvfabric:local"
MODULES = {
    "kvfabric.directory": "services/directory",
    "kvfabric.segment_storage": "services/segment_storage",
    "kvfabric.eviction_policy": "services/eviction_policy",
    "kvfabric.repair": "services/repair",
    "kvfabric.prefetch": "services/prefetch",
}
# The services' own stop deadline (`KVF_STOP_DEADLINE_MS` default): Docker must not kill before it.
STOP_DEADLINE_MS = STOP_DEADLINE_MS_DEFAULT


def documented_metrics() -> set[str]:
    text = (REPO / "docs" / "metrics.md").read_text()
    names = set(re.findall(r"`(kvfabric_[a-z_<>]+)`", text))
    expanded = set()
    for name in names:
        if "<service>" in name:
            expanded |= {
                name.replace("<service>", s)
                for s in ("directory", "segment", "eviction", "repair", "prefetch")
            }
        else:
            expanded.add(name)
    return {n for n in expanded if "<" not in n}


# nats-server's flags that open its HTTP(S) monitoring port (users, subscriptions, byte counters,
# readable without credentials): none may be given (docs/security.md).
NATS_MONITOR_FLAGS = ("-m", "--http_port", "-http_port", "-ms", "--https_port", "-https_port")

USERS = {
    "kvfabric.directory": "svc-directory",
    "kvfabric.segment_storage": "svc-segment",
    "kvfabric.eviction_policy": "svc-eviction",
    "kvfabric.repair": "svc-repair",
    "kvfabric.prefetch": "svc-prefetch",
}


def check_auth(services: dict[str, Any], kvfabric_services: dict[str, Any]) -> list[str]:
    problems = []
    init = services.get("auth-init", {})
    if "kvctl auth init --out /auth" not in " ".join(init.get("command", [])):
        problems.append("auth-init: must run `kvctl auth init --out /auth`")
    nats = services.get("nats", {})
    command = nats.get("command", [])
    if command[:2] != ["-c", "/auth/nats-auth.conf"]:
        problems.append("nats: must load -c /auth/nats-auth.conf")
    condition = (
        (nats.get("depends_on") or {}).get("auth-init", {})
        if isinstance(nats.get("depends_on"), dict)
        else {}
    )
    if condition.get("condition") != "service_completed_successfully":
        problems.append("nats: must wait for auth-init to complete")
    for name, svc in kvfabric_services.items():
        module = (svc.get("command") or ["", "", ""])[2]
        env = svc.get("environment", {})
        user = USERS.get(module)
        if env.get("KVF_NATS_USER") != user or env.get("KVF_NATS_PASSWORD_FILE") != f"/auth/passwords/{user}":
            problems.append(f"{name}: must connect as {user} with /auth/passwords/{user}")
        if not any(str(v).startswith("auth:/auth") for v in svc.get("volumes", [])):
            problems.append(f"{name}: the auth volume is not mounted")
        if (
            module == "kvfabric.directory"
            and env.get("KVF_DIRECTORY_TENANT_GRANTS_FILE") != "/auth/grants.json"
        ):
            problems.append(f"{name}: KVF_DIRECTORY_TENANT_GRANTS_FILE must be /auth/grants.json")
    secrets = {
        str(svc.get("environment", {}).get("KVF_CLUSTER_SECRET", "")) for svc in kvfabric_services.values()
    }
    if not secrets or any(":?" not in secret for secret in secrets):
        problems.append("KVF_CLUSTER_SECRET must be required (${KVF_CLUSTER_SECRET:?...}), never defaulted")
    if any(str(p).split(":")[-1] == "8222" for p in nats.get("ports", [])):
        problems.append("nats: the monitoring port 8222 must not be published")
    monitoring = [a for a in command if str(a).split("=")[0] in NATS_MONITOR_FLAGS]
    if monitoring:
        problems.append(f"nats: the HTTP monitoring port must stay off (no credentials), got {monitoring}")
    return problems


def check(compose: Path = COMPOSE) -> list[str]:
    problems: list[str] = []
    doc: dict[str, Any] = yaml.safe_load((compose / "docker-compose.yml").read_text())
    services: dict[str, Any] = doc.get("services", {})
    dockerfile_text = ""
    builders = [s for s in services.values() if s.get("build") and s.get("image") == IMAGE]
    if not builders:
        problems.append(f"no service builds {IMAGE}")
    for svc in builders:
        build = svc["build"]
        dockerfile = (compose / build.get("context", ".") / build.get("dockerfile", "Dockerfile")).resolve()
        if not dockerfile.exists():
            problems.append(f"Dockerfile {dockerfile} does not exist")
        else:
            dockerfile_text = dockerfile.read_text()
            for src in re.findall(r"^COPY\s+(\S+)", dockerfile_text, flags=re.M):
                if not (REPO / src).exists():
                    problems.append(f"Dockerfile copies {src}, which does not exist")
    kvfabric_services = {
        n: s for n, s in services.items() if s.get("image") == IMAGE and s.get("restart") != "no"
    }
    problems += check_auth(services, kvfabric_services)
    metrics_ports = set()
    for name, svc in services.items():
        if not svc.get("image"):
            problems.append(f"{name}: no image")
        for dep in svc.get("depends_on", []):
            if dep not in services:
                problems.append(f"{name}: depends_on unknown service {dep}")
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith((".", "/")) and not (compose / source).exists():
                problems.append(f"{name}: mounted {source} does not exist")
    segments = []
    for name, svc in kvfabric_services.items():
        command = svc.get("command", [])
        if command[:2] != ["python", "-m"] or len(command) < 3:
            problems.append(f"{name}: command must be python -m <module>, got {command}")
            continue
        module = command[2]
        path = MODULES.get(module)
        if path is None or not (REPO / path / "src" / Path(*module.split("."))).is_dir():
            problems.append(f"{name}: module {module} is not a kvfabric service in this repo")
        elif f"./{path}" not in dockerfile_text:
            problems.append(f"{name}: the Dockerfile does not install {path}")
        env = svc.get("environment", {})
        for var in ("KVF_CLUSTER_SECRET", "KVF_NATS_URL", "KVF_METRICS_PORT"):
            if var not in env:
                problems.append(f"{name}: {var} not set")
        metrics_ports.add(str(env.get("KVF_METRICS_PORT")))
        grace = str(svc.get("stop_grace_period", "10s"))
        if not grace.endswith("s") or not grace[:-1].isdigit() or int(grace[:-1]) * 1000 <= STOP_DEADLINE_MS:
            problems.append(f"{name}: stop_grace_period {grace} must pass the services' stop deadline")
        if env.get("KVF_METRICS_HOST", "127.0.0.1") in ("127.0.0.1", "localhost", "::1"):
            # the runtime's default: reachable from its own container only, not Prometheus's
            problems.append(f"{name}: KVF_METRICS_HOST must not be loopback (Prometheus scrapes it)")
        if module == "kvfabric.segment_storage":
            segments.append((name, env))
    ids = [env.get("KVF_SEGMENT_ID") for _, env in segments]
    if len(set(ids)) != len(ids) or None in ids:
        problems.append(f"segment ids must be set and unique: {ids}")
    domains = [
        (env.get("KVF_SEGMENT_ZONE"), env.get("KVF_SEGMENT_RACK"), env.get("KVF_SEGMENT_HOST"))
        for _, env in segments
    ]
    if len({d[2] for d in domains}) != len(domains):  # one segment per host, at least
        problems.append(f"segments share a failure domain: {domains}")
    for name, env in segments:
        if env.get("KVF_SEGMENT_DATA_HOST") != name:
            problems.append(f"{name}: KVF_SEGMENT_DATA_HOST must be its service name (advertised to clients)")
    if len(metrics_ports) != 1:
        problems.append(f"kvfabric services disagree on KVF_METRICS_PORT: {metrics_ports}")
    port = next(iter(metrics_ports), "")
    prometheus = yaml.safe_load((compose / "prometheus.yml").read_text())
    targets = {
        t for job in prometheus["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]
    }
    expected = {f"{name}:{port}" for name in kvfabric_services}
    if targets != expected:
        problems.append(f"prometheus targets {sorted(targets)} != kvfabric services {sorted(expected)}")
    providers = yaml.safe_load((compose / "grafana/provisioning/dashboards/kvfabric.yml").read_text())
    mounted = {v.split(":")[1] for v in services["grafana"]["volumes"]}
    for provider in providers["providers"]:
        if provider["options"]["path"] not in mounted:
            problems.append(f"grafana provider path {provider['options']['path']} is not mounted")
    documented = documented_metrics()
    for dashboard in (compose / "grafana" / "dashboards").glob("*.json"):
        panels = json.loads(dashboard.read_text())["panels"]
        for panel in panels:
            for target in panel.get("targets", []):
                for metric in re.findall(r"\b(kvfabric_[a-z_]+)", target["expr"]):
                    base = re.sub(r"_(bucket|sum|count)$", "", metric)
                    if metric not in documented and base not in documented:
                        problems.append(
                            f"{dashboard.name} '{panel['title']}': {metric} is not in docs/metrics.md"
                        )
    return problems


def main() -> int:
    problems = check()
    for problem in problems:
        print(f"compose-check: {problem}")
    if not problems:
        print("compose-check: compose file, Dockerfile, Prometheus and Grafana config are consistent")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
