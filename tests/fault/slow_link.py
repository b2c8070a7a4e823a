"""A slow link in user space (this kernel has no netem): a transparent TCP proxy that holds every
chunk it relays for a fixed delay, in both directions, preserving order.

    ip netns exec NS python -m tests.fault.slow_link --port 7400 --delay-ms 200 --mark 1

It runs in the sending node's namespace, where policy routing delivers that node's connections to a
peer's ``--port`` locally (``tests.fault.netns.Network.slow``). It listens transparently
(``IP_TRANSPARENT``) on every address at ``--port``, so an accepted connection's local address is
the peer it was meant for; it opens its own connection to that peer with ``SO_MARK`` = ``--mark``
(which the routing rule lets through) and relays. A chunk read at time t is written at t + delay:
the link's latency grows by the delay and its throughput is not limited otherwise.

Bounded: at most ``CONNECTIONS_MAX`` connections, and per direction at most ``QUEUE_CHUNKS_MAX`` chunks
of at most ``CHUNK_BYTES_MAX`` bytes in flight; a full queue stops reading from that side (TCP's own
flow control then slows the sender). Prints ``listening`` once it accepts connections.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys

IP_TRANSPARENT = 19  # from linux/in.h; Python's socket module has no name for it
CHUNK_BYTES_MAX = 64 * 1024
QUEUE_CHUNKS_MAX = 256  # with CHUNK_BYTES_MAX: at most 16 MiB in flight per direction
CONNECTIONS_MAX = 256
CONNECT_TIMEOUT_S = 5


async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(QUEUE_CHUNKS_MAX)

    async def read() -> None:
        while chunk := await reader.read(CHUNK_BYTES_MAX):
            await queue.put((loop.time() + delay_s, chunk))
        await queue.put((loop.time() + delay_s, b""))

    async def write() -> None:
        while True:
            due, chunk = await queue.get()
            await asyncio.sleep(max(0.0, due - loop.time()))
            if not chunk:
                break
            writer.write(chunk)
            await writer.drain()

    reading = asyncio.ensure_future(read())
    try:
        await write()
    finally:
        reading.cancel()
        writer.close()


async def relay(
    client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter, delay_s: float, mark: int, slots
) -> None:
    async with slots:
        target = client_writer.get_extra_info("sockname")[:2]  # the peer the connection was meant for
        upstream = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        upstream.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, mark)
        upstream.setblocking(False)
        try:
            loop = asyncio.get_running_loop()
            await asyncio.wait_for(loop.sock_connect(upstream, target), CONNECT_TIMEOUT_S)
            peer_reader, peer_writer = await asyncio.open_connection(sock=upstream)
        except (TimeoutError, OSError):
            upstream.close()
            client_writer.close()
            return
        forward = asyncio.ensure_future(pump(client_reader, peer_writer, delay_s))
        backward = asyncio.ensure_future(pump(peer_reader, client_writer, delay_s))
        try:
            # Either side closing (or failing) ends the relay, as it would end a direct connection.
            await asyncio.wait([forward, backward], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (forward, backward):
                task.cancel()
            peer_writer.close()
            client_writer.close()


async def serve(port: int, delay_ms: int, mark: int) -> None:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.setsockopt(socket.SOL_IP, IP_TRANSPARENT, 1)
    listener.bind(("0.0.0.0", port))
    listener.listen(CONNECTIONS_MAX)
    listener.setblocking(False)
    slots = asyncio.Semaphore(CONNECTIONS_MAX)

    async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await relay(reader, writer, delay_ms / 1000, mark, slots)
        except (OSError, asyncio.CancelledError):
            writer.close()

    server = await asyncio.start_server(accepted, sock=listener, limit=CHUNK_BYTES_MAX)
    print("listening", flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--delay-ms", type=int, required=True)
    parser.add_argument("--mark", type=int, required=True)
    arguments = parser.parse_args(argv)
    if not 0 <= arguments.delay_ms <= 60_000:
        parser.error("--delay-ms must be within 0-60000")
    asyncio.run(serve(arguments.port, arguments.delay_ms, arguments.mark))
    return 0


if __name__ == "__main__":
    sys.exit(main())
