// colibri serve's expert atlas: draws atlas.json (written by `colibri atlas`) and polls
// dashboard.json about once a second for the tier holding each expert and for the
// experts the current turn routes. Plain JS, nothing loaded from anywhere but this server.
//
// The map (canvas #atlas-map, SIZE x SIZE) inside a 1-pixel FRAME on EMPTY: domain d of
// D sits on a circle of RADIUS around the centre C at angle -pi/2 + 2*pi*d/D; an expert
// is drawn at its profile-weighted mean of the domains' points (its profile: its domain
// affinities normalised to sum 1), so a generalist sits near the centre and an expert of
// one domain at that domain's point: x = floor(C + RADIUS * sum_d profile[d] cos(angle_d)
// + 0.5), y likewise with sin. It is a square of side 2h+1 centred there (h = 3 for a
// specialist, 2 for a generalist) in its tier's colour; an expert routed in the current
// (or last) turn first gets a ring: a square of side 2h+3 in LIT. Experts are drawn in
// order of (layer, expert), the later over the earlier; those never routed are not drawn.
// tests/test_serve_atlas.py checks a screenshot against exactly this.
"use strict";

// TIERS, EMPTY and FRAME: tiers.js; $, getJSON, setStatus, onKeyForm, showFailure: page.js
const LIT = [250, 204, 21];
const GUIDE = [63, 63, 70];
const LABEL = [212, 212, 216];
const SIZE = 640, C = 320, RADIUS = 250;
const POLL_MS = 1000;

const rgb = (c) => `rgb(${c.join(",")})`;
let atlas = null;     // atlas.json
let tiers = null;     // dashboard.json's experts.tiers
let heat = null;      // its experts.heat at the last poll
let lit = new Set();  // "layer/expert" routed in the current (or last) turn
let turnOpen = false; // the last poll saw routing: the next one continues the same turn
let drawn = [];       // [expert record, x, y, h] in drawing order, for clicks
let selected = null;

function position(profile) {
  const n = profile.length;
  let x = 0, y = 0;
  for (let d = 0; d < n; d++) {
    const angle = -Math.PI / 2 + (2 * Math.PI * d) / n;
    x += profile[d] * Math.cos(angle);
    y += profile[d] * Math.sin(angle);
  }
  return [Math.floor(C + RADIUS * x + 0.5), Math.floor(C + RADIUS * y + 0.5)];
}

function draw() {
  const canvas = $("atlas-map");
  if (!atlas || !atlas.verdict.specialised) return;
  canvas.hidden = false;
  const ctx = canvas.getContext("2d", { alpha: false });
  ctx.fillStyle = rgb(FRAME);
  ctx.fillRect(0, 0, SIZE, SIZE);
  ctx.fillStyle = rgb(EMPTY);
  ctx.fillRect(1, 1, SIZE - 2, SIZE - 2);
  ctx.strokeStyle = rgb(GUIDE);
  ctx.beginPath();
  ctx.arc(C, C, RADIUS, 0, 2 * Math.PI);
  ctx.stroke();
  ctx.fillStyle = rgb(LABEL);
  ctx.font = "13px system-ui, sans-serif";
  ctx.textAlign = "center";
  ctx.textBaseline = "middle";
  const n = atlas.domains.length;
  atlas.domains.forEach((name, d) => {
    const angle = -Math.PI / 2 + (2 * Math.PI * d) / n;
    ctx.fillText(name, C + (RADIUS + 28) * Math.cos(angle), C + (RADIUS + 28) * Math.sin(angle));
  });
  const layer = $("layer").value;
  drawn = [];
  for (const e of atlas.experts) {
    if (!e.profile || (layer !== "all" && String(e.layer) !== layer)) continue;
    const [x, y] = position(e.profile);
    const h = e.specialist ? 3 : 2;
    if (lit.has(`${e.layer}/${e.expert}`)) {
      ctx.fillStyle = rgb(LIT);
      ctx.fillRect(x - h - 1, y - h - 1, 2 * h + 3, 2 * h + 3);
    }
    ctx.fillStyle = rgb(tierOf(e).rgb);
    ctx.fillRect(x - h, y - h, 2 * h + 1, 2 * h + 1);
    drawn.push([e, x, y, h]);
  }
  document.body.dataset.drawn = String(drawn.length);
  document.body.dataset.lit = String(lit.size);
}

function tierOf(e) {
  const row = tiers && tiers[e.layer];
  return TIERS[(row && row[e.expert]) || "."] || TIERS["."];
}

