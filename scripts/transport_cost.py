"""CPU per message of one internal hop: a grpc.aio bidirectional stream against a plain
length-prefixed asyncio stream, at the message rate of a real engine's steps.

Usage: ``.venv/bin/python scripts/transport_cost.py [--rate 50] [--messages 500] [--bytes 300]``

For each transport a server process echoes every message back over one long-lived
stream (as a worker, router or postprocessor session does with frames), and this process
sends ``--messages`` messages of ``--bytes`` bytes, one every ``1 / --rate`` s, each
waiting for its echo. Both processes run uvloop, as the tiers do. Reported per echoed
message: the client's CPU (a send and a receive) less what the same loop costs with no
message at all (the timer wake-up of the pacing), and the server's CPU (a receive and a
send) from its own rusage over the run. The figures are what a tier pays per frame on
each side of a hop, before any work of its own. Not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import resource
import struct
from collections.abc import AsyncIterator
from multiprocessing.connection import Connection

_HEADER = struct.Struct("!I")


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _install_uvloop() -> None:
    import uvloop

    uvloop.install()


# -- servers (child processes): echo until told to stop, then report their CPU ------------

async def _grpc_server(port: int, conn: Connection) -> None:
    import grpc

    async def echo(messages: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        async for message in messages:
            yield message

    handler = grpc.method_handlers_generic_handler(
        "transportcost.Echo", {"Stream": grpc.stream_stream_rpc_method_handler(echo)})
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await _serve_until_told(conn)
    await server.stop(None)


async def _raw_server(port: int, conn: Connection) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                header = await reader.readexactly(_HEADER.size)
                body = await reader.readexactly(_HEADER.unpack(header)[0])
                writer.write(header + body)
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    await _serve_until_told(conn)
    server.close()


async def _serve_until_told(conn: Connection) -> None:
    loop = asyncio.get_running_loop()
    conn.send("ready")
    await loop.run_in_executor(None, conn.recv)  # "start": the measured run begins
    cpu0 = _cpu_s()
    await loop.run_in_executor(None, conn.recv)  # "stop"
    conn.send(_cpu_s() - cpu0)


def _server_main(kind: str, port: int, conn: Connection) -> None:
    _install_uvloop()
    asyncio.run(_grpc_server(port, conn) if kind == "grpc" else _raw_server(port, conn))


# -- the client (this process) -------------------------------------------------------------

async def _pace_only(rate: float, messages: int) -> float:
    cpu0 = _cpu_s()
    for _ in range(messages):
        await asyncio.sleep(1 / rate)
    return _cpu_s() - cpu0


async def _grpc_client(port: int, rate: float, messages: int, payload: bytes) -> float:
    import grpc

    outbox: asyncio.Queue[bytes | None] = asyncio.Queue()

    async def requests() -> AsyncIterator[bytes]:
        while (message := await outbox.get()) is not None:
            yield message

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.stream_stream("/transportcost.Echo/Stream")(requests())
        outbox.put_nowait(payload)
        await call.read()  # connected and warm
        cpu0 = _cpu_s()
        for _ in range(messages):
            outbox.put_nowait(payload)
            await call.read()
            await asyncio.sleep(1 / rate)
        spent = _cpu_s() - cpu0
        outbox.put_nowait(None)
        await call.read()  # the end of the stream
    return spent


async def _raw_client(port: int, rate: float, messages: int, payload: bytes) -> float:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    frame = _HEADER.pack(len(payload)) + payload

    async def round_trip() -> None:
        writer.write(frame)
        header = await reader.readexactly(_HEADER.size)
        await reader.readexactly(_HEADER.unpack(header)[0])

    await round_trip()
    cpu0 = _cpu_s()
    for _ in range(messages):
        await round_trip()
        await asyncio.sleep(1 / rate)
    spent = _cpu_s() - cpu0
    writer.close()
    await writer.wait_closed()
    return spent


def _measure(kind: str, port: int, rate: float, messages: int, payload: bytes,
             pacing_s: float) -> dict[str, float]:
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    server = ctx.Process(target=_server_main, args=(kind, port, theirs), daemon=True)
    server.start()
    try:
        if ours.poll(30) is False or ours.recv() != "ready":
            raise SystemExit(f"transport_cost: the {kind} server did not start")
        client = _grpc_client if kind == "grpc" else _raw_client
        ours.send("start")
        client_s = asyncio.run(client(port, rate, messages, payload))
        ours.send("stop")
        server_s = float(ours.recv())
    finally:
        server.join(10)
        if server.is_alive():
            server.kill()
    return {
        "client_us_per_message": round((client_s - pacing_s) / messages * 1e6, 1),
        "server_us_per_message": round(server_s / messages * 1e6, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--rate", type=float, default=50.0, help="messages per second")
    parser.add_argument("--messages", type=int, default=500, help="messages per transport")
    parser.add_argument("--bytes", type=int, default=300, help="bytes per message")
    parser.add_argument("--port", type=int, default=47391, help="loopback port of the echo servers")
    args = parser.parse_args()
    _install_uvloop()
    payload = b"x" * args.bytes
    pacing_s = asyncio.run(_pace_only(args.rate, args.messages))
    result: dict[str, object] = {
        "rate": args.rate, "messages": args.messages, "bytes": args.bytes,
        "pacing_us_per_message": round(pacing_s / args.messages * 1e6, 1),
    }
    for kind in ("grpc", "raw"):
        result[kind] = _measure(kind, args.port, args.rate, args.messages, payload, pacing_s)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
