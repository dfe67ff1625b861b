"""``llmesh generate`` and ``llmesh chat``: stream answers from the gateway to a terminal.

``llmesh generate "prompt"`` prints the text deltas as they arrive on stdout, then a
one-line summary on stderr (finish reason, tokens, where it ran, time to first token).
``--json`` instead prints the whole completion as one JSON object.

``llmesh chat`` reads lines from stdin and keeps the conversation as chat messages;
``/reset`` starts over, ``/exit`` (or end of input) leaves. It works with piped stdin:
each line is one user turn and each answer is printed on its own line(s).

Exit status: 0 on success, 1 when a call fails (the message names the gRPC status code)
or the answer finished with ``error``, 2 on bad usage, 130 when interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import textwrap
from collections.abc import Sequence
from typing import Any, TextIO

from llmesh.client import (
    DEFAULT_TARGET,
    ChatMessage,
    Client,
    Completion,
    CompletionStream,
    GenerateOptions,
    LlmeshClientError,
)

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

CHAT_COMMANDS = "/exit (or /quit) leaves, /reset starts a new conversation, /help shows this"

EPILOG = """\
exit status: 0 done, 1 the call failed (the gRPC status code is printed) or the answer
finished with 'error', 2 bad usage, 130 interrupted (the generation is cancelled).

examples:
  llmesh generate --chat "What is the capital of France?" --max-tokens 32
  echo "Once upon a time" | llmesh generate --temperature 0.7 --json
  LLMESH_API_KEY=... llmesh chat --target gw:50051 --ca ca.pem --cert client.pem --key client-key.pem
