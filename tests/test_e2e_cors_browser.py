"""A browser app on another origin calls tierlm through CORS: headless Chromium (Debian's chromium + chromium-driver,
driven by selenium) loads a page from a second small HTTP server on another port, and the page's fetch() calls a real
tierlm server (built-in model, --api-key, --allowed-origins naming the page's origin): the preflighted completion,
a streamed one and a 401 are all readable by the page, and the answer is run.c's story. The same page served from an
origin that is not listed is refused. Skipped, with the reason, where Chromium or selenium is missing."""
from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from e2e_server import ServerProcess, free_port, start_server
from test_builtin_model import PROMPT, RUN_C_NEW_TOKENS, RUN_C_TEXT
from test_e2e_page_browser import _skip_reason, browser, wait_for  # noqa: F401 - browser is a fixture

pytestmark = pytest.mark.slow

if _skip_reason():
    pytest.skip(_skip_reason(), allow_module_level=True)

from selenium.webdriver.common.by import By  # noqa: E402

KEY = "cors-key"
# The browser app: one preflighted JSON POST with a Bearer key, the same streamed (read as SSE from the body), and a
# request with a wrong key whose 401 body the page can read only if errors carry the CORS header too.
PAGE = """<!doctype html><html><head><meta charset="utf-8"><title>app</title></head><body>
<p id="status">loading</p><pre id="answer"></pre><pre id="streamed"></pre><p id="unauthorized"></p>
<script>
const q = new URLSearchParams(location.search), api = q.get("api");
const headers = {"Authorization": "Bearer " + q.get("key"), "Content-Type": "application/json"};
const body = (stream) => JSON.stringify({model: "stories260K", prompt: q.get("prompt"), temperature: 0,
                                         max_tokens: Number(q.get("n")), stream});
const show = (id, text) => { document.getElementById(id).textContent = text; };
async function plain() {
  const r = await fetch(api + "/v1/completions", {method: "POST", headers, body: body(false)});
  show("answer", (await r.json()).choices[0].text);
}
async function streamed() {
  const r = await fetch(api + "/v1/completions", {method: "POST", headers, body: body(true)});
  const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "", text = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) break;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\\n\\n")) >= 0) {
      const data = buffer.slice(0, end).replace(/^data: /, "");
      buffer = buffer.slice(end + 2);
      if (data !== "[DONE]") for (const c of JSON.parse(data).choices) text += c.text;
    }
  }
  show("streamed", text);
}
async function wrongKey() {
  const r = await fetch(api + "/v1/models", {headers: {"Authorization": "Bearer wrong"}});
  show("unauthorized", r.status + " " + (await r.json()).error.code);
}
(async () => {
  try { await plain(); await streamed(); await wrongKey(); show("status", "done"); }
  catch (e) { show("status", "refused: " + e); }
})();
</script></body></html>"""


class _PageHandler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        data = PAGE.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


def page_server() -> http.server.ThreadingHTTPServer:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), _PageHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


@pytest.fixture(scope="module")
def pages() -> Iterator[tuple[str, str]]:
    """Two origins serving the app: the one tierlm lists, and one it does not (another port is another origin)."""
    listed, other = page_server(), page_server()
    try:
        yield f"http://127.0.0.1:{listed.server_port}", f"http://127.0.0.1:{other.server_port}"
    finally:
        for httpd in (listed, other):
            httpd.shutdown()
            httpd.server_close()


@pytest.fixture(scope="module")
def server(pages: tuple[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with start_server(["--skip-warmup", "--api-key", KEY, "--allowed-origins", pages[0]],
                      env={"TIERLM_NO_PROGRESS": "1", "HF_HUB_OFFLINE": "1"},
                      log_dir=tmp_path_factory.mktemp("cors_logs")) as s:
        yield s


def open_app(driver: Any, origin: str, server: ServerProcess) -> str:
    driver.get(f"{origin}/app.html?api={server.url}&key={KEY}&prompt={PROMPT.replace(' ', '%20')}"
               f"&n={RUN_C_NEW_TOKENS}")
    status = driver.find_element(By.ID, "status")
    wait_for(driver, "the app to finish", lambda d: status.text != "loading", timeout=120)
    return status.text


def text_of(driver: Any, element_id: str) -> str:
    return driver.find_element(By.ID, element_id).get_attribute("textContent")


def test_a_page_on_a_listed_origin_shows_the_answer(browser: Any, pages: tuple[str, str],  # noqa: F811
                                                     server: ServerProcess) -> None:
    assert open_app(browser, pages[0], server) == "done"
    assert text_of(browser, "answer") == RUN_C_TEXT
    assert text_of(browser, "streamed") == RUN_C_TEXT
    assert text_of(browser, "unauthorized") == "401 invalid_api_key"


def test_a_page_on_an_origin_not_listed_is_refused(browser: Any, pages: tuple[str, str],  # noqa: F811
                                                   server: ServerProcess) -> None:
    status = open_app(browser, pages[1], server)
    assert status.startswith("refused: TypeError"), status  # the browser hides the 403 from the page
    assert text_of(browser, "answer") == ""
    assert f"refused OPTIONS /v1/completions: requests from the web page at origin '{pages[1]}'" in server.log_text()
