"""The console in a real headless Chromium (Debian's `chromium` + `chromium-driver`, driven by
selenium through the system chromedriver: nothing is downloaded), served by the real `outbox ui`
command: pages, actions, hostile values, byte-exact edits, and what each role sees (masks, no
button it may not press, an admin's reveal in the audit log). Screenshots of every page go to
test-output/ui/ (or $OUTBOX_TEST_OUTPUT/ui/)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from selenium import webdriver
from selenium.common.exceptions import NoAlertPresentException, WebDriverException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import WebDriverWait

from outbox.drain.workers import Drainer
from outbox.errors import UnknownMessageError
from outbox.records import DeadLetterFilter, NewMessage, Status
from outbox.stores.sqlite import SQLiteOutbox
from outbox.testing.consume import consume
from outbox.testing.ports import free_port
from outbox.ui import security
from outbox.ui.masking import MASK

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
HOSTILE = '<script>alert("pwned")</script><img src=x onerror=alert(1)>'
SHOTS = Path(os.environ.get("OUTBOX_TEST_OUTPUT", ROOT / "test-output")) / "ui"


@pytest.fixture
def console(tmp_path: Path) -> Iterator[tuple[str, SQLiteOutbox, dict[str, list[int]]]]:
    """A SQLite outbox with dead letters, served by `outbox ui` in a child process."""
    path = tmp_path / "console.db"
    store = SQLiteOutbox(str(path))
    now = time.time()
    ids = {
        "big": store.add_dead(
            [NewMessage("orders", b'{"order": %d, "items": [1, 2, 3]}' % i, key=b"customer-%d" % i,
                        msg_id=f"order-{i}", headers=[("trace", b"t-%d" % i)], attempts=3, error_code=10,
                        error_name="MSG_SIZE_TOO_LARGE",
                        last_error="MSG_SIZE_TOO_LARGE (10): Broker: Message size too large")
             for i in range(3)], failed_at=now - 120),
        "auth": store.add_dead(
            [NewMessage("payments", b"card=...", msg_id=f"pay-{i}", attempts=1, error_code=29,
                        error_name="TOPIC_AUTHORIZATION_FAILED",
                        last_error="TOPIC_AUTHORIZATION_FAILED (29): Broker: Topic authorization failed")
             for i in range(2)], failed_at=now - 60),
        "hostile": store.add_dead(
            [NewMessage("orders", HOSTILE.encode(), key=HOSTILE.encode(), msg_id="hostile-1",
                        headers=[("x-evil", HOSTILE.encode())], attempts=5, error_code=-192,
                        error_name="_MSG_TIMED_OUT",
                        last_error=f"_MSG_TIMED_OUT (-192): {HOSTILE}")], failed_at=now),
        "group": store.add_dead(
            [NewMessage("orders.billing.retry-1", b'{"order": %d, "price": "n/a"}' % i, msg_id=f"bill-{i}",
                        headers=[("outbox-original-topic", b"orders"), ("outbox-original-partition", b"0"),
                                 ("outbox-original-offset", b"%d" % (40 + i)), ("outbox-group", b"billing"),
                                 ("outbox-attempt", b"4"), ("outbox-error-class", b"builtins.ValueError")],
                        attempts=4, error_name="builtins.ValueError",
                        last_error="builtins.ValueError (consumer): price is not a number")
             for i in range(2)], failed_at=now - 30),
    }
    store.enqueue([NewMessage("orders", b"waiting", msg_id="order-9")])
    try:
        with serve(path) as base:
            yield base, store, ids
    finally:
        store.close()


@contextlib.contextmanager
def serve(path: Path, *args: str, env: dict[str, str] | None = None, token: str | None = None) -> Iterator[str]:
    """`outbox ui` on the store at `path` (with `args` and `env`), in a child process: its base
    URL once it answers (to `token`, when it needs one)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", "from outbox_cli.main import main; main()", "ui", "--outbox", str(path),
         "--port", str(port), *args],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                headers = {"Authorization": f"Bearer {token}"} if token else {}
                urllib.request.urlopen(urllib.request.Request(base + "/api/stats", headers=headers), timeout=2).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError("outbox ui did not start: " + proc.communicate()[0].decode()) from None
                time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def browser() -> Iterator[WebDriver]:
    for f in (CHROMIUM, CHROMEDRIVER):
        assert os.access(f, os.X_OK), f"{f} is missing: apt-get install chromium chromium-driver"
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM  # with the driver's path below, selenium-manager is never asked
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1000", "--disable-extensions"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def shot(driver: WebDriver, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(SHOTS / f"{name}.png"))


