"""The status page: its data function and throughput meter, then the real page in headless Chromium.

The browser test starts the whole service (real Ray, Redis, SmolLM2, one worker, an API key),
sends completions, opens `/dashboard#key=...` in Debian's Chromium through Playwright and
checks what a person would see, including a screenshot.
"""

from pathlib import Path

import httpx
import pytest

from cluster.control.messages import ClusterStatus, WorkerRecord
from cluster.ingress.dashboard import DASHBOARD_HTML, RouterNumbers, ThroughputMeter, dashboard_data, generated_tokens_by_worker
from workers.actors.ports import free_port
from workers.values.work_types import WorkerStats

CHROMIUM = Path("/usr/bin/chromium")
API_KEY = "dash-key-1"
MODEL = "smollm2-135m-instruct"


def make_record(worker_id: str, num_total_blocks: int = 100, state: str = "ready") -> WorkerRecord:
    return WorkerRecord(worker_id, f"s3-worker-{worker_id}", num_total_blocks, 16, state, 0.0)


def make_stats(worker_id: str, num_used_blocks: int = 0, num_reserved_blocks: int = 0, num_running: int = 0,
               num_waiting: int = 0, num_generated_tokens: int = 0, num_total_blocks: int = 100) -> WorkerStats:
    return WorkerStats(
        worker_id=worker_id, num_total_blocks=num_total_blocks,
        num_free_blocks=num_total_blocks - num_reserved_blocks, num_used_blocks=num_used_blocks,
        num_reserved_blocks=num_reserved_blocks, block_size=16, bytes_per_block=1024, num_running=num_running,
        num_waiting=num_waiting, num_steps=0, num_generated_tokens=num_generated_tokens, num_overruns=0,
        num_preemptions=0, num_migrated_in=0, num_migrated_out=0, overruns=(), request_ids=())


def make_status(records=(), stats=(), reserved=None, num_pending=0, counters=None, is_redis_ok=True) -> ClusterStatus:
    return ClusterStatus(tuple(records), tuple(stats), dict(reserved or {}), num_pending, dict(counters or {}),
                         is_redis_ok)


def make_numbers(tokens_per_s: float | None = None, num_in_flight: int = 0) -> RouterNumbers:
    return RouterNumbers(MODEL, "s3", num_in_flight, 64, 12.34, tokens_per_s)


# -- dashboard_data ----------------------------------------------------------------------


def test_workers_show_kv_bars_and_load():
    status = make_status(
        records=[make_record("w2", 200), make_record("w1", 100)],
        stats=[make_stats("w1", 30, 50, num_running=3, num_waiting=1, num_generated_tokens=500),
               make_stats("w2", 10, 20, num_running=1, num_generated_tokens=7, num_total_blocks=200)],
        reserved={"w1": 40, "w2": 60})
    data = dashboard_data(status, make_numbers())
    w1, w2 = data["workers"]
    assert (w1["worker_id"], w2["worker_id"]) == ("w1", "w2")
    assert (w1["num_used_blocks"], w1["num_reserved_blocks"], w1["num_total_blocks"]) == (30, 50, 100)
    assert w1["used_fraction"] == pytest.approx(0.3) and w1["reserved_fraction"] == pytest.approx(0.5)
    # The ledger reserves at placement, before the worker knows: the larger count wins.
    assert w2["num_reserved_blocks"] == 60 and w2["reserved_fraction"] == pytest.approx(0.3)
    assert (w1["num_running"], w1["num_waiting"], w1["num_generated_tokens"]) == (3, 1, 500)
    assert data["kv"] == {"num_total_blocks": 300, "num_used_blocks": 40, "num_reserved_blocks": 110}
    assert data["throughput"]["num_generated_tokens"] == 507
    assert data["queue"]["num_waiting_on_workers"] == 1


def test_workers_sort_numerically():
    status = make_status(records=[make_record(f"w{i}") for i in (10, 2, 1)])
    assert [w["worker_id"] for w in dashboard_data(status, make_numbers())["workers"]] == ["w1", "w2", "w10"]


def test_a_starting_worker_has_no_stats_yet():
    status = make_status(records=[make_record("w1", 0, state="starting")], reserved={"w1": 4})
    (worker,) = dashboard_data(status, make_numbers())["workers"]
    assert worker["state"] == "starting"
    assert (worker["num_used_blocks"], worker["num_running"], worker["num_generated_tokens"]) == (0, 0, 0)
    assert worker["num_reserved_blocks"] == 4 and worker["reserved_fraction"] == 0.0  # no pool yet: no division


