// colibri serve's dashboard: polls dashboard.json about once a second and draws it.
// Plain JS, no dependencies, nothing loaded from anywhere but this server.
//
// The heat map (canvas #map): one row per MoE layer, one cell per expert, inside a
// 1-pixel FRAME. Cell (layer l, expert e) covers x = 1 + e*cw .. , y = 1 + l*ch ..,
// (cw - gap) x (ch - gap) pixels, the gap showing EMPTY. Its colour is the tier's,
// scaled towards EMPTY by the heat: EMPTY + (TIER - EMPTY) * (0.25 + 0.75 * h), each
// channel rounded, h = log(1 + count) / log(1 + heat_max) (h = 1 without a routing
// history). tests/test_serve_dashboard.py checks a screenshot against exactly this.
"use strict";

// TIERS, EMPTY and FRAME: tiers.js; $, getJSON, setStatus, onKeyForm, showFailure: page.js
const POLL_MS = 1000;
const LOOKUPS = [["device", "device"], ["ram_pinned", "RAM pinned"], ["ram_lru", "RAM LRU"],
                 ["prefetched", "prefetched"], ["disk", "disk (read)"]];

const rates = []; // [time, tokens/s], the last 2 minutes
let last = null;  // the last snapshot drawn, and its cell geometry
let geometry = null;

function fmtBytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : String(n)) + " " + units[i];
}

function cellColour(code, count, heatMax, hasHeat) {
  const tier = TIERS[code] || TIERS["."];
  let h = 1;
  if (hasHeat) h = heatMax > 0 ? Math.log1p(count) / Math.log1p(heatMax) : 0;
  const k = 0.25 + 0.75 * h;
  return tier.rgb.map((c, i) => Math.round(EMPTY[i] + (c - EMPTY[i]) * k));
}

function drawMap(map) {
  const canvas = $("map");
  const room = Math.max(64, document.documentElement.clientWidth - 64);
  const cw = Math.max(1, Math.min(32, Math.floor((room - 2) / Math.max(1, map.experts))));
  const ch = Math.max(3, Math.min(24, cw));
  const gap = cw >= 4 ? 1 : 0;
  const width = 2 + map.experts * cw, height = 2 + map.layers * ch;
  if (canvas.width !== width || canvas.height !== height) {
    canvas.width = width;
    canvas.height = height;
  }
  canvas.style.width = width + "px";
  canvas.style.height = height + "px";
  const ctx = canvas.getContext("2d", { alpha: false });
  ctx.fillStyle = `rgb(${FRAME.join(",")})`;
  ctx.fillRect(0, 0, width, height);
  ctx.fillStyle = `rgb(${EMPTY.join(",")})`;
  ctx.fillRect(1, 1, width - 2, height - 2);
  const hasHeat = Array.isArray(map.heat);
  for (let l = 0; l < map.layers; l++) {
    const row = map.tiers[l] || "";
    for (let e = 0; e < row.length; e++) {
      const count = hasHeat ? map.heat[l][e] : 0;
      const [r, g, b] = cellColour(row[e], count, map.heat_max, hasHeat);
      ctx.fillStyle = `rgb(${r},${g},${b})`;
      ctx.fillRect(1 + e * cw, 1 + l * ch, cw - gap, ch - gap);
    }
  }
  geometry = { cw, ch };
  const c = map.counts;
  $("map-info").textContent = `${map.layers} layers × ${map.experts} experts: ` +
    `${c.device_pinned + c.device_lru} on the device (${c.device_pinned} pinned), ` +
    `${c.ram_pinned + c.ram_lru} in RAM (${c.ram_pinned} pinned), ${c.disk} on disk only`;
}

function drawLegend() {
  const legend = $("legend");
  for (const [code, tier] of Object.entries(TIERS)) {
    const item = document.createElement("span");
    const swatch = document.createElement("i");
    swatch.style.background = `rgb(${tier.rgb.join(",")})`;
    item.append(swatch, `${code} ${tier.name}`);
    legend.append(item);
  }
  const note = document.createElement("span");
  note.textContent = "brighter: routed more often since loading";
  legend.append(note);
}

function drawSpark() {
  const canvas = $("spark");
  const ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  if (rates.length < 2) return;
  const t1 = rates[rates.length - 1][0], t0 = t1 - 120;
  const top = Math.max(1, ...rates.map((r) => r[1]));
  ctx.strokeStyle = "rgb(59,130,246)";
  ctx.lineWidth = 1.5;
  ctx.beginPath();
  rates.forEach(([t, v], i) => {
    const x = ((t - t0) / 120) * canvas.width, y = canvas.height - 2 - (v / top) * (canvas.height - 4);
    if (i) ctx.lineTo(x, y); else ctx.moveTo(x, y);
  });
  ctx.stroke();
  ctx.fillStyle = "rgb(161,161,170)";
  ctx.font = "11px system-ui, sans-serif";
  ctx.fillText(`max ${top.toFixed(1)}`, 4, 12);
}

