"""The live queue page: its JSON state built from a real server's store, its routes, and the
page itself in Debian's chromium (driven by Playwright) while a burst waits behind a one-slot
pool of a real stack (Envoy, the sidecar, simulated vLLM)."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import re
import shutil
from collections import deque
from collections.abc import AsyncIterator

import aiohttp
import pytest
import yaml
from playwright.async_api import Page, async_playwright

from extproc.core.admission import Ticket
from extproc.core.config import parse_config
from extproc.ops.queue_page import DECISIONS_SHOWN, is_loopback, state_json
from extproc.server import SidecarServer
from extproc.stores.queue import Lease, Waiter

from ..conftest import e2e_config, start_stack
from ..helpers import chat, sidecar_from_file

TIERS = {"yellow": 2, "orange": 6, "red": 9, "hard_max": 20}


def page_config(**overrides) -> dict:
    config = e2e_config(**overrides)
    config["pools"]["primary"]["tiers"] = TIERS
    return config


# -- the JSON state, built directly from a server that is not listening ---------------------

async def queue_state(server: SidecarServer) -> dict:
    """What the page reads at /queue/state (strict JSON, as the browser parses it)."""
    return json.loads(state_json(await server.read_state(DECISIONS_SHOWN)))


class Colour(enum.Enum):  # a decision field that is not a JSON type
    BLUE = "blue"


async def test_the_state_counts_the_line_by_class_and_branch_against_the_limits():
    config = page_config()
    config["pools"] = dict(reversed(config["pools"].items()))  # fallback configured first
    server = SidecarServer(parse_config(config))
    tickets = [("loan_approval", "0417"), ("loan_approval", "0417"), ("loan_approval", "0802"),
               ("complaint", "0802"), ("complaint", "1123")]
    results = [await server.store.enqueue("primary", Ticket(score=i, seq=i, id=f"t{i}", class_name=c, branch_id=b,
                                                            cost=100))
               for i, (c, b) in enumerate(tickets)]
    assert isinstance(results[0], Lease) and all(isinstance(r, Waiter) for r in results[1:])

    state = await queue_state(server)
    primary, fallback = state["pools"]  # the default pool first
    assert primary["name"] == "primary" and fallback["name"] == "fallback"
    assert primary["waiting"] == 4
    assert primary["waiting_by_class"] == {"loan_approval": 2, "complaint": 2}
    assert primary["waiting_by_branch"] == {"loan_approval": {"0417": 1, "0802": 1},
                                            "complaint": {"0802": 1, "1123": 1}}
    assert (primary["inflight"], primary["max_inflight"], primary["max_inflight_configured"]) == (1, 1, 1)
    assert primary["inflight_tokens"] == 100 and primary["token_budget"] is None
    assert primary["latency_cap"] is None  # no class has a latency target
    assert primary["tier"] == "yellow" and primary["tiers"] == TIERS  # 4 waiting: above yellow (2)
    assert primary["breaker"]["instant"] == "closed" and list(primary["breaker"]["windows"]) == ["1s", "60s", "300s"]
    assert fallback["waiting"] == 0 and fallback["waiting_by_branch"] == {} and fallback["tier"] == "green"
    assert [c["name"] for c in state["classes"]] == ["loan_approval", "complaint", "archive_query", "quick_check"]
    assert state["canary"]["pool"] is None and state["shared"] is False and state["draining"] is False
    assert state["config_version"] == server.config_version and len(state["config_version"]) == 12

    await server.store.release(results[0])  # the next one is admitted: one fewer waits
    primary = (await queue_state(server))["pools"][0]
    assert primary["waiting"] == 3 and primary["waiting_by_branch"]["loan_approval"] == {"0802": 1}


async def test_the_state_lists_the_newest_decisions_first_and_few_of_them():
    server = SidecarServer(parse_config(page_config()))
    records = deque(({"ts": 1000.0 + i, "request_id": f"r{i}", "outcome": "admitted", "class": "complaint",
                      "branch": "0417", "colour": Colour.BLUE} for i in range(DECISIONS_SHOWN + 20)), maxlen=200)
    server.recent.records = records
    state = await queue_state(server)
    ids = [d["request_id"] for d in state["decisions"]]
    assert len(ids) == DECISIONS_SHOWN and ids[0] == f"r{DECISIONS_SHOWN + 19}" and ids[-1] == "r20"
    assert state["decisions"][0]["colour"] == "Colour.BLUE"
    records.append({"ts": 2000.0, "request_id": "latest"})
    assert (await queue_state(server))["decisions"][0]["request_id"] == "latest"


@pytest.mark.parametrize(("remote", "loopback"), [
    ("127.0.0.1", True), ("127.3.2.1", True), ("::1", True), ("::ffff:127.0.0.1", True),
    ("10.0.0.7", False), ("192.168.1.20", False), ("::ffff:10.0.0.7", False), ("fe80::1%eth0", False),
    ("", False), (None, False), ("not-an-address", False),
])
def test_only_loopback_peers_are_served(remote, loopback):
    assert is_loopback(remote) is loopback


async def test_the_routes_on_the_metrics_port_are_read_only():
    config = parse_config(page_config(listen={"host": "127.0.0.1", "grpc_port": 0, "metrics_port": 0},
                                      admin={"port": 0}))
    server = SidecarServer(config)
    await server.start()
    try:
        base = f"http://127.0.0.1:{server.metrics_port}"
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{base}/queue") as page:
                assert page.status == 200 and page.content_type == "text/html"
                assert "connect-src 'self'" in page.headers["content-security-policy"]
                html = await page.text()
                assert 'fetch("/queue/state"' in html and "<script src" not in html  # nothing fetched from elsewhere
            async with session.get(f"{base}/queue/state") as state:
                assert state.status == 200 and state.content_type == "application/json"
                body = await state.json()
                assert [p["name"] for p in body["pools"]] == ["primary", "fallback"]
            for method in ("POST", "PUT", "DELETE"):
                async with session.request(method, f"{base}/queue/state") as refused:
                    assert refused.status == 405
            async with session.get(f"{base}/metrics") as metrics:
                assert metrics.status == 200  # still served beside the page
    finally:
        await server.stop()


# -- the page in a real browser, during a real burst ------------------------------------------

BRANCHES = ("0417", "0802", "1123")
CLASSES = ("loan_approval", "complaint")
BURST = 9  # one slot: 8 of them wait


@pytest.fixture(scope="module")
def page_stack(tmp_path_factory):
    stack = start_stack(tmp_path_factory.mktemp("queue-page"), page_config(), primaries=1)
    yield stack
    stack.stop()


def chromium() -> str:
    path = shutil.which("chromium")
    assert path, "Debian's chromium is needed (apt-get install chromium; .ci/run installs it)"
    return path


@contextlib.asynccontextmanager
async def queue_page_of(server: SidecarServer) -> AsyncIterator[Page]:
    """The live queue page of a sidecar served in this process, open in Debian's chromium (the
    page's policy forbids eval, which Playwright's polling uses: lifted for the tests only)."""
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=chromium())
        try:
            page = await browser.new_page(bypass_csp=True)
            await page.goto(f"http://127.0.0.1:{server.metrics_port}/queue")
            yield page
        finally:
            await browser.close()


async def send_burst(envoy_url: str) -> list[int]:
    """BURST requests at once, from three branches, in two classes; each takes about 0.6 s."""
    async def one(session: aiohttp.ClientSession, i: int) -> int:
        headers = {"content-type": "application/json", "x-branch-id": BRANCHES[i % 3],
                   "x-ticket-type": CLASSES[i % 2]}
        async with session.post(f"{envoy_url}/v1/chat/completions", data=chat(f"ticket {i}", max_tokens=600),
                                headers=headers) as response:
            await response.read()
            return response.status

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=90)) as session:
        return list(await asyncio.gather(*(one(session, i) for i in range(BURST))))


# What the page shows for the primary pool: read from its DOM, not from the JSON.
READ_PRIMARY = """() => {
  const pool = document.querySelector('[data-pool="primary"]');
  if (!pool) return null;
  const rows = {};
  for (const row of pool.querySelectorAll('tr[data-class]')) {
    rows[row.dataset.class] = {waiting: Number(row.dataset.waiting), text: row.innerText,
      branches: Object.fromEntries([...row.querySelectorAll('[data-branch]')].map(c => [c.dataset.branch, Number(c.dataset.count)]))};
  }
  return {tier: pool.dataset.tier, waiting: Number(pool.querySelector('[data-total-waiting]').dataset.totalWaiting),
          slots: pool.querySelector('[data-limit="max_inflight"] .value').innerText, rows,
          tokens: pool.querySelector('[data-limit="token_budget"]').innerText};
}"""


async def test_the_page_shows_a_burst_waiting_then_the_line_draining(page_stack, tmp_path):
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=chromium())
        try:
            # The page's policy forbids eval, which Playwright's polling uses: lifted for the test only.
            page = await browser.new_page(viewport={"width": 1280, "height": 900}, bypass_csp=True)
            await page.goto(page_stack.metrics_url.removesuffix("/metrics") + "/queue")
            await page.wait_for_function(f"({READ_PRIMARY})()?.waiting === 0", timeout=15_000)
            state = json.loads(await page.evaluate("fetch('/queue/state').then(r => r.text())"))
            assert await page.inner_text("#config-version") == state["config_version"]

            burst = asyncio.create_task(send_burst(page_stack.url))
            await page.wait_for_function(
                f"""() => {{ const p = ({READ_PRIMARY})();
                   return p && p.waiting >= 3 && p.rows.loan_approval.waiting > 0 && p.rows.complaint.waiting > 0; }}""",
                timeout=30_000)
            shown = await page.evaluate(f"({READ_PRIMARY})()")
            await page.screenshot(path=str(tmp_path / "queue-page.png"), full_page=True)

            assert 3 <= shown["waiting"] <= BURST - 1
            assert shown["waiting"] == sum(row["waiting"] for row in shown["rows"].values())
            assert shown["tier"] == ("orange" if shown["waiting"] > TIERS["orange"] else "yellow")
            assert shown["slots"] == "1 / 1"  # the one slot is taken while others wait
            assert "no token budget" in shown["tokens"]
            for class_name in CLASSES:
                row = shown["rows"][class_name]
                assert class_name in row["text"] and row["branches"]
                assert set(row["branches"]) <= set(BRANCHES) and sum(row["branches"].values()) == row["waiting"]
            assert len({b for row in shown["rows"].values() for b in row["branches"]}) >= 2

            assert await burst == [200] * BURST
            await page.wait_for_function(f"({READ_PRIMARY})()?.waiting === 0", timeout=30_000)
            drained = await page.evaluate(f"({READ_PRIMARY})()")
            assert all(row["waiting"] == 0 and not row["branches"] for row in drained["rows"].values())
            assert drained["tier"] == "green"

            # The burst's decisions, newest first.
            await page.wait_for_function(
                f"document.querySelectorAll('.decisions tr[data-outcome=\"admitted\"]').length >= {BURST}",
                timeout=15_000)
            decisions = await page.eval_on_selector_all(
                ".decisions tbody tr", "rows => rows.map(r => [r.dataset.class, r.dataset.branch])")
            burst_rows = [d for d in decisions if d[1] in BRANCHES]
            assert len(burst_rows) >= BURST and {c for c, _ in burst_rows} == set(CLASSES)
        finally:
            await browser.close()


# -- draining engines, in a real browser ------------------------------------------------------------

READ_DRAINING = """() => [...document.querySelectorAll('[data-pool="primary"] tr[data-engine]')].map(
  r => ({engine: r.dataset.engine, state: r.dataset.state, requests: Number(r.dataset.requests), text: r.innerText}))"""


async def test_the_page_lists_each_draining_engine_with_what_it_still_runs():
    from extproc.core.capacity import Placing

    config = page_config(listen={"host": "127.0.0.1", "grpc_port": 0, "metrics_port": 0}, admin={"port": 0})
    config["pools"]["primary"].update(max_inflight=8, capacity={
        "backends": ["http://127.0.0.2:9", "http://127.0.0.3:9"], "pick_backend": True})
    server = SidecarServer(parse_config(config))
    await server.start()
    try:
        picker = server.gate.picker
        placed = [picker.pick("primary", f"t{i}", Placing(100)) for i in range(2)]  # one on each
        await server.drains.drain("primary", "127.0.0.2:9", 60)
        async with queue_page_of(server) as page:
            await page.wait_for_function(f"({READ_DRAINING})().length === 1", timeout=15_000)
            (row,) = await page.evaluate(f"({READ_DRAINING})()")
            assert (row["engine"], row["state"], row["requests"]) == ("127.0.0.2:9", "draining", 1)
            cells = row["text"].split("\t")
            assert cells[1:5] == ["drained by an operator", "draining", "1", "100"]
            assert re.fullmatch(r"in \d+ s", cells[5])  # its deadline, about 60 s off
            picker.release(next(f"t{i}" for i, p in enumerate(placed) if p.startswith("127.0.0.2:9")))
            await page.wait_for_function(f"({READ_DRAINING})()[0]?.state === 'idle'", timeout=15_000)
            assert "may be stopped" in (await page.evaluate(f"({READ_DRAINING})()"))[0]["text"]
            await server.drains.undrain("primary", "127.0.0.2:9")
            await page.wait_for_function(f"({READ_DRAINING})().length === 0", timeout=15_000)
    finally:
        await server.stop()


# -- what holds long prompts, in a real browser ------------------------------------------------------

READ_LONG = """() => [...document.querySelectorAll('[data-pool] [data-long-prompts]')].map(
  s => ({pool: s.closest('[data-pool]').dataset.pool, rule: s.dataset.longPrompts, text: s.innerText}))"""


async def test_the_page_says_what_holds_each_pools_long_prompts_and_follows_a_reload(tmp_path):
    """A pool whose requests Envoy places (no engine picks) keeps long prompts from the loans in
    time, and the page says so with the quiet spell; one whose only engine does not answer keeps
    nothing apart; a reload that turns `keep_long_apart` off shows at the next look."""
    config = page_config(listen={"host": "127.0.0.1", "grpc_port": 0, "metrics_port": 0}, admin={"port": 0})
    config["classes"]["loan_approval"]["latency_target_s"] = 2
    config["pools"]["primary"]["capacity"] = {"long_quiet_s": 3}
    config["pools"]["fallback"]["capacity"] = {"backends": ["http://127.0.0.2:9"], "pick_backend": True}
    path = tmp_path / "extproc.yaml"
    server = sidecar_from_file(path, config)
    await server.start()
    try:
        async with queue_page_of(server) as page:
            await page.wait_for_function(f"({READ_LONG})().length === 2", timeout=15_000)
            shown = {s["pool"]: s for s in await page.evaluate(f"({READ_LONG})()")}
            assert shown["primary"]["rule"] == "wait_for_quiet"
            assert "waits until no latency-bound request and no other long prompt runs" in shown["primary"]["text"]
            assert "none came in the last 3 s, nor 4 in the last 12 s" in shown["primary"]["text"]
            assert shown["fallback"]["rule"] == "one_engine"
            assert "fewer than two engines answer" in shown["fallback"]["text"]

            config["pools"]["primary"]["capacity"]["keep_long_apart"] = False
            path.write_text(yaml.safe_dump(config))
            assert (await server.reload("test")).accepted
            await page.wait_for_function(
                f"({READ_LONG})().some(s => s.pool === 'primary' && s.rule === 'not_kept_apart')", timeout=15_000)
            shown = {s["pool"]: s for s in await page.evaluate(f"({READ_LONG})()")}
            assert "keep_long_apart is off" in shown["primary"]["text"]
    finally:
        await server.stop()
