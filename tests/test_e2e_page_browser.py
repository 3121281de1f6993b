"""The page at / in a real browser: headless Chromium (Debian's chromium + chromium-driver, driven by selenium)
against a real server on the built-in model with all three tiers. It loads the page, sends a chat and sees the
streamed answer, repeats it and sees the device share of the prompt rise, stops a long answer, sees the tier bars
change after /flush_cache, and opens the machine tab; a screenshot of each state is kept (build/test-artifacts/page/,
or $TIERLM_TEST_ARTIFACTS) and checked to be non-blank. Skipped, with the reason, where Chromium or selenium is
missing (.ci/run installs both where apt-get is available)."""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest

from e2e_server import ServerProcess, start_server
from test_builtin_model import RUN_C_NEW_TOKENS, RUN_C_TEXT

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
# 40+ tokens, so whole 16-token pages of its KV are cached and reused by the repeat
PROMPT = ("Once upon a time there was a little dog named Max who liked to run in the park with his friends every "
          "day, and one day he found a red ball.")
WAIT_S = 60


def _skip_reason() -> str | None:
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[browser]'; .ci/run does)"
    if not CHROMIUM or not CHROMEDRIVER:
        return ("headless Chromium is not installed (Debian: apt-get install chromium chromium-driver; .ci/run does "
                "where apt-get is available)")
    return None


if _skip_reason():
    pytest.skip(_skip_reason(), allow_module_level=True)

from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402


@pytest.fixture(scope="module")
def artifacts() -> Path:
    folder = Path(os.environ.get("TIERLM_TEST_ARTIFACTS") or REPO / "build" / "test-artifacts") / "page"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    l3 = tmp_path_factory.mktemp("page_l3")
    with start_server(["--skip-warmup", "--enable-hierarchical-cache", "--hicache-ratio", "2",
                       "--hicache-storage-backend", "file"],
                      env={"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(l3), "TIERLM_NO_PROGRESS": "1",
                           "HF_HUB_OFFLINE": "1"},
                      log_dir=tmp_path_factory.mktemp("page_logs")) as s:
        yield s


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,800", "--no-first-run", "--disable-extensions"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_window_size(1280, 800)
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(driver: Any, what: str, check: Callable[[Any], Any], timeout: float = WAIT_S) -> Any:
    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(check, message=f"waited for {what}")


# The screenshot decoded by the browser itself (a canvas), so no image library is needed: how many distinct
# colours it has and the share of its most common one.
COLOUR_STATS = """
const [png, done] = arguments;
const img = new Image();
img.onload = () => {
  const c = document.createElement("canvas");
  c.width = img.width; c.height = img.height;
  const g = c.getContext("2d");
  g.drawImage(img, 0, 0);
  const px = g.getImageData(0, 0, c.width, c.height).data;
  const counts = new Map();
  for (let i = 0; i < px.length; i += 4) {
    const k = (px[i] << 16) | (px[i + 1] << 8) | px[i + 2];
    counts.set(k, (counts.get(k) || 0) + 1);
  }
  done({width: c.width, height: c.height, colours: counts.size,
        top_share: Math.max(...counts.values()) / (px.length / 4)});
};
img.onerror = () => done(null);
img.src = "data:image/png;base64," + png;
"""


def screenshot(driver: Any, folder: Path, name: str) -> None:
    png = driver.get_screenshot_as_base64()
    (folder / f"{name}.png").write_bytes(__import__("base64").b64decode(png))
    stats = driver.execute_async_script(COLOUR_STATS, png)
    assert stats is not None, f"{name}.png does not decode"
    assert stats["colours"] > 20 and stats["top_share"] < 0.97, f"{name}.png looks blank: {stats}"


def answers(driver: Any) -> list[Any]:
    return driver.find_elements(By.CSS_SELECTOR, "#messages li.msg.assistant")


def finished_answer(driver: Any, count: int) -> Any:
    def check(d: Any) -> Any:
        items = answers(d)
        return items[-1] if len(items) == count and items[-1].get_attribute("data-state") != "streaming" else False
    return wait_for(driver, f"answer {count} to finish", check)


def kv_split(answer: Any) -> dict[str, int]:
    kv = answer.find_element(By.CSS_SELECTOR, ".kv")
    return {k: int(kv.get_attribute(f"data-{k}")) for k in ("device", "host", "storage", "computed")}


def send(driver: Any, text: str, temperature: str = "0", max_tokens: str = "24") -> None:
    for field, value in (("temperature", temperature), ("max-tokens", max_tokens)):
        box = driver.find_element(By.ID, field)
        box.clear()
        box.send_keys(value)
    prompt = driver.find_element(By.ID, "prompt")
    prompt.clear()
    prompt.send_keys(text)
    driver.find_element(By.ID, "send").click()


def tier_cached(driver: Any, tier: str) -> int:
    """The tier bar's cached pages (-1 while the bar is being redrawn by the page's poll)."""
    value = driver.execute_script(f"const t = document.getElementById('tier-{tier}'); return t && t.dataset.cached")
    return int(value) if value is not None else -1


