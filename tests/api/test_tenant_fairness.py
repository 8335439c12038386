"""One tenant cannot shut another out of the realtime door: with the default settings, a tenant
holding nothing gets in within one request's run time, however hard another loops the largest
request the API accepts."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from servers import API_KEYS, BatchServer
from test_realtime import completion_body, seconds_until, seconds_until_idle

from pagedbatch.api.realtime import DEMAND_GRACE_SECONDS

# The largest request the door accepts by default: 2 prompts x n 128 is 256 sequences, all of
# `max_realtime_queue`, and a lone tenant's whole share of it.
LARGEST = completion_body(
    prompt=["Once upon a time", "In a land far away"],
    n=128,
    max_tokens=60,
    ignore_eos=True,
    stream=True,
)
SMALL = completion_body(max_tokens=2, stream=True)
FLOODING_CLIENTS = 3


@dataclass
class Run:
    admitted: float  # its response began: it was admitted
    finished: float


@dataclass
class Flood:
    """Several clients of one tenant, each looping LARGEST and trying again at once when
    refused (a client that ignores Retry-After)."""

    server: BatchServer
    key: str
    runs: list[Run] = field(default_factory=list)
    refusals: int = 0
    failures: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.threads = [threading.Thread(target=self._loop) for _ in range(FLOODING_CLIENTS)]
        for thread in self.threads:
            thread.start()

    def _loop(self) -> None:
        with self.server.http(self.key) as http:
            while not self.stop.is_set():
                with http.stream("POST", "/v1/completions", json=LARGEST) as response:
                    admitted = time.monotonic()
                    if response.status_code == 429:
                        self.refusals += 1
                        time.sleep(0.02)
                        continue
                    if response.status_code != 200:
                        self.failures.append(f"{response.status_code}: {response.read()!r}")
                        return
                    response.read()
                    self.runs.append(Run(admitted, time.monotonic()))

    def admitted_since(self, moment: float) -> int:
        return sum(run.admitted > moment for run in self.runs)

    def end(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(120)


def test_a_tenant_holding_nothing_gets_in_within_one_request_while_another_floods(
    serve_batches,
):
    server: BatchServer = serve_batches(api_keys=API_KEYS)  # the default admission settings
    flood = Flood(server, API_KEYS[0])
    try:
        seconds_until(lambda: len(flood.runs) >= 1, timeout=120)  # the engine is A's now
        asked = time.monotonic()
        tries, admitted = 0, None
        with server.http(API_KEYS[1]) as http:
            # B retries as Retry-After says, until it is in or A has been admitted four times
            # since B first asked: by then B has waited through several of A's requests.
            while admitted is None and flood.admitted_since(asked) < 4 and not flood.failures:
                tries += 1
                with http.stream("POST", "/v1/completions", json=SMALL) as response:
                    if response.status_code == 429:
                        time.sleep(float(response.headers["retry-after"]))
                        continue
                    assert response.status_code == 200, response.read()
                    admitted = time.monotonic()
                    response.read()
        passed = flood.admitted_since(asked)
    finally:
        flood.end()
    assert not flood.failures
    longest = max(run.finished - run.admitted for run in flood.runs)
    assert admitted is not None, (
        f"B was refused {tries} times over {time.monotonic() - asked:.1f} s while A was "
        f"admitted {passed} times (A's requests take up to {longest:.1f} s)"
    )
    # At most the request A had in hand when B asked; none of A's later ones.
    assert passed <= 1, f"A was admitted {passed} times before B, who asked {tries} times"
    # Retry-After told B when A's request would end (rounded up to whole seconds, and told
    # again if that request ran late), so B waited about one of A's requests, not many.
    assert admitted - asked < longest + DEMAND_GRACE_SECONDS + 2
    print(
        f"B in after {admitted - asked:.2f} s and {tries} tries; A's requests take up to "
        f"{longest:.2f} s; A refused {flood.refusals} times"
    )
    seconds_until_idle(server)
