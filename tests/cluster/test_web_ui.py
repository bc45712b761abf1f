"""The web view in a real browser (Debian's chromium, headless, driven over WebDriver) against a real control plane
and Ray: the jobs page lists a job, a running job's curves gain points as steps arrive, a second tenant's token lists
none of the first tenant's jobs, and /docs works offline. Screenshots go to .test-output/screenshots/."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from harness.local_control_plane import REPO_ROOT, wait_for_state
from ringmaster.service import auth
from ringmaster.service.db import session_scope

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

SCREENSHOTS = Path(os.environ.get("RINGMASTER_SCREENSHOTS", REPO_ROOT / ".test-output" / "screenshots"))


@pytest.fixture(scope="module")
def browser():
    chromium, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver_path):
        message = (
            "the web view is tested in Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)"
        )
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    from selenium import webdriver

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1400,1100",
    ):
        options.add_argument(argument)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=driver_path))
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def _wait(what: str, condition, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while not (result := condition()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:.0f}s"
        time.sleep(0.2)
    return result


def _read_when_shown(browser, what: str, selector: str, read):
    """read(element) of the first element the selector finds, once there is one. The page re-renders as the job's
    stream updates it: an element found a moment ago may be gone by the time it is read, and is then found again."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    def found_and_read():
        try:
            elements = browser.find_elements(By.CSS_SELECTOR, selector)
            return [read(elements[0])] if elements else None
        except StaleElementReferenceException:
            return None

    return _wait(what, found_and_read)[0]


def _wait_for_element(browser, by: str, value: str, timeout_s: float = 30.0):
    """The element once the page has it. A CI run once found no token field just after `get` returned; if that
    recurs, the failure says which page the browser was on and keeps its screenshot."""
    from selenium.webdriver.common.by import By

    try:
        return _wait(repr(value), lambda: browser.find_elements(by, value), timeout_s)[0]
    except AssertionError:
        _shot(browser, f"missing-{value}")
        body = browser.find_elements(By.TAG_NAME, "body")
        pytest.fail(
            f"no {value!r} within {timeout_s:.0f}s on {browser.current_url} (title {browser.title!r}, "
            f"readyState {browser.execute_script('return document.readyState')!r}): "
            f"{(body[0].text if body else browser.page_source)[:500]!r}"
        )


def _use_token(browser, url: str, token: str) -> None:
    from selenium.webdriver.common.by import By

    browser.get(f"{url}/ui")
    field = _wait_for_element(browser, By.ID, "token")
    field.clear()
    field.send_keys(token)
    browser.find_element(By.CSS_SELECTOR, "#token-form button[type=submit]").click()
    _wait("the token taken", lambda: "tenant" in browser.find_element(By.ID, "whoami").text)


def _shot(browser, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(SCREENSHOTS / f"{name}.png"))


def _points(browser, chart: str) -> int:
    """Points the chart shows; 0 while the page has not drawn it yet (the URL changes before the page renders)."""
    from selenium.webdriver.common.by import By

    found = browser.find_elements(By.ID, chart)
    return int(found[0].get_attribute("data-points")) if found else 0


def test_jobs_page_a_live_job_page_and_tenants_apart(ray_server, browser) -> None:
    from selenium.webdriver.common.by import By

    client = ray_server.client()
    job = client.submit(
        {
            "name": "web-view",
            "model": "mlp",
            "strategy": "ddp",
            "workers": {"min": 2, "max": 2, "cpus_per_worker": 1},
            "train": {"steps": 100000, "global_batch_size": 16, "micro_batch_size": 8, "lr": 0.01},
            "checkpoint": {"every_steps": 0},
        }
    )
    try:
        wait_for_state(client, job["id"], {"RUNNING"}, timeout_s=120)
        _use_token(browser, ray_server.url, ray_server.token)
        row = _wait("the job listed", lambda: browser.find_elements(By.CSS_SELECTOR, f'tr[data-job-id="{job["id"]}"]'))
        assert "web-view" in row[0].text and "RUNNING" in row[0].text
        _shot(browser, "jobs")

        row[0].find_element(By.TAG_NAME, "a").click()
        _wait("the job page", lambda: browser.current_url.endswith(f"/ui/jobs/{job['id']}"))
        first = _wait("loss points", lambda: _points(browser, "chart-loss"))
        _wait("more loss points as steps arrive", lambda: _points(browser, "chart-loss") >= first + 10, timeout_s=90)
        for chart in ("chart-speed", "chart-lr", "chart-grad-norm", "chart-world-size"):
            assert _points(browser, chart) > 0, chart
        # The facts line refreshes every 5 s: it may have been drawn before the first step was reported.
        facts = _wait(
            "the facts line with the world size",
            lambda: "world size 2" in (text := browser.find_element(By.ID, "facts").text) and text,
            timeout_s=30,
        )
        assert "state RUNNING" in facts
        assert browser.find_elements(By.CSS_SELECTOR, "#chart-loss canvas"), "uPlot drew no canvas"
        assert any(
            "training on 2 workers" in cell.text for cell in browser.find_elements(By.CSS_SELECTOR, "#events td")
        )
        _wait("the driver's log tail", lambda: "step " in browser.find_element(By.ID, "log").text, timeout_s=30)
        _shot(browser, "job-running")

        with session_scope(ray_server.app.state.db.sessions) as session:
            other = auth.create_token(session, "web-other-team").secret
        _use_token(browser, ray_server.url, other)
        browser.get(f"{ray_server.url}/ui")
        _wait("the other tenant's empty list", lambda: "0 job(s)" in browser.find_element(By.TAG_NAME, "main").text)
        assert not browser.find_elements(By.CSS_SELECTOR, f'tr[data-job-id="{job["id"]}"]')
        _shot(browser, "jobs-other-tenant")
    finally:
        client.cancel(job["id"])