def navigate(driver: WebDriver, element: WebElement) -> None:
    """Click something that loads a new page, and wait until the old page is gone.

    A click returns once the event is dispatched, not once the next page has loaded: reading the
    next page straight away found the old one (seen once in a full run: no #confirm-count yet).
    The old page is marked in its `window`, which a loaded page replaces: asking whether an old
    element went stale instead failed once with chromedriver's "Node with given id does not
    belong to the document", its other way of saying the page is gone. A script that runs while
    the next page loads can fail the same way, so such errors only mean "look again".
    """
    driver.execute_script("window.__outboxOldPage = true")
    element.click()
    WebDriverWait(driver, 30, ignored_exceptions=(WebDriverException,)).until(
        lambda d: d.execute_script("return window.__outboxOldPage === undefined")
    )


def text(driver: WebDriver, css: str) -> str:
    return str(driver.find_element(By.CSS_SELECTOR, css).text)


def no_alert(driver: WebDriver) -> bool:
    try:
        alert = driver.switch_to.alert
    except NoAlertPresentException:
        return True
    return alert is None


def test_filter_redrive_two_purge_one(console: Any, browser: WebDriver) -> None:
    base, store, ids = console
    browser.get(base + "/")
    assert text(browser, "#dead-count") == "8" and text(browser, "#pending-count") == "1"
    assert "billing 2" in text(browser, "#by-group")
    assert "MSG_SIZE_TOO_LARGE (10)" in text(browser, "#by-error")
    shot(browser, "overview")

    # Filter by error, from the list page's form.
    navigate(browser, browser.find_element(By.LINK_TEXT, "Dead letters"))
    field = browser.find_element(By.ID, "f-error")
    field.send_keys("msg_size_too_large")
    navigate(browser, browser.find_element(By.ID, "apply-filter"))
    rows = browser.find_elements(By.CSS_SELECTOR, "input[name=ids]")
    assert sorted(int(r.get_attribute("value") or 0) for r in rows) == ids["big"]
    shot(browser, "dead-letters")

    # Redrive two of them: a confirmation with the dry-run count, then a job with progress.
    browser.find_element(By.ID, f"sel-{ids['big'][0]}").click()
    browser.find_element(By.ID, f"sel-{ids['big'][1]}").click()
    navigate(browser, browser.find_element(By.ID, "redrive-selected"))
    assert text(browser, "#confirm-count") == "2"
    shot(browser, "confirm-redrive")
    navigate(browser, browser.find_element(By.ID, "confirm"))
    WebDriverWait(browser, 30).until(lambda d: text(d, "#job-state") == "done")
    assert text(browser, "#job-done") == "2" and text(browser, "#job-total") == "2"
    shot(browser, "job")

    # Purge the third, confirmed.
    navigate(browser, browser.find_element(By.LINK_TEXT, "Back to the dead letters"))
    rows = browser.find_elements(By.CSS_SELECTOR, "input[name=ids]")
    assert [int(r.get_attribute("value") or 0) for r in rows] == [ids["big"][2]]
    browser.find_element(By.ID, f"sel-{ids['big'][2]}").click()
    navigate(browser, browser.find_element(By.ID, "purge-selected"))
    assert text(browser, "#confirm-count") == "1"
    shot(browser, "confirm-purge")
    navigate(browser, browser.find_element(By.ID, "confirm"))
    assert text(browser, "#notice") == "Purged 1 dead letter(s)."
    assert text(browser, "#empty") == "No dead letters match."

    # The store afterwards: two pending again (attempts reset), one gone, the others untouched.
    redriven = [store.get(i) for i in ids["big"][:2]]
    assert [(r.status, r.attempts) for r in redriven] == [(Status.PENDING, 0)] * 2
    with pytest.raises(UnknownMessageError):
        store.get(ids["big"][2])
    assert [r.id for r in store.list_dead()] == ids["auth"] + ids["hostile"] + ids["group"]

    # Every action is in the audit log.
    browser.get(base + "/audit")
    audit = text(browser, "#audit")
    assert "redrive (done) " in audit and "purge " in audit and "local" in audit
    shot(browser, "audit")

    browser.get(base + "/trace?msg_id=order-0")
    assert "pending" in text(browser, "#trace")
    shot(browser, "trace")
    assert store.count_dead(DeadLetterFilter(error="MSG_SIZE_TOO_LARGE")) == 0


