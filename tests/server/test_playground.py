"""The playground page in real headless Chromium (Debian's `chromium`, driven by Playwright's Python API)
against real servers on the default model: the API key prompt, a streamed chat reply with its blocks coming
into the cache view and going back to free, n = 3's shared prompt blocks, a reply holding `<script>` that
stays text, and the cache view under preemption (swapped-out groups in the CPU pool) on a server with a small
KV cache. Screenshots are saved under tests/artifacts/ (gitignored); their paths are printed."""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# No sandbox as root (CI runs as root); nothing that would reach past the loopback server.
FLAGS = [
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    *(["--no-sandbox"] if os.geteuid() == 0 else []),
]
HTML_PROMPT = "Write a minimal HTML page with a script tag that shows an alert."


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Headless Chromium; missing outside CI, the tests skip saying how to install it (in CI, .ci/run does)."""
    if not os.path.exists(CHROMIUM):
        reason = "headless Chromium is missing: `apt-get install -y chromium` (Debian) installs it"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def page(browser: Any) -> Iterator[Any]:
    """One tab on the shared server's playground for the module's tests (they run in order)."""
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    tab = context.new_page()
    tab.dialogs = []
    tab.on("dialog", lambda d: (tab.dialogs.append(d.message), d.dismiss()))
    tab.errors = []
    tab.on("pageerror", lambda e: tab.errors.append(str(e)))
    yield tab
    context.close()
    assert not tab.errors, tab.errors


def until(page: Any, js: str, timeout: float = 60.0) -> Any:
    """Poll a JS expression until it is truthy (the page's CSP forbids the eval behind wait_for_function)."""
    deadline = time.monotonic() + timeout
    while not (value := page.evaluate(js)):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {js}")
        time.sleep(0.05)
    return value


def settings(page: Any, **fields: object) -> None:
    """Fill the sampling settings (`beam` is the checkbox)."""
    for name, value in fields.items():
        if name == "beam":
            page.set_checked("#beam", bool(value))
        else:
            page.fill(f"#{name}", str(value))


def screenshot(page: Any, name: str) -> Path:
    """The page down to the end of its content, saved under tests/artifacts/."""
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / name
    bottom = page.evaluate("document.querySelector('main').getBoundingClientRect().bottom")
    width = page.viewport_size["width"]
    page.screenshot(path=str(path), clip={"x": 0, "y": 0, "width": width, "height": min(bottom, 900)})
    print(f"screenshot: {path}")
    return path


@dataclass
class Sample:
    """What the page shows at one moment while a reply streams."""

    text: str  # the first choice's text
    held: int  # GPU blocks held
    shared: int  # of those, shared (ref count > 1)
    cpu_held: int  # swap blocks held


READ = """() => ({
    busy: document.getElementById('send').disabled,
    text: document.querySelector('#transcript .reply:last-child .choice .text')?.textContent ?? '',
    held: +document.getElementById('kv-gpu-held').textContent,
    shared: +document.getElementById('kv-gpu-shared').textContent,
    cpu_held: +document.getElementById('kv-cpu-held').textContent,
})"""


def send_and_watch(page: Any, prompt: str, shot: str | None = None, shot_when: Any = None) -> list[Sample]:
    """Send a message and sample the page until the reply is complete; one screenshot when `shot_when(sample)`."""
    page.fill("#prompt", prompt)
    page.press("#prompt", "Enter")
    samples: list[Sample] = []
    deadline = time.monotonic() + 120
    while True:
        state = page.evaluate(READ)
        busy = state.pop("busy")
        samples.append(Sample(**state))
        if shot and shot_when(samples[-1]):
            screenshot(page, shot)
            shot = None
        if not busy and len(samples) > 1:
            return samples
        assert time.monotonic() < deadline, "the reply did not finish"
        time.sleep(0.05)


def wait_all_free(page: Any) -> None:
    """The cache view comes back to every block free."""
    until(page, "document.getElementById('kv-gpu-held').textContent === '0'", timeout=10)


def test_chat_streams_and_its_blocks_come_and_go(page: Any, server: Any) -> None:
    t0 = time.monotonic()
    page.goto(server.url + "/")
    # The server has an API key: the page asks for it and keeps it in this tab only.
    until(page, "!document.getElementById('key-form').hidden")
    page.fill("#key-input", server.api_key)
    page.click("#key-form button")
    assert until(page, "document.getElementById('model').textContent") == server.model
    assert page.evaluate("sessionStorage.getItem('tinypaged.apiKey')") == server.api_key
    assert page.evaluate("localStorage.length") == 0 and page.evaluate("document.cookie") == ""
    settings(page, temperature=0, max_tokens=48, n=1)
    samples = send_and_watch(page, "What is a paged KV cache?")
    final = page.text_content("#transcript .reply .choice .text")
    assert final and any(0 < len(s.text) < len(final) for s in samples), "the reply did not stream"
    assert max(s.held for s in samples) > 0, "no block appeared in the cache view"
    wait_all_free(page)
    stats = page.text_content("#transcript .reply .stats")
    assert "TTFT" in stats and "tok/s" in stats, stats
    print(f"chat test: {time.monotonic() - t0:.1f} s")
    server.wait_idle()


def test_n3_shows_shared_prompt_blocks(page: Any, server: Any) -> None:
    page.click("#clear")
    settings(page, temperature=0.8, max_tokens=40, n=3)
    samples = send_and_watch(
        page, "Describe the sea in one sentence.", shot="playground.png", shot_when=lambda s: len(s.text) > 50
    )
    assert page.locator("#transcript .reply .choice").count() == 3
    assert all(t.strip() for t in page.locator("#transcript .reply .choice .text").all_text_contents())
    # The prompt's full blocks are shared by the three samples for the whole run.
    assert max(s.shared for s in samples) > 0
    wait_all_free(page)
    server.wait_idle()


def test_a_reply_with_a_script_tag_stays_text(page: Any, server: Any) -> None:
    page.click("#clear")
    settings(page, temperature=0, max_tokens=60, n=1)
    send_and_watch(page, HTML_PROMPT)
    text = page.text_content("#transcript .reply .choice .text")
    assert "<script>" in text, text  # the model wrote a script tag (greedy, so always this one)
    assert page.evaluate("document.querySelectorAll('#transcript script, #transcript *[onload]').length") == 0
    assert "&lt;script&gt;" in page.inner_html("#transcript .reply .choice .text")
    assert not page.dialogs
    wait_all_free(page)
    server.wait_idle()


def test_fifty_thousand_blocks_are_drawn_on_one_canvas(page: Any) -> None:
    """A large cache (here a made-up view of 50,000 blocks, 500 requests) is cells on a canvas, not DOM nodes."""
    drawn_ms = page.evaluate(
        """() => {
        kvView.live.checked = false;  // no poll replaces the made-up view
        kvView.schedule();
        const requests = [], runs = [];
        for (let i = 0; i < 500; i++) {
            requests.push({id: `cmpl-${i}-0`, gpu_blocks: 90, cpu_blocks: 0});
            runs.push((i + 1) << 2 | 2, 60, (i + 1) << 2, 30);  // 60 shared blocks, 30 not
        }
        runs.push(1, 1000, 0, 4000);  // free: cached, then plain
        const pool = (n, free, shared, cached, runs) =>
            ({num_blocks: n, num_free: free, num_shared: shared, num_cached: cached, runs});
        const view = {block_size: 16, requests, gpu: pool(50000, 5000, 30000, 1000, runs),
            cpu: pool(0, 0, 0, 0, []), num_running: 500, num_waiting: 0, num_swapped: 0,
            gpu_cache_usage: 0.9, cpu_cache_usage: 0, num_preemptions: 0, num_steps: 1};
        const t0 = performance.now();
        kvView.render(view);
        return performance.now() - t0;
    }"""
    )
    print(f"50,000 blocks drawn in {drawn_ms:.0f} ms")
    assert page.text_content("#kv-gpu-held") == "45000" and page.text_content("#kv-gpu-total") == "50000"
    assert page.evaluate("document.querySelectorAll('#kv *').length") < 1000
    assert drawn_ms < 1000


def test_cache_view_under_preemption(browser: Any, make_server: Any) -> None:
    """A small KV cache (24 blocks), three n = 4 requests: groups are swapped out to the CPU pool and back."""
    t0 = time.monotonic()
    small = make_server(num_gpu_blocks_override=24, swap_space=0.05)  # 72 swap blocks
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    page.goto(small.url + "/")  # no API key on this server: the page does not ask for one
    until(page, "document.getElementById('model').textContent")
    assert page.evaluate("document.getElementById('key-form').hidden")
    settings(page, temperature=0.8, max_tokens=48, n=4)

    def load(i: int) -> None:
        with openai.OpenAI(base_url=small.url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
            c.chat.completions.create(
                model=small.model,
                messages=[{"role": "user", "content": f"Write a poem about block {i}."}],
                max_tokens=48,
                n=4,
                temperature=0.8,
                extra_body={"ignore_eos": True},
            )

    threads = [threading.Thread(target=load, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    samples = send_and_watch(
        page, "Write a poem about paging.", shot="kv-cache-preemption.png", shot_when=lambda s: s.cpu_held > 0
    )
    for t in threads:
        t.join(120)
    assert max(s.cpu_held for s in samples) > 0, "no group was seen swapped out"
    assert int(until(page, "+document.getElementById('kv-preemptions').textContent")) > 0
    until(page, "document.getElementById('kv-gpu-held').textContent === '0'", timeout=30)
    assert page.text_content("#kv-cpu-held") == "0"
    context.close()
    small.wait_idle()
    print(f"preemption test: {time.monotonic() - t0:.1f} s")