def test_the_page_shows_the_story_and_where_its_kv_came_from(server: ServerProcess, browser: Any,
                                                             artifacts: Path) -> None:
    d = browser
    d.get(server.url + "/")
    wait_for(d, "the model name", lambda d: d.find_element(By.ID, "model-name").text == "stories260K")
    wait_for(d, "the tier bars", lambda d: d.find_elements(By.ID, "tier-storage"))
    screenshot(d, artifacts, "1-loaded")

    send(d, PROMPT)
    first = finished_answer(d, 1)
    assert first.get_attribute("data-state") == "done"
    assert first.find_element(By.CSS_SELECTOR, ".text").text.strip()  # the streamed story
    cold, first_text = kv_split(first), first.find_element(By.CSS_SELECTOR, ".text").text
    assert cold["computed"] > 0 and cold["device"] == 0
    assert first.find_element(By.CSS_SELECTOR, ".kv").get_attribute("data-ttft-ms") != ""
    screenshot(d, artifacts, "2-first-answer")

    d.find_element(By.ID, "clear").click()  # a new chat with the same prompt: the same prompt tokens again
    send(d, PROMPT)
    again = finished_answer(d, 1)
    warm = kv_split(again)
    assert warm["device"] > cold["device"] and warm["computed"] < cold["computed"]
    assert again.find_element(By.CSS_SELECTOR, ".text").text == first_text  # greedy: the KV reused is exact
    wait_for(d, "the device tier to show cached pages", lambda d: tier_cached(d, "device") > 0)
    screenshot(d, artifacts, "3-repeat-from-device")


def test_stop_aborts_a_long_answer(server: ServerProcess, browser: Any, artifacts: Path) -> None:
    d = browser
    d.find_element(By.ID, "clear").click()
    send(d, "Once upon a time", temperature="1", max_tokens="450")
    wait_for(d, "the first streamed words",
             lambda d: answers(d) and answers(d)[-1].find_element(By.CSS_SELECTOR, ".text").text.strip())
    d.find_element(By.ID, "stop").click()
    stopped = finished_answer(d, 1)
    assert stopped.get_attribute("data-state") == "stopped"
    assert d.find_element(By.ID, "send").is_enabled() and not d.find_element(By.ID, "stop").is_enabled()
    deadline = time.monotonic() + WAIT_S  # the abort reached the server: nothing left running there
    while httpx.get(f"{server.url}/tiers").json()["requests"]["running"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert httpx.get(f"{server.url}/tiers").json()["requests"]["running"] == 0
    screenshot(d, artifacts, "4-stopped")


def test_flush_cache_empties_the_tier_bars(server: ServerProcess, browser: Any, artifacts: Path) -> None:
    d = browser
    wait_for(d, "cached pages on the device", lambda d: tier_cached(d, "device") > 0)
    assert httpx.post(f"{server.url}/flush_cache").status_code == 200
    wait_for(d, "the device bar to empty", lambda d: tier_cached(d, "device") == 0)
    assert tier_cached(d, "host") == 0
    screenshot(d, artifacts, "5-after-flush")


def test_machine_tab_and_a_phone_screen(server: ServerProcess, browser: Any, artifacts: Path) -> None:
    d = browser
    d.find_element(By.ID, "tab-machine").click()
    machine = d.find_element(By.ID, "view-machine")
    wait_for(d, "the machine facts", lambda d: "torch" in machine.text and "float32" in machine.text)
    assert d.find_element(By.ID, "reasons").find_elements(By.TAG_NAME, "li")
    screenshot(d, artifacts, "6-machine")
    d.find_element(By.ID, "tab-main").click()
    d.set_window_size(390, 844)  # a phone
    try:
        wide = d.execute_script("return document.documentElement.scrollWidth - window.innerWidth")
        assert wide <= 0, f"the page is {wide}px wider than a phone screen"
        screenshot(d, artifacts, "7-phone")
    finally:
        d.set_window_size(1280, 800)


def test_serve_without_a_model_asks_the_key_once_and_tells_the_run_c_story(tmp_path: Path, browser: Any) -> None:
    """`tierlm serve` with no model (only a key, hub off): the key is typed once and kept for the tab, and the page's
    greedy chat answer to "Once upon a time" is llama2.c run.c's text."""
    d = browser
    with start_server(["--skip-warmup", "--api-key", "page-key"], env={"TIERLM_NO_PROGRESS": "1",
                      "HF_HUB_OFFLINE": "1"}, log_dir=tmp_path) as keyed:
        d.get(keyed.url + "/")
        form = d.find_element(By.ID, "key-form")
        wait_for(d, "the key form", lambda d: form.is_displayed())
        d.find_element(By.ID, "key-input").send_keys("page-key")
        d.find_element(By.CSS_SELECTOR, "#key-form button").click()
        wait_for(d, "the model name", lambda d: d.find_element(By.ID, "model-name").text == "stories260K")
        d.refresh()  # the same tab: the key is still there, no form
        wait_for(d, "the model name again", lambda d: d.find_element(By.ID, "model-name").text == "stories260K")
        assert not d.find_element(By.ID, "key-form").is_displayed()
        send(d, "Once upon a time", temperature="0", max_tokens=str(RUN_C_NEW_TOKENS))
        answer = finished_answer(d, 1)
        assert answer.get_attribute("data-state") == "done"
        assert answer.find_element(By.CSS_SELECTOR, ".text").get_attribute("textContent") == RUN_C_TEXT
