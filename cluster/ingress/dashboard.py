"""The built-in status page at `GET /dashboard` and the JSON it polls at `GET /dashboard/data`.

    browser --GET /dashboard--------> Router: DASHBOARD_HTML (self-contained: no CDN, inline CSS/JS)
    browser --GET /dashboard/data---> Router: controller.status() -> dashboard_data(...) -> JSON
            (every second; Bearer key when the service has API keys)

The page itself is public (it holds no data); the data needs the API key like every other
endpoint when keys are configured. The page takes the key from the URL fragment
(`/dashboard#key=KEY`: a fragment never leaves the browser, so the key stays out of server
and proxy logs) or asks for it on the first 401, and keeps it in the tab's sessionStorage.

Throughput is measured between successive polls of the workers' cumulative
`num_generated_tokens` by a `ThroughputMeter` that the router replica owns.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the status is only read here; importing the controller would pull in Ray
    from cluster.control.messages import ClusterStatus


@dataclass(frozen=True, slots=True)
class RouterNumbers:
    """What the answering router replica knows that the controller does not.

    Attributes:
        model_id: the served model's id.
        policy: the KV reservation policy.
        num_in_flight: requests this replica is answering now.
        max_concurrent_requests: this replica's limit before 429s.
        uptime_s: seconds since this replica started.
        tokens_per_s: output tokens per second over the last poll interval; None before a second poll.
    """

    model_id: str
    policy: str
    num_in_flight: int
    max_concurrent_requests: int
    uptime_s: float
    tokens_per_s: float | None


class ThroughputMeter:
    """Output tokens per second from successive samples of each worker's cumulative count.

    A worker seen for the first time contributes nothing to the interval it appears in (its
    count covers an unknown span); a worker that left contributes nothing either, so a pool
    that shrinks never shows a negative rate.

    Args:
        min_interval_s: samples closer than this to the previous one return the last rate
            unchanged (a 1-step difference over a few ms is noise, and several open tabs
            must not shorten the window).
    """

    def __init__(self, min_interval_s: float = 0.5) -> None:
        if min_interval_s <= 0:
            raise ValueError(f"min_interval_s must be > 0, got {min_interval_s}")
        self.min_interval_s = min_interval_s
        self._last_s: float | None = None
        self._last_tokens: dict[str, int] = {}
        self._rate: float | None = None

    def update(self, now_s: float, num_generated_tokens_by_worker: dict[str, int]) -> float | None:
        """Records a sample taken at monotonic time `now_s`; returns tokens/s, None until two samples."""
        if self._last_s is not None and now_s - self._last_s < self.min_interval_s:
            return self._rate
        if self._last_s is not None:
            num_new = sum(max(0, count - self._last_tokens[wid])
                          for wid, count in num_generated_tokens_by_worker.items() if wid in self._last_tokens)
            self._rate = num_new / (now_s - self._last_s)
        self._last_s = now_s
        self._last_tokens = dict(num_generated_tokens_by_worker)
        return self._rate


def generated_tokens_by_worker(status: "ClusterStatus") -> dict[str, int]:
    """Each ready worker's cumulative output tokens, the ThroughputMeter's input."""
    return {str(stats.worker_id): stats.num_generated_tokens for stats in status.stats}


def _fraction(part: int, whole: int) -> float:
    return part / whole if whole > 0 else 0.0


def dashboard_data(status: "ClusterStatus", router: RouterNumbers) -> dict:
    """The JSON the page shows: workers with their KV bars, queue, request outcomes, throughput.

    `misprediction_rate` is overruns per finished request (finished = stopped or hit its
    length limit); None before any request finished. A request can overrun more than once
    (its bound is raised step by step), so the rate can exceed 1.
    """
    stats_by_id = {str(s.worker_id): s for s in status.stats}
    workers = []
    for record in sorted(status.workers, key=lambda r: (len(r.worker_id), r.worker_id)):
        stats = stats_by_id.get(record.worker_id)
        num_total = record.num_total_blocks
        num_used = stats.num_used_blocks if stats else 0
        # The ledger reserves at placement, the worker when the request arrives: show the larger.
        num_reserved = max(status.reserved_blocks.get(record.worker_id, 0), stats.num_reserved_blocks if stats else 0)
        workers.append({
            "worker_id": record.worker_id, "state": record.state, "num_total_blocks": num_total,
            "num_used_blocks": num_used, "num_reserved_blocks": num_reserved,
            "used_fraction": _fraction(num_used, num_total), "reserved_fraction": _fraction(num_reserved, num_total),
            "num_running": stats.num_running if stats else 0, "num_waiting": stats.num_waiting if stats else 0,
            "num_generated_tokens": stats.num_generated_tokens if stats else 0,
        })
    counters = status.counters
    num_finished = counters.get("finished_stop", 0) + counters.get("finished_length", 0)
    num_overruns = counters.get("overruns", 0)
    return {
        "model_id": router.model_id,
        "policy": router.policy,
        "uptime_s": round(router.uptime_s, 1),
        "is_redis_ok": status.is_redis_ok,
        "queue": {
            "num_pending": status.num_pending,
            "num_waiting_on_workers": sum(w["num_waiting"] for w in workers),
            "num_in_flight": router.num_in_flight,
            "max_concurrent_requests": router.max_concurrent_requests,
        },
        "workers": workers,
        "kv": {
            "num_total_blocks": sum(w["num_total_blocks"] for w in workers),
            "num_used_blocks": sum(w["num_used_blocks"] for w in workers),
            "num_reserved_blocks": sum(w["num_reserved_blocks"] for w in workers),
        },
        "requests": {
            "num_finished": num_finished,
            "num_finished_stop": counters.get("finished_stop", 0),
            "num_finished_length": counters.get("finished_length", 0),
            "num_cancelled": counters.get("finished_cancelled", 0),
            "num_overruns": num_overruns,
            "num_preemptions": counters.get("preemptions", 0),
            "num_migrations": counters.get("migrations", 0),
            "num_requeues": counters.get("requeues", 0),
            "misprediction_rate": num_overruns / num_finished if num_finished else None,
        },
        "throughput": {
            "tokens_per_s": None if router.tokens_per_s is None else round(router.tokens_per_s, 2),
            "num_generated_tokens": sum(w["num_generated_tokens"] for w in workers),
        },
    }


DASHBOARD_HTML = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>S3 Serve dashboard</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body{font:14px/1.4 system-ui,sans-serif;margin:0;background:#f4f5f7;color:#1d2330}
header{background:#1d2330;color:#fff;padding:12px 20px;display:flex;gap:24px;align-items:baseline;flex-wrap:wrap}
header h1{font-size:18px;margin:0}.muted{color:#8a93a6}main{padding:16px 20px}
.cards{display:grid;grid-template-columns:repeat(auto-fill,minmax(150px,1fr));gap:12px;margin-bottom:16px}
.card{background:#fff;border-radius:6px;padding:10px 14px;box-shadow:0 1px 2px #0002}
.card .v{font-size:24px;font-weight:600}.card .l{color:#5a6275;font-size:12px}
table{width:100%;border-collapse:collapse;background:#fff;box-shadow:0 1px 2px #0002;border-radius:6px}
th,td{padding:8px 10px;text-align:left;border-bottom:1px solid #e6e8ee}th{font-size:12px;color:#5a6275}
.bar{position:relative;height:14px;width:260px;background:#e6e8ee;border-radius:3px;overflow:hidden}
.bar span{position:absolute;left:0;top:0;bottom:0}.bar .res{background:#9ec5fe}.bar .used{background:#1f6feb}
.ok{color:#1a7f37;font-weight:600}.bad{color:#cf222e;font-weight:600}
#banner{display:none;background:#ffebe9;color:#cf222e;padding:8px 20px}
#keyform{display:none;padding:8px 20px;background:#fff8c5}
svg{display:block;width:100%;height:28px}
</style></head><body>
<header><h1>S3 Serve</h1><span id="model" class="muted"></span><span id="policy" class="muted"></span>
<span>Redis: <span id="redis">?</span></span><span class="muted">up <span id="uptime">?</span></span>
<span class="muted">updated <span id="updated">never</span></span></header>
<div id="banner"></div>
<form id="keyform">This service needs an API key:
<input id="key" type="password" autocomplete="off"> <button>Use key</button></form>
<main>
<div class="cards">
<div class="card"><div class="v" id="queue">-</div><div class="l">queued for placement</div></div>
<div class="card"><div class="v" id="inflight">-</div><div class="l">in flight (this router)</div></div>
<div class="card"><div class="v" id="finished">-</div><div class="l">finished requests</div></div>
<div class="card"><div class="v" id="mispred">-</div><div class="l">misprediction rate (overruns / finished)</div></div>
<div class="card"><div class="v" id="tps">-</div><div class="l">output tokens/s</div>
<svg id="spark" viewBox="0 0 150 28" preserveAspectRatio="none"></svg></div>
<div class="card"><div class="v" id="kv">-</div><div class="l">KV blocks used / reserved / total</div></div>
<div class="card"><div class="v" id="moves">-</div><div class="l">migrations / preemptions / requeues</div></div>
</div>
<table><thead><tr><th>worker</th><th>state</th><th colspan="2">KV blocks (used / reserved / total)</th>
<th>running</th><th>waiting</th><th>tokens</th></tr></thead><tbody id="workers"></tbody></table>
<p class="muted">Dark bar: blocks holding KV; light bar: blocks reserved for admitted requests' predicted
lengths. Refreshed every second from <code>dashboard/data</code>, which needs the API key when the service has
keys: open <code>/dashboard#key=KEY</code> or type it when asked (kept in this tab only).</p>
</main>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
const KEY_ITEM = "s3serve-dashboard-key";
const frag = new URLSearchParams(location.hash.slice(1));
if (frag.get("key")) { sessionStorage.setItem(KEY_ITEM, frag.get("key")); history.replaceState(null, "", location.pathname + location.search); }
const history_tps = [];
function fmtNum(x) { return x === null || x === undefined ? "-" : x.toLocaleString("en-US", {maximumFractionDigits: 1}); }
function fmtAge(s) { s = Math.floor(s); return s >= 3600 ? Math.floor(s / 3600) + "h " + Math.floor(s % 3600 / 60) + "m" : s >= 60 ? Math.floor(s / 60) + "m " + s % 60 + "s" : s + "s"; }
function cell(text) { const td = document.createElement("td"); td.textContent = text; return td; }
function bar(w) {
  const td = document.createElement("td"), b = document.createElement("div"), r = document.createElement("span"), u = document.createElement("span");
  b.className = "bar"; r.className = "res"; u.className = "used";
  r.style.width = (100 * Math.min(1, w.reserved_fraction)) + "%"; u.style.width = (100 * Math.min(1, w.used_fraction)) + "%";
  b.append(r, u); td.append(b); return td;
}
function spark() {
  const svg = $("spark"), max = Math.max(1, ...history_tps), n = history_tps.length;
  const pts = history_tps.map((v, i) => (150 * i / Math.max(1, n - 1)).toFixed(1) + "," + (26 - 24 * v / max).toFixed(1)).join(" ");
  svg.innerHTML = n > 1 ? '<polyline fill="none" stroke="#1f6feb" stroke-width="1.5" vector-effect="non-scaling-stroke" points="' + pts + '"/>' : "";
}
function render(d) {
  $("model").textContent = d.model_id; $("policy").textContent = "policy " + d.policy;
  $("redis").textContent = d.is_redis_ok ? "ok" : "down"; $("redis").className = d.is_redis_ok ? "ok" : "bad";
  $("uptime").textContent = fmtAge(d.uptime_s);
  $("queue").textContent = fmtNum(d.queue.num_pending);
  $("inflight").textContent = d.queue.num_in_flight + " / " + d.queue.max_concurrent_requests;
  $("finished").textContent = fmtNum(d.requests.num_finished);
  const rate = d.requests.misprediction_rate;
  $("mispred").textContent = rate === null ? "-" : (100 * rate).toFixed(1) + "%";
  $("tps").textContent = fmtNum(d.throughput.tokens_per_s);
  if (d.throughput.tokens_per_s !== null) { history_tps.push(d.throughput.tokens_per_s); if (history_tps.length > 60) history_tps.shift(); spark(); }
  $("kv").textContent = d.kv.num_used_blocks + " / " + d.kv.num_reserved_blocks + " / " + d.kv.num_total_blocks;
  $("moves").textContent = d.requests.num_migrations + " / " + d.requests.num_preemptions + " / " + d.requests.num_requeues;
  const rows = d.workers.map((w) => {
    const tr = document.createElement("tr"); tr.dataset.workerId = w.worker_id;
    tr.append(cell(w.worker_id), cell(w.state), bar(w), cell(w.num_used_blocks + " / " + w.num_reserved_blocks + " / " + w.num_total_blocks),
              cell(w.num_running), cell(w.num_waiting), cell(fmtNum(w.num_generated_tokens)));
    return tr;
  });
  $("workers").replaceChildren(...rows);
  $("updated").textContent = new Date().toLocaleTimeString();
}
function problem(text) { $("banner").textContent = text; $("banner").style.display = text ? "block" : "none"; }
async function poll() {
  const key = sessionStorage.getItem(KEY_ITEM);
  try {
    const r = await fetch("dashboard/data", {headers: key ? {Authorization: "Bearer " + key} : {}, cache: "no-store"});
    if (r.status === 401) { $("keyform").style.display = "block"; problem(key ? "The API key was refused." : ""); return; }
    $("keyform").style.display = "none";
    if (!r.ok) { const e = await r.json().catch(() => null); problem("status " + r.status + ": " + (e && e.error ? e.error.message : r.statusText)); return; }
    problem(""); render(await r.json());
  } catch (err) { problem("service unreachable: " + err); }
}
$("keyform").addEventListener("submit", (e) => { e.preventDefault(); sessionStorage.setItem(KEY_ITEM, $("key").value); poll(); });
poll(); setInterval(poll, 1000);
</script></body></html>
"""