def test_misprediction_rate_is_overruns_per_finished_request():
    counters = {"finished_stop": 6, "finished_length": 2, "finished_cancelled": 5, "overruns": 2, "migrations": 1,
                "preemptions": 3, "requeues": 4, "worker_ids": 9}
    requests = dashboard_data(make_status(counters=counters), make_numbers())["requests"]
    assert requests["num_finished"] == 8 and requests["num_cancelled"] == 5
    assert requests["misprediction_rate"] == pytest.approx(0.25)
    assert (requests["num_migrations"], requests["num_preemptions"], requests["num_requeues"]) == (1, 3, 4)


def test_no_finished_request_means_no_rate():
    data = dashboard_data(make_status(counters={"overruns": 1}), make_numbers())
    assert data["requests"]["misprediction_rate"] is None and data["requests"]["num_finished"] == 0


def test_router_numbers_and_health_pass_through():
    data = dashboard_data(make_status(num_pending=7, is_redis_ok=False), make_numbers(tokens_per_s=12.345, num_in_flight=3))
    assert data["is_redis_ok"] is False
    assert data["queue"]["num_pending"] == 7 and data["queue"]["num_in_flight"] == 3
    assert data["queue"]["max_concurrent_requests"] == 64
    assert data["throughput"]["tokens_per_s"] == 12.35
    assert (data["model_id"], data["policy"], data["uptime_s"]) == (MODEL, "s3", 12.3)


# -- ThroughputMeter -----------------------------------------------------------------------


def test_throughput_from_successive_samples():
    meter = ThroughputMeter()
    assert meter.update(10.0, {"w1": 100, "w2": 50}) is None
    assert meter.update(12.0, {"w1": 140, "w2": 70}) == pytest.approx(30.0)
    assert meter.update(13.0, {"w1": 140, "w2": 70}) == pytest.approx(0.0)


def test_new_and_departed_workers_never_distort_the_rate():
    meter = ThroughputMeter()
    meter.update(0.0, {"w1": 100, "w2": 1000})
    # w2 left, w3 appeared with a count from before this interval: only w1's growth counts.
    assert meter.update(1.0, {"w1": 110, "w3": 5000}) == pytest.approx(10.0)
    assert meter.update(2.0, {"w1": 110, "w3": 5020}) == pytest.approx(20.0)


def test_samples_too_close_keep_the_last_rate():
    meter = ThroughputMeter(min_interval_s=0.5)
    meter.update(0.0, {"w1": 0})
    assert meter.update(1.0, {"w1": 10}) == pytest.approx(10.0)
    assert meter.update(1.1, {"w1": 1000}) == pytest.approx(10.0)  # ignored, window unchanged
    assert meter.update(2.0, {"w1": 30}) == pytest.approx(20.0)


def test_meter_rejects_a_non_positive_interval():
    with pytest.raises(ValueError, match="min_interval_s"):
        ThroughputMeter(min_interval_s=0)


def test_generated_tokens_by_worker_reads_ready_workers():
    status = make_status(stats=[make_stats("w1", num_generated_tokens=3), make_stats("w2", num_generated_tokens=9)])
    assert generated_tokens_by_worker(status) == {"w1": 3, "w2": 9}


def test_page_is_self_contained():
    assert "<script>" in DASHBOARD_HTML and "<style>" in DASHBOARD_HTML
    # Nothing fetched from elsewhere: this machine (and many deployments) have no internet.
    for remote in ("http://", "https://", "src=", "<link"):
        assert remote not in DASHBOARD_HTML
    assert 'fetch("dashboard/data"' in DASHBOARD_HTML


# -- the real page in headless Chromium ----------------------------------------------------------


@pytest.fixture(scope="module")
def service(tmp_path_factory, model_cache_dir):
    from cluster.config import ServiceConfig
    from cluster.service import start_service, stop_service

    config = ServiceConfig(
        port=free_port(), num_workers=1, model_cache_dir=str(model_cache_dir), max_model_len=512,
        kv_cache_memory=32 * 1024**2, default_max_tokens=16, api_keys=(API_KEY,), max_concurrent_requests=4,
        data_dir=str(tmp_path_factory.mktemp("s3serve-dash")), num_cpus=4, num_torch_threads=1,
        stats_interval_s=0.25)
    running = start_service(config, ready_timeout_s=600, progress=lambda _msg: None)
    yield running
    stop_service(running)


def _png_pixels(path: Path):
    from PIL import Image  # Pillow comes with matplotlib, a dependency

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(path) as image:
        assert image.format == "PNG"
        return image.size, image.convert("L")


WIDTH, HEIGHT = 1200, 700


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if not CHROMIUM.exists():
        pytest.fail("Debian chromium is missing: `make setup` installs it (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        # A fresh profile, and no background connections: this machine's network is closed.
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=str(CHROMIUM), headless=True,
            viewport={"width": WIDTH, "height": HEIGHT},
            args=["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"])
        try:
            yield context
        finally:
            context.close()


