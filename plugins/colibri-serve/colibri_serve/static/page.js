// What every page of colibri serve shares: the API key (sessionStorage, this tab only;
// given as #key=KEY it is kept and taken out of the address bar), the status line, the
// key form, and reading the server's JSON with the key. Loaded first by each page.
"use strict";

const KEY = "colibri-api-key";
const $ = (id) => document.getElementById(id);

if (location.hash.startsWith("#key=")) {
  sessionStorage.setItem(KEY, decodeURIComponent(location.hash.slice(5)));
  history.replaceState(null, "", location.pathname + location.search);
}

function setStatus(text, error) {
  $("status").textContent = text;
  $("status").className = error ? "error" : "";
}

// the Authorization header when a key is kept (and a JSON body's content type)
function authHeaders(json) {
  const h = {};
  const key = sessionStorage.getItem(KEY);
  if (key) h.Authorization = `Bearer ${key}`;
  if (json) h["Content-Type"] = "application/json";
  return h;
}

class Loading extends Error {} // 503 while the model loads: not an error to show as one

// GET path's JSON with the key; shows the key form on 401. Throws Loading on 503, else an
// Error with the server's message and .status for any other failure.
async function getJSON(path) {
  const response = await fetch(path, { cache: "no-store", headers: authHeaders(false) });
  if (response.status === 401) {
    $("key-form").hidden = false;
    const err = new Error(sessionStorage.getItem(KEY) ? "the API key was refused" : "this server needs an API key");
    err.status = 401;
    throw err;
  }
  if (response.status === 503) throw new Loading("the model is loading…");
  if (!response.ok) {
    const body = await response.json().catch(() => ({}));
    const err = new Error((body.error && body.error.message) || `${path} answered ${response.status}`);
    err.status = response.status;
    throw err;
  }
  $("key-form").hidden = true;
  return response.json();
}

// the key form keeps what is typed (trimmed), then calls then()
function onKeyForm(then) {
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(KEY, $("key").value.trim());
    $("key").value = "";
    if (then) then();
  });
}

// a poll's failure on the status line: loading is not shown as an error
function showFailure(err) {
  const unreachable = err instanceof TypeError || !err.message; // fetch itself failed
  setStatus(unreachable ? "the server cannot be reached" : err.message, !(err instanceof Loading));
}