function render(data) {
  const s = data.scheduler;
  $("model").textContent = data.model;
  $("tok-s").textContent = s.decode_tok_s.toFixed(1);
  $("queue").textContent = `${s.queue_depth} / ${s.max_queue}`;
  $("slots").textContent = `${s.active} / ${s.slots}`;
  $("ttft").textContent = s.ttft_s ? `${(s.ttft_s * 1000).toFixed(0)} ms` : "–";
  $("totals").textContent = `${s.requests_total} / ${s.tokens_total}`;
  $("kv").textContent = `${fmtBytes(s.kv_bytes)} of ${fmtBytes(s.kv_budget_bytes)}` +
    (s.kv_disk_files ? `; on disk ${fmtBytes(s.kv_disk_bytes)} in ${s.kv_disk_files} prefixes, ` +
                       `${s.kv_disk_hit_tokens} prompt tokens read back` : "");
  const total = LOOKUPS.reduce((n, [k]) => n + data.lookups[k], 0);
  const rows = $("lookup-rows");
  rows.replaceChildren(...LOOKUPS.map(([k, label]) => {
    const tr = document.createElement("tr");
    const n = data.lookups[k];
    for (const [text, cls] of [[label, ""], [String(n), "n"], [total ? `${((100 * n) / total).toFixed(1)} %` : "", "n"]]) {
      const td = document.createElement("td");
      td.textContent = text;
      td.className = cls;
      tr.append(td);
    }
    return tr;
  }));
  $("reads").textContent = `${data.reads} reads from disk, ${fmtBytes(data.bytes_read)}`;
  drawTierBars(data.tier_bars || []);
  rates.push([data.time, s.decode_tok_s]);
  while (rates.length && rates[0][0] < data.time - 120) rates.shift();
  drawSpark();
  if (data.experts) {
    drawMap(data.experts);
  } else {
    $("map-info").textContent = "this model has no routed experts";
  }
  last = data;
  document.body.dataset.updated = String(data.time);
}

// one bar per tier: filled to bytes / budget (the disk's, to its share of lookups);
// data-fill and data-served carry the two fractions (tests/test_serve_dashboard.py)
function drawTierBars(bars) {
  const served = bars.reduce((n, b) => n + b.served, 0);
  $("tier-bars").replaceChildren(...bars.map((b) => {
    const row = document.createElement("div");
    row.className = "tier-bar";
    row.id = "tier-" + b.tier;
    const share = served ? b.served / served : 0;
    const fill = b.budget ? Math.min(1, b.bytes / b.budget) : share;
    row.dataset.fill = fill.toFixed(4);
    row.dataset.served = share.toFixed(4);
    const label = document.createElement("span");
    label.className = "name";
    label.textContent = b.tier === "ram" ? "RAM" : b.tier;
    const bar = document.createElement("span");
    bar.className = "bar";
    const inner = document.createElement("i");
    inner.style.width = (100 * fill).toFixed(1) + "%";
    bar.append(inner);
    const text = document.createElement("span");
    text.className = "text";
    text.textContent = (b.budget ? `${fmtBytes(b.bytes)} of ${fmtBytes(b.budget)}, ` : "") +
      `serves ${(100 * share).toFixed(1)} % of lookups`;
    row.append(label, bar, text);
    return row;
  }));
}

function hover(event) {
  if (!last || !last.experts || !geometry) return;
  const rect = $("map").getBoundingClientRect();
  const e = Math.floor((event.clientX - rect.left - 1) / geometry.cw);
  const l = Math.floor((event.clientY - rect.top - 1) / geometry.ch);
  const map = last.experts;
  if (l < 0 || e < 0 || l >= map.layers || e >= (map.tiers[l] || "").length) return;
  const code = map.tiers[l][e];
  const count = Array.isArray(map.heat) ? `, routed ${map.heat[l][e]} times` : "";
  $("hover").textContent = `MoE layer ${l}, expert ${e}: ${TIERS[code].name}${count}`;
}

async function poll() {
  try {
    render(await getJSON("dashboard.json"));
    setStatus(`live, every ${POLL_MS / 1000} s`);
  } catch (err) {
    showFailure(err);
  }
  setTimeout(poll, POLL_MS);
}

onKeyForm();
$("map").addEventListener("mousemove", hover);
drawLegend();
poll();