"""


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(name) or default


def build_parser(mode: str) -> argparse.ArgumentParser:
    if mode == "generate":
        parser = argparse.ArgumentParser(
            prog="llmesh generate",
            description=textwrap.fill(
                "Send one prompt to the llmesh gateway and stream the answer to stdout; a summary "
                "line (finish reason, tokens, worker, time to first token) goes to stderr."
            ),
            epilog=EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        parser.add_argument(
            "prompt",
            nargs="?",
            default=None,
            help="the prompt; omitted or '-' reads it from stdin",
        )
        parser.add_argument(
            "--chat",
            action="store_true",
            help="send the prompt as a user chat message (the model's chat template applies) "
            "instead of raw text",
        )
        parser.add_argument(
            "--json",
            action="store_true",
            help="do not stream: print the whole completion as one JSON object on stdout",
        )
    else:
        parser = argparse.ArgumentParser(
            prog="llmesh chat",
            description=textwrap.fill(
                "Interactive chat with the llmesh gateway. Each line read from stdin is a user "
                f"turn; {CHAT_COMMANDS}. Works with piped stdin (stops at the first error)."
            ),
            epilog=EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    parser.add_argument("--system", default=None, help="system message that opens the conversation")

    sampling = parser.add_argument_group("sampling")
    sampling.add_argument("--model", default="", help="model id (default: the gateway's default model)")
    sampling.add_argument("--max-tokens", type=int, default=None, help="most tokens to generate")
    sampling.add_argument("--temperature", type=float, default=None, help="0 is greedy")
    sampling.add_argument("--top-p", type=float, default=None)
    sampling.add_argument("--top-k", type=int, default=None)
    sampling.add_argument("--seed", type=int, default=None)
    sampling.add_argument(
        "--stop", action="append", default=None, metavar="TEXT", help="stop string (repeatable)"
    )
    sampling.add_argument("--priority", type=int, default=0, help="higher is admitted first under load")
    sampling.add_argument("--request-id", default="", help="client-chosen request id (echoed back)")

    conn = parser.add_argument_group("connection")
    conn.add_argument(
        "--target",
        default=_env("LLMESH_TARGET", DEFAULT_TARGET),
        help=f"gateway address host:port (env LLMESH_TARGET, default {DEFAULT_TARGET})",
    )
    conn.add_argument(
        "--api-key",
        default=_env("LLMESH_API_KEY"),
        help="API key sent as 'authorization: Bearer <key>' (env LLMESH_API_KEY, which keeps it out of ps)",
    )
    conn.add_argument(
        "--ca",
        default=_env("LLMESH_CA"),
        help="CA file (PEM): use TLS and verify the gateway (env LLMESH_CA)",
    )
    conn.add_argument(
        "--cert",
        default=_env("LLMESH_CERT"),
        help="client certificate (PEM) for mutual TLS (env LLMESH_CERT)",
    )
    conn.add_argument(
        "--key", default=_env("LLMESH_KEY"), help="client private key (PEM) for mutual TLS (env LLMESH_KEY)"
    )
    conn.add_argument(
        "--server-name", default=None, help="name expected in the gateway's certificate, if not the host"
    )
    conn.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="deadline of each answer in seconds (default 300; 0 = none)",
    )
    conn.add_argument(
        "--max-attempts",
        type=int,
        default=3,
        help="attempts for calls failing with UNAVAILABLE before any answer (default 3; 1 = no retry)",
    )
    summary_default = mode == "generate"
    parser.add_argument(
        "--summary",
        action=argparse.BooleanOptionalAction,
        default=summary_default,
        help=f"print the summary line on stderr (default: {'on' if summary_default else 'off'})",
    )
    return parser


def _options(args: argparse.Namespace) -> GenerateOptions:
    options: GenerateOptions = {}
    if args.max_tokens is not None:
        options["max_tokens"] = args.max_tokens
    if args.temperature is not None:
        options["temperature"] = args.temperature
    if args.top_p is not None:
        options["top_p"] = args.top_p
    if args.top_k is not None:
        options["top_k"] = args.top_k
    if args.seed is not None:
        options["seed"] = args.seed
    if args.stop:
        options["stop"] = list(args.stop)
    if args.priority:
        options["priority"] = args.priority
    if args.request_id:
        options["request_id"] = args.request_id
    return options


def summary_line(done: Completion) -> str:
    """One line for stderr: finish reason, tokens, where it ran, timing."""
    parts = [f"finish={done.finish_reason or 'unspecified'}"]
    if done.matched_stop:
        parts.append(f"stop={done.matched_stop!r}")
    usage = done.usage
    tokens = f"tokens={usage.prompt_tokens}+{usage.completion_tokens}"
    if usage.cached_tokens:
        tokens += f" (cached {usage.cached_tokens})"
    parts.append(tokens)
    served = done.served_by
    if served.worker_id or served.zone:
        where = served.worker_id or "?"
        detail = [d for d in (served.zone, served.device) if d]
        if served.degraded:
            detail.append("degraded")
        if served.resumed:
            detail.append(f"resumed {served.resumed}x")
        parts.append(f"served_by={where}" + (f" ({', '.join(detail)})" if detail else ""))
    parts.append(f"ttft={done.timing.ttft_ms:.0f}ms")
    parts.append(f"total={done.timing.total_ms:.0f}ms")
    if done.request_id:
        parts.append(f"request_id={done.request_id}")
    return "[" + " ".join(parts) + "]"


def format_error(err: LlmeshClientError) -> str:
    """``error: CODE: message`` plus one line per field violation and the retry hint."""
    lines = [f"error: {err.code.name}: {err.message}"]
    lines += [f"  field {v.field}: {v.description}" for v in err.field_violations]
    if err.retry_delay is not None:
        lines.append(f"  retry after {err.retry_delay:g} s")
    return "\n".join(lines)


def _client(args: argparse.Namespace) -> Client:
    return Client(
        args.target,
        api_key=args.api_key or None,
        ca=args.ca or None,
        cert=args.cert or None,
        key=args.key or None,
        server_name=args.server_name,
        timeout=args.timeout if args.timeout and args.timeout > 0 else None,
        max_attempts=args.max_attempts,
    )


def _stream_to(out: TextIO, stream: CompletionStream) -> Completion:
    for delta in stream:
        out.write(delta)
        out.flush()
    return stream.final


def _exit_for(done: Completion) -> int:
    return EXIT_FAILED if done.finish_reason == "error" else EXIT_OK


def run_generate(args: argparse.Namespace, client: Client) -> int:
    prompt = args.prompt
    if prompt is None or prompt == "-":
        prompt = sys.stdin.read().rstrip("\r\n")  # `echo text |` adds a newline nobody typed
    if not prompt.strip():
        print("llmesh generate: error: empty prompt", file=sys.stderr)
        return EXIT_USAGE
    messages: list[ChatMessage] | None = None
    if args.chat or args.system is not None:
        messages = [ChatMessage("system", args.system)] if args.system is not None else []
        messages.append(ChatMessage("user", prompt))
        prompt = None
    options = _options(args)
    if args.json:
        done = client.generate(prompt, messages=messages, model=args.model, **options)
        print(json.dumps(done.to_dict(), ensure_ascii=False))
        if args.summary:
            print(summary_line(done), file=sys.stderr)
        return _exit_for(done)
    stream = client.stream(prompt, messages=messages, model=args.model, **options)
    try:
        done = _stream_to(sys.stdout, stream)
    except LlmeshClientError:
        if stream.text:
            sys.stdout.write("\n")  # end the partial answer so the error starts its own line
            sys.stdout.flush()
        raise
    finally:
        stream.cancel()  # no-op once finished; stops the generation on Ctrl-C or errors
    sys.stdout.write("\n")
    sys.stdout.flush()
    if args.summary:
        print(summary_line(done), file=sys.stderr)
    return _exit_for(done)


def _read_turn(interactive: bool) -> str | None:
    """One line of user input without its newline; None at end of input."""
    if interactive:
        try:
            return input("> ")
        except EOFError:
            return None
    line = sys.stdin.readline()
    return line.rstrip("\r\n") if line else None


def run_chat(args: argparse.Namespace, client: Client) -> int:
    interactive = sys.stdin.isatty()
    opening = [ChatMessage("system", args.system)] if args.system else []
    history: list[ChatMessage] = list(opening)
    options = _options(args)
    if interactive:
        print(f"llmesh chat with {args.target} ({CHAT_COMMANDS})", file=sys.stderr)
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401 - gives input() line editing and history
    status = EXIT_OK
    while True:
        try:
            text = _read_turn(interactive)
        except KeyboardInterrupt:
            print(file=sys.stderr)
            return status
        if text is None:  # end of input
            if interactive:
                print(file=sys.stderr)
            return status
        command = text.strip()
        if not command:
            continue
        if command in ("/exit", "/quit"):
            return status
        if command == "/reset":
            history = list(opening)
            print("(conversation reset)", file=sys.stderr)
            continue
        if command == "/help":
            print(CHAT_COMMANDS, file=sys.stderr)
            continue
        history.append(ChatMessage("user", text))
        stream = client.stream(messages=history, model=args.model, **options)
        try:
            done = _stream_to(sys.stdout, stream)
        except LlmeshClientError as err:
            history.pop()  # the turn did not happen: keep the conversation consistent
            if stream.text:
                sys.stdout.write("\n")  # end the partial answer
                sys.stdout.flush()
            print(f"llmesh chat: {format_error(err)}", file=sys.stderr)
            if not interactive:
                return EXIT_FAILED
            status = EXIT_FAILED
            continue
        except KeyboardInterrupt:
            stream.cancel()
            history.pop()
            print("\n(interrupted)", file=sys.stderr)
            if not interactive:
                return EXIT_INTERRUPTED
            continue
        sys.stdout.write("\n")
        sys.stdout.flush()
        history.append(ChatMessage("assistant", done.text))
        if args.summary:
            print(summary_line(done), file=sys.stderr)
        if done.finish_reason == "error":
            status = EXIT_FAILED


def main(argv: Sequence[str] | None = None, mode: str = "generate") -> int:
    if mode not in ("generate", "chat"):
        raise ValueError(f"mode: expected 'generate' or 'chat', got {mode!r}")
    args = build_parser(mode).parse_args(list(argv) if argv is not None else None)
    prog = f"llmesh {mode}"
    try:
        client = _client(args)
    except (OSError, ValueError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        with client:
            runner: Any = run_generate if mode == "generate" else run_chat
            return int(runner(args, client))
    except LlmeshClientError as err:
        sys.stdout.flush()
        print(f"{prog}: {format_error(err)}", file=sys.stderr)
        return EXIT_FAILED
    except (ValueError, TypeError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"\n{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # stdout closed early (e.g. piped into head): not an error worth a traceback.
        # Point stdout at /dev/null so the interpreter's final flush does not fail again.
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
