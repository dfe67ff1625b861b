"""Sampling <-> protobuf messages, driven by the fields of :class:`Sampling`.

The public ``llmesh.v1.SamplingParams`` and the internal ``llmesh.common.v1.EngineSampling``
carry the fields of :class:`~services.common.sampling.Sampling` under the same names
(proto3 ``optional`` for scalars, so unset differs from zero; ``repeated`` for lists),
so each boundary's converter (gateway, worker) reads and writes them here without
naming a field.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar

from google.protobuf.message import Message

from services.common.sampling import FieldSpec, Sampling

M = TypeVar("M", bound=Message)


def sampling_from_message(msg: Message, fields: Iterable[FieldSpec]) -> Sampling:
    """``fields`` of ``msg`` as a :class:`Sampling`: unset scalars stay None; fields not
    listed keep their defaults (unset)."""
    values: dict[str, Any] = {}
    for spec in fields:
        if spec.repeated:
            values[spec.name] = list(getattr(msg, spec.name))
        elif msg.HasField(spec.name):
            values[spec.name] = getattr(msg, spec.name)
    return Sampling(**values)


def sampling_to_message(s: Sampling, msg: M, fields: Iterable[FieldSpec]) -> M:
    """Write the set ``fields`` of ``s`` into ``msg`` and return it."""
    for spec in fields:
        value = getattr(s, spec.name)
        if spec.repeated:
            getattr(msg, spec.name).extend(value)
        elif value is not None:
            setattr(msg, spec.name, value)
    return msg
