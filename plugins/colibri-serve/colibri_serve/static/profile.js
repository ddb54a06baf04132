// colibri serve's profiling page: polls dashboard.json about once a second and draws its
// `turns` (the last finished requests, oldest first) as stacked bars of their `seconds`
// per phase. Plain JS, nothing loaded from anywhere but this server.
//
// The chart (canvas #profile-chart, W x H) is a 1-pixel FRAME around EMPTY. Turn i of
// the n drawn (the last MAX_TURNS, oldest first) is a column of BAR pixels from
// x = 1 + GAP + i * (BAR + GAP). Its phases are stacked from the bottom row (y = H - 2)
// upwards in the order of dashboard.json's profile.phases: with s = PLOT / the largest
// turn's sum of seconds and c_k the turn's cumulative seconds through phase k,
// phase k fills the rows from y = BOTTOM - round(s * c_k) + 1 down to
// BOTTOM - round(s * c_(k-1)) in PHASES[name] (nothing when both round alike).
// tests/test_serve_profile_page.py checks a screenshot against exactly this.
"use strict";

// FRAME and EMPTY: tiers.js; $, getJSON, setStatus, onKeyForm, showFailure: page.js
const PHASES = {
  tokenize: { label: "tokenize", rgb: [100, 116, 139] },
  prefill: { label: "prefill", rgb: [99, 102, 241] },
  embed: { label: "embeddings", rgb: [6, 182, 212] },
  attention: { label: "attention", rgb: [59, 130, 246] },
  prefetch: { label: "prefetch", rgb: [168, 85, 247] },
  routers: { label: "routers", rgb: [234, 179, 8] },
  routed_experts: { label: "routed experts", rgb: [239, 68, 68] },
  expert_reads: { label: "waiting on expert reads", rgb: [249, 115, 22] },
  shared_experts: { label: "shared experts", rgb: [236, 72, 153] },
  dense_mlp: { label: "dense MLP", rgb: [34, 197, 94] },
  lm_head: { label: "LM head", rgb: [132, 204, 22] },
  other: { label: "other (norms, residuals)", rgb: [113, 113, 122] },
  drafting: { label: "drafting", rgb: [217, 70, 239] },
  sampling: { label: "sampling", rgb: [20, 184, 166] },
  detokenize: { label: "detokenize", rgb: [250, 250, 210] },
};
const W = 932, H = 302, BAR = 24, GAP = 6, MAX_TURNS = 30;
const BOTTOM = H - 2, PLOT = H - 2 - 10; // the tallest bar stops 10 rows under the frame
const POLL_MS = 1000;

const rgb = (c) => `rgb(${c.join(",")})`;
let phases = [];  // dashboard.json's profile.phases
let shown = [];   // [turn, x] as drawn, for the hover line

const total = (turn) => phases.reduce((sum, name) => sum + turn.seconds[name], 0);

function draw(turns) {
  const canvas = $("profile-chart");
  canvas.hidden = turns.length === 0;
  $("empty").hidden = turns.length > 0;
  const ctx = canvas.getContext("2d", { alpha: false });
  ctx.fillStyle = rgb(FRAME);
  ctx.fillRect(0, 0, W, H);
  ctx.fillStyle = rgb(EMPTY);
  ctx.fillRect(1, 1, W - 2, H - 2);
  const tallest = Math.max(0, ...turns.map(total));
  const scale = tallest > 0 ? PLOT / tallest : 0;
  shown = [];
  turns.forEach((turn, i) => {
    const x = 1 + GAP + i * (BAR + GAP);
    let below = 0, sum = 0;
    for (const name of phases) {
      sum += turn.seconds[name];
      const top = Math.round(scale * sum);
      if (top > below) {
        ctx.fillStyle = rgb((PHASES[name] || PHASES.other).rgb);
        ctx.fillRect(x, BOTTOM - top + 1, BAR, top - below);
      }
      below = top;
    }
    shown.push([turn, x]);
  });
  document.body.dataset.turns = turns.map((t) => t.id).join(",");
}

const ms = (s) => (s === null || s === undefined ? "–" : `${(1000 * s).toFixed(s < 0.1 ? 1 : 0)} ms`);
const mib = (b) => `${(b / 1048576).toFixed(b < 10485760 ? 2 : 0)} MiB`;

function largest(turn) {
  let best = null;
  for (const name of phases) if (best === null || turn.seconds[name] > turn.seconds[best]) best = name;
  const share = total(turn) > 0 ? (100 * turn.seconds[best]) / total(turn) : 0;
  return `${(PHASES[best] || { label: best }).label} ${share.toFixed(0)} %`;
}

function table(turns) {
  const rows = [...turns].reverse().map((t) => {
    const tr = document.createElement("tr");
    const cells = [String(t.id), String(t.prompt_tokens), String(t.cached_tokens), String(t.completion_tokens),
      ms(t.wall_s), ms(t.ttft_s), ms(total(t)), largest(t), String(t.lookups),
      t.hit_rate === null ? "–" : `${(100 * t.hit_rate).toFixed(1)} %`, mib(t.bytes_read)];
    cells.forEach((text, i) => {
      const td = document.createElement("td");
      td.textContent = text;
      if (i === 7) td.className = "phase";
      tr.append(td);
    });
    return tr;
  });
  $("turn-rows").replaceChildren(...rows);
}

function drawLegend() {
  const legend = $("legend");
  const items = phases.map((name) => {
    const item = document.createElement("span");
    const swatch = document.createElement("i");
    swatch.style.background = rgb((PHASES[name] || PHASES.other).rgb);
    item.append(swatch, (PHASES[name] || { label: name }).label);
    return item;
  });
  legend.replaceChildren(...items);
}

function hover(event) {
  const rect = $("profile-chart").getBoundingClientRect();
  const px = event.clientX - rect.left;
  const hit = shown.find(([, x]) => px >= x && px < x + BAR);
  if (!hit) return;
  const turn = hit[0];
  const parts = phases.filter((name) => turn.seconds[name] > 0)
    .map((name) => `${(PHASES[name] || { label: name }).label} ${ms(turn.seconds[name])}`);
  $("hover").textContent = `turn ${turn.id}: ${parts.join(", ")}`;
}

async function poll() {
  try {
    const dash = await getJSON("dashboard.json");
    $("model").textContent = dash.model;
    const profile = dash.profile;
    if (phases.join() !== profile.phases.join()) {
      phases = profile.phases;
      drawLegend();
    }
    const note = $("deferred");
    note.hidden = !profile.deferred;
    note.textContent = profile.deferred ? `The ${profile.backend} backend queues its work and runs it when the host ` +
      "needs a result: a phase's time is where the engine waited, so the device's work shows up in the phases that " +
      "read results (the routers' choices, the LM head), not where it was queued." : "";
    const turns = dash.turns.slice(-MAX_TURNS);
    draw(turns);
    table(turns);
    document.body.dataset.updated = String(dash.time);
    setStatus(`live, every ${POLL_MS / 1000} s`);
  } catch (err) {
    showFailure(err);
  }
  setTimeout(poll, POLL_MS);
}

onKeyForm();
$("profile-chart").addEventListener("mousemove", hover);
poll();
