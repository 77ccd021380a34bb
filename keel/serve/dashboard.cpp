#include "keel/serve/dashboard.h"

namespace keel::serve {

// Charts are drawn on canvases from the step records of the run's event stream (read with fetch,
// since EventSource cannot send an Authorization header). Skipped steps (the scaler's) are marked
// orange, non-finite steps red.
const std::string& dashboard_html() {
  static const std::string html = R"HTML(<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>keel serve</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body{font:14px system-ui,sans-serif;margin:0;color:#222;background:#fafafa}
header{background:#223;color:#eee;padding:8px 16px;display:flex;gap:12px;align-items:center}
header h1{font-size:16px;margin:0 12px 0 0}
main{display:grid;grid-template-columns:340px 1fr;gap:16px;padding:16px}
table{border-collapse:collapse;width:100%;background:#fff}
td,th{padding:4px 6px;border-bottom:1px solid #ddd;text-align:left;font-size:13px}
tr.run{cursor:pointer} tr.run:hover,tr.sel{background:#eef}
.charts{display:grid;grid-template-columns:1fr 1fr;gap:12px}
.chart{background:#fff;border:1px solid #ddd;padding:6px}
.chart h3{margin:0 0 4px;font-size:13px}
canvas{width:100%;height:160px}
#stats span{display:inline-block;margin-right:14px} code{background:#eee;padding:2px 4px}
.state-failed,.state-nonfinite{color:#b00} .state-running{color:#070} .err{color:#b00}
</style></head><body>
<header><h1>keel serve</h1>
<input id="key" type="password" placeholder="API key" size="28">
<button id="connect">Connect</button><span id="status"></span></header>
<main><section><h2>Runs</h2><table><thead><tr><th>id</th><th>state</th><th>step</th><th>loss</th></tr></thead>
<tbody id="runs"></tbody></table></section>
<section id="detail"><h2 id="run-title">Select a run</h2>
<div id="stats"></div>
<div class="charts">
<div class="chart"><h3>loss</h3><canvas id="c-loss" width="600" height="160"></canvas></div>
<div class="chart"><h3>grad_norm</h3><canvas id="c-grad_norm" width="600" height="160"></canvas></div>
<div class="chart"><h3>loss_scale</h3><canvas id="c-loss_scale" width="600" height="160"></canvas></div>
<div class="chart"><h3>learning_rate</h3><canvas id="c-learning_rate" width="600" height="160"></canvas></div>
</div>
<p>Marks: <span style="color:#e80">| skipped step</span> <span style="color:#d00">| non-finite step</span></p>
<h3>Advisor</h3><ul id="advice"></ul>
<h3>Capture</h3><p id="capture">none</p>
<p id="error" class="err"></p>
<p id="points" data-points="0"></p>
</section></main>
<script>
"use strict";
let key = "", current = null, records = [], abort = null, lastId = 0;
const $ = id => document.getElementById(id);
const fmt = v => typeof v === "number" ? (Math.abs(v) >= 1e4 || (v !== 0 && Math.abs(v) < 1e-3) ? v.toExponential(3) : v.toFixed(4)) : (v ?? "-");
function api(path, opt = {}) {
  opt.headers = Object.assign({Authorization: "Bearer " + key}, opt.headers || {});
  return fetch(path, opt);
}
async function listRuns() {
  const r = await api("/v1/runs");
  if (!r.ok) { $("status").textContent = "error " + r.status + ": " + (await r.json()).error.message; return; }
  $("status").textContent = "connected";
  const body = await r.json(), tb = $("runs");
  tb.innerHTML = "";
  for (const run of body.data) {
    const tr = document.createElement("tr");
    tr.className = "run" + (current === run.id ? " sel" : "");
    tr.dataset.id = run.id;
    tr.innerHTML = `<td>${run.id}</td><td class="state-${run.state}">${run.state}</td><td>${run.step}/${run.total_steps}</td><td>${fmt(run.loss)}</td>`;
    tr.onclick = () => select(run.id);
    tb.appendChild(tr);
  }
}
function num(v) { return typeof v === "number" ? v : (v === "nan" || v === "inf" || v === "-inf" ? NaN : null); }
function draw(name) {
  const cv = $("c-" + name), g = cv.getContext("2d"), W = cv.width, H = cv.height;
  g.clearRect(0, 0, W, H);
  const pts = records.map(r => [r.step, num(r[name])]).filter(p => p[1] !== null && isFinite(p[1]));
  const steps = records.map(r => r.step);
  if (!records.length) return;
  const x0 = Math.min(...steps), x1 = Math.max(...steps, x0 + 1);
  let y0 = Math.min(...pts.map(p => p[1])), y1 = Math.max(...pts.map(p => p[1]));
  if (!isFinite(y0)) { y0 = 0; y1 = 1; } if (y1 === y0) { y1 = y0 + 1; }
  const X = s => 30 + (W - 40) * (s - x0) / (x1 - x0), Y = v => H - 16 - (H - 26) * (v - y0) / (y1 - y0);
  let prev = null;
  for (const r of records) {  // marks: a step that raised skipped_steps or nan_steps
    if (prev) {
      const nan = r.nan_steps > prev.nan_steps, skip = r.skipped_steps > prev.skipped_steps;
      if (nan || skip) { g.strokeStyle = nan ? "#d00" : "#e80"; g.beginPath(); g.moveTo(X(r.step), 4); g.lineTo(X(r.step), H - 16); g.stroke(); }
    }
    prev = r;
  }
  g.strokeStyle = "#236"; g.lineWidth = 1.5; g.beginPath();
  pts.forEach((p, i) => i ? g.lineTo(X(p[0]), Y(p[1])) : g.moveTo(X(p[0]), Y(p[1])));
  g.stroke();
  g.fillStyle = "#555"; g.font = "11px sans-serif";
  g.fillText(fmt(y1), 2, 12); g.fillText(fmt(y0), 2, H - 18); g.fillText("step " + x1, W - 70, H - 3);
}
function drawAll() {
  ["loss", "grad_norm", "loss_scale", "learning_rate"].forEach(draw);
  let skipped = 0, nonfinite = 0;
  records.forEach((r, i) => { if (i) { skipped += r.skipped_steps > records[i - 1].skipped_steps; nonfinite += r.nan_steps > records[i - 1].nan_steps; } else { skipped += r.skipped_steps > 0; nonfinite += r.nan_steps > 0; } });
  const p = $("points");
  p.dataset.points = records.length; p.dataset.skipped = skipped; p.dataset.nonfinite = nonfinite;
  p.textContent = `${records.length} steps received, ${skipped} skipped, ${nonfinite} non-finite marked`;
}
async function showRun(id) {
  const r = await api("/v1/runs/" + id);
  if (!r.ok) return;
  const run = await r.json();
  $("run-title").textContent = "Run " + run.id;
  $("stats").innerHTML = `<span>state <b id="run-state" class="state-${run.state}">${run.state}</b></span>` +
    `<span>step <b id="run-step">${run.step}</b>/${run.total_steps}</span><span>loss ${fmt(run.loss)}</span>` +
    `<span>grad_norm ${fmt(run.grad_norm)}</span><span>scale ${fmt(run.loss_scale)}</span><span>lr ${fmt(run.learning_rate)}</span>` +
    `<span>skipped ${run.skipped_steps}</span><span>non-finite ${run.nan_steps}</span>` +
    `<span>${fmt(run.tokens_per_s)} tok/s</span><span>eta ${run.eta_s == null ? "-" : Math.round(run.eta_s) + "s"}</span>`;
  $("advice").innerHTML = "";
  for (const a of run.advice) { const li = document.createElement("li"); li.textContent = "step " + a.step + ": " + a.advice; $("advice").appendChild(li); }
  $("capture").innerHTML = run.capture ? `<code id="replay">${run.capture.replay}</code>` : "none";
  $("error").textContent = run.error || "";
}
async function follow(id) {
  abort = new AbortController();
  const r = await api(`/v1/runs/${id}/events`, {signal: abort.signal, headers: lastId ? {"Last-Event-ID": String(lastId)} : {}});
  if (!r.ok || !r.body) return;
  const reader = r.body.getReader(), dec = new TextDecoder();
  let buf = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) break;
    buf += dec.decode(value, {stream: true});
    let i;
    while ((i = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, i); buf = buf.slice(i + 2);
      let type = "message", data = "", eid = null;
      for (const line of block.split("\n")) {
        if (line.startsWith("event: ")) type = line.slice(7);
        else if (line.startsWith("data: ")) data += line.slice(6);
        else if (line.startsWith("id: ")) eid = +line.slice(4);
      }
      if (eid !== null) lastId = eid;
      if (type === "step") { records.push(JSON.parse(data)); drawAll(); }
      if (type === "state" || type === "end" || type === "advice") { showRun(id); listRuns(); }
    }
  }
}
function select(id) {
  if (abort) abort.abort();
  current = id; records = []; lastId = 0;
  drawAll(); showRun(id); listRuns(); follow(id).catch(() => {});
}
$("connect").onclick = () => { key = $("key").value; listRuns(); };
setInterval(() => { if (key) { listRuns(); if (current) showRun(current); } }, 2000);
</script></body></html>
)HTML";
  return html;
}

}  // namespace keel::serve
