"""The web dashboard: GET /dashboard.json against the model and the store's counters, and
the page at / loaded in headless Chromium: its screenshot must show the heat map drawn
from the live JSON (every cell in the colour of its tier and heat, no cell in the colour
of a tier the JSON says is empty), and its DOM the scheduler's numbers."""

import math
import re
import struct
import subprocess
import zlib
from pathlib import Path

import httpx
import numpy as np
import pytest

from conftest import Server

KEY = "dash-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHROMIUM = Path("/usr/bin/chromium")
# the drawing contract of colibri_serve/static/dashboard.js (see its header)
TIERS = {"D": (239, 68, 68), "d": (249, 160, 40), "R": (59, 130, 246), "r": (45, 212, 191), ".": (160, 160, 170)}
EMPTY = (17, 17, 20)
FRAME = (255, 255, 255)


@pytest.fixture(scope="module")
def dash_server(random_model):
    # four experts per layer at most (two pinned on average, two LRU): every kind of
    # CPU tier is non-empty once the history has counts (pins are chosen every 16
    # tokens); "read" leaves the session's shared model directory as it was
    server = Server(random_model, "--api-key", KEY, "--slots", "2", "--pin", "on", "--cap", "4",
                    "--history", "read").wait_ready()
    yield server
    server.stop()


def generate(server, n, first=0):
    for i in range(first, first + n):
        r = httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=60,
                       json={"model": "random-olmoe", "prompt": f"the dashboard test, prompt number {i}",
                             "max_tokens": 12, "temperature": 0})
        assert r.status_code == 200, r.text


