"""Forced decode steps for exact resume (vLLM V1 logits processor).

A request resumed after a failure carries the tokens an earlier attempt already
delivered. Re-submitting them as part of the prompt would compute their KV cache in a
prefill, which on vLLM's CPU kernels does not round exactly like the decode steps of the
original run, so a greedy continuation can drift (observed after ~30 tokens on both test
models, bf16 and float32). Instead the worker submits the original prompt and forces
the delivered tokens one decode step at a time: every logit but the forced token is
masked, so the sequence, its KV cache and everything after it are computed exactly as in
an undisturbed run. The forced tokens are not streamed again.

Loaded inside vLLM's engine-core process (registered through ``logits_processors``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

EXTRA_ARG = "llmesh_forced_token_ids"
"""Key in ``SamplingParams.extra_args`` holding the token ids to force, in order."""


def _forcer(forced: list[int]) -> Callable[[list[int], torch.Tensor], torch.Tensor]:
    def apply(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        step = len(output_ids)
        if step < len(forced):
            token = forced[step]
            value = logits[token].clone()
            logits.fill_(float("-inf"))
            # Keep the model's own logit for the forced token (finite, so logprobs stay sane).
            logits[token] = value if torch.isfinite(value) else 0.0
        return logits

    return apply


class ForcedTokensLogitsProcessor(AdapterLogitsProcessor):
    """Forces the first N sampled tokens of requests that ask for it."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams) -> Any:
        extra = params.extra_args or {}
        forced = extra.get(EXTRA_ARG)
        if not forced:
            return None
        return _forcer([int(t) for t in forced])