function showVerdict() {
  const v = atlas.verdict, s = atlas.summary, el = $("verdict");
  const z = v.z === null ? "n/a" : v.z.toFixed(1);
  const tokens = atlas.input.domains.map((d) => `${d.name} ${d.tokens}`).join(", ");
  if (v.specialised) {
    el.className = "";
    el.textContent = `Specialised: the routers carry ${v.observed_bits.toFixed(3)} bits of domain information per layer, ` +
      `random routers on the same hidden states ${v.random_mean_bits.toFixed(3)} (z = ${z}). ` +
      `${s.specialists} of ${s.experts_routed} routed experts are specialists, the median normalised entropy is ` +
      `${s.median_entropy.toFixed(3)}. Tokens: ${tokens}. Near the centre: generalists; near a domain: its specialists.`;
  } else {
    el.className = "nothing";
    el.textContent = `Nothing to show: this model's routing is no more domain-specific than random routers on the same ` +
      `hidden states (${v.observed_bits.toFixed(3)} against ${v.random_mean_bits.toFixed(3)} bits, z = ${z}), ` +
      `as with random weights. A map would only draw noise.`;
    $("atlas-map").hidden = true;
  }
}

function fillLayers() {
  const select = $("layer");
  for (const l of atlas.layers) {
    const option = document.createElement("option");
    option.value = String(l.layer);
    option.textContent = `${l.layer} (${l.specialists} specialists)`;
    select.append(option);
  }
}

function showPanel(e) {
  selected = e;
  const panel = $("panel");
  panel.dataset.layer = String(e.layer);
  panel.dataset.expert = String(e.expert);
  const title = document.createElement("h3");
  title.textContent = `MoE layer ${e.layer}, expert ${e.expert}`;
  const rows = [
    ["tier", tierOf(e).name],
    ["kind", e.specialist ? "specialist" : "generalist"],
    ["tokens (atlas)", String(e.tokens)],
    ["entropy", `${e.entropy_bits.toFixed(3)} bits (${e.entropy.toFixed(3)} of the maximum)`],
  ];
  if (heat) rows.push(["routed since loading", String(heat[e.layer][e.expert])]);
  const table = document.createElement("table");
  for (const [k, v] of rows) table.append(row(k, v));
  const top = document.createElement("table");
  top.append(row("top domains", "affinity", "share"));
  for (const name of e.top_domains.slice(0, 3)) {
    const d = atlas.domains.indexOf(name);
    top.append(row(name, `${e.affinity[d].toFixed(2)}×`, `${(100 * e.share[d]).toFixed(1)} %`));
  }
  panel.replaceChildren(title, table, top);
}

function row(...cells) {
  const tr = document.createElement("tr");
  for (const text of cells) {
    const td = document.createElement("td");
    td.textContent = text;
    tr.append(td);
  }
  return tr;
}

function click(event) {
  const rect = $("atlas-map").getBoundingClientRect();
  const px = event.clientX - rect.left, py = event.clientY - rect.top;
  for (let i = drawn.length - 1; i >= 0; i--) { // the topmost first
    const [e, x, y, h] = drawn[i];
    if (Math.abs(px - x) <= h + 1 && Math.abs(py - y) <= h + 1) return showPanel(e);
  }
}

function drawLegend() {
  const legend = $("legend");
  for (const [code, tier] of Object.entries(TIERS)) {
    const item = document.createElement("span");
    const swatch = document.createElement("i");
    swatch.style.background = rgb(tier.rgb);
    item.append(swatch, `${code} ${tier.name}`);
    legend.append(item);
  }
  const note = document.createElement("span");
  const swatch = document.createElement("i");
  swatch.style.background = rgb(LIT);
  note.append(swatch, "routed in the current turn; large squares: specialists");
  legend.append(note);
}

// a turn: consecutive polls in which the routing counts grew; its experts stay lit until the next
function updateLive(map) {
  if (!map || !Array.isArray(map.heat)) {
    $("live-info").textContent = "live mode needs the routing history (this server runs with --history off)";
    return;
  }
  if (heat) {
    const now = [];
    map.heat.forEach((row, l) => row.forEach((count, e) => { if (count > heat[l][e]) now.push(`${l}/${e}`); }));
    if (now.length) {
      if (!turnOpen) lit = new Set();
      now.forEach((k) => lit.add(k));
      $("live-info").textContent = `${lit.size} experts routed in the turn at ${new Date().toLocaleTimeString()}`;
    }
    turnOpen = now.length > 0;
  }
  heat = map.heat;
  if (!$("live").checked) lit = new Set();
}

async function poll() {
  try {
    if (!atlas) {
      try {
        atlas = await getJSON("atlas.json");
      } catch (err) {
        if (err.status !== 404) throw err;
        $("verdict").className = "nothing";
        $("verdict").textContent = err.message;
        setStatus("no atlas");
        return; // nothing to draw: reload the page once the atlas is made
      }
      $("model").textContent = atlas.model.name;
      showVerdict();
      fillLayers();
    }
    const dash = await getJSON("dashboard.json");
    tiers = dash.experts ? dash.experts.tiers : null;
    updateLive(dash.experts);
    draw();
    if (selected) showPanel(selected);
    document.body.dataset.updated = String(dash.time);
    setStatus(`live, every ${POLL_MS / 1000} s`);
  } catch (err) {
    showFailure(err);
  }
  setTimeout(poll, POLL_MS);
}

onKeyForm();
$("atlas-map").addEventListener("click", click);
$("layer").addEventListener("change", draw);
$("live").addEventListener("change", draw);
drawLegend();
poll();