def test_a_failed_job_is_listed_with_its_reason_in_one_line(ray_server, browser) -> None:
    """The job's input at fault: its one-line error; the user's code raised: the exception its traceback ends in."""

    client = ray_server.client()
    missing = "/nonexistent/web-ui/train.bin"
    small = {"workers": {"min": 1, "max": 1}, "train": {"steps": 2, "global_batch_size": 4, "micro_batch_size": 4}}
    bad_input = client.submit(
        {"name": "web-bad-input", "model": "tiny-gpt", "data": {"kind": "tokens", "path": missing}, **small}
    )
    raising = client.submit(
        {
            "name": "web-user-code-raised",
            "model": "examples.user_model:build",
            "model_options": {"text_path": "/nonexistent/web-ui/corpus.txt"},
            **small,
        }
    )
    done = {
        job["id"]: wait_for_state(client, job["id"], {"FAILED", "SUCCEEDED", "CANCELLED"}, timeout_s=120)
        for job in (bad_input, raising)
    }
    assert [job["state"] for job in done.values()] == ["FAILED", "FAILED"], done
    assert "Traceback (most recent call last):" in done[raising["id"]]["error"]

    _use_token(browser, ray_server.url, ray_server.token)
    browser.get(f"{ray_server.url}/ui")
    reasons = {
        job_id: _read_when_shown(
            browser, f"job {job_id} listed", f'tr[data-job-id="{job_id}"] td.reason', lambda cell: cell.text
        )
        for job_id in done
    }
    assert (
        reasons[bad_input["id"]]
        == f"data.path: data file '{missing}' does not exist on this node"
        == done[bad_input["id"]]["error"]
    ), reasons
    assert reasons[raising["id"]] == done[raising["id"]]["error"].strip().splitlines()[-1].strip(), reasons
    raised = reasons[raising["id"]]
    assert raised.startswith("FileNotFoundError:") and "/nonexistent/web-ui/corpus.txt" in raised, raised
    _shot(browser, "jobs-failed")
    # On the job's page, the whole traceback, line for line, in a monospace block.
    browser.get(f"{ray_server.url}/ui/jobs/{raising['id']}")
    text, font = _read_when_shown(
        browser,
        "the error on the job page",
        "pre.error",
        lambda block: (block.text, block.value_of_css_property("font-family")),
    )
    assert text.strip() == done[raising["id"]]["error"].strip(), text
    assert "monospace" in font, font


def test_the_plan_and_submit_pages_answer_from_the_api(ray_server, browser) -> None:
    from selenium.webdriver.common.by import By

    _use_token(browser, ray_server.url, ray_server.token)
    browser.get(f"{ray_server.url}/ui/plan")
    _wait_for_element(browser, By.CSS_SELECTOR, "#plan-form button[type=submit]").click()  # 7B parameters on 8 × 80 GB
    table = _wait("the plan's options", lambda: browser.find_elements(By.CSS_SELECTOR, "#plan-result table tr"))
    assert len(table) > 3 and "recommended:" in browser.find_element(By.ID, "plan-result").text
    _shot(browser, "plan")

    browser.get(f"{ray_server.url}/ui/submit")
    spec = _wait_for_element(browser, By.ID, "spec")
    spec.clear()
    spec.send_keys("name: web-bad\nmodel: mlp\ntrain: {steps: 0}\n")
    browser.find_element(By.ID, "submit").click()
    error = _wait("the 422 shown", lambda: browser.find_elements(By.CSS_SELECTOR, "#submit-result .error"))
    assert "train.steps" in error[0].text, error[0].text
    assert not [job for job in ray_server.client().jobs()["items"] if job["name"] == "web-bad"]


def test_docs_work_offline(ray_server, browser) -> None:
    from selenium.webdriver.common.by import By

    browser.get(f"{ray_server.url}/docs")
    _wait(
        "Swagger UI drawn from ringmaster's own assets",
        lambda: browser.find_elements(By.CSS_SELECTOR, ".swagger-ui .opblock"),
        timeout_s=30,
    )
    assert "/v1/jobs" in browser.find_element(By.TAG_NAME, "body").text
    sources = [
        script.get_attribute("src")
        for script in browser.find_elements(By.TAG_NAME, "script")
        if script.get_attribute("src")
    ]
    assert sources and all(source.startswith(ray_server.url) for source in sources), sources
    _shot(browser, "docs")
