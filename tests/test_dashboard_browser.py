"""/dashboard in a real headless browser: Chromium from the distribution's
packages driven by Selenium, the driver's path given so nothing is fetched.
A tiny server on loopback runs agent programs (turns, tool gaps, pins) while
the page is open: the page loads, programs appear on the timeline as they
run, a pin counts its TTL down, the TTL decisions show their inputs, and a
screenshot is taken (under the test's temporary folder; the docs' picture is
made on purpose with AGENTSERVE_DASHBOARD_SCREENSHOT=docs/dashboard.png). On a server with an API key the
page asks for the key before it shows anything."""

from __future__ import annotations

import os
import pathlib
import shutil
import threading
import time

import openai
import pytest

from agentserve.engine.executor import Executor, ExecutorResult
from agentserve.engine.scheduler_output import SchedulerOutput
from server_fixtures import start_tiny_server

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install '.[test]')")

from selenium.common.exceptions import TimeoutException  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser")) if p), None)
CHROMEDRIVER = shutil.which("chromedriver")
if CHROMIUM is None or CHROMEDRIVER is None:
    pytest.skip("no Chromium and chromedriver on PATH (Debian: apt-get install chromium chromium-driver)",
                allow_module_level=True)

# each turn declares only the tool it calls: the tiny model's context is 1024 bytes
TOOLS = {name: [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}]
         for name in ("get_weather", "search_docs", "run_tests")}


class Paced(Executor):
    """The tiny model at the pace of a real one, so turns and queueing are wide enough to see."""

    def __init__(self, inner: Executor, step_s: float) -> None:
        self.inner, self.step_s = inner, step_s

    def execute(self, output: SchedulerOutput) -> ExecutorResult:
        time.sleep(self.step_s)
        return self.inner.execute(output)

    def release(self, request_id: str) -> None:
        self.inner.release(request_id)


def _call(tool: str) -> str:
    return '<tool_call>\n{"name": "%s", "arguments": {"q": "x"}}\n</tool_call>' % tool


@pytest.fixture(scope="module")
def browser():
    offline = os.environ.get("SE_OFFLINE")
    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager, should anything call it, stays off the network
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,1050",
                "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-default-apps", "--disable-extensions", "--hide-scrollbars",
                # loopback only: any other name resolves to nothing
                "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1"):
        opts.add_argument(arg)
    try:
        driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=opts)
        driver.set_page_load_timeout(30)
        yield driver
        driver.quit()
    finally:
        if offline is None:
            del os.environ["SE_OFFLINE"]
        else:
            os.environ["SE_OFFLINE"] = offline


def _wait(driver, what, timeout: float = 30.0, message: str = ""):
    return WebDriverWait(driver, timeout, poll_frequency=0.1).until(what, message)


def _agent(client, scripted, pid: str, tools: list[str], gap: float, ttl: float | None, stop: threading.Event,
           errors: list):
    try:
        _turns(client, scripted, pid, tools, gap, ttl, stop)
    except Exception as e:  # reported by the test
        errors.append(f"{pid}: {type(e).__name__}: {e}")