def test_hostile_value_renders_as_text(console: Any, browser: WebDriver) -> None:
    base, _store, ids = console
    [hostile] = ids["hostile"]
    browser.get(f"{base}/dead-letters/{hostile}")
    assert no_alert(browser)
    assert text(browser, "#value") == HOSTILE  # shown as the text it is
    assert HOSTILE in text(browser, "#headers") and HOSTILE in text(browser, "#last-error")
    assert browser.find_elements(By.CSS_SELECTOR, "main script, main img") == []  # nothing became markup
    shot(browser, "dead-letter")
    browser.get(f"{base}/dead-letters?error=-192")
    assert no_alert(browser) and browser.find_elements(By.CSS_SELECTOR, "main script, main img") == []
    assert "<script>alert" in text(browser, "#dead-letters")
    shot(browser, "hostile-list")


def test_save_and_redrive_unchanged_sends_the_stored_bytes(
    tmp_path: Path, browser: WebDriver, kafka_bootstrap: str, make_topic: Callable[..., str]
) -> None:
    """Each dead letter opened in the browser and submitted unchanged reaches Kafka byte for byte:
    compact JSON (not its pretty view), binary and non-UTF-8 bytes, text with line breaks, empty
    and null values and headers."""
    topic = make_topic(partitions=1)
    compact = b'{"note":"%s","n":[1,2,3]}' % (b"x" * 3000)
    letters = [
        (compact, [("h", b"\xff\xfe binary"), ("json", b'{"a":1}')]),
        (b"\xff\xfe\x00 binary", [("empty", b""), ("none", None), ("pad", b"  x  ")]),
        (b"\nfirst line empty\nsecond", [("crlf", b"a\r\nb"), ("name: colon", b"v")]),
        (b"windows\r\nline", []),
        (b"", [("h", b"\x00")]),
        (None, [("only", b"header")]),
    ]
    path = tmp_path / "edit.db"
    store = SQLiteOutbox(str(path))
    try:
        ids = store.add_dead([NewMessage(topic, v, key=b"k%d" % n, msg_id=f"edit-{n}", headers=h, attempts=3)
                              for n, (v, h) in enumerate(letters)], failed_at=time.time())
        with serve(path) as base:
            for i in ids:
                browser.get(f"{base}/dead-letters/{i}")
                navigate(browser, browser.find_element(By.ID, "edit-redrive"))
                assert "Edited and redriven" in text(browser, "#notice")
        shot(browser, "edited-unchanged")
        assert [store.get(i).status for i in ids] == [Status.PENDING] * len(ids)
        assert Drainer(store, {"bootstrap.servers": kafka_bootstrap}).run(until_empty=True).delivered == len(ids)
        got = consume(kafka_bootstrap, topic, expected=len(ids), timeout=30)
        # The drain adds its own outbox-* headers (the id, the attempt); the rest are the letter's.
        by_id = {dict(m.headers() or [])["outbox-id"]: m for m in got}
        assert len(got) == len(by_id) == len(letters)
        for n, (value, headers) in enumerate(letters):
            m = by_id[b"edit-%d" % n]
            assert (m.key(), m.value()) == (b"k%d" % n, value)
            assert [h for h in m.headers() or [] if not h[0].startswith("outbox-")] == headers
    finally:
        store.close()


VIEWER, OPERATOR, ADMIN = "viewer-token-0123456789", "operator-token-0123456789", "admin-token-0123456789"
CARD, PASSWORD, BEARER = "4111 1111 1111 1111", "hunter2-Pa55", "Bearer eyJhbGciOi.secret-part"
SECRETS = (CARD, PASSWORD, "secret-part", "4111111111111111")


