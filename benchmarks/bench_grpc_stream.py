"""What a message on an open grpc.aio stream costs its client, by transport and by the internal token's
interceptor (issue 59's levers: Unix domain sockets for the hops on one host, and streams without the
interceptor): a ping-pong of --messages 200-byte messages on one stream-stream call to an echo server in another
process, uvloop on both ends as the services run, the arms alternating each round. Beside them, for scale, the
floor under any RPC library: the same ping-pong as length-prefixed frames on a plain asyncio stream (loopback TCP).
Prints the client's CPU and wall time per round trip (one message each way).

    .venv/bin/python benchmarks/bench_grpc_stream.py [--rounds 3] [--messages 20000]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402

METHOD = "/bench.Echo/Stream"
TOKEN = "t" * 32


async def _serve(tcp: str, uds: str) -> None:
    async def frames(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readexactly(4)
                writer.write(head + await reader.readexactly(int.from_bytes(head, "little")))
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    raw = await asyncio.start_server(frames, "127.0.0.1", 0)

    async def echo(requests, context):
        async for message in requests:
            yield message

    server = grpc.aio.server()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "bench.Echo", {"Stream": grpc.stream_stream_rpc_method_handler(echo)})])
    port = server.add_insecure_port(tcp)
    server.add_insecure_port(uds)
    await server.start()
    print(port, raw.sockets[0].getsockname()[1], flush=True)
    await server.wait_for_termination()


async def raw_round_trip(port: int, messages: int) -> tuple[float, float]:
    """As round_trip, on a plain asyncio stream: a 4-byte length, then the message."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    frame = (200).to_bytes(4, "little") + b"x" * 200

    async def one() -> None:
        writer.write(frame)
        head = await reader.readexactly(4)
        await reader.readexactly(int.from_bytes(head, "little"))

    for _ in range(200):
        await one()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(messages):
        await one()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    writer.close()
    return cpu / messages * 1e6, wall / messages * 1e6


async def round_trip(target: str, interceptor: bool, messages: int) -> tuple[float, float]:
    """(client CPU, wall) in microseconds per round trip."""
    from stagemesh.core import internal_token

    if interceptor:
        channel = grpc.aio.insecure_channel(target, interceptors=internal_token.aio_client_interceptors(TOKEN))
        metadata = None
    else:  # the token as the call's own metadata
        channel = grpc.aio.insecure_channel(target)
        metadata = ((internal_token.METADATA_KEY, TOKEN),)
    outbox: asyncio.Queue = asyncio.Queue()

    async def requests():
        while True:
            yield await outbox.get()

    call = channel.stream_stream(METHOD)(requests(), metadata=metadata)
    message = b"x" * 200
    for _ in range(200):  # warm
        outbox.put_nowait(message)
        await call.read()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(messages):
        outbox.put_nowait(message)
        await call.read()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    call.cancel()
    await channel.close()
    return cpu / messages * 1e6, wall / messages * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--messages", type=int, default=20000)
    p.add_argument("--serve", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    import uvloop

    if args.serve:
        uvloop.run(_serve(*args.serve))
        return
    from stage_worker.cpu_isa import cpu_flags, describe_isa

    print(describe_isa(cpu_flags()))
    with tempfile.TemporaryDirectory() as tmp:
        uds = f"unix:{os.path.join(tmp, 'echo.sock')}"
        server = subprocess.Popen([sys.executable, __file__, "--serve", "127.0.0.1:0", uds], stdout=subprocess.PIPE,
                                  text=True)
        try:
            assert server.stdout is not None
            grpc_port, raw_port = (int(v) for v in server.stdout.readline().split())
            tcp = f"127.0.0.1:{grpc_port}"
            arms = {"TCP loopback, interceptor": (tcp, True), "TCP loopback, metadata": (tcp, False),
                    "Unix socket, interceptor": (uds, True), "Unix socket, metadata": (uds, False),
                    "plain asyncio stream (floor)": (None, False)}
            results: dict[str, list[tuple[float, float]]] = {a: [] for a in arms}
            for _ in range(args.rounds):
                for arm, (target, interceptor) in arms.items():
                    results[arm].append(uvloop.run(
                        raw_round_trip(raw_port, args.messages) if target is None else
                        round_trip(target, interceptor, args.messages)))
        finally:
            server.kill()
            server.wait(timeout=10)
    print(f"{args.messages} round trips a round, medians of {args.rounds} rounds (the rounds' spread):")
    for arm, rows in results.items():
        cpu, wall = [r[0] for r in rows], [r[1] for r in rows]
        print(f"  {arm:28s} client CPU {statistics.median(cpu):6.1f} us ({min(cpu):.1f}-{max(cpu):.1f}), "
              f"wall {statistics.median(wall):6.1f} us ({min(wall):.1f}-{max(wall):.1f})")


if __name__ == "__main__":
    main()