def dashboard(server) -> dict:
    r = httpx.get(server.url + "/dashboard.json", headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json", r.text
    return r.json()


def test_the_json_describes_the_model_and_the_store(dash_server, random_model):
    import json

    config = json.loads((random_model / "config.json").read_text())
    layers, experts, top_k = config["num_hidden_layers"], config["num_experts"], config["num_experts_per_tok"]
    before = dashboard(dash_server)
    generate(dash_server, 4)
    data = dashboard(dash_server)
    s, m = data["scheduler"], data["experts"]
    assert data["model"] == "random-olmoe"
    assert s["slots"] == 2 and s["active"] == 0 and s["queue_depth"] == 0 and s["max_queue"] == 64
    assert s["requests_total"] == before["scheduler"]["requests_total"] + 4 and s["decode_tok_s"] > 0
    assert (m["layers"], m["experts"]) == (layers, experts)
    assert len(m["tiers"]) == layers and all(len(row) == experts for row in m["tiers"])
    assert set("".join(m["tiers"])) <= set(m["codes"]) == set(TIERS)
    # counts are the map's; the capacities bound them; the CPU backend has no device tier
    joined = "".join(m["tiers"])
    assert m["counts"] == {name: joined.count(code) for code, name in m["codes"].items()}
    cap = m["capacity"]
    assert cap["device_lru_per_layer"] == cap["device_pinned"] == 0 and cap["ram_pinned"] > 0
    assert all(row.count("r") <= cap["ram_lru_per_layer"] for row in m["tiers"])
    assert 0 < m["counts"]["ram_pinned"] <= cap["ram_pinned"]
    assert m["counts"]["ram_lru"] > 0 and m["counts"]["disk"] > 0
    assert m["counts"]["device_pinned"] == m["counts"]["device_lru"] == data["lookups"]["device"] == 0
    # the store's counters: pinned experts served lookups, misses were read from disk
    looked = data["lookups"]
    assert looked["ram_pinned"] > 0 and looked["ram_lru"] > 0 and looked["disk"] > 0
    assert data["reads"] >= looked["disk"] and data["bytes_read"] > 0
    # heat: every token routed through a layer adds top_k to that layer's counts
    sums = {sum(row) for row in m["heat"]}
    assert len(sums) == 1 and len(m["heat"][0]) == experts
    routed = sums.pop()
    assert routed % top_k == 0 and top_k * s["prefill_tokens"] < routed <= top_k * (s["prefill_tokens"] + s["tokens_total"])
    assert sum(looked.values()) <= layers * routed  # a lookup per unique expert of a pass, a count per token
    assert m["heat_max"] == max(max(row) for row in m["heat"]) > 0
    assert routed > sum(before["experts"]["heat"][0])
    # tier bars: the RAM tier holds its pinned and LRU experts, within its room; the lookups split
    bars = {b["tier"]: b for b in data["tier_bars"]}
    assert list(bars) == ["ram", "disk"]  # no device tier on the CPU backend
    ram = bars["ram"]
    held = m["counts"]["ram_pinned"] + m["counts"]["ram_lru"]
    assert ram["bytes"] > 0 and ram["bytes"] % held == 0 and ram["bytes"] <= ram["budget"]
    assert ram["served"] == looked["ram_pinned"] + looked["ram_lru"] + looked["prefetched"]
    assert bars["disk"]["served"] == looked["disk"] and bars["disk"]["bytes"] is None


def test_the_key_guards_the_data_not_the_page(dash_server):
    url = dash_server.url
    assert httpx.get(url + "/dashboard.json").status_code == 401
    assert httpx.get(url + "/dashboard.json", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(url + "/dashboard.json", headers={"x-api-key": KEY}).status_code == 200
    bad = httpx.post(url + "/dashboard.json", headers=AUTH, json={})
    assert bad.status_code == 405 and "error" in bad.json()
    for path, kind in (("/", "text/html"), ("/static/dashboard.js", "text/javascript"), ("/static/dashboard.css", "text/css")):
        r = httpx.get(url + path)  # no key: the files hold no data
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind)
        assert "default-src 'none'" in r.headers["content-security-policy"]
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", r.text, re.I), f"{path} refers to another site"
    assert httpx.get(url + "/static/nothing.js").status_code == 401  # only the page's own files are open
    schema = httpx.get(url + "/openapi.json", headers=AUTH).json()
    assert "/dashboard.json" in schema["paths"] and "/" not in schema["paths"]


def test_503_while_loading_and_the_page_still_loads():
    import asyncio

    from colibri_serve.app import create_app
    from colibri_serve.service import Service

    app = create_app(Service(lambda: None, model_name="m", slots=1, max_queue=1))  # never started: loading

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as http:
            r = await http.get("/dashboard.json")
            assert r.status_code == 503 and r.headers["retry-after"] == "5" and r.json()["error"]["code"] == "model_loading"
            assert (await http.get("/")).status_code == 200

    asyncio.run(go())


def test_the_map_of_a_large_model_stays_small():
    """75 MoE layers x 256 experts, with counts in the millions: one string of tier codes
    per layer and one integer per expert, the fastest tier shown where two hold one."""
    import json
    from types import SimpleNamespace

    from colibri_core.experts.history import RoutingHistory
    from colibri_core.experts.store import ExpertStore
    from colibri_core.experts.tiers import DeviceTier, ExpertWeights, RamTier

    layers, experts = 75, 256
    history = RoutingHistory(Path("/nonexistent"), "test", None, layers, experts)
    history.session[:] = np.random.default_rng(0).integers(0, 10**6, (layers, experts))
    ram, device = RamTier(layers, 32, pinned_capacity=layers * 20), DeviceTier(layers, 8, None, pinned_capacity=layers * 4)
    weights = ExpertWeights({}, 1)
    for layer in range(layers):
        for e in range(40):  # the LRU keeps the last 32: 8 to 39
            ram.put(layer, e, weights)
        for e in range(40, 60):
            ram.pin(layer, e, weights)
        for e in range(8):  # also in the RAM LRU: shown as the device's
            device.put(layer, e, weights)
        for e in range(56, 60):  # also pinned in RAM
            device.pin(layer, e, weights)
    store = ExpertStore([[{}] * experts] * layers, SimpleNamespace(backend=None), ram, history=history, io_workers=0,
                        device=device)
    m = store.expert_map()
    assert m["tiers"] == ["d" * 8 + "r" * 32 + "R" * 16 + "D" * 4 + "." * 196] * layers
    assert m["counts"] == {"device_pinned": 4 * layers, "device_lru": 8 * layers, "ram_pinned": 16 * layers,
                           "ram_lru": 32 * layers, "disk": 196 * layers}
    assert m["heat"] == history.session.astype(int).tolist()
    assert m["capacity"] == {"device_lru_per_layer": 8, "device_pinned": 4 * layers, "ram_lru_per_layer": 32,
                             "ram_pinned": 20 * layers}
    assert len(json.dumps(m, separators=(",", ":"))) < 200_000


# -- the page in a browser ----------------------------------------------------------------
def chromium(tmp_path, url, *args, timeout=90):
    """Headless Chromium on ``url``; returns its standard output."""
    cmd = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-extensions",
           "--disable-dev-shm-usage", "--force-device-scale-factor=1", "--force-color-profile=srgb", "--hide-scrollbars",
           f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1280,720", "--virtual-time-budget=4000", *args, url]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def read_png(path: Path) -> np.ndarray:
    """(height, width, 3) uint8 of an 8-bit RGB or RGBA PNG, not interlaced."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, [], None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
        elif kind == b"IEND":
            break
        pos += 12 + length
    width, height, depth, colour, _, _, interlace = header
    assert depth == 8 and colour in (2, 6) and interlace == 0, header
    bpp = 3 if colour == 2 else 4
    raw = zlib.decompress(b"".join(idat))
    stride = width * bpp
    out = np.zeros((height, stride), dtype=np.uint8)
    prev = np.zeros(stride, dtype=np.int32)
    for y in range(height):
        kind, line = raw[y * (stride + 1)], np.frombuffer(raw, np.uint8, stride, y * (stride + 1) + 1).astype(np.int32)
        if kind == 0:
            row = line
        elif kind == 1:  # Sub: a running sum per channel
            row = np.cumsum(line.reshape(width, bpp), axis=0).ravel() % 256
        elif kind == 2:  # Up
            row = (line + prev) % 256
        elif kind in (3, 4):  # Average, Paeth: byte by byte
            row, above = line.tolist(), prev.tolist()
            for i in range(stride):
                left = row[i - bpp] if i >= bpp else 0
                if kind == 3:
                    pred = (left + above[i]) // 2
                else:
                    up_left = above[i - bpp] if i >= bpp else 0
                    p = left + above[i] - up_left
                    pa, pb, pc = abs(p - left), abs(p - above[i]), abs(p - up_left)
                    pred = left if pa <= pb and pa <= pc else above[i] if pb <= pc else up_left
                row[i] = (row[i] + pred) % 256
            row = np.asarray(row, dtype=np.int32)
        else:
            raise AssertionError(f"PNG filter type {kind}")
        out[y], prev = row, row
    return out.reshape(height, width, bpp)[:, :, :3]


def expected_colour(code: str, count: int, heat_max: int) -> np.ndarray:
    h = math.log1p(count) / math.log1p(heat_max) if heat_max > 0 else 0.0
    k = 0.25 + 0.75 * h
    return np.array([round(e + (t - e) * k) for t, e in zip(TIERS[code], EMPTY)])


def nearest_tier(pixel: np.ndarray) -> str:
    """The tier whose colour line (from EMPTY to the tier's colour) passes nearest."""
    best = None
    for code, colour in TIERS.items():
        axis, off = np.subtract(colour, EMPTY), pixel.astype(float) - EMPTY
        k = min(1.0, max(0.0, float(off @ axis) / float(axis @ axis)))
        miss = float(np.linalg.norm(off - k * axis))
        if best is None or miss < best[0]:
            best = (miss, code)
    return best[1]


@pytest.mark.skipif(not CHROMIUM.exists(), reason="headless Chromium (/usr/bin/chromium, Debian package chromium) is not installed")
def test_the_page_draws_the_live_heat_map(dash_server, tmp_path):
    generate(dash_server, 3, first=100)
    shown = dashboard(dash_server)
    shot = tmp_path / "dashboard.png"
    chromium(tmp_path, f"{dash_server.url}/#key={KEY}", f"--screenshot={shot}")
    after = dashboard(dash_server)  # nothing generated meanwhile: the page drew this same map
    m = shown["experts"]
    assert (after["experts"]["tiers"], after["experts"]["heat"]) == (m["tiers"], m["heat"])
    image = read_png(shot)

    # the map's frame: the only pure white on the page
    ys, xs = np.nonzero(np.all(image == FRAME, axis=2))
    assert ys.size, "no heat map frame in the screenshot"
    top, bottom, left, right = ys.min(), ys.max(), xs.min(), xs.max()
    width, height = right - left + 1, bottom - top + 1
    assert (width - 2) % m["experts"] == 0 and (height - 2) % m["layers"] == 0, (width, height)
    cw, ch = (width - 2) // m["experts"], (height - 2) // m["layers"]
    assert cw >= 4 and ch >= 4

    seen = {}
    for layer, row in enumerate(m["tiers"]):
        for expert, code in enumerate(row):
            y, x = top + 1 + layer * ch + (ch - 1) // 2, left + 1 + expert * cw + (cw - 1) // 2
            pixel = image[y, x].astype(int)
            want = expected_colour(code, m["heat"][layer][expert], m["heat_max"])
            assert np.abs(pixel - want).max() <= 3, f"layer {layer} expert {expert} ({code}): {pixel} != {want}"
            seen[nearest_tier(pixel)] = seen.get(nearest_tier(pixel), 0) + 1
    # each tier the JSON reports is drawn, in as many cells; a tier it says is empty is not
    assert seen == {code: m["counts"][name] for code, name in m["codes"].items() if m["counts"][name]}
    inside = image[top + 1:bottom, left + 1:right].reshape(-1, 3).astype(int)
    for code in ("D", "d"):
        assert m["counts"][m["codes"][code]] == 0
        axis = np.subtract(TIERS[code], EMPTY)
        off = inside - EMPTY
        k = off @ axis / (axis @ axis)
        on_line = (k > 0.2) & (np.linalg.norm(off - k[:, None] * axis, axis=1) < 6)
        assert not on_line.any(), f"cells in the colour of {code}, which the JSON says is empty"

    # the page's numbers, rendered by its script from the same endpoint
    dom = chromium(tmp_path, f"{dash_server.url}/#key={KEY}", "--dump-dom")
    s = shown["scheduler"]
    assert re.search(rf'id="slots">{s["active"]} / {s["slots"]}<', dom)
    assert re.search(rf'id="queue">{s["queue_depth"]} / {s["max_queue"]}<', dom)
    assert f'{m["layers"]} layers × {m["experts"]} experts' in dom
    assert re.search(r'id="tok-s">\d+\.\d<', dom) and "data-updated=" in dom
    # the tier bars: filled to bytes / budget, the disk's to its share of lookups
    bars = {b["tier"]: b for b in shown["tier_bars"]}
    served = sum(b["served"] for b in bars.values())
    ram = re.search(r'id="tier-ram" data-fill="([0-9.]+)" data-served="([0-9.]+)"', dom)
    disk = re.search(r'id="tier-disk" data-fill="([0-9.]+)" data-served="([0-9.]+)"', dom)
    assert ram and disk, dom[-3000:]
    assert float(ram.group(1)) == pytest.approx(bars["ram"]["bytes"] / bars["ram"]["budget"], abs=1e-4)
    assert float(ram.group(2)) == pytest.approx(bars["ram"]["served"] / served, abs=1e-4)
    assert float(disk.group(1)) == float(disk.group(2)) == pytest.approx(bars["disk"]["served"] / served, abs=1e-4)


@pytest.mark.skipif(not CHROMIUM.exists(), reason="headless Chromium (/usr/bin/chromium, Debian package chromium) is not installed")
def test_the_page_asks_for_the_key(dash_server, tmp_path):
    dom = chromium(tmp_path, dash_server.url + "/", "--dump-dom")
    assert "this server needs an API key" in dom
    assert re.search(r'<form id="key-form">', dom)  # shown: no longer hidden
    assert "data-updated=" not in dom
