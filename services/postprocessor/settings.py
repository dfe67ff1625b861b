"""Settings of ``llmesh postprocessor`` (env prefix ``LLMESH_POSTPROCESSOR_``, flags derived)."""

from __future__ import annotations

from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from services.common.settings import ServerSettings
from services.postprocessor.sensitive import FilterMode
from services.tokenizer.settings import default_model_specs


class PostprocessorSettings(ServerSettings):
    """Settings of the postprocessor tier."""

    model_config = SettingsConfigDict(
        env_prefix="LLMESH_POSTPROCESSOR_",
        frozen=True,
        use_attribute_docstrings=True,
        extra="ignore",
        env_nested_delimiter="__",
    )

    port: int = 50062
    """gRPC port of the PostprocessService; 0 picks a free port."""
    models: list[str] = Field(default_factory=list)
    """Models as ``name=dir`` or ``dir`` (named after the directory); the first is the default.
    Empty serves the prepared default model (smollm2-135m-instruct)."""
    default_filter_mode: str = "redact"
    """Output filter for streams whose ProcessConfig leaves filter_mode unspecified:
    off, redact or block."""
    max_stop_strings: int = 16
    """Most stop strings one stream may set."""
    max_stop_chars: int = 256
    """Longest stop string, in characters."""
    max_tokens_per_stream: int = 131_072
    """Most tokens one stream may send (a bound on per-stream memory)."""
    final_drain_seconds: float = 30.0
    """After a stop string or a blocked match sent the final message early, how long to keep
    reading (and ignoring) the caller's messages until it closes its side."""
    error_drain_seconds: float = 1.0
    """After bad input, how long to keep reading the caller's messages before the error
    status ends the call (so a grpc.aio caller that is still writing sees that status)."""

    @field_validator("default_filter_mode")
    @classmethod
    def _known_mode(cls, value: str) -> str:
        allowed = [m.value for m in FilterMode]
        if value not in allowed:
            raise ValueError(f"default_filter_mode must be one of {', '.join(allowed)}, got {value!r}")
        return value

    def model_specs(self) -> list[str]:
        return list(self.models) or default_model_specs()
