"""Every tier runs on uvloop unless told otherwise (services/common/eventloop.py)."""

from __future__ import annotations

import asyncio
import logging
import sys

import pytest

from services.common import eventloop


async def _loop_module() -> str:
    await asyncio.sleep(0)
    return type(asyncio.get_running_loop()).__module__


def test_uvloop_is_the_default_and_asyncio_the_option() -> None:
    from services.common.settings import ServerSettings

    assert ServerSettings().event_loop == "uvloop"
    assert eventloop.run(_loop_module(), "uvloop").startswith("uvloop")
    assert eventloop.run(_loop_module(), "asyncio").startswith("asyncio")


def test_without_uvloop_the_process_runs_on_asyncio_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import fails as if not installed
    with caplog.at_level(logging.INFO, logger="services.common.eventloop"):
        assert eventloop.run(_loop_module(), "uvloop").startswith("asyncio")
    assert "uvloop is not installed" in caplog.text and "event loop: asyncio" in caplog.text


def test_an_unknown_event_loop_is_refused_naming_the_setting() -> None:
    from pydantic import ValidationError

    from services.common.settings import ServerSettings

    with pytest.raises(ValidationError, match="event_loop"):
        ServerSettings(event_loop="tokio")  # type: ignore[arg-type]
