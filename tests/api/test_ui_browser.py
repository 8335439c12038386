"""The status page in a real browser (Debian's headless chromium, driven by Playwright): a user
enters their key once and watches a running batch's progress bar fill until it is completed.

Screenshots go to `$PAGEDBATCH_TEST_ARTIFACTS` (default `tests/artifacts/`).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from playwright.sync_api import Page, expect

ARTIFACTS = Path(
    os.environ.get("PAGEDBATCH_TEST_ARTIFACTS", Path(__file__).parent.parent / "artifacts")
)
LINES = 60


def batch_text() -> bytes:
    lines = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "tiny",
                "messages": [{"role": "user", "content": f"Tell me about {i}"}],
                # Lengths that differ, so that lines finish one by one, not in lockstep.
                "max_tokens": 16 + 8 * (i % 8),
                "ignore_eos": True,
            },
        }
        for i in range(LINES)
    ]
    return "\n".join(json.dumps(line) for line in lines).encode()


def progress_of(page: Page, batch_id: str) -> tuple[str, float]:
    """The row's status and its progress bar's fill in percent (-100 while indeterminate)."""
    row = page.locator(f'tr[data-batch-id="{batch_id}"]')
    if row.count() == 0:
        return "", -100.0
    status = row.locator(".status").inner_text()
    return status, row.locator("progress").evaluate("bar => bar.position") * 100


def test_the_status_page_shows_a_batch_running_to_completion(serve_batches, browser, tmp_path):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    # One shard of four lines at a time: a few seconds of work, seen over several refreshes.
    server = serve_batches(api_keys=["k1"], worker_concurrency=1)
    client = server.client("k1")
    page = browser.new_page(viewport={"width": 1400, "height": 600})
    page.goto(f"{server.url}/ui")

    # The key is asked for once; a wrong one is refused with the API's own message.
    page.fill("#api-key", "wrong")
    page.click("#key-form button[type=submit]")
    expect(page.locator("#key-error")).to_have_text("Incorrect API key provided.")
    page.fill("#api-key", "k1")
    page.click("#key-form button[type=submit]")
    expect(page.locator("#no-batches")).to_be_visible()
    expect(page.locator("#engine-rows tr td").nth(1)).to_have_text("tiny")

    input_file = client.files.create(file=("input.jsonl", batch_text()), purpose="batch")
    batch = client.batches.create(
        input_file_id=input_file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    # A reload shows the new batch at once, and the key is not asked for again.
    page.reload()
    expect(page.locator(f'tr[data-batch-id="{batch.id}"]')).to_be_visible()
    expect(page.locator("#key-form")).to_be_hidden()

    seen: list[float] = []
    midway_shot = False
    deadline = time.monotonic() + 120
    status = ""
    while status != "completed":
        assert time.monotonic() < deadline, f"the page still shows {status!r}, bar at {seen}"
        status, percent = progress_of(page, batch.id)
        if percent >= 0 and (not seen or percent != seen[-1]):
            seen.append(percent)
            if 0 < percent < 100 and not midway_shot:
                page.screenshot(path=ARTIFACTS / "status_page_running.png", full_page=True)
                midway_shot = True
        time.sleep(0.1)

    assert seen == sorted(seen), f"the bar went backwards: {seen}"
    assert any(0 < percent < 100 for percent in seen), f"the bar never moved midway: {seen}"
    assert seen[-1] == 100
    row = page.locator(f'tr[data-batch-id="{batch.id}"]')
    expect(row.locator(".completed")).to_have_text(str(LINES))
    expect(row.locator(".failed")).to_have_text("0")
    expect(row.locator(".total")).to_have_text(str(LINES))
    for times in (".created", ".started", ".ended"):
        expect(row.locator(times)).not_to_be_empty()
    expect(row.locator(".errors")).to_be_hidden()
    page.screenshot(path=ARTIFACTS / "status_page_completed.png", full_page=True)

    # The output link downloads the output file (the request carries the key).
    with page.expect_download() as download:
        row.locator(".output").click()
    saved = tmp_path / "output.jsonl"
    download.value.save_as(saved)
    output = [json.loads(line) for line in saved.read_text().splitlines()]
    assert sorted(line["custom_id"] for line in output) == sorted(f"r{i}" for i in range(LINES))


def test_without_api_keys_or_an_engine_the_page_asks_for_nothing(server, browser):
    page = browser.new_page()
    page.goto(f"{server.url}/ui")
    expect(page.locator("#no-batches")).to_be_visible()
    expect(page.locator("#key-form")).to_be_hidden()
    expect(page.locator("#forget-key")).to_be_hidden()
    # The distributed API runs no engine: its figures are said to be missing, not shown as zeros.
    expect(page.locator("#engines-unavailable")).to_be_visible()
    expect(page.locator("#engine-rows tr")).to_have_count(0)
