"""The startup heap frozen out of the garbage collector, and full collections timed."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from services.common import gcpause
from services.common.metrics import FULL_COLLECTIONS


def _count(tier: str) -> float:
    for metric in FULL_COLLECTIONS.collect():
        for sample in metric.samples:
            if sample.name.endswith("_count") and sample.labels.get("tier") == tier:
                return sample.value
    return 0.0


@pytest.fixture
def unfrozen() -> Iterator[None]:
    """The test process's collector as it was: nothing frozen, no callback left behind."""
    yield
    gc.unfreeze()
    gcpause.unwatch("gc-test")


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_freeze_moves_startup_objects_out_of_collections(unfrozen: None) -> None:
    garbage = _Cycle()
    del garbage  # a cycle: only the collector frees it
    survivor = _Cycle()
    frozen = gcpause.freeze_startup_heap("gc-test", "imports")
    # Frozen objects that die later leave the count (the log line's handlers may free a
    # few an earlier test left behind), so the count now is at most what was frozen.
    assert 0 < gc.get_freeze_count() <= frozen
    # What survived startup is no longer tracked in any generation; the cycle was collected
    # before the freeze, not frozen with the rest.
    assert not any(obj is survivor for obj in gc.get_objects())
    assert not any(type(obj) is _Cycle and obj is not survivor for obj in gc.get_objects())
    # Objects made after the freeze are collected as before.
    later = _Cycle()
    assert any(obj is later for obj in gc.get_objects())


def test_only_full_collections_are_timed(unfrozen: None) -> None:
    gcpause.watch_full_collections("gc-test")
    gcpause.watch_full_collections("gc-test")  # once per process, however often asked
    before = _count("gc-test")
    gc.collect(0)
    gc.collect(1)
    assert _count("gc-test") == before
    gc.collect()
    assert _count("gc-test") == before + 1
    gcpause.unwatch("gc-test")
    gc.collect()
    assert _count("gc-test") == before + 1