def _turns(client, scripted, pid: str, tools: list[str], gap: float, ttl: float | None, stop: threading.Event):
    """One program: a turn per tool, each followed by the tool's `gap`; then a last turn that ends it."""
    msgs = [{"role": "user", "content": f"task of {pid}"}]
    for i, tool in enumerate(tools):
        if stop.is_set():
            return
        scripted.script(pid, _call(tool))
        extra = {"ttl": ttl} if ttl is not None else {}
        r = client.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS[tool], extra_body=extra,
                                           extra_headers={"X-Program-Id": pid})
        assert r.choices[0].message.tool_calls, (pid, i, r.choices[0])
        call = r.choices[0].message.tool_calls[0]
        msgs += [r.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": f"result {i}"}]
        stop.wait(gap)
    scripted.script(pid, "Done.")
    client.chat.completions.create(model="tiny", messages=msgs, extra_headers={"X-Program-Id": pid,
                                                                               "X-Program-End": "true"})


def _traffic(server_url: str, scripted, stop: threading.Event, errors: list) -> list[threading.Thread]:
    client = openai.OpenAI(base_url=server_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    plans = [("swe-agent-1", ["search_docs", "run_tests", "run_tests"], 2.0, 25.0),
             ("swe-agent-2", ["run_tests", "search_docs", "run_tests"], 3.5, 2.5),
             ("web-agent-3", ["get_weather", "get_weather", "search_docs"], 1.5, None),
             ("web-agent-4", ["search_docs", "get_weather", "search_docs"], 4.0, 30.0),
             ("quiet-agent-5", ["run_tests"], 60.0, 40.0)]  # its tool never returns during the test
    threads = []
    for k, (pid, tools, gap, ttl) in enumerate(plans):
        t = threading.Thread(target=_agent, args=(client, scripted, pid, tools, gap, ttl, stop, errors),
                             daemon=True)
        threads.append(t)
        t.start()
        stop.wait(0.7)

    def long_decode():  # a long answer that is running when the screenshot is taken
        try:
            while not stop.is_set():
                client.completions.create(model="tiny", prompt="a long story", max_tokens=200,
                                          extra_body={"ignore_eos": True})
        except Exception as e:
            errors.append(f"long decode: {type(e).__name__}: {e}")

    t = threading.Thread(target=long_decode, daemon=True)
    t.start()
    threads.append(t)
    return threads


def test_dashboard_updates_live_and_writes_a_screenshot(browser, tmp_path):
    screenshot = pathlib.Path(os.environ.get("AGENTSERVE_DASHBOARD_SCREENSHOT") or tmp_path / "dashboard.png")
    srv, llm, scripted = start_tiny_server(api_key=None, kv_cache_tokens=4096, host_kv_tokens=8192, max_num_seqs=3)
    scripted.inner = Paced(scripted.inner, 0.02)
    stop = threading.Event()
    threads: list[threading.Thread] = []
    errors: list[str] = []
    try:
        browser.get(srv.url + "/dashboard")
        _wait(browser, lambda d: d.find_element(By.ID, "status").text == "live", message="the page never went live")
        assert browser.find_element(By.ID, "scope").text == "all programs (no API key)"
        assert not browser.find_elements(By.CSS_SELECTOR, "#timeline g.program")
        Select(browser.find_element(By.ID, "window")).select_by_value("15")
        threads = _traffic(srv.url, scripted, stop, errors)
        # programs appear on the timeline while they run
        _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, '#timeline g.program[data-program="swe-agent-1"]'),
              message="the first program never appeared")
        # a pin with its TTL counting down (the quiet program's: its tool never returns)
        sel = '#pins tr[data-program="quiet-agent-5"] .ttl-left'
        _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, sel), message="no pin shown")
        first = browser.find_element(By.CSS_SELECTOR, sel).text
        time.sleep(1.2)
        later = browser.find_elements(By.CSS_SELECTOR, sel)
        assert later and later[0].text != first, "the TTL did not count down"
        # the TTL decisions with their inputs
        _wait(browser, lambda d: any("search_docs" in r.text and "hint" in r.text
                                     for r in d.find_elements(By.CSS_SELECTOR, "#decisions tbody tr")),
              message="no TTL decision shown")
        _wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#timeline g.program")) >= 5, timeout=30,
              message="not every program appeared")
        legend = browser.find_element(By.ID, "kv-legend").text
        assert "running" in legend and "pinned" in legend and "cached" in legend and "free" in legend
        _wait(browser, lambda d: "host copies" in d.find_element(By.ID, "host-legend").text)
        # let a few turns and gaps accumulate, then take the picture while the programs still run
        time.sleep(5)
        states = {g.get_attribute("data-program"): g.get_attribute("data-state")
                  for g in browser.find_elements(By.CSS_SELECTOR, "#timeline g.program")}
        assert states.get("quiet-agent-5") == "pinned", states
        assert browser.find_elements(By.CSS_SELECTOR, "#timeline g.program rect"), "no turn drawn"
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        assert browser.save_screenshot(str(screenshot))
        assert screenshot.stat().st_size > 20_000
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        srv.stop()
    assert not errors, errors


def test_with_api_keys_the_page_asks_for_one_and_shows_only_its_tenant(browser):
    srv, _, _ = start_tiny_server(api_key="key-a", config={"api_keys": {"key-b": "team-b"}})
    try:
        for key, pid in (("key-a", "mine-1"), ("key-b", "theirs-1")):
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=60)
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                           extra_headers={"X-Program-Id": pid})
        browser.get(srv.url + "/dashboard")
        form = _wait(browser, lambda d: d.find_element(By.ID, "keyform") if d.find_element(By.ID, "keyform")
                     .is_displayed() else None, message="the page did not ask for the key")
        assert not browser.find_element(By.ID, "main").is_displayed()
        form.find_element(By.ID, "key").send_keys("not-the-key")
        form.find_element(By.ID, "keysubmit").click()
        _wait(browser, lambda d: "not accepted" in d.find_element(By.ID, "keyerror").text)
        assert not browser.find_element(By.ID, "main").is_displayed()
        key = browser.find_element(By.ID, "key")
        key.clear()
        key.send_keys("key-a")
        browser.find_element(By.ID, "keysubmit").click()
        try:
            _wait(browser, lambda d: d.find_element(By.ID, "main").is_displayed(), timeout=10)
        except TimeoutException:
            pytest.fail("the right key did not open the dashboard")
        assert browser.find_element(By.ID, "scope").text == "tenant api-key-1 (its programs only)"
        _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, '#timeline g.program[data-program="mine-1"]'),
              message="the tenant's own program is not shown")
        shown = {g.get_attribute("data-program") for g in browser.find_elements(By.CSS_SELECTOR, "#timeline g.program")}
        assert shown == {"mine-1"} and "theirs" not in browser.page_source
        legend = browser.find_element(By.ID, "kv-legend").text
        assert "other" in legend and "cached" not in legend  # a tenant sees only its own blocks
    finally:
        srv.stop()
