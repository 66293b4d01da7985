"""The dashboard (`saga dashboard`, `saga.web`) served for real by the command, on a real
database holding sagas in every status, looked at in headless Chromium driven by
Selenium; and `saga show --format mermaid`.

The browser tests need Debian's `chromium` and `chromium-driver` (`/usr/bin/chromium`,
`/usr/bin/chromedriver`) and are skipped, saying so, without them. Screenshots go to each
test's temporary directory; the list and a saga's page are also copied to
`/tmp/dashboard-shots/` for a person to look at.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo
from pydantic import BaseModel
from support import wait_until

from saga import (
    Orchestrator,
    PermanentError,
    RetryPolicy,
    Saga,
    StepContext,
    TransientError,
    durable_step,
)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
SHOTS = Path("/tmp/dashboard-shots")
# How long the page may take to show a change made in the database (seconds): the
# dashboard polls every second, and NOTIFY wakes it sooner.
LIVE_TIMEOUT = 15.0

FAST = RetryPolicy(max_attempts=3, initial_delay=0.05, max_delay=0.1)


class Order(BaseModel):
    """The input of the dashboard's test saga; `plan` says how it goes."""

    tenant_id: str = "acme"
    order_id: str
    amount_cents: int = 4990
    plan: str = "ok"


checkout = Saga(
    "dash_checkout",
    version=1,
    input=Order,
    key=lambda o: o.order_id,
    tenant=lambda o: o.tenant_id,
)
# Released by the test that watches a running saga complete (and at teardown).
HOLD = threading.Event()


@checkout.step(retry=FAST, idempotent=True)
def reserve(ctx: StepContext, o: Order) -> dict[str, Any]:
    time.sleep(0.02)
    if "glitch" in o.plan and ctx.attempt == 1:
        raise RuntimeError("connection reset after the request was sent")
    return {"reservation": f"r-{o.order_id}"}


@reserve.compensation(retry=FAST)
def release(ctx: StepContext, o: Order, result: dict[str, Any]) -> None:
    time.sleep(0.02)


@checkout.step(retry=FAST)
def charge(ctx: StepContext, o: Order) -> dict[str, Any]:
    time.sleep(0.03)
    if "flaky" in o.plan and ctx.attempt < 3:
        raise TransientError("gateway timeout")
    if o.plan == "unknown":
        raise RuntimeError("parse error after the gateway answered")
    if o.plan == "hold":
        HOLD.wait(60)
    return {"charge_id": f"ch-{o.order_id}", "amount_cents": o.amount_cents}


@charge.compensation(retry=FAST)
def refund(ctx: StepContext, o: Order, result: dict[str, Any]) -> None:
    time.sleep(0.02)


@checkout.step(retry=FAST)
def ship(ctx: StepContext, o: Order) -> dict[str, Any]:
    time.sleep(0.02)
    if "nostock" in o.plan:
        raise PermanentError("carrier refused the parcel")
    return {"tracking": "1Z999"}


@durable_step(name="dash_notify", key=lambda to: to, idempotent=True)
def notify(to: str) -> dict[str, str]:
    return {"to": to}


@dataclass
class World:
    """The sagas the dashboard shows, by what they are."""

    url: str
    orch: Orchestrator
    completed: str
    flaky: str
    compensated: str
    parked: str
    pending: str
    running: str
    session: str
    channel: str
    driver: threading.Thread
    # Parked on an unknown charge that alice resolved, then forked from `ship` to `fork`,
    # which inherited reserve and charge and completed.
    resolved: str
    fork: str


