"""/dashboard in a real browser: headless Chromium (Debian's package, driven by selenium through
chromium-driver) loads the page from a running ``pagellm serve`` under load, is asked for the API
key, draws all 1,024 blocks and shows a known request's blocks; a screenshot is kept."""
from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time

import httpx
import pytest
from server_utils import API_KEY, MODEL_NAME, ServerProcess

NUM_BLOCKS = 1024
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


def ensure_chromium() -> None:
    """Install Debian's chromium and chromium-driver where they are missing (CI runs as root on
    a fresh machine); a machine where this test cannot install them skips it, saying why."""
    if os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER):
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip(f"{CHROMIUM} or {CHROMEDRIVER} is missing and apt-get cannot run here "
                    "(install the Debian packages chromium and chromium-driver)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"],
                ["apt-get", "install", "-y", "-qq", "chromium", "chromium-driver"]):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}"


@pytest.fixture(scope="module")
def browser():
    ensure_chromium()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1320,1000"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def big_server(tiny_model, tmp_path_factory):
    proc = ServerProcess(tiny_model, tmp_path_factory.mktemp("logs") / "dashboard.log",
                         "--api-key", API_KEY, "--num-gpu-blocks-override", str(NUM_BLOCKS),
                         "--block-size", "4")
    proc.wait_ready()
    yield proc
    assert proc.stop() == 0, proc.log()


class Load:
    """Threads that send streaming completions one after another until ``close`` (or a
    deadline), so that the engine stays busy while the browser looks."""

    def __init__(self, url: str, num_threads: int, max_tokens: int, deadline_s: float = 60):
        self.url, self.max_tokens = url, max_tokens
        self.deadline = time.monotonic() + deadline_s
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                        for i in range(num_threads)]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        with httpx.Client(base_url=self.url, headers=AUTH, timeout=60) as http:
            n = 0
            while not self.stop.is_set() and time.monotonic() < self.deadline:
                body = {"model": MODEL_NAME, "max_tokens": self.max_tokens - 40 * (n % 3),
                        "prompt": f"Request {i}.{n}: " + "the blocks " * (4 + 3 * i),
                        "ignore_eos": True, "stream": True}
                with http.stream("POST", "/v1/completions", json=body) as response:
                    for _ in response.iter_lines():
                        if self.stop.is_set():
                            return
                n += 1

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)


def running_request(url: str) -> str:
    """A request holding device blocks right now, with the most tokens still to come."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        view = httpx.get(f"{url}/stats/blocks", headers=AUTH, timeout=10).json()
        running = [s for s in view["sequences"] if s["status"] == "running"]
        if running:
            return min(running, key=lambda s: s["num_tokens"])["request_id"]
        time.sleep(0.1)
    raise AssertionError("no request was running")


def test_snapshot_needs_the_key_and_the_page_does_not(big_server):
    assert httpx.get(f"{big_server.url}/stats/blocks").status_code == 401
    page = httpx.get(f"{big_server.url}/dashboard")
    assert page.status_code == 200 and "dashboard.js" in page.text
    assert httpx.get(f"{big_server.url}/dashboard/dashboard.js").status_code == 200
    assert httpx.get(f"{big_server.url}/dashboard/secrets.txt").status_code == 404
    view = httpx.get(f"{big_server.url}/stats/blocks", headers=AUTH).json()
    assert view["num_blocks"] == NUM_BLOCKS and len(view["blocks"]["state"]) == NUM_BLOCKS


def test_dashboard_draws_the_block_map_under_load(big_server, browser, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    load = Load(big_server.url, num_threads=12, max_tokens=400)
    shot = tmp_path / "dashboard.png"
    try:
        browser.get(f"{big_server.url}/dashboard")
        wait = WebDriverWait(browser, 20, poll_frequency=0.1)
        key = wait.until(lambda d: d.find_element(By.ID, "api-key") if d.find_element(
            By.ID, "auth").is_displayed() else None)
        key.send_keys(API_KEY)
        browser.find_element(By.CSS_SELECTOR, "#auth button").click()
        known = running_request(big_server.url)
        selector = f'.grid[data-pool="device"] .block[data-requests~="{known}"]'
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, selector))
        drawn = browser.execute_script(
            'return document.querySelectorAll(\'.grid[data-pool="device"] .block\').length')
        assert drawn == NUM_BLOCKS
        mine = browser.find_elements(By.CSS_SELECTOR, selector)
        assert 0 < len(mine) < NUM_BLOCKS
        # hover a block of its own: a prefix block shared by many lists only the first few
        private = [e for e in mine if e.get_attribute("data-requests") == known]
        target = private[-1] if private else mine[-1]
        ActionChains(browser).move_to_element(target).perform()
        tooltip = wait.until(lambda d: d.find_element(By.ID, "tooltip").text or None)
        assert "ref count" in tooltip and "tokens" in tooltip
        # The page polls live: under this load the request may have been preempted or
        # finished since its block was found, and the block handed to another request. The
        # tooltip names whoever holds the block when it is hovered.
        holders = {known, *(target.get_attribute("data-requests") or "").split()}
        assert any(h in tooltip for h in holders), (holders, tooltip)
        time.sleep(1.0)  # a few more polls, so the picture shows the load growing
        assert "live" in browser.find_element(By.ID, "status").text
    finally:
        browser.save_screenshot(str(shot))  # also of a failure: what the page showed
        print(f"dashboard screenshot: {shot}")
        for entry in browser.get_log("browser"):
            print("browser console:", entry["level"], entry["message"])
        load.close()
