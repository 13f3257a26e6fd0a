"""The page `meshinfer serve` answers at `/`, driven by a real headless Chromium (Debian's
`chromium` and `chromium-driver`, through Selenium), over live in-process meshes.

The meshes and servers run on an event loop in a background thread (:class:`Live`), so the
synchronous browser calls never block them. Every browser test saves screenshots of what it
checked to its tmp_path.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import threading
import time
import urllib.error
import urllib.request

import pytest

from helpers.meshkit import crash, mesh, split, start_peer
from meshinfer.app.api import ApiServer
from meshinfer.core.config import LayerRange
from meshinfer.engine.generate import load_shard
from meshinfer.client.mesh import MeshClient

#: Seconds a page has to show what a test waits for (a loaded 2-core machine is slow).
WAIT_S = 90
CHROMIUM_HINT = ("the browser tests need Debian's chromium and chromium-driver: "
                 "apt-get update && apt-get install -y chromium chromium-driver (.ci/run does it)")


class Live:
    """An event loop in a thread that runs meshes and API servers for a synchronous test."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="live-mesh", daemon=True)
        self.thread.start()
        self.stack = contextlib.AsyncExitStack()

    def run(self, coro, timeout_s: float = 600):
        """Run ``coro`` on the loop and return its result (raising its exception)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def enter(self, cm):
        """Enter an async context manager on the loop; it is exited by :meth:`close`."""
        return self.run(self.stack.enter_async_context(cm))

    def close(self) -> None:
        try:
            self.run(self.stack.aclose(), timeout_s=120)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(30)


@contextlib.asynccontextmanager
async def serving(bootstrap, *, mesh_key: bytes | None = None, **options):
    """An :class:`ApiServer` on 127.0.0.1:0 over the mesh reached through ``bootstrap``."""
    async with MeshClient(list(bootstrap), mesh_key=mesh_key, request_timeout_s=5.0) as client:
        server = ApiServer(client, host="127.0.0.1", port=0, **options)
        await server.start()
        try:
            yield server
        finally:
            await server.close()


@pytest.fixture
def live():
    lv = Live()
    yield lv
    lv.close()


def tiny_mesh(live: Live, tiny, **settings):
    path, digest, tok, _ = tiny
    peers = live.enter(mesh(split(lambda r: load_shard(path, r), (0, 2, 4)), weights_hash=digest,
                            bundle=tok.to_bundle(), **dict({"advert_ttl_s": 30.0}, **settings)))
    return peers


@pytest.fixture(scope="module")
def browser():
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.fail("the browser tests need selenium: pip install -e '.[test]'")
    binary = shutil.which("chromium")
    driver_path = shutil.which("chromedriver") or ("/usr/bin/chromedriver" if os.path.exists("/usr/bin/chromedriver")
                                                   else None)
    if binary is None or driver_path is None:
        pytest.fail(CHROMIUM_HINT)
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,900", "--disable-extensions", "--no-first-run"):
        options.add_argument(arg)
    os.environ.setdefault("SE_OFFLINE", "true")  # never let Selenium Manager fetch a driver
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    yield driver
    driver.quit()


# --------------------------------------------------------------------------- page helpers
def page_url(server: ApiServer) -> str:
    return f"http://127.0.0.1:{server.port}/"


def wait_for(driver, script: str, *, timeout_s: float = WAIT_S, what: str = ""):
    """Poll ``return <script>`` in the page until it is truthy; return it."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, timeout_s, poll_frequency=0.2).until(lambda d: d.execute_script(f"return {script}"))
    except TimeoutException:
        raise AssertionError(f"the page never showed {what or script} within {timeout_s} s; it shows: "
                             f"{driver.execute_script('return document.body.innerText')[:2000]}") from None


def open_page(driver, server: ApiServer) -> None:
    driver.get(page_url(server))
    wait_for(driver, "document.readyState === 'complete' && typeof renderText === 'function'", what="the page")


def show(driver, view: str) -> None:
    driver.find_element("id", f"tab-{view}").click()
    wait_for(driver, f"!document.getElementById('view-{view}').hidden", what=f"the {view} view")


