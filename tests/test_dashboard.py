"""The live dashboard in a real headless browser: it loads, its numbers move while a request runs, no console errors."""

from __future__ import annotations

import os
import shutil
import threading

import httpx
import pytest

BROWSERS = ("chromium-headless-shell", "chromium")  # Debian's, installed by .ci/run through apt


@pytest.fixture(scope="module")
def browser():
    executable = next((path for path in map(shutil.which, BROWSERS) if path), None)
    if executable is None:
        if os.environ.get("CI"):
            pytest.fail("no Debian chromium on PATH: .ci/run installs chromium-headless-shell")
        pytest.skip("no Debian chromium on PATH (apt-get install chromium-headless-shell)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        yield browser
        browser.close()


def test_the_dashboard_shows_numbers_that_move_while_a_request_runs(served, browser):
    page = browser.new_page()
    problems = []
    page.on("console", lambda message: problems.append(message.text) if message.type == "error" else None)
    page.on("pageerror", lambda error: problems.append(str(error)))
    page.goto(served.url + "/dashboard")
    page.wait_for_function("document.getElementById('rounds').textContent !== '-'")
    rounds_before = int(page.text_content("#rounds").replace(",", ""))
    # streamed requests back to back until the page has shown one running: on a loaded machine the page's polls may
    # come seconds apart, and the random test model's reply (all its tokens, its text held back while its bytes are
    # not yet whole UTF-8) can end in a fraction of a second, between two polls
    body = {"prompt": "def add(a, b):\n", "max_tokens": 1900, "temperature": 0, "draft": False, "stream": True}
    seen = threading.Event()

    def stream() -> None:
        while not seen.is_set():
            with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=120) as response:
                for _ in response.iter_lines():
                    if seen.is_set():
                        break

    running = threading.Thread(target=stream)
    running.start()
    page.wait_for_function(f"Number(document.getElementById('rounds').textContent.replace(/,/g, '')) > "
                           f"{rounds_before}", timeout=60_000)
    # the running stream's own row, with its tokens per second, while it runs
    page.wait_for_function("[...document.querySelectorAll('#streams tr')].some((row) => "
                           "Number(row.cells[3].textContent.replace(/,/g, '')) > 0)", timeout=60_000)
    seen.set()
    running.join(120)
    assert page.text_content("#waiting").replace(",", "").isdigit()  # the queue's length
    hits, _, lookups = page.text_content("#cache").replace(",", "").partition(" of ")
    assert hits.isdigit() and int(lookups) >= 1  # the prompt cache's hits of its lookups: this request's counted
    assert page.text_content("#error") == ""
    assert "stream_cache" in page.text_content("#ledger") or "kept_state" in page.text_content("#ledger")
    assert page.locator("#positions tr").count() >= 1 and page.locator("#verdicts tr").count() >= 1
    assert not problems, problems
    page.close()


def test_the_dashboard_data_needs_the_api_key_and_the_page_does_not(served):
    from tensorfold_core.options import ServeOptions
    from tensorfold_core.server import Server

    server = Server(served.host, "127.0.0.1", 0, log_level="warning", options=ServeOptions(api_key="k")).start()
    try:
        assert httpx.get(server.url + "/dashboard/data").status_code == 401
        assert httpx.get(server.url + "/dashboard").status_code == 200  # the page holds no data; it asks for the key
        data = httpx.get(server.url + "/dashboard/data", headers={"Authorization": "Bearer k"}).json()
        assert {"streams", "metrics", "health"} <= set(data)
    finally:
        server.stop()


def test_the_dashboard_shows_drafts_by_the_proposer_that_gave_them(shipped, browser):
    page = browser.new_page()
    page.goto(shipped.url + "/dashboard")
    page.wait_for_function("document.getElementById('rounds').textContent !== '-'")
    body = {"prompt": "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n", "max_tokens": 48, "temperature": 0}
    assert httpx.post(shipped.url + "/v1/completions", json=body, timeout=120).json()["usage"]["tensorfold"]["drafted"]
    page.wait_for_function("document.querySelectorAll('#sources tr').length > 0", timeout=30_000)
    shown = {row.split("\t")[0] for row in page.locator("#sources tr").all_inner_texts()}
    assert shown and shown <= {"copy", "recall", shipped.host.drafter.name}, shown
    page.close()
