"""`AsyncLLM`: the engine stepping in a background thread, one async generator per request.

The engine is single-threaded: only the engine thread touches it. Callers post commands (add,
abort) to a queue that the thread drains before every step, and receive outputs through
per-request asyncio queues fed with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from pagedbatch.engine.config import EngineArgs
from pagedbatch.engine.llm_engine import LLMEngine
from pagedbatch.engine.outputs import RequestOutput
from pagedbatch.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

IDLE_WAIT_SECONDS = 0.5


class EngineDeadError(RuntimeError):
    pass


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]
    final_only: bool

    def put(self, item: RequestOutput | BaseException) -> None:
        # A caller whose event loop has ended (a finished `asyncio.run`) has stopped listening.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncLLM:
    def __init__(self, model: str, **engine_args: Any):
        self.engine = LLMEngine(EngineArgs(model=str(model), **engine_args))
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._stopping = threading.Event()
        self._dead: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="pagedbatch-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    async def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        timeout: float | None = None,
        final_only: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative output each step it moves, the last one finished;
        with `final_only`, the last one alone (a batch line: its caller then sleeps, rather than
        wake every step to drop an output, and takes no time from the others).

        Bad input raises ValueError before anything is yielded. Leaving the generator early
        (a disconnected client) aborts the request.
        """
        if self._dead is not None:
            raise EngineDeadError(f"the engine has stopped: {self._dead}")
        request_id = request_id or f"async-{next(self._ids)}"
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue(), final_only)
        admitted: asyncio.Future[None] = loop.create_future()

        def add() -> None:
            try:
                self.engine.add_request(request_id, prompt, sampling_params, priority, timeout)
            except Exception as e:  # noqa: BLE001 - handed to the caller
                loop.call_soon_threadsafe(_settle, admitted, e)
                return
            self._streams[request_id] = stream
            loop.call_soon_threadsafe(_settle, admitted, None)

        self._commands.put(add)
        finished = False
        try:
            # Inside the try: a caller cancelled while waiting for admission must still abort.
            await admitted
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        def abort() -> None:
            self._streams.pop(request_id, None)
            self.engine.abort_request(request_id)

        self._commands.put(abort)

    async def get_stats(self) -> dict:
        loop = asyncio.get_running_loop()
        result: asyncio.Future[dict] = loop.create_future()
        self._commands.put(
            lambda: loop.call_soon_threadsafe(_settle, result, self.engine.get_stats())
        )
        return await result

    def shutdown(self) -> None:
        self._stopping.set()
        self._commands.put(lambda: None)  # wake the loop
        self._thread.join()
        self.engine.shutdown()

    def _loop(self) -> None:
        try:
            while not self._stopping.is_set():
                self._run_commands(block=not self.engine.has_unfinished_requests())
                if self.engine.has_unfinished_requests():
                    for output in self.engine.step():
                        stream = self._streams.get(output.request_id)
                        if stream is None or (stream.final_only and not output.finished):
                            continue
                        if output.finished:
                            del self._streams[output.request_id]
                        stream.put(output)
                else:
                    self.engine.idle()
        except BaseException as e:  # noqa: BLE001 - every waiter must learn the engine died
            logger.exception("engine loop died")
            self._dead = e
            for stream in self._streams.values():
                stream.put(EngineDeadError(f"the engine has stopped: {e}"))
            self._streams.clear()

    def _run_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=IDLE_WAIT_SECONDS) if block else None
            while True:
                if command is not None:
                    command()
                command = self._commands.get_nowait()
        except queue.Empty:
            return


def _settle(future: asyncio.Future, value: Any) -> None:
    if future.done():
        return
    if isinstance(value, BaseException):
        future.set_exception(value)
    else:
        future.set_result(value)