def ask(driver, prompt: str, *, max_tokens: int) -> dict:
    """Type ``prompt`` in the chat view and wait for the reply; returns its text, finish and stats."""
    show(driver, "chat")
    n = driver.execute_script("return document.querySelectorAll('.msg.assistant[data-finish]').length")
    box = driver.find_element("id", "max-tokens")
    box.clear()
    box.send_keys(str(max_tokens))
    driver.find_element("id", "prompt").send_keys(prompt)
    driver.find_element("id", "send").click()
    wait_for(driver, f"document.querySelectorAll('.msg.assistant[data-finish]').length > {n}", what="a reply")
    return driver.execute_script("""
        const m = [...document.querySelectorAll('.msg.assistant')].pop();
        const err = m.querySelector('.error-text');
        return {text: m.querySelector('.content').textContent, finish: m.dataset.finish,
                stats: m.querySelector('.stats').textContent, error: err ? err.textContent : null};""")


def peer_states(driver) -> dict:
    return driver.execute_script(
        "return Object.fromEntries([...document.querySelectorAll('#peers tbody tr')]"
        ".map(r => [r.dataset.peerId, r.dataset.state]))")


def strips(driver) -> list:
    """Per group: one entry per layer, 'gap' or the peer count shown."""
    return driver.execute_script(
        "return [...document.querySelectorAll('#groups .strip')].map(s => [...s.children]"
        ".map(c => c.classList.contains('gap') ? 'gap' : c.textContent))")


def http_get(url: str, key: str | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


# --------------------------------------------------------------------------- without a browser
def test_page_files_are_served_with_a_strict_content_security_policy(live, tiny):
    peers = tiny_mesh(live, tiny)
    server = live.enter(serving(peers[0].addrs, api_key="k"))
    for path, kind in [("", "text/html"), ("app.js", "text/javascript"), ("style.css", "text/css")]:
        with urllib.request.urlopen(page_url(server) + path, timeout=60) as r:  # no key needed for the page
            body = r.read().decode()
            assert r.headers["Content-Type"] == f"{kind}; charset=utf-8", path
            assert "script-src 'self'" in r.headers["Content-Security-Policy"] and "http" not in body.split("<body")[0]
    status, body = http_get(server.url + "/mesh")
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert http_get(server.url + "/mesh", key="k")[0] == 200


def test_completion_carries_timings_and_route_and_the_mesh_endpoint_shows_them(live, tiny):
    _, digest, _, _ = tiny
    peers = tiny_mesh(live, tiny)
    server = live.enter(serving(peers[0].addrs))
    req = urllib.request.Request(server.url + "/chat/completions", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"model": digest, "max_tokens": 4,
                                                  "messages": [{"role": "user", "content": "hi"}]}).encode())
    with urllib.request.urlopen(req, timeout=120) as r:
        info = json.loads(r.read())["meshinfer"]
    status, view = http_get(server.url + "/mesh")
    assert status == 200 and view["object"] == "mesh" and view["problem"] is None
    assert info["ttft_ms"] > 0 and info["tokens_per_s"] > 0 and info["failovers"] == info["detections"] == []
    assert [h["layers"] for h in info["route"]] == ["0-1", "2-3"]
    assert all(h["compute_ms_per_token"] > 0 and h["network_ms_per_token"] >= 0 for h in info["route"])
    assert view["last_reply"]["route"] == info["route"] and view["last_reply"]["completion_tokens"] == 4
    assert sorted(p["layers"] for p in view["peers"]) == ["0-1", "2-3"]
    assert {p["state"] for p in view["peers"]} == {"ready"} and all(p["rtt_ms"] > 0 for p in view["peers"])
    [group] = view["groups"]
    assert group["coverage"] == [1, 1, 1, 1] and group["missing_layers"] == [] and len(group["route"]) == 2


def test_every_page_file_is_package_data_so_a_wheel_ships_it():
    import fnmatch
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parent.parent
    section = (root / "pyproject.toml").read_text().split("[tool.setuptools.package-data]", 1)[1]
    patterns = json.loads(re.search(r'^"meshinfer.app" = (\[.*\])$', section, re.M).group(1))  # no tomllib on 3.10
    app = root / "meshinfer" / "app"
    files = sorted(p.relative_to(app).as_posix() for p in (app / "web").iterdir())
    assert files == ["web/app.js", "web/index.html", "web/style.css"]
    assert all(any(fnmatch.fnmatch(f, pat) for pat in patterns) for f in files)


