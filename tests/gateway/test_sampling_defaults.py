"""The gateway's sampling defaults, as pure functions (no servers)."""

from __future__ import annotations

from gateway.core import _to_engine_sampling
from gateway.server import build_core
from gateway.settings import GatewaySettings
from gateway.types import GenerateCall, Sampling


def test_unset_temperature_takes_the_default_and_stops_are_left_to_the_postprocessor() -> None:
    call = GenerateCall(prompt="x", sampling=Sampling(stop=["END"]))
    out = _to_engine_sampling(call, 16, 0.0)
    assert out.sampling.temperature == 0.0
    assert out.sampling.max_tokens == 16
    assert out.sampling.stop == []
    assert call.sampling.temperature is None  # the caller's call is not modified


def test_an_explicit_temperature_is_kept() -> None:
    call = GenerateCall(prompt="x", sampling=Sampling(temperature=0.7))
    assert _to_engine_sampling(call, 16, 0.0).sampling.temperature == 0.7


def test_no_default_leaves_temperature_to_the_engine() -> None:
    call = GenerateCall(prompt="x")
    assert _to_engine_sampling(call, 16, None).sampling.temperature is None


async def test_settings_map_a_negative_default_temperature_to_the_engines() -> None:
    for value, expected in ((None, 0.0), (-1.0, None), (0.8, 0.8)):
        settings = GatewaySettings() if value is None else GatewaySettings(default_temperature=value)
        core, tiers, _ = build_core(settings)
        try:
            assert core.config.default_temperature == expected
        finally:
            for tier in tiers:
                await tier.close()
