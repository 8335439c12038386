"""`AsyncLLM`: the engine stepping in a background thread, one async generator per request.

The engine is single-threaded: only the engine thread touches it. Callers post commands (add,
abort) to a queue that the thread drains before every step, and receive outputs through
per-request asyncio queues fed with `call_soon_threadsafe`.

Nothing a caller does can stop the engine thread: a request that fails ends alone (LLMEngine sees
to that), and a caller whose event loop has closed is treated as gone (its request is aborted).
The thread dies only of an engine bug; `dead_error` then says which, and every waiter is told.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from pagedbatch.engine.config import EngineArgs
from pagedbatch.engine.llm_engine import LLMEngine
from pagedbatch.engine.multimodal.inputs import MediaItem
from pagedbatch.engine.outputs import RequestOutput
from pagedbatch.engine.pooling_params import PoolingParams
from pagedbatch.engine.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

IDLE_WAIT_SECONDS = 0.5

T = TypeVar("T")


class EngineDeadError(RuntimeError):
    pass


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]

    def put(self, item: RequestOutput | BaseException) -> bool:
        return _call_soon(self.loop, self.queue.put_nowait, item)


@dataclass(eq=False)
class _Reply:
    """An answer the engine thread owes a caller (hashed by identity: kept in a set)."""

    loop: asyncio.AbstractEventLoop
    future: asyncio.Future

    def send(self, value: Any) -> bool:
        return _call_soon(self.loop, _settle, self.future, value)


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[..., Any], *args: Any) -> bool:
    """Run `callback` on a caller's loop; False if that loop has closed (a finished
    `asyncio.run`: its caller has gone), which must not raise into the engine thread."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        return False
    return True


class AsyncLLM:
    def __init__(self, model: str, **engine_args: Any):
        self.engine = LLMEngine(EngineArgs(model=str(model), **engine_args))
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._replies: set[_Reply] = set()  # owed to callers; all failed if the engine dies
        self._stopping = threading.Event()
        self._dead: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="pagedbatch-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def dead_error(self) -> BaseException | None:
        """What stopped the engine thread (an engine bug), or None while it runs."""
        return self._dead

    async def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | PoolingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        timeout: float | None = None,
        final_only: bool = False,
        cache_salt: str | None = None,
        media: tuple[MediaItem, ...] = (),
        user_priority: int = 0,
        lora_name: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as its params' `output_kind` asks (by default, the
        cumulative output each step it moves), the last one finished; `final_only` makes it
        FINAL_ONLY, the last one alone (a batch line: its caller then sleeps, rather than wake
        every step, and the engine builds no output before). Prefix-cache blocks are shared only
        with requests of the same `cache_salt` and `lora_name`, the LoRA adapter it runs with
        (see LLMEngine). An embedding model takes
        PoolingParams, and yields one output: the finished one, with its `embedding`.

        Bad input raises ValueError before anything is yielded. Leaving the generator early
        (a disconnected client) aborts the request.
        """
        self._check_alive()
        request_id = request_id or f"async-{next(self._ids)}"
        if final_only:
            final = RequestOutputKind.FINAL_ONLY
            params = sampling_params or self.engine.default_params()
            sampling_params = replace(params, output_kind=final)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())

        def add() -> None:
            self.engine.add_request(
                request_id,
                prompt,
                sampling_params,
                priority,
                timeout,
                cache_salt,
                media,
                user_priority,
                lora_name=lora_name,
            )
            self._streams[request_id] = stream

        finished = False
        try:
            # Inside the try: a caller cancelled while waiting for admission must still abort.
            # Should the caller's loop close before admission, nobody is left to listen.
            await self._on_engine(add, gone=lambda: self._abort_now(request_id, listening=False))
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._commands.put(lambda: self._abort_now(request_id, listening=False))

    def abort(self, request_id: str) -> None:
        """Abort a request; a task reading its stream gets a last output, finish_reason "abort"."""
        self._commands.put(lambda: self._abort_now(request_id, listening=True))

    def _abort_now(self, request_id: str, listening: bool) -> None:
        """On the engine thread: abort; unless someone is `listening`, drop the stream too."""
        if not listening:
            self._streams.pop(request_id, None)
        self.engine.abort_request(request_id)

    async def get_stats(self) -> dict:
        return await self._on_engine(self.engine.get_stats)

    async def load_lora(self, name: str, path: Path) -> None:
        """Serves the LoRA adapter in PEFT folder `path` as `name` (see LLMEngine.read_lora):
        its folder is read and checked on a thread of its own, the steps going on meanwhile;
        the engine thread only registers it."""
        self._check_alive()
        adapter = await asyncio.to_thread(self.engine.read_lora, name, path)
        await self._on_engine(lambda: self.engine.add_lora(adapter, path))

    async def unload_lora(self, name: str) -> None:
        """Stops serving adapter `name` (see LLMEngine.unload_lora)."""
        await self._on_engine(lambda: self.engine.unload_lora(name))

    async def _on_engine(self, fn: Callable[[], T], gone: Callable[[], None] | None = None) -> T:
        """Run `fn` on the engine thread and return its result, or raise its exception, here.
        If this caller's loop has closed by then, `gone` runs there instead of the delivery."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        reply = _Reply(loop, loop.create_future())

        def command() -> None:
            self._replies.discard(reply)
            try:
                value: Any = fn()
            except Exception as e:  # noqa: BLE001 - handed to the caller
                value = e
            if not reply.send(value) and gone is not None and not isinstance(value, Exception):
                gone()

        self._replies.add(reply)
        self._commands.put(command)
        if self._dead is not None:  # died before running it; else the dying thread answers
            reply.send(_dead(self._dead))
        return await reply.future

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise _dead(self._dead)

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
                        self._deliver(output)
                else:
                    self.engine.idle()
        except BaseException as e:  # noqa: BLE001 - every waiter must learn the engine died
            # Only an engine bug gets here: LLMEngine ends a failing request by itself.
            logger.exception("engine loop died")
            self._dead = e
            for stream in list(self._streams.values()):
                stream.put(_dead(e))
            self._streams.clear()
            for reply in list(self._replies):
                reply.send(_dead(e))

    def _deliver(self, output: RequestOutput) -> None:
        stream = self._streams.get(output.request_id)
        if stream is None:
            return
        if output.finished:
            del self._streams[output.request_id]
        if not stream.put(output) and not output.finished:
            self._abort_now(output.request_id, listening=False)  # its caller's loop has closed

    def _run_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=IDLE_WAIT_SECONDS) if block else None
            while True:
                if command is not None:
                    command()
                command = self._commands.get_nowait()
        except queue.Empty:
            return


def _dead(cause: BaseException) -> EngineDeadError:
    return EngineDeadError(f"the engine has stopped: {cause}")


def _settle(future: asyncio.Future, value: Any) -> None:
    if future.done():
        return
    if isinstance(value, BaseException):
        future.set_exception(value)
    else:
        future.set_result(value)


def first_dead(engines: Iterable[AsyncLLM | None]) -> AsyncLLM | None:
    """The first of `engines` (None: one not configured) whose thread has died; None while all
    run. A process's engines stand or fall together: with one dead, every request that needs it
    fails, and the process is restarted as a whole."""
    return next((e for e in engines if e is not None and e.dead_error is not None), None)
