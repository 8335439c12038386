"""Runs the lines of an OpenAI batch input file through an AsyncLLM, each line through the same
request pipeline as the service's (protocol/pipeline.py): its content filter, the engine's
refusals as OpenAI errors, its usage from the engine's outputs.

Lines are read lazily and at most `max_in_flight` of them are under way at once, so memory does
not grow with the file. Lines are checked in order on the event loop (a custom_id repeated is a
later line's fault) and prepared (templated, tokenized, media decoded) on other threads. Every
input line yields exactly one output line, in the order lines finish: a response (status 200, or
the endpoint's error status and body) or, for a line that is not a well-formed request line, an
`error`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from pagedbatch.engine import AsyncLLM
from pagedbatch.engine.async_llm import EngineDeadError
from pagedbatch.protocol.batch_lines import (
    EMBEDDINGS,
    ENDPOINTS,
    BatchInputLine,
    BatchOutputLine,
    InputLineChecker,
    InvalidBatchLine,
    error_line,
    failed_line,
    response_line,
)
from pagedbatch.protocol.pipeline import RequestContext, RequestPipeline

# Threads preparing lines while the engine steps: the machine's two cores, one of them shared
# with the engine, are kept busy without more.
PREPARE_THREADS = 2


@dataclass
class BatchProgress:
    lines_done: int = 0
    lines_failed: int = 0  # error lines and non-200 responses, among lines_done
    generated_tokens: int = 0  # by the lines done


class BatchRunner:
    def __init__(
        self,
        engine: AsyncLLM,
        context: RequestContext,
        *,
        max_in_flight: int,
        embedder: AsyncLLM | None = None,
    ) -> None:
        """`context`: how every line runs (batch priority, the content filter in force).
        `embedder`: the engine `/v1/embeddings` lines run on; None: `engine`."""
        self.engine = engine
        self.embedder = embedder
        self.context = context
        self.max_in_flight = max_in_flight  # lines under way: prepared, screened or running

    def run(
        self,
        lines: Iterable[str | bytes],
        write: Callable[[BatchOutputLine], None],
        on_progress: Callable[[BatchProgress], None] | None = None,
    ) -> BatchProgress:
        """Runs every line of `lines`, passing each output line to `write` as it is ready.

        Blank lines are skipped. `on_progress` is called after each line is written; the
        returned progress holds the totals. A dead engine ends the run with its error.
        """
        return asyncio.run(self._run(lines, write, on_progress))

    async def _run(
        self,
        lines: Iterable[str | bytes],
        write: Callable[[BatchOutputLine], None],
        on_progress: Callable[[BatchProgress], None] | None,
    ) -> BatchProgress:
        progress = BatchProgress()
        checker = InputLineChecker(ENDPOINTS)
        room = asyncio.Semaphore(self.max_in_flight)
        running: set[asyncio.Task[None]] = set()
        failures: list[BaseException] = []

        def emit(line: BatchOutputLine, generated: int = 0) -> None:
            write(line)
            progress.lines_done += 1
            progress.generated_tokens += generated
            if line.error is not None or line.response.status_code != 200:
                progress.lines_failed += 1
            if on_progress:
                on_progress(progress)

        async def answer(request_line: BatchInputLine, pool: ThreadPoolExecutor) -> None:
            try:
                emit(*await self._answer(request_line, pool))
            except EngineDeadError as exc:  # the run ends
                failures.append(exc)
            finally:
                room.release()

        with ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="prepare-line") as pool:
            try:
                numbered = enumerate(lines, start=1)
                while not failures:
                    await room.acquire()  # the next line is read once there is room for it
                    number, raw = next(numbered, (0, None))
                    if raw is None or not raw.strip():
                        room.release()
                        if raw is None:
                            break
                        continue
                    try:
                        request_line = checker.check(raw, number)
                    except InvalidBatchLine as exc:
                        room.release()
                        emit(error_line(exc))
                        continue
                    task = asyncio.create_task(answer(request_line, pool))
                    running.add(task)
                    task.add_done_callback(running.discard)
                await asyncio.gather(*running)
            finally:
                for task in running:
                    task.cancel()  # closing their pipelines aborts their engine requests
                await asyncio.gather(*running, return_exceptions=True)
        if failures:
            raise failures[0]
        return progress

    async def _answer(
        self, request_line: BatchInputLine, pool: ThreadPoolExecutor
    ) -> tuple[BatchOutputLine, int]:
        """The line's output line and the tokens it generated. Raises only EngineDeadError:
        anything else is this line's failure."""
        custom_id = request_line.custom_id
        try:
            prepare = ENDPOINTS[request_line.url]
            engine = self.engine
            if request_line.url == EMBEDDINGS and self.embedder is not None:
                engine = self.embedder
            loop = asyncio.get_running_loop()
            prepared = await loop.run_in_executor(pool, prepare, request_line.body, engine.engine)
            context = replace(self.context, request_id=custom_id)
            body, used = await RequestPipeline(engine, prepared, context).batch_line()
        except EngineDeadError:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever it is, it is this line's failure
            return failed_line(custom_id, exc), 0
        return response_line(custom_id, 200, body), used.completion_tokens if used else 0