@pytest.fixture
def roles_console(tmp_path: Path) -> Iterator[tuple[str, SQLiteOutbox, list[int]]]:
    """Dead letters holding secrets, served by `outbox ui` with a token per role: the viewer's
    and the admin's from files, the operator's from its environment variable."""
    path = tmp_path / "roles.db"
    store = SQLiteOutbox(str(path))
    value = json.dumps({"order": 42, "card": {"number": CARD}, "user": {"name": "Ann", "password": PASSWORD}})
    ids = store.add_dead([
        NewMessage("orders", value.encode(), key=b"customer-42", msg_id="secret-1",
                   headers=[("authorization", BEARER.encode()), ("trace", b"t-1")], attempts=2,
                   error_name="builtins.ValueError", last_error=f"builtins.ValueError (consumer): bad card {CARD}"),
        NewMessage("payments", f"card={CARD} password={PASSWORD}".encode(), msg_id="secret-2", attempts=1,
                   error_code=10, error_name="MSG_SIZE_TOO_LARGE", last_error="MSG_SIZE_TOO_LARGE (10): too big"),
    ], failed_at=time.time())
    (tmp_path / "viewer").write_text(VIEWER + "\n")
    (tmp_path / "admin").write_text(ADMIN + "\n")
    args = ("--viewer-token-file", str(tmp_path / "viewer"), "--admin-token-file", str(tmp_path / "admin"))
    try:
        with serve(path, *args, env={"OUTBOX_UI_OPERATOR_TOKEN": OPERATOR}, token=VIEWER) as base:
            yield base, store, ids
    finally:
        store.close()


def sign_in(driver: WebDriver, base: str, token: str) -> None:
    driver.get(f"{base}/login?token={token}")
    WebDriverWait(driver, 30).until(lambda d: d.find_elements(By.ID, "role"))


ACTIONS = ("selection", "redrive-selected", "purge-selected", "redrive-filter", "purge-filter", "edit-form",
           "edit-redrive", "reveal-form", "reveal")


def test_a_viewer_never_sees_a_masked_value_or_an_action(roles_console: Any, browser: WebDriver) -> None:
    base, store, [secret, text_letter] = roles_console
    before = (store.messages(), store.audit_log())
    sign_in(browser, base, VIEWER)
    assert text(browser, "#role") == "viewer"
    pages = ["/", "/dead-letters", f"/dead-letters/{secret}", f"/dead-letters/{text_letter}",
             "/trace?msg_id=secret-1", "/audit"]
    for page in pages:
        browser.get(base + page)
        shown = browser.find_element(By.TAG_NAME, "body").text
        source = browser.page_source
        assert not any(s in shown or s in source for s in SECRETS), page
        assert [a for a in ACTIONS if browser.find_elements(By.ID, a)] == [], page
        assert browser.find_elements(By.CSS_SELECTOR, "main form[method=post], main input[type=checkbox]") == [], page
        if page == f"/dead-letters/{secret}":
            value = json.loads(text(browser, "#value"))
            assert value == {"order": 42, "card": {"number": MASK}, "user": {"name": "Ann", "password": MASK}}
            assert f"authorization {MASK}" in text(browser, "#headers")
            assert text(browser, "#last-error") == f"builtins.ValueError (consumer): bad card {MASK}"
            assert "Only an admin may reveal them" in text(browser, "#masked-note")
            shot(browser, "viewer-dead-letter")
        if page == "/dead-letters":
            assert f"card={MASK} password={MASK}" in text(browser, "#dead-letters")
            shot(browser, "viewer-dead-letters")
    assert (store.messages(), store.audit_log()) == before


def test_an_admins_reveal_shows_the_value_and_leaves_an_audit_row(roles_console: Any, browser: WebDriver) -> None:
    base, store, [secret, _text_letter] = roles_console
    sign_in(browser, base, OPERATOR)  # an operator may act, but sees no Reveal button
    browser.get(f"{base}/dead-letters/{secret}")
    assert text(browser, "#role") == "operator" and browser.find_elements(By.ID, "edit-redrive")
    assert browser.find_elements(By.ID, "reveal") == [] and CARD not in browser.page_source
    browser.delete_all_cookies()
    sign_in(browser, base, ADMIN)
    browser.get(f"{base}/dead-letters/{secret}")
    assert text(browser, "#role") == "admin"
    assert PASSWORD not in browser.page_source and MASK in text(browser, "#value")  # masked until revealed
    assert store.audit_log() == []
    navigate(browser, browser.find_element(By.ID, "reveal"))
    assert "Revealed" in text(browser, "#revealed")
    value = json.loads(text(browser, "#value"))
    assert value == {"order": 42, "card": {"number": CARD}, "user": {"name": "Ann", "password": PASSWORD}}
    assert BEARER in text(browser, "#headers")
    shot(browser, "admin-revealed")
    [entry] = store.audit_log()
    assert (entry.action, json.loads(entry.filter), entry.count, entry.who) == (
        "reveal", {"ids": [secret]}, 1, security.who(ADMIN))
    browser.get(base + "/audit")
    assert f"{security.who(ADMIN)} reveal" in text(browser, "#audit")
    assert ADMIN not in browser.page_source
