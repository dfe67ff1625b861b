"""FieldViolation, kept apart from :mod:`services.common.errors` so domain modules that
report bad fields (:mod:`services.common.sampling`) import no grpc."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FieldViolation:
    """One bad request field (as ``google.rpc.BadRequest.FieldViolation`` names it)."""

    field: str
    description: str
