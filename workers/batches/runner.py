"""Runs the lines of an OpenAI batch input file through an LLMEngine that it drives itself.

Lines are read lazily and only a bounded number of engine requests are in flight, so memory does
not grow with the file. Lines are checked in order on the engine's thread (a custom_id repeated
is a later line's fault) and prepared (templated, tokenized, media decoded) on other threads.
Every input line yields exactly one output line, in the order lines finish: a response (status
200, or the endpoint's error status and body) or, for a line that is not a well-formed request
line, an `error`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from pagedbatch.engine import LLMEngine
from pagedbatch.engine.outputs import RequestOutput
from pagedbatch.protocol.batch_lines import (
    ENDPOINTS,
    BatchOutputLine,
    InputLineChecker,
    InvalidBatchLine,
    error_line,
    failed_line,
    response_line,
)
from pagedbatch.protocol.errors import OpenAIError
from pagedbatch.protocol.serving.common import BATCH_PRIORITY, Prepared

# Threads preparing lines while the engine steps: the machine's two cores, one of them shared
# with the engine, are kept busy without more.
PREPARE_THREADS = 2


@dataclass
class BatchProgress:
    lines_done: int = 0
    lines_failed: int = 0  # error lines and non-200 responses, among lines_done
    generated_tokens: int = 0


@dataclass
class _Line:
    """An input line whose engine requests are running."""

    custom_id: str
    prepared: Prepared
    finished: dict[str, RequestOutput] = field(default_factory=dict)


class BatchRunner:
    def __init__(
        self, engine: LLMEngine, *, max_in_flight: int, priority: int = BATCH_PRIORITY
    ) -> None:
        self.engine = engine
        self.max_in_flight = max_in_flight  # engine requests, not lines
        self.priority = priority

    def run(
        self,
        lines: Iterable[str | bytes],
        write: Callable[[BatchOutputLine], None],
        on_progress: Callable[[BatchProgress], None] | None = None,
    ) -> BatchProgress:
        """Runs every line of `lines`, passing each output line to `write` as it is ready.

        Blank lines are skipped. `on_progress` is called after each engine step and each line
        that fails before reaching the engine; the returned progress holds the totals.
        """
        progress = BatchProgress()
        checker = InputLineChecker(ENDPOINTS)
        owners: dict[str, _Line] = {}  # engine request id -> its line
        generated: dict[str, int] = {}  # engine request id -> tokens generated so far
        # Lines being prepared (templated, tokenized, their media decoded) on other threads, in
        # input order: a line of large images or clips does not hold up the engine's steps.
        preparing: deque[tuple[str, Future[Prepared]]] = deque()
        numbered = enumerate(lines, start=1)
        exhausted = False

        def emit(line: BatchOutputLine) -> None:
            write(line)
            progress.lines_done += 1
            if line.error is not None or line.response.status_code != 200:
                progress.lines_failed += 1

        def refuse(line: BatchOutputLine) -> None:
            """A line that failed before reaching the engine."""
            emit(line)
            if on_progress:
                on_progress(progress)

        with ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="prepare-line") as pool:
            while True:
                while not exhausted and len(owners) + len(preparing) < self.max_in_flight:
                    number, raw = next(numbered, (0, None))
                    if raw is None:
                        exhausted = True
                    elif raw.strip():
                        try:
                            request_line = checker.check(raw, number)
                        except InvalidBatchLine as exc:
                            refuse(error_line(exc))
                            continue
                        prepare = ENDPOINTS[request_line.url]
                        future = pool.submit(prepare, request_line.body, self.engine)
                        preparing.append((request_line.custom_id, future))
                # Prepared lines join in order; with nothing to run, wait for the next one.
                while preparing and (preparing[0][1].done() or not owners):
                    custom_id, future = preparing.popleft()
                    if (failure := self._submit(custom_id, future, owners)) is not None:
                        refuse(failure)
                if not owners:
                    if exhausted and not preparing:
                        return progress
                    continue
                for output in self.engine.step():
                    line = owners.get(output.request_id)
                    if line is None:  # aborted when a later request of its line was refused
                        continue
                    tokens = sum(len(c.token_ids) for c in output.outputs)
                    progress.generated_tokens += tokens - generated.get(output.request_id, 0)
                    generated[output.request_id] = tokens
                    if output.finished:
                        del owners[output.request_id], generated[output.request_id]
                        line.finished[output.request_id] = output
                        if len(line.finished) == len(line.prepared.inputs):
                            emit(self._result(line))
                if on_progress:
                    on_progress(progress)

    def _submit(
        self, custom_id: str, preparing: Future[Prepared], owners: dict[str, _Line]
    ) -> BatchOutputLine | None:
        """Puts the line's requests into the engine once prepared, or returns its output line
        if it fails."""
        added: list[str] = []
        try:
            prepared = preparing.result()
            for engine_input in prepared.inputs:
                try:
                    self.engine.add_request(
                        engine_input.request_id,
                        engine_input.prompt_token_ids,
                        engine_input.params,
                        priority=self.priority,
                        media=engine_input.media,
                    )
                except ValueError as exc:  # the engine's own checks, e.g. the KV cache is too small
                    raise OpenAIError(str(exc)) from None
                added.append(engine_input.request_id)
        except Exception as exc:  # noqa: BLE001 - whatever it is, it is this line's failure
            for request_id in added:
                self.engine.abort_request(request_id)
            return failed_line(custom_id, exc)
        line = _Line(custom_id, prepared)
        owners.update(dict.fromkeys(added, line))
        return None

    def _result(self, line: _Line) -> BatchOutputLine:
        outputs = [line.finished[i.request_id] for i in line.prepared.inputs]
        try:
            body = line.prepared.response(outputs).model_dump(mode="json")
        except Exception as exc:  # noqa: BLE001 - this line's failure, not the batch's
            return failed_line(line.custom_id, exc)
        return response_line(line.custom_id, 200, body)