# --------------------------------------------------------------------------- tiny model, in Chromium
def test_code_fences_render_as_code_and_html_stays_text(live, tiny, browser, tmp_path):
    peers = tiny_mesh(live, tiny)
    server = live.enter(serving(peers[0].addrs))
    open_page(browser, server)
    got = browser.execute_script("""
        const d = document.createElement('div');
        renderText(d, "a <b>bold</b>\\n```python\\nprint('<script>alert(1)</script>')\\n```\\nafter `x<i>`, `y");
        return [d.querySelectorAll('pre > code').length, d.querySelector('pre code').textContent,
                d.querySelector('pre code').className, d.querySelectorAll('b, i, script').length,
                [...d.querySelectorAll('.text code')].map(c => c.textContent), d.textContent];""")
    assert got == [1, "print('<script>alert(1)</script>')", "language-python", 0, [],
                   "a <b>bold</b>print('<script>alert(1)</script>')after `x<i>`, `y"]
    got = browser.execute_script("""
        const d = document.createElement('div');
        renderText(d, "use `a<b>` and `c`.");
        return [[...d.querySelectorAll('.text code')].map(c => c.textContent), d.textContent];""")
    assert got == [["a<b>", "c"], "use a<b> and c."]
    hostile = '<img src=x onerror="window.pwned=1">'
    reply = ask(browser, hostile, max_tokens=3)
    assert reply["finish"] == "length" and reply["error"] is None and "tok/s" in reply["stats"]
    assert browser.execute_script("return document.querySelector('.msg.user .content').textContent") == hostile
    assert browser.execute_script("return [document.querySelectorAll('#messages img').length, window.pwned]") == [0, None]
    browser.save_screenshot(str(tmp_path / "chat.png"))


def test_mesh_provided_strings_stay_text(live, tiny, browser):
    peers = tiny_mesh(live, tiny)
    server = live.enter(serving(peers[0].addrs))
    open_page(browser, server)
    hostile = '<img src=x onerror="window.pwned=1">'
    got = browser.execute_script("""
        const h = arguments[0];
        renderMesh({peers: [], groups: [], events: [], last_reply: {model: h, time: 0, finish_reason: h, completion_tokens: 1, route: [
            {peer_id: h, address: h, layers: h, device: h, compute_ms_per_token: 1, network_ms_per_token: 1}]}});
        const route = document.getElementById('last-route').textContent;
        renderMesh({peers: [{peer_id: h, address: h, model: h, layers: h, device: h, precision: h,
                             weights_hash: h, state: h, rtt_ms: null, free_kv_tokens: h}],
                    groups: [{model: h, precision: h, num_layers: 1, usable: 0, coverage: [0], route: null,
                              missing_layers: [h]}], last_reply: null,
                    events: [{kind: "detection", time: 0, peer: h, layers: h, reason: h},
                             {kind: "failover", time: 0, failed: [h], reason: h}]});
        return [document.querySelectorAll('img').length, window.pwned, document.getElementById('events').textContent,
                document.querySelector('#peers td.address').textContent,
                document.querySelector('#peers tbody tr').dataset.state, route];""", hostile)
    assert got[:2] == [0, None]
    assert f"lying peer <img src=x o [{hostile}] excluded: {hostile}" in got[2]
    assert f"failover from <img src=x o: {hostile}" in got[2]
    assert got[3:5] == [hostile, "other"] and got[5].count(hostile) == 5