def _complete(base: str, prompt: str, **extra) -> None:
    response = httpx.post(f"{base}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=300,
                          json={"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, **extra})
    assert response.status_code == 200, response.text


def _finished_at_least(n: int) -> str:
    return f"Number(document.getElementById('finished').textContent) >= {n}"


@pytest.mark.slow
def test_dashboard_in_headless_chromium(service, browser, tmp_path):
    from PIL import ImageStat

    base = service.base_url
    assert httpx.get(f"{base}/dashboard/data", timeout=30).status_code == 401  # data needs the key
    page_response = httpx.get(f"{base}/dashboard", timeout=30)
    assert page_response.status_code == 200 and "text/html" in page_response.headers["content-type"]
    for prompt in ("The capital of France is", "List three colors:"):
        _complete(base, prompt)
    auth = {"Authorization": f"Bearer {API_KEY}"}
    data = httpx.get(f"{base}/dashboard/data", headers=auth, timeout=30).json()
    assert data["requests"]["num_finished"] >= 2 and data["throughput"]["num_generated_tokens"] >= 2

    page = browser.new_page()
    page.goto(f"{base}/dashboard#key={API_KEY}")
    page.wait_for_selector("#workers tr[data-worker-id]", timeout=60_000)
    page.wait_for_function(_finished_at_least(2), timeout=60_000)
    # Live: a request served while the page is open shows up as throughput on the next poll.
    _complete(base, "Count to twenty:", max_tokens=24, ignore_eos=True)
    page.wait_for_function(_finished_at_least(3), timeout=60_000)
    page.wait_for_function("history_tps.some((tps) => tps > 0)", timeout=30_000)
    screenshot = tmp_path / "dashboard.png"
    page.screenshot(path=str(screenshot))
    row = page.inner_text("#workers tr[data-worker-id]")
    header = page.inner_text("header")
    assert "#key=" not in page.url  # the key leaves the address bar once stored
    assert page.inner_text("#mispred").endswith("%")
    assert not page.is_visible("#keyform") and not page.is_visible("#banner")
    page.close()

    worker_id = data["workers"][0]["worker_id"]
    assert row.split("\t")[:2] == [worker_id, "ready"], row
    assert MODEL in header and "Redis: ok" in header, header
    size, gray = _png_pixels(screenshot)
    assert size == (WIDTH, HEIGHT)
    assert ImageStat.Stat(gray).stddev[0] > 10  # text and bars on the page, not a blank frame
    assert len(gray.getcolors(maxcolors=1 << 16) or range(1 << 16)) > 20


@pytest.mark.slow
def test_dashboard_asks_for_the_key_and_refuses_a_wrong_one(service, browser):
    page = browser.new_page()  # a new tab: its sessionStorage holds no key
    page.goto(f"{service.base_url}/dashboard")
    page.wait_for_selector("#keyform", state="visible", timeout=30_000)
    assert page.locator("#workers tr").count() == 0
    page.fill("#key", "wrong-key")
    page.click("#keyform button")
    page.wait_for_function("document.getElementById('banner').textContent.includes('refused')", timeout=30_000)
    assert page.locator("#workers tr").count() == 0
    page.fill("#key", API_KEY)
    page.click("#keyform button")
    page.wait_for_selector("#workers tr[data-worker-id]", timeout=30_000)
    assert not page.is_visible("#keyform") and not page.is_visible("#banner")
    page.close()


def test_page_draws_kv_bars_from_the_data(browser, tmp_path):
    import json

    status = make_status(records=[make_record("w1", 200), make_record("w2", 100, state="starting")],
                         stats=[make_stats("w1", 60, 150, num_running=5, num_waiting=2, num_total_blocks=200)],
                         counters={"finished_stop": 3, "finished_length": 1, "overruns": 1}, num_pending=4)
    data = dashboard_data(status, make_numbers(tokens_per_s=42.5, num_in_flight=2))
    page = browser.new_page()
    page.set_content(DASHBOARD_HTML)  # no server: only the drawing is under test
    page.evaluate(f"render({json.dumps(data)})")
    widths = page.eval_on_selector_all(
        "#workers tr", "rows => rows.map(r => [r.dataset.workerId, r.querySelector('.res').style.width, "
                       "r.querySelector('.used').style.width])")
    assert widths == [["w1", "75%", "30%"], ["w2", "0%", "0%"]]
    cells = [text.strip() for text in page.inner_text("#workers tr[data-worker-id=w1]").split("\t")]
    assert cells == ["w1", "ready", "", "60 / 150 / 200", "5", "2", "0"]
    assert (page.inner_text("#queue"), page.inner_text("#inflight")) == ("4", "2 / 64")
    assert (page.inner_text("#finished"), page.inner_text("#mispred"), page.inner_text("#tps")) == ("4", "25.0%",
                                                                                                   "42.5")
    assert page.inner_text("#kv") == "60 / 150 / 300"
    page.screenshot(path=str(tmp_path / "bars.png"))
    page.close()
