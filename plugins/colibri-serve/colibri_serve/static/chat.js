// colibri serve's chat page: a plain client of the server's own OpenAI API
// (/v1/chat/completions, streamed). No dependencies, nothing loaded from elsewhere.
// Each reply gets a stats line: tokens, tokens/s, time to first token, and the experts
// read from disk during the turn (the difference of /dashboard.json's reads around it).
"use strict";

// $, KEY, authHeaders, getJSON, Loading, setStatus, onKeyForm: page.js
let model = null;
let messages = [];
let busy = false;

async function connect() {
  try {
    const models = await getJSON("v1/models");
    model = models.data[0].id;
    $("model").textContent = model;
    setStatus("ready");
  } catch (e) {
    setStatus(e.message, !(e instanceof Loading));
    if (e instanceof Loading) setTimeout(connect, 1000);
  }
}

function addTurn(role, text) {
  const div = document.createElement("div");
  div.className = "turn " + role;
  const body = document.createElement("span");
  body.className = "text";
  body.textContent = text;
  div.appendChild(body);
  $("turns").appendChild(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

async function diskReads() {
  try {
    return (await getJSON("dashboard.json")).reads;
  } catch (e) {
    return null;
  }
}

// the data of each server-sent event in a streamed response
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of block.split("\n")) {
        if (line.startsWith("data: ")) yield line.slice(6);
      }
    }
  }
}

async function send(text) {
  if (busy || !text.trim() || !model) return;
  busy = true;
  $("send").disabled = true;
  const system = $("system").value.trim();
  const stop = $("stop").value.split("|").filter((s) => s.length);
  messages.push({ role: "user", content: text });
  addTurn("user", text);
  const turn = addTurn("assistant", "");
  const out = turn.querySelector(".text");
  const body = {
    model, stream: true, stream_options: { include_usage: true },
    messages: (system ? [{ role: "system", content: system }] : []).concat(messages),
    temperature: Number($("temperature").value), max_tokens: Number($("max-tokens").value),
  };
  if (stop.length) body.stop = stop;
  const readsBefore = await diskReads();
  const started = performance.now();
  let first = null, last = null, usage = null, finish = null;
  try {
    const r = await fetch("v1/chat/completions", { method: "POST", headers: authHeaders(true), body: JSON.stringify(body) });
    if (!r.ok) {
      const err = await r.json().catch(() => ({}));
      throw new Error((err.error && err.error.message) || "HTTP " + r.status);
    }
    for await (const data of events(r)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        const piece = choice.delta && choice.delta.content;
        if (piece) {
          const now = performance.now();
          if (first === null) first = now;
          last = now;
          out.textContent += piece;
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
    }
    messages.push({ role: "assistant", content: out.textContent });
    const readsAfter = await diskReads();
    const n = usage ? usage.completion_tokens : 0;
    const parts = [n + " tokens"];
    if (n > 1 && last > first) parts.push(((n - 1) / ((last - first) / 1000)).toFixed(1) + " tok/s");
    if (first !== null) parts.push("first token " + ((first - started) / 1000).toFixed(2) + " s");
    if (readsBefore !== null && readsAfter !== null) parts.push((readsAfter - readsBefore) + " experts read from disk");
    if (finish) parts.push(finish);
    const stats = document.createElement("span");
    stats.className = "stats";
    stats.dataset.tokens = String(n);
    stats.textContent = parts.join(" · ");
    turn.appendChild(stats);
    turn.dataset.done = "1";
    setStatus("ready");
  } catch (e) {
    messages.pop();
    turn.classList.add("error");
    out.textContent += (out.textContent ? "\n" : "") + "error: " + e.message;
    turn.dataset.done = "1";
    setStatus(e.message, true);
  } finally {
    busy = false;
    $("send").disabled = false;
  }
}

$("send-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("message").value;
  $("message").value = "";
  send(text);
});
$("message").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) {
    ev.preventDefault();
    $("send-form").requestSubmit();
  }
});
onKeyForm(connect);
$("reset").addEventListener("click", () => {
  messages = [];
  $("turns").textContent = "";
});
connect();
