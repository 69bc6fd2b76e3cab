"""A TCP proxy that injects faults into one link of a deployment: a delay on every chunk each way,
a cut (every open connection closed, new ones refused) and its end. Flower's SuperNodes talk to
their SuperLink over HTTP on one port, so putting this between them is putting it on the link.

    proxy = FaultProxy(listen_port, "127.0.0.1", superlink_port, delay=0.03)
    proxy.start()        # a thread with its own event loop
    proxy.cut(); ...; proxy.restore()
    proxy.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading

log = logging.getLogger("hfl")
CHUNK = 65536


class FaultProxy:
    def __init__(self, listen_port: int, target_host: str, target_port: int, delay: float = 0.0,
                 host: str = "127.0.0.1") -> None:
        self.listen = (host, listen_port)
        self.target = (target_host, target_port)
        self.delay = delay  # seconds added to every chunk, each way
        self.refusing = False
        self.counts = {"connections": 0, "refused": 0, "cut": 0, "bytes": 0}
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._server: asyncio.AbstractServer | None = None

    # ---- control, from any thread
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="fault-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError(f"fault proxy could not listen on {self.listen}")

    def cut(self) -> None:
        """Close every open connection and refuse new ones until ``restore``."""
        self._call(self._cut)

    def restore(self) -> None:
        self.refusing = False

    def stop(self) -> None:
        if self._loop is not None:
            self._call(self._close)
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _call(self, fn) -> None:  # noqa: ANN001
        assert self._loop is not None, "start() the proxy first"
        asyncio.run_coroutine_threadsafe(fn(), self._loop).result(timeout=10)

    # ---- the event loop's side
    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._accept, *self.listen))
        self._ready.set()
        self._loop.run_forever()
        pending = asyncio.all_tasks(self._loop)  # connections still being piped: ended, not abandoned
        for task in pending:
            task.cancel()
        self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self._loop.close()

    async def _cut(self) -> None:
        self.refusing = True
        self.counts["cut"] += len(self._writers)
        for writer in list(self._writers):
            writer.transport.abort()  # a reset, as a broken link gives, not a polite close
        self._writers.clear()

    async def _close(self) -> None:
        await self._cut()
        if self._server is not None:
            self._server.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.refusing:
            self.counts["refused"] += 1
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self.counts["connections"] += 1
        self._writers |= {writer, up_writer}
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        self._writers -= {writer, up_writer}

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while chunk := await reader.read(CHUNK):
                if self.delay:
                    await asyncio.sleep(self.delay)
                writer.write(chunk)
                self.counts["bytes"] += len(chunk)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()