def test_stop_regenerate_and_new_conversation(live, tiny, browser, tmp_path, monkeypatch):
    peers = tiny_mesh(live, tiny)
    server = live.enter(serving(peers[0].addrs))
    finish, steps = peers[-1]._finish_step, []

    def slow(conv, start, *rest):  # 50 ms a step: the reply is still running when Stop is clicked
        steps.append(start)
        time.sleep(0.05)
        return finish(conv, start, *rest)

    monkeypatch.setattr(peers[-1], "_finish_step", slow)
    open_page(browser, server)
    wait_for(browser, "document.getElementById('model').value !== ''", what="a model")
    browser.find_element("id", "max-tokens").send_keys("220")
    browser.find_element("id", "prompt").send_keys("count\n")  # greedy on the tiny model: 220 tokens, no end
    wait_for(browser, "document.querySelector('.msg.assistant .content').textContent.length > 0", what="streaming")
    browser.find_element("id", "stop").click()
    wait_for(browser, "document.querySelector('.msg.assistant').dataset.finish === 'stopped'", what="the stop")
    stopped = browser.execute_script("return document.querySelector('.msg.assistant .content').textContent")
    live.run(wait_idle(peers))  # the server closed the conversation on every hop
    assert len(steps) < 200
    box = browser.find_element("id", "max-tokens")
    box.clear()
    box.send_keys("3")
    browser.find_element("id", "regenerate").click()
    wait_for(browser, "document.querySelector('.msg.assistant')?.dataset.finish === 'length'", what="the new reply")
    texts = browser.execute_script("return [...document.querySelectorAll('.msg')].map(m => m.className)")
    assert texts == ["msg user", "msg assistant"] and stopped
    browser.save_screenshot(str(tmp_path / "regenerated.png"))
    browser.find_element("id", "new-chat").click()
    assert browser.execute_script("return document.querySelectorAll('.msg').length") == 0


async def wait_idle(peers, timeout_s: float = 30.0) -> None:
    async with asyncio.timeout(timeout_s):
        while any(p.convs for p in peers):
            await asyncio.sleep(0.05)


@pytest.mark.slow
def test_killed_peer_shows_as_gone_with_the_gap_and_the_page_recovers(live, tiny, browser, tmp_path):
    path, digest, tok, _ = tiny
    peers = tiny_mesh(live, tiny, advert_ttl_s=3.0)
    server = live.enter(serving(peers[0].addrs))
    open_page(browser, server)
    show(browser, "mesh")
    wait_for(browser, "document.querySelectorAll('#peers tr[data-state=ready]').length === 2", what="two ready peers")
    assert strips(browser) == [["1", "1", "1", "1"]]
    browser.save_screenshot(str(tmp_path / "mesh-whole.png"))

    live.run(crash(peers[1]))
    wait_for(browser, f"document.querySelector('#peers tr[data-peer-id=\"{peers[1].peer_id}\"]')"
                      f"?.dataset.state === 'gone'", what="the killed peer as gone")
    wait_for(browser, "document.getElementById('problem').dataset.code === 'no_route'", what="the no-route problem")
    assert strips(browser) == [["1", "1", "gap", "gap"]]
    assert "layers 2-3" in browser.find_element("id", "problem").text
    assert peer_states(browser)[peers[0].peer_id] == "ready"
    browser.save_screenshot(str(tmp_path / "mesh-gone.png"))
    failed = ask(browser, "anyone there?", max_tokens=3)
    assert failed["finish"] == "error" and "cannot serve" in failed["error"]

    new = live.run(start_peer(load_shard(path, LayerRange(2, 4)), weights_hash=digest,
                              bundle=tok.to_bundle(), bootstrap=peers[0].addrs, advert_ttl_s=3.0))
    try:
        show(browser, "mesh")
        wait_for(browser, "document.getElementById('problem').hidden", what="the problem cleared")
        assert strips(browser) == [["1", "1", "1", "1"]] and peer_states(browser)[new.peer_id] == "ready"
        reply = ask(browser, "hello again", max_tokens=3)
        assert reply["finish"] == "length" and reply["error"] is None
    finally:
        live.run(new.close())


def test_api_key_is_asked_once_and_kept_only_in_session_storage(live, tiny, browser, tmp_path):
    peers = tiny_mesh(live, tiny)
    server = live.enter(serving(peers[0].addrs, api_key="open sesame"))
    open_page(browser, server)
    wait_for(browser, "!document.getElementById('key-form').hidden", what="the key form")
    browser.find_element("id", "key-input").send_keys("wrong\n")
    wait_for(browser, "document.getElementById('key-error').textContent.includes('refused')", what="the refusal")
    browser.save_screenshot(str(tmp_path / "key.png"))
    browser.find_element("id", "key-input").send_keys("open sesame\n")
    wait_for(browser, "document.querySelectorAll('#peers tr[data-state=ready]').length === 2", what="the peers")
    assert browser.execute_script("return [sessionStorage.getItem('meshinfer-api-key'), localStorage.length, "
                                  "document.cookie]") == ["open sesame", 0, ""]
    browser.refresh()
    wait_for(browser, "document.querySelectorAll('#peers tr[data-state=ready]').length === 2", what="the peers again")
    assert browser.find_element("id", "key-form").is_displayed() is False
    assert ask(browser, "hi", max_tokens=2)["finish"] == "length"


