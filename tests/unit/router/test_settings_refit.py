"""`KVF_ROUTER_REFIT`: off by default, `on`, or a JSON object of `RefitConfig` fields; anything
else stops the service with a `SettingsError` naming the variable. The state collector shows the
coefficients in use and the refit's state."""

from __future__ import annotations

import json

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvfabric.core.routing import Decision, RefitConfig, RoutingCore
from kvfabric.core.routing_index import RoutingIndex
from kvfabric.router.metrics import StateCollector
from kvfabric.router.settings import load_router_settings
from kvfabric.runtime.config import SettingsError

ENV = {
    "KVF_ROUTER_ENGINES": json.dumps([{"id": "e1", "url": "http://127.0.0.1:1"}]),
    "KVF_ROUTER_KEYSPACE": json.dumps(
        {
            "tenant_id": "t",
            "domain_salt_hex": "00" * 16,
            "model_id": "m",
            "weights_revision": "r",
            "kv_dtype": "float32",
            "attn_config_digest": "a",
            "tensor_layout": "x",
            "tokens_per_chunk": 16,
        }
    ),
    "KVF_ROUTER_COEFFICIENTS": json.dumps({"overhead_s": 0.01, "running_s": 0.002}),
}


def test_refit_off_by_default_on_or_configured() -> None:
    assert load_router_settings(ENV).routing.refit is None
    assert load_router_settings({**ENV, "KVF_ROUTER_REFIT": "off"}).routing.refit is None
    assert load_router_settings({**ENV, "KVF_ROUTER_REFIT": "on"}).routing.refit == RefitConfig()
    got = load_router_settings({**ENV, "KVF_ROUTER_REFIT": '{"window_max": 64, "min_observations": 8}'})
    assert got.routing.refit == RefitConfig(window_max=64, min_observations=8)


@pytest.mark.parametrize("bad", ["yes", "[1]", '{"window_max": 1}', '{"nope": 1}', "{"])
def test_refit_bad_values_name_the_variable(bad: str) -> None:
    with pytest.raises(SettingsError, match="KVF_ROUTER_REFIT"):
        load_router_settings({**ENV, "KVF_ROUTER_REFIT": bad})


def scrape(core: RoutingCore) -> str:
    registry = CollectorRegistry()
    registry.register(StateCollector(core, dict))
    return generate_latest(registry).decode()


def test_metrics_show_coefficients_in_use_and_refit_state() -> None:
    settings = load_router_settings({**ENV, "KVF_ROUTER_REFIT": '{"min_observations": 4, "refit_every": 1}'})
    core = RoutingCore(settings.routing, [e.spec for e in settings.engines], RoutingIndex())
    core.health("e1", True, 0)
    text = scrape(core)
    assert 'kvfabric_router_coefficient{name="overhead_s"} 0.01' in text
    assert 'kvfabric_router_state{name="refit_fitted"} 0.0' in text
    for n in range(6):  # every request: 40 tokens (keyed: unkeyed ones are no observation), 0.3 s
        d = core.route(f"r{n}", "t", [bytes([n + 1]) * 48], 40, n)
        assert isinstance(d, Decision)
        core.first_token(f"r{n}", 0.3, n)
        core.finished(f"r{n}")
    text = scrape(core)
    assert 'kvfabric_router_state{name="refit_fitted"} 1.0' in text
    assert 'kvfabric_router_state{name="refit_observations"} 6.0' in text
    assert 'kvfabric_router_coefficient{name="overhead_s"} 0.01\n' not in text
    estimate = core.route("probe", "t", [bytes([99]) * 48], 40, 7, admit=False)
    assert isinstance(estimate, Decision) and abs(estimate.estimate.ttft_s - 0.3) < 0.01
