"""Settings of ``llmesh tokenizer`` (env prefix ``LLMESH_TOKENIZER_``, flags derived)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from services.common.limits import RequestLimits, RequestLimitSettings
from services.common.settings import ServerSettings


def default_model_specs() -> list[str]:
    """The embedded default model, where ``llmesh model prepare`` puts it."""
    from llmesh.models import DEFAULT_MODEL, model_path

    return [f"{DEFAULT_MODEL}={model_path(DEFAULT_MODEL)}"]


class TokenizerSettings(RequestLimitSettings, ServerSettings):
    """Settings of the tokenizer tier (request limits shared with the gateway)."""

    model_config = SettingsConfigDict(
        env_prefix="LLMESH_TOKENIZER_",
        frozen=True,
        use_attribute_docstrings=True,
        extra="ignore",
        env_nested_delimiter="__",
    )

    port: int = 50061
    """gRPC port of the TokenizerService; 0 picks a free port."""
    models: list[str] = Field(default_factory=list)
    """Models as ``name=dir`` or ``dir`` (named after the directory); the first is the default.
    Empty serves the prepared default model (smollm2-135m-instruct)."""
    max_batch_inputs: int = 64
    """Most inputs one EncodeBatch call may carry."""
    max_request_chars: int = 4_000_000
    """Most characters in all inputs of one EncodeBatch call."""
    encode_threads: int = 2
    """Threads running encode_batch (the Rust tokenizer releases the GIL); about one per core."""
    max_encode_batch: int = 32
    """Most texts encoded in one encode_batch call when requests queue up."""
    inline_encode_max_chars: int = 512
    """A text up to this long that arrives alone, with no encode running, is encoded on the
    event loop (tens of microseconds; up to ~0.3 ms at this length on a loaded 2-core
    machine) instead of on a thread, which saves the hand-off there and back (0.1-0.5 ms of
    time to first token). 0 sends every text to the threads."""

    def limits(self) -> RequestLimits:
        return self.request_limits(max_batch_inputs=self.max_batch_inputs,
                                   max_batch_chars=self.max_request_chars)

    def model_specs(self) -> list[str]:
        return list(self.models) or default_model_specs()
