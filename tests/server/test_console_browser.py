"""The web console in headless Chromium (Playwright driving Debian's /usr/bin/chromium; the
Makefile's setup installs it): the page loads without console errors, a chat message
streams a reply into the page, and the engine view's KV numbers match /metrics.
Screenshots go to $KVSERVE_ARTIFACTS when set, else to a pytest tmp dir."""
from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from benchmarks.server_process import ServerProcess
from kvserve.server.metrics import parse_metrics

CHROMIUM = "/usr/bin/chromium"
KEY = "console-key"

pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM),
                                reason=f"{CHROMIUM} absent: `make setup` installs Debian's chromium")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"{KEY} alice\n")
    with ServerProcess("--api-keys-file", str(keys), "--threads", "1", "--dtype", "float32",
                       "--kv-cache-gib", "0.05", "--max-num-seqs", "4") as proc:
        yield proc


@pytest.fixture()
def artifacts(tmp_path) -> Path:
    folder = Path(os.environ.get("KVSERVE_ARTIFACTS") or tmp_path) / "console"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture()
def page(server):
    from playwright.sync_api import sync_playwright
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        try:
            yield browser.new_page(viewport={"width": 1200, "height": 800})
        finally:
            browser.close()


def _metrics(server) -> dict[str, float]:
    r = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 200, r.text
    return parse_metrics(r.text)


def _kv_shown(page) -> dict[str, int]:
    return {name: int(page.text_content(f"#kv-{name}")) for name in ("used", "cached", "free", "total")}


@pytest.mark.model
def test_console_chat_streams_and_kv_matches_metrics(server, page, artifacts):
    errors = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.add_init_script(f"localStorage.setItem('kvserve.apiKey', '{KEY}')")    # a key saved earlier
    page.goto(server.url + "/")
    assert page.input_value("#api-key") == KEY
    page.wait_for_function("document.getElementById('feed-state').textContent === 'live'", timeout=10_000)
    page.wait_for_function("document.getElementById('kv-explanation').textContent !== '–'", timeout=10_000)
    assert "block" in page.text_content("#kv-explanation").lower()     # the engine's start-up arithmetic
    page.screenshot(path=str(artifacts / "console_loaded.png"))

    page.fill("#temperature", "0")
    page.fill("#max-tokens", "24")
    page.fill("#seed", "7")
    page.fill("#stop", "###,\\n\\n")
    page.fill("#prompt", "Name three colours.")
    with page.expect_request("**/v1/chat/completions") as sent:
        page.click("#send")
    body = sent.value.post_data_json
    assert body["stream"] is True and body["temperature"] == 0 and body["max_tokens"] == 24
    assert body["seed"] == 7 and body["stop"] == ["###", "\n\n"] and "response_format" not in body
    reply = page.locator(".msg.assistant[data-done='1']")
    reply.wait_for(timeout=30_000)
    assert reply.text_content().strip()
    page.screenshot(path=str(artifacts / "console_chat.png"))

    # idle engine: its numbers are steady; the next SSE snapshot must equal /metrics
    seen = page.get_attribute("body", "data-status-time")
    page.wait_for_function(f"document.body.dataset.statusTime !== '{seen}'", timeout=5_000)
    samples, shown = _metrics(server), _kv_shown(page)
    assert shown["used"] == samples["kvserve_kv_blocks_used"]
    assert shown["cached"] == samples["kvserve_kv_blocks_cached"]
    assert shown["total"] == samples["kvserve_kv_blocks_total"] > 0
    assert shown["free"] == shown["total"] - shown["used"] - shown["cached"]
    assert page.text_content("#slots") == f"{int(samples['kvserve_num_requests_running'])} / 4"   # --max-num-seqs
    assert int(page.text_content("#gen-total")) == samples["kvserve_generation_tokens_total"] > 0
    branches = page.eval_on_selector_all("#subtrees tbody tr", "rows => rows.map(r => r.cells[0].textContent)")
    assert branches == ["tenant:alice"]          # the chat's prompt, cached under its tenant's namespace
    assert page.locator("#latency-chart").is_visible()
    assert errors == [], errors
    page.check("#json-mode")                  # the toggle only adds the field (the engine enforces it)
    assert page.evaluate("requestBody()")["response_format"] == {"type": "json_object"}


@pytest.mark.model
def test_console_without_key_says_so(server, page):
    page.goto(server.url + "/")
    page.wait_for_function("document.getElementById('feed-state').textContent.includes('401')", timeout=10_000)