def test_private_mesh_without_key_and_no_peer_are_explained(live, tiny, browser, tmp_path):
    peers = tiny_mesh(live, tiny, mesh_key=os.urandom(32))
    private = live.enter(serving(peers[0].addrs))
    open_page(browser, private)
    wait_for(browser, "document.getElementById('problem').dataset.code === 'unauthenticated'", what="the key problem")
    assert "--mesh-key-file" in browser.find_element("id", "problem").text
    browser.save_screenshot(str(tmp_path / "private.png"))
    nobody = live.enter(serving(["ws://127.0.0.1:9"]))
    open_page(browser, nobody)
    wait_for(browser, "document.getElementById('problem').dataset.code === 'peer_unavailable'", what="no peers")
    assert "Every peer is gone" in browser.find_element("id", "problem").text
    reply = ask(browser, "hello?", max_tokens=2)
    assert reply["finish"] == "error" and "no peers yet" in reply["error"]


# --------------------------------------------------------------------------- the real default model
@pytest.fixture(scope="module")
def real_served():
    """The real default model split over 2 peers (layers 0-11 and 12-23) and an API server."""
    from helpers.realmodels import model_path
    from helpers.meshkit import file_hash
    from meshinfer.text.tokenizer import Tokenizer
    from helpers.realmodels import DEFAULT, shard_of

    path = model_path(DEFAULT)
    tok = Tokenizer.from_gguf(path)
    lv = Live()
    try:
        peers = lv.enter(mesh([shard_of(DEFAULT, 0, 12), shard_of(DEFAULT, 12, 24)], weights_hash=file_hash(path),
                              bundle=tok.to_bundle(), advert_ttl_s=30.0))
        yield lv, peers, lv.enter(serving(peers[0].addrs))
    finally:
        lv.close()


PROMPT = "Name three primary colors, in one short sentence."


@pytest.mark.realmodel
def test_typed_prompt_streams_the_same_text_as_meshinfer_chat(real_served, browser, tmp_path):
    from helpers.meshkit import chat_json

    live, peers, server = real_served
    chat = live.run(chat_json(peers[0].addrs[0], [{"role": "user", "content": PROMPT}], tmp_path, max_tokens=16))
    open_page(browser, server)
    wait_for(browser, "document.getElementById('model').value !== ''", what="a model")
    reply = ask(browser, PROMPT, max_tokens=16)
    browser.save_screenshot(str(tmp_path / "chat.png"))
    assert chat["text"] and "`" not in chat["text"]  # the page renders backticks as code
    assert reply["text"] == chat["text"] and reply["error"] is None
    assert reply["finish"] == chat["finish_reason"]
    assert "tok/s" in reply["stats"] and "TTFT" in reply["stats"] and "2 hop(s)" in reply["stats"]
    assert "UNVERIFIED: 2 hop(s) nobody checked" in reply["stats"]  # no peer serves either hop's layers twice


@pytest.mark.realmodel
def test_mesh_view_lists_both_peers_and_the_route_of_the_last_reply(real_served, browser, tmp_path):
    from helpers.realmodels import DEFAULT

    live, peers, server = real_served
    open_page(browser, server)
    ask(browser, "Say hi.", max_tokens=4)
    show(browser, "mesh")
    wait_for(browser, "document.querySelectorAll('#peers tr[data-state=ready]').length === 2", what="both peers")
    wait_for(browser, "document.querySelectorAll('#last-route tr.hop').length === 2", what="the route")
    assert set(peer_states(browser)) == {p.peer_id for p in peers}
    assert strips(browser) == [["1"] * 24]
    hops = browser.execute_script("""return [...document.querySelectorAll('#last-route tr.hop')].map(r =>
        [r.children[3].textContent, +r.querySelector('.compute').textContent, +r.querySelector('.network').textContent]);""")
    assert [h[0] for h in hops] == ["0-11", "12-23"] and all(c > 0 and n >= 0 for _, c, n in hops)
    assert DEFAULT in browser.find_element("id", "groups").text
    browser.save_screenshot(str(tmp_path / "mesh.png"))