@pytest.fixture(scope="module")
def module_database(server_url: str, template_database: str) -> Iterator[str]:
    """A migrated database of this module's tests (they share one server)."""
    name = f"saga_dash_{os.getpid()}_{secrets.token_hex(4)}"
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(name), sql.Identifier(template_database)
            )
        )
    try:
        yield make_conninfo(server_url, dbname=name)
    finally:
        with psycopg.connect(server_url, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


@pytest.fixture(scope="module")
def world(module_database: str) -> Iterator[World]:
    """Sagas in every status, made through the public API: completed (once after two
    retries), compensated (after an unknown outcome retried, two retries, and a step that
    failed for good), parked on an unknown outcome, pending, running (its charge waits
    for `HOLD`), a session, a ledger channel parked on an unknown call, and a saga whose
    unknown charge alice resolved, forked to one that inherited its first two steps."""
    orch = Orchestrator(module_database, sagas=[checkout])

    def run(order: Order) -> str:
        saga_id = orch.start(checkout, order).id
        orch.run(saga_id)
        return saga_id

    completed = run(Order(order_id="o-1"))
    flaky = run(Order(order_id="o-2", plan="flaky", tenant_id="globex"))
    compensated = run(Order(order_id="o-3", plan="glitch flaky nostock"))
    parked = run(Order(order_id="o-4", plan="unknown"))
    pending = orch.start(checkout, Order(order_id="o-5")).id
    resolved = run(Order(order_id="crashB-013", plan="unknown"))
    charged = {"charge_id": "ch-crashB-013", "amount_cents": 4990}
    orch.resolve(resolved, "charge", outcome="succeeded", result=charged, actor="alice")
    fork = orch.fork(resolved, "ship", actor="bob").id
    assert orch.run(fork).status == "completed"
    with orch.session("ticket-4821", tenant="acme") as session:
        notify("ops@acme.com")
        notify("billing@acme.com")
    paid = orch.ledger.claim(
        "run-7f2a", "charge:o-9", "charge_customer", {"order_id": "o-9", "amount_cents": 100}
    )
    orch.ledger.complete(paid, {"charge_id": "ch-9"})
    mailed = orch.ledger.claim("run-7f2a", "email:o-9", "send_email", {"to": "ops@acme.com"})
    orch.ledger.unknown(mailed, "timeout reading the reply")
    running = orch.start(checkout, Order(order_id="o-6", plan="hold", tenant_id="initech")).id
    HOLD.clear()
    driver = threading.Thread(target=orch.run, args=(running,), daemon=True)
    driver.start()
    wait_until(lambda: orch.get(running).operation("charge").status == "running")
    try:
        yield World(
            module_database,
            orch,
            completed,
            flaky,
            compensated,
            parked,
            pending,
            running,
            session.id,
            paid.saga_id,
            driver,
            resolved,
            fork,
        )
    finally:
        HOLD.set()
        driver.join(30)
        orch.close()


@dataclass
class Dashboard:
    """A `saga dashboard` process and its address."""

    base: str
    process: subprocess.Popen[bytes]
    log: Path


@pytest.fixture(scope="module")
def dashboard(world: World, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dashboard]:
    """`saga dashboard --port 0` on the world's database, until the module ends."""
    log = tmp_path_factory.mktemp("dashboard") / "stderr.txt"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAGA_")}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(ROOT)])
    with log.open("wb") as err:
        process = subprocess.Popen(
            [sys.executable, "-m", "saga", "dashboard", "--port", "0", "--database-url", world.url],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    try:
        found = wait_until(
            lambda: (
                re.search(r"http://127\.0\.0\.1:\d+/", log.read_text())
                or process.poll() is not None
            ),
            timeout=60,
        )
        assert process.poll() is None, f"saga dashboard exited: {log.read_text()}"
        assert isinstance(found, re.Match)
        base = found.group(0).rstrip("/")
        wait_until(lambda: _answers(base), timeout=30)
        yield Dashboard(base, process, log)
    finally:
        process.terminate()
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
    assert process.returncode == 0, log.read_text()
    assert "saga dashboard: stopped" in log.read_text()


def _answers(base: str) -> bool:
    try:
        return httpx.get(base + "/", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Headless Chromium through Debian's chromedriver."""
    if not CHROMEDRIVER.exists() or not CHROMIUM.exists():
        pytest.skip(
            f"the browser tests need {CHROMIUM} and {CHROMEDRIVER}: "
            "apt-get install -y chromium chromium-driver"
        )
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1440,1000",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _screenshot(browser: Any, path: Path, *, copy_to: Path | None = None) -> None:
    """The whole page as a PNG at `path` (and a copy at `copy_to`)."""
    height = browser.execute_script("return document.documentElement.scrollHeight")
    browser.set_window_size(1440, min(max(int(height) + 40, 800), 6000))
    browser.save_screenshot(str(path))
    browser.set_window_size(1440, 1000)
    if copy_to is not None:
        copy_to.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, copy_to)


def _live(browser: Any) -> None:
    """Wait until the page's stream of updates is open."""
    wait_until(lambda: (_text(browser, "live-status") or "").startswith("live"), timeout=15)


def _rows(browser: Any, table: str) -> dict[str, str]:
    """Saga id -> status of the rows of the list's table `table`, in order (read in one
    go: the live updates may replace the table between two WebDriver calls)."""
    pairs = browser.execute_script(
        "return Array.from(document.querySelectorAll(arguments[0])).map("
        "r => [r.dataset.sagaId, r.dataset.status || ''])",
        f"#{table} tbody tr",
    )
    return dict(pairs)


def _text(browser: Any, element_id: str) -> str | None:
    """The text of the element with this id (None when there is none), read in one go."""
    text = browser.execute_script(
        "var e = document.getElementById(arguments[0]); return e ? e.innerText : null;",
        element_id,
    )
    return None if text is None else str(text).strip()


# ----- the list -----------------------------------------------------------------------


def test_the_list_shows_sagas_in_every_status_and_the_needs_review_queue(
    world: World, dashboard: Dashboard, browser: Any, tmp_path: Path
) -> None:
    browser.get(dashboard.base + "/")
    _live(browser)
    rows = _rows(browser, "saga-table")
    assert rows[world.completed] == "completed"
    assert rows[world.compensated] == "compensated"
    assert rows[world.parked] == "needs_review"
    assert rows[world.pending] == "pending"
    assert rows[world.running] == "running"
    assert rows[world.session] == "completed"
    assert rows[world.channel] == "needs_review"
    # Newest first: the running saga was started last, the completed one first.
    order = list(rows)
    assert order.index(world.running) < order.index(world.channel) < order.index(world.completed)

    queue = browser.find_elements("css selector", "#queue-table tbody tr")
    reasons = {row.get_attribute("data-saga-id"): row.text for row in queue}
    assert set(reasons) >= {world.parked, world.channel}
    assert "outcome of step 'charge' attempt 1 is unknown" in reasons[world.parked]
    assert "timeout reading the reply" in reasons[world.channel]
    # Each row links to the saga's own page.
    link = browser.find_element("css selector", f'#saga-table tr[data-saga-id="{world.parked}"] a')
    assert link.get_attribute("href") == f"{dashboard.base}/sagas/{world.parked}"
    _screenshot(browser, tmp_path / "list.png", copy_to=SHOTS / "list.png")


def test_the_list_filters_by_status_saga_tenant_and_age(
    world: World, dashboard: Dashboard, browser: Any, tmp_path: Path
) -> None:
    from selenium.webdriver.support.ui import Select

    browser.get(dashboard.base + "/")
    Select(browser.find_element("id", "filter-status")).select_by_value("needs_review")
    browser.find_element("id", "filter-apply").click()
    wait_until(lambda: "status=needs_review" in browser.current_url)
    rows = _rows(browser, "saga-table")
    assert {world.parked, world.channel} <= set(rows)
    assert set(rows.values()) == {"needs_review"}
    _screenshot(browser, tmp_path / "needs_review.png")

    browser.get(dashboard.base + "/?tenant=globex")
    assert list(_rows(browser, "saga-table")) == [world.flaky]
    assert browser.find_element("id", "filter-tenant").get_attribute("value") == "globex"

    browser.get(dashboard.base + "/?saga=session/session")
    assert list(_rows(browser, "saga-table")) == [world.session]

    browser.get(dashboard.base + "/?saga=dash_checkout&status=compensated")
    assert list(_rows(browser, "saga-table")) == [world.compensated]

    # Age: nothing here has waited an hour; everything has waited 10 ms.
    browser.get(dashboard.base + "/?older_than=1h")
    assert browser.find_element("id", "no-sagas").text == "No saga matches these filters."
    browser.get(dashboard.base + "/?older_than=0.01")
    assert world.completed in _rows(browser, "saga-table")

    browser.get(dashboard.base + "/?older_than=soon")
    message = browser.find_element("id", "error-message").text
    assert "age 'soon'" in message
    browser.find_element("link text", "← all sagas").click()
    wait_until(lambda: browser.current_url == dashboard.base + "/")


def test_the_search_box_finds_sagas_by_business_key(
    world: World, dashboard: Dashboard, browser: Any
) -> None:
    """A key typed into the search box lists the sagas of that exact key, and stays in
    the box; `/sagas/KEY` opens the saga of a key."""
    browser.get(dashboard.base + "/")
    box = browser.find_element("id", "filter-key")
    box.send_keys("o-4")
    browser.find_element("id", "filter-apply").click()
    wait_until(lambda: "key=o-4" in browser.current_url)
    assert list(_rows(browser, "saga-table")) == [world.parked]
    assert browser.find_element("id", "filter-key").get_attribute("value") == "o-4"

    browser.get(dashboard.base + "/?key=o-")
    assert browser.find_element("id", "no-sagas").text == "No saga matches these filters."
    browser.get(dashboard.base + "/?key=o-2&tenant=globex")
    assert list(_rows(browser, "saga-table")) == [world.flaky]

    browser.get(dashboard.base + "/sagas/o-4")
    wait_until(lambda: browser.current_url == f"{dashboard.base}/sagas/{world.parked}")


# ----- one saga -----------------------------------------------------------------------


def _lanes(browser: Any) -> list[tuple[str, str, list[float]]]:
    """(kind, step, left edges of its attempt bars) of each lane of the timeline."""
    lanes = []
    for lane in browser.find_elements("css selector", "#timeline .tl-row[data-kind]"):
        lefts = [
            float(bar.get_attribute("data-left"))
            for bar in lane.find_elements("css selector", ".bar.attempt")
        ]
        lanes.append((lane.get_attribute("data-kind"), lane.get_attribute("data-step"), lefts))
    return lanes


def _tones(browser: Any, kind: str, step: str) -> list[str]:
    """How each attempt bar of an operation's lane looks (its outcome), in order."""
    bars = browser.find_elements(
        "css selector", f'#timeline .tl-row[data-kind="{kind}"][data-step="{step}"] .bar.attempt'
    )
    return [(bar.get_attribute("class") or "").split()[-1] for bar in bars]


def test_the_timeline_shows_the_compensations_in_reverse_order(
    world: World, dashboard: Dashboard, browser: Any, tmp_path: Path
) -> None:
    browser.get(f"{dashboard.base}/sagas/{world.compensated}")
    _live(browser)
    assert browser.find_element("id", "saga-status").text == "compensated"
    assert "carrier refused the parcel" in browser.find_element("id", "saga-reason").text

    lanes = _lanes(browser)
    assert [(kind, step) for kind, step, _ in lanes] == [
        ("saga", ""),
        ("action", "reserve"),
        ("action", "charge"),
        ("action", "ship"),
        ("compensation", "charge"),
        ("compensation", "reserve"),
    ]
    starts = [lefts[0] for kind, _, lefts in lanes if kind != "saga"]
    assert starts == sorted(starts), starts  # drawn to scale: each starts after the one before
    assert starts[-1] > starts[0]
    last_action = max(left for kind, _, lefts in lanes if kind == "action" for left in lefts)
    assert all(lefts[0] > last_action for kind, _, lefts in lanes if kind == "compensation")
    # An unknown outcome retried with the same key, and two failures waited out.
    assert _tones(browser, "action", "reserve") == ["unknown", "succeeded"]
    assert _tones(browser, "action", "charge") == ["failed", "failed", "succeeded"]
    waits = browser.find_elements("css selector", '#timeline .tl-row[data-step="charge"] .bar.wait')
    assert len(waits) == 2
    ship_bar = browser.find_element(
        "css selector", '#timeline .tl-row[data-step="ship"] .bar.attempt'
    )
    assert "failed" in (ship_bar.get_attribute("class") or "")
    assert "carrier refused the parcel" in (ship_bar.get_attribute("title") or "")

    history = world.orch.history(world.compensated)
    events = browser.find_elements("css selector", "#audit tbody tr")
    assert [e.get_attribute("data-event") for e in events] == [e.event for e in history]
    operations = browser.find_elements("css selector", "#operations tbody tr")
    assert len(operations) == 5
    assert '"plan": "glitch flaky nostock"' in browser.find_element("id", "saga-input").text
    _screenshot(browser, tmp_path / "saga.png", copy_to=SHOTS / "saga.png")


def test_the_timeline_shows_retries_with_their_waits_and_unknown_outcomes(
    world: World, dashboard: Dashboard, browser: Any
) -> None:
    browser.get(f"{dashboard.base}/sagas/{world.flaky}")
    charge_lane = browser.find_element("css selector", '#timeline .tl-row[data-step="charge"]')
    bars = charge_lane.find_elements("css selector", ".bar")
    kinds = [(b.get_attribute("class") or "").split()[1:] for b in bars]
    assert kinds == [
        ["attempt", "failed"],
        ["wait", "wait"],
        ["attempt", "failed"],
        ["wait", "wait"],
        ["attempt", "succeeded"],
    ]
    attempts = charge_lane.find_elements("css selector", ".bar.attempt")
    assert [b.get_attribute("data-attempt") for b in attempts] == ["1", "2", "3"]
    # Operations' results are shown.
    assert '"charge_id": "ch-o-2"' in browser.find_element("id", "op-action-charge").text

    browser.get(f"{dashboard.base}/sagas/{world.parked}")
    unknown = browser.find_element(
        "css selector", '#timeline .tl-row[data-step="charge"] .bar.attempt'
    )
    assert "unknown" in (unknown.get_attribute("class") or "")
    never = browser.find_element("css selector", '#timeline .tl-row[data-step="ship"]')
    assert "never attempted" in never.text


def test_sessions_and_ledger_channels_have_pages_like_sagas(
    world: World, dashboard: Dashboard, browser: Any, tmp_path: Path
) -> None:
    browser.get(f"{dashboard.base}/sagas/{world.session}")
    assert "session" in browser.find_element("id", "saga-title").text
    steps = [step for kind, step, _ in _lanes(browser) if kind == "action"]
    assert len(steps) == 2 and all(s.startswith("dash_notify.") for s in steps)

    browser.get(f"{dashboard.base}/sagas/{world.channel}")
    assert "channel" in browser.find_element("id", "saga-title").text
    assert browser.find_element("id", "saga-status").text == "parked"
    lanes = {step: lane for kind, step, lane in _lanes(browser) if kind == "action"}
    assert len(lanes) == 2
    unknown = browser.find_element(
        "css selector", '#timeline .tl-row[data-step^="send_email."] .bar.attempt'
    )
    assert "unknown" in (unknown.get_attribute("class") or "")
    _screenshot(browser, tmp_path / "channel.png")


def test_pages_are_read_only_and_links_resolve(world: World, dashboard: Dashboard) -> None:
    """Plain HTTP: no page changes anything, a prefix of an id redirects to the saga's
    address, an unknown id is a 404 saying so, and a foreign Host is refused."""
    with httpx.Client(base_url=dashboard.base, timeout=10) as client:
        page = client.get(f"/sagas/{world.compensated}")
        assert page.status_code == 200
        assert "script-src 'nonce-" in page.headers["content-security-policy"]
        assert "<form" not in page.text
        assert client.post(f"/sagas/{world.compensated}").status_code == 405
        assert client.post("/", data={"status": "completed"}).status_code == 405

        short = client.get(f"/sagas/{world.compensated[:8]}")
        assert short.status_code == 307
        assert short.headers["location"] == f"/sagas/{world.compensated}"

        missing = client.get("/sagas/00000000-0000-4000-8000-000000000000")
        assert missing.status_code == 404
        assert "no saga with id" in missing.text

        assert client.get("/?status=bogus").status_code == 400
        assert client.get("/", headers={"Host": "evil.example"}).status_code == 400

        mermaid = client.get(f"/sagas/{world.compensated}/mermaid")
        assert mermaid.text.startswith("gantt\n")


# ----- what the screens say: who settled an operation, what to run, keys, the legend ----


def _commands(browser: Any, selector: str) -> list[str]:
    """The command lines shown in the `.commands` box under `selector`, in order."""
    return [
        str(line)
        for line in browser.execute_script(
            "return Array.from(document.querySelectorAll(arguments[0] + ' .commands code'))"
            ".map(c => c.textContent);",
            selector,
        )
    ]


def test_the_needs_review_queue_and_a_parked_sagas_page_say_what_to_run(
    world: World, dashboard: Dashboard, browser: Any, tmp_path: Path
) -> None:
    """Each parked saga of the queue shows, under its reason, the exact `saga resolve` and
    `saga compensate` lines that take it on (those `SessionParked` words come from); a
    ledger channel's only settle its call. The saga's own page shows the same."""
    parked = world.parked
    expected = [
        f"saga resolve {parked} charge --app MODULE --succeeded --result JSON",
        f"saga resolve {parked} charge --app MODULE --failed --reason TEXT",
        f"saga compensate {parked} --app MODULE --include-unknown",
    ]
    browser.get(dashboard.base + "/")
    _live(browser)
    assert _commands(browser, f'#queue-table tr[data-saga-id="{parked}"]') == expected
    (call,) = [op.step for op in world.orch.get(world.channel).operations if op.status == "unknown"]
    assert _commands(browser, f'#queue-table tr[data-saga-id="{world.channel}"]') == [
        f"saga resolve {world.channel} {call} --succeeded --result JSON",
        f"saga resolve {world.channel} {call} --failed --reason TEXT",
    ]
    assert _commands(browser, "#saga-table") == []  # the list of all sagas shows none
    _screenshot(browser, tmp_path / "queue.png", copy_to=SHOTS / "queue.png")

    browser.get(f"{dashboard.base}/sagas/{parked}")
    assert _commands(browser, "#live") == expected
    _screenshot(browser, tmp_path / "parked.png")
    browser.get(f"{dashboard.base}/sagas/{world.completed}")
    assert _commands(browser, "#live") == []

    from saga.remedies import parked_commands  # what SessionParked's words come from

    assert parked_commands(world.orch.get(parked)) == expected


def _took(browser: Any, step: str) -> str:
    """The Last took cell of the action `step` in the saga page's operations table."""
    cell = browser.find_element(
        "css selector", f'#operations tr[data-step="{step}"] td:nth-child(5)'
    )
    return str(cell.text).strip()


def _lane_note(browser: Any, step: str) -> str:
    lane = browser.find_element(
        "css selector", f'#timeline .tl-row[data-kind="action"][data-step="{step}"] .note'
    )
    return str(lane.text).strip()


def test_a_resolved_operation_says_who_and_an_inherited_one_from_which_saga(
    world: World, dashboard: Dashboard, browser: Any, tmp_path: Path
) -> None:
    """The charge alice resolved says `resolved by alice`, not the minutes she took, in
    the operations table and its timeline lane; the fork's inherited steps say
    `inherited from` their source (linked), not `never attempted`."""
    browser.get(f"{dashboard.base}/sagas/{world.resolved}")
    assert _took(browser, "charge") == "resolved by alice"
    assert _lane_note(browser, "charge") == "succeeded, 1/3, resolved by alice"
    assert re.fullmatch(r"[\d.]+ m?s", _took(browser, "reserve")), _took(browser, "reserve")

    browser.get(f"{dashboard.base}/sagas/{world.fork}")
    source = world.resolved
    for step in ("reserve", "charge"):
        assert _took(browser, step) == f"inherited from {source[:8]}"
        assert _lane_note(browser, step) == f"succeeded, 1/3, inherited from {source[:8]}"
    link = browser.find_element(
        "css selector", '#operations tr[data-step="charge"] td:nth-child(5) a'
    )
    assert link.get_attribute("href") == f"{dashboard.base}/sagas/{source}"
    assert "inherited" not in _took(browser, "ship")
    _screenshot(browser, tmp_path / "fork.png", copy_to=SHOTS / "fork.png")


# How many lines the text `arguments[1]` takes on the screen, in each element a CSS
# selector (`arguments[0]`) finds.
_LINES = """
return Array.from(document.querySelectorAll(arguments[0])).map(el => {
  var walk = document.createTreeWalker(el, NodeFilter.SHOW_TEXT), node, at;
  while ((node = walk.nextNode()) && (at = node.data.indexOf(arguments[1])) < 0) {}
  if (!node) { return 0; }
  var range = document.createRange();
  range.setStart(node, at); range.setEnd(node, at + arguments[1].length);
  var tops = new Set();
  Array.from(range.getClientRects()).forEach(r => {
    if (r.width > 0) { tops.add(Math.round(r.top)); }
  });
  return tops.size;
});
"""


def test_keys_never_break_at_their_hyphens(
    world: World, dashboard: Dashboard, browser: Any
) -> None:
    """In a window too narrow for the tables, a key such as `crashB-013` stays on one
    line, in the list and on its saga's page; a longer key (the fork's, an idempotency
    key) breaks only after a colon, never inside `crashB-013`."""
    browser.set_window_size(520, 900)
    try:
        browser.get(dashboard.base + "/")
        keys = {  # the list's Key column
            str(row.get_attribute("data-saga-id")): row.find_element(
                "css selector", "td:nth-child(4)"
            )
            for row in browser.find_elements("css selector", "#saga-table tbody tr")
        }
        assert keys[world.resolved].text == "crashB-013"
        assert keys[world.fork].text == "crashB-013:fork:ship"
        cells = "#saga-table td:nth-child(4)"
        assert sorted(browser.execute_script(_LINES, cells, "crashB-013"))[-2:] == [1, 1]
        browser.get(f"{dashboard.base}/sagas/{world.resolved}")
        facts = browser.execute_script(_LINES, "dl.facts dd", "crashB-013")
        assert sorted(facts)[-1] == 1 and facts.count(1) == 1, facts  # the key: one line
        idempotency = "#operations td:nth-child(7)"
        assert browser.find_element("css selector", idempotency).text == (
            "dash_checkout:v1:acme:crashB-013:reserve"
        )
        assert browser.execute_script(_LINES, idempotency, "crashB-013") == [1, 1, 1]
    finally:
        browser.set_window_size(1440, 1000)


_LOOK = """
var el = document.querySelector(arguments[0]);
var s = getComputedStyle(el), after = getComputedStyle(el, '::after');
return [el.textContent, s.backgroundImage, s.backgroundColor, s.borderTopStyle, after.content];
"""


def test_the_legend_tells_an_unknown_outcome_from_no_outcome_recorded(
    world: World, dashboard: Dashboard, browser: Any
) -> None:
    """The two swatches, and the bars they stand for, differ by pattern, border and a
    glyph (`?`, `…`), not by a shade of the same colour."""
    browser.get(f"{dashboard.base}/sagas/{world.parked}")
    unknown = browser.execute_script(_LOOK, "#timeline .legend .sw.unknown")
    missing = browser.execute_script(_LOOK, "#timeline .legend .sw.no_outcome")
    assert (unknown[0], missing[0]) == ("?", "…")
    assert "repeating-linear-gradient" in unknown[1] and missing[1] == "none"
    assert (unknown[3], missing[3]) == ("none", "dashed")
    # The bars: draw one of each in a lane, as the timeline does.
    browser.execute_script(
        "var track = document.querySelector('#timeline .tl-row[data-step] .track');"
        "['unknown', 'no_outcome'].forEach(t => { var b = document.createElement('span');"
        "b.className = 'bar attempt ' + t; b.id = 'probe-' + t; b.textContent = '1';"
        "track.appendChild(b); });"
    )
    unknown = browser.execute_script(_LOOK, "#probe-unknown")
    missing = browser.execute_script(_LOOK, "#probe-no_outcome")
    assert "repeating-linear-gradient" in unknown[1] and missing[1] == "none"
    assert (unknown[3], missing[3]) == ("none", "dashed")
    assert (unknown[4], missing[4]) == ('"?"', '"…"')


# ----- live updates -------------------------------------------------------------------


def test_a_saga_that_changes_state_updates_without_a_reload(
    world: World, dashboard: Dashboard, browser: Any, tmp_path: Path
) -> None:
    browser.get(f"{dashboard.base}/sagas/{world.running}")
    _live(browser)
    assert browser.find_element("id", "saga-status").text == "running"
    running = browser.find_element("css selector", '#timeline .tl-row[data-step="charge"] .bar')
    assert "running" in (running.get_attribute("class") or "")
    _screenshot(browser, tmp_path / "running.png")
    browser.execute_script("window.notReloaded = true;")

    HOLD.set()  # the held charge returns: the saga completes, and sends no NOTIFY
    world.driver.join(30)
    assert world.orch.get(world.running).status == "completed"
    wait_until(lambda: _text(browser, "saga-status") == "completed", timeout=LIVE_TIMEOUT)
    assert browser.execute_script("return window.notReloaded === true;")
    lane = browser.find_element("css selector", '#timeline .tl-row[data-step="ship"] .bar.attempt')
    assert "succeeded" in (lane.get_attribute("class") or "")
    _screenshot(browser, tmp_path / "completed.png")

    # The list: a new saga appears in the needs-review queue, and leaves it once resolved.
    browser.get(dashboard.base + "/")
    _live(browser)
    browser.execute_script("window.notReloaded = true;")
    late = world.orch.start(checkout, Order(order_id="o-7", plan="unknown", tenant_id="live")).id
    world.orch.run(late)
    wait_until(lambda: late in _rows(browser, "queue-table"), timeout=LIVE_TIMEOUT)
    # The two tables are refreshed by requests of their own: the list may show the saga
    # a refresh after the queue does, on a loaded machine.
    wait_until(
        lambda: _rows(browser, "saga-table").get(late) == "needs_review", timeout=LIVE_TIMEOUT
    )
    world.orch.resolve(late, "charge", outcome="failed", reason="no charge", actor="test")
    world.orch.run(late)
    wait_until(
        lambda: _rows(browser, "saga-table").get(late) == "compensated", timeout=LIVE_TIMEOUT
    )
    assert late not in _rows(browser, "queue-table")
    assert browser.execute_script("return window.notReloaded === true;")


def _badges(browser: Any) -> dict[str, str]:
    """Saga id -> the status its badge shows, of the rows of the list's sagas."""
    pairs = browser.execute_script(
        "return Array.from(document.querySelectorAll('#saga-table tbody tr')).map("
        "r => [r.dataset.sagaId, r.querySelector('.badge').innerText.trim()])"
    )
    return dict(pairs)


def test_sessions_and_channels_show_open_idle_parked_or_closed(
    world: World, dashboard: Dashboard, browser: Any, tmp_path: Path
) -> None:
    """A session or a ledger channel is stored `running` while it is open: the list and
    its page say whether a call is in flight (open), none is (idle), one waits for a
    human (parked), or it ended (closed), the stored status in the badge's title."""
    held = world.orch.ledger.claim("run-idle", "refund:o-8", "refund", {"order_id": "o-8"})
    browser.get(dashboard.base + "/")
    _live(browser)
    wait_until(lambda: _badges(browser).get(held.saga_id) == "open", timeout=LIVE_TIMEOUT)
    world.orch.ledger.fail(held, "card declined for good")
    wait_until(lambda: _badges(browser).get(held.saga_id) == "idle", timeout=LIVE_TIMEOUT)
    badges = _badges(browser)
    assert (badges[world.session], badges[world.channel]) == ("closed", "parked")
    _screenshot(browser, tmp_path / "list-statuses.png")

    browser.get(f"{dashboard.base}/sagas/{held.saga_id}")
    badge = browser.find_element("id", "saga-status")
    assert (badge.text, badge.get_attribute("title")) == ("idle", "stored as running")
    browser.get(f"{dashboard.base}/sagas/{world.session}")
    assert browser.find_element("id", "saga-status").text == "closed"


# ----- saga show --format mermaid, and the missing extra ------------------------------


def _saga(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SAGA_")}
    clean["PYTHONPATH"] = os.pathsep.join([str(HERE), str(ROOT)])
    clean.update(env)
    return subprocess.run(
        [sys.executable, "-m", "saga", *args],
        env=clean,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


_TASK = re.compile(
    r"^    (?P<name>[^:#;]+) :(?P<tags>[a-z, ]+), op\d+, (?P<start>\d+), (?P<end>\d+)$"
)


def test_show_format_mermaid_prints_a_gantt_with_one_task_per_operation(world: World) -> None:
    shown = _saga("show", world.compensated[:8], "--format", "mermaid", "--database-url", world.url)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0] == "gantt"
    assert "    dateFormat x" in lines
    assert any(line.startswith("    title dash_checkout v1") for line in lines)
    tasks = [m for m in map(_TASK.match, lines) if m is not None]
    header = ("%%", "title ", "dateFormat ", "axisFormat ", "section ")
    body = [line for line in lines[1:] if not line.lstrip().startswith(header)]
    assert len(body) == len(tasks) == 5, shown.stdout
    assert [t["name"] for t in tasks] == [
        "reserve succeeded, 2 attempts",
        "charge succeeded, 3 attempts",
        "ship failed, 1 attempt",
        "compensate charge succeeded, 1 attempt",
        "compensate reserve succeeded, 1 attempt",
    ]
    assert [t["tags"] for t in tasks] == ["done", "done", "crit", "done", "done"]
    spans = [(int(t["start"]), int(t["end"])) for t in tasks]
    assert all(start < end for start, end in spans)
    assert [s for s, _ in spans] == sorted(s for s, _ in spans)
    assert lines.index("    section Steps") < lines.index(
        "    section Compensations (in the order they ran)"
    )

    # Never attempted operations are comments; a retried one says how many attempts.
    pending = _saga("show", world.pending, "--format", "mermaid", "--database-url", world.url)
    assert [m for m in map(_TASK.match, pending.stdout.splitlines()) if m] == []
    assert pending.stdout.count("never attempted") == 3
    flaky = _saga("show", world.flaky, "--format", "mermaid", "--database-url", world.url)
    assert "    charge succeeded, 3 attempts :done, op2, " in flaky.stdout

    both = _saga("show", world.flaky, "--json", "--format", "mermaid", "--database-url", world.url)
    assert both.returncode == 2
    assert "--json and --format mermaid" in both.stderr


def test_without_the_web_extra_the_dashboard_says_what_to_install() -> None:
    """The core package never imports the dashboard; `saga dashboard` without its
    dependencies is a one-line usage error naming the extra."""
    loaded = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, saga, saga.cli, saga.cli.format; "
            "print(sorted(m for m in sys.modules if m.startswith(('saga.web', 'starlette', "
            "'jinja2', 'uvicorn'))))",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert loaded.stdout.strip() == "[]"
    for blocked in ("starlette", "uvicorn"):
        missing = subprocess.run(
            [
                sys.executable,
                "-c",
                f"import sys; sys.modules[{blocked!r}] = None; "
                "from saga.cli import main; sys.exit(main(['dashboard', '--port', '0']))",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert missing.returncode == 2, missing.stderr
        lines = missing.stderr.strip().splitlines()
        assert len(lines) == 1, missing.stderr
        assert lines[0] == (
            f"saga: dashboard: the dashboard needs the web extra, and {blocked} is not "
            "installed: pip install 'saga-orchestrator[web]'"
        )
