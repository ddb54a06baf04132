"""The expert atlas page at /atlas: /atlas.json serves what ``colibri atlas`` wrote beside
the model's routing history, and the page in headless Chromium draws it as its script's
header says (every expert at its profile's point, in its tier's colour, specialists
larger), lights up the experts a turn routed, shows a clicked expert, and on a model
with random weights says it has nothing to show."""

import base64
import json
import math
from pathlib import Path

import httpx
import numpy as np
import pytest

from cdp import CHROMIUM, Browser
from colibri_core.cli.demo import build_demo_model
from colibri_core.testing.cli import run_colibri
from colibri_core.testing.demo_specs import SMALL_RANDOM
from conftest import Server
from test_serve_dashboard import EMPTY, FRAME, TIERS, read_png

KEY = "atlas-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
# the drawing contract of colibri_serve/static/atlas.js (see its header)
LIT = (250, 204, 21)
C, RADIUS = 320, 250

pytestmark = pytest.mark.slow


def make_atlas(model, cache, *args):
    done = run_colibri("atlas", "--model", model, "--json", *args, env={"XDG_CACHE_HOME": str(cache)}, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    colibri_trained = pytest.importorskip("colibri_trained", reason="colibri-trained is not installed")
    model = colibri_trained.path("olmoe")
    cache = tmp_path_factory.mktemp("atlas-cache")  # the trained model's history and atlas live in the cache dir
    made = make_atlas(model, cache, "--max-tokens", "2048")
    assert made["verdict"]["specialised"], made
    server = Server(model, "--api-key", KEY, "--history", "read", env={"XDG_CACHE_HOME": str(cache)}).wait_ready()
    yield server, made
    server.stop()


@pytest.fixture(scope="module")
def random_served(tmp_path_factory):
    model = tmp_path_factory.mktemp("atlas-random") / "random-olmoe"
    build_demo_model(model, SMALL_RANDOM)
    cache = tmp_path_factory.mktemp("atlas-random-cache")
    server = Server(model, "--api-key", KEY, env={"XDG_CACHE_HOME": str(cache)}).wait_ready()
    yield server, model, cache
    server.stop()


@pytest.fixture
def browser(tmp_path):
    if not CHROMIUM.exists():
        pytest.skip("headless Chromium (/usr/bin/chromium, Debian package chromium) is not installed")
    b = Browser(tmp_path / "profile")
    yield b
    b.close()


def get(server, path):
    r = httpx.get(server.url + path, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def screenshot(browser) -> np.ndarray:
    import tempfile

    data = browser._send("Page.captureScreenshot", {"format": "png"}, browser.session)["data"]
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "shot.png"
        path.write_bytes(base64.b64decode(data))
        return read_png(path)


def layout(atlas: dict, lit=frozenset()) -> list[tuple]:
    """(layer, expert, x, y, h, lit) of every drawn expert in drawing order, computed from
    atlas.json as the contract says."""
    n = len(atlas["domains"])
    out = []
    for e in atlas["experts"]:
        if not e["profile"]:
            continue
        x = sum(p * math.cos(-math.pi / 2 + 2 * math.pi * d / n) for d, p in enumerate(e["profile"]))
        y = sum(p * math.sin(-math.pi / 2 + 2 * math.pi * d / n) for d, p in enumerate(e["profile"]))
        out.append((e["layer"], e["expert"], math.floor(C + RADIUS * x + 0.5), math.floor(C + RADIUS * y + 0.5),
                    3 if e["specialist"] else 2, (e["layer"], e["expert"]) in lit))
    return out


def owner(drawn: list[tuple], px: int, py: int, margin: int = 1):
    """The expert whose square (or ring) is on top at (px, py); None when another one's
    edge comes within ``margin`` pixels (a rounding step there could change it)."""
    top = None
    for item in drawn:
        _, _, x, y, h, lit = item
        reach = h + (1 if lit else 0)
        d = max(abs(px - x), abs(py - y))
        if d <= reach + margin:
            top = item if d <= reach - margin else None
    return top


def frame_origin(image: np.ndarray) -> tuple[int, int]:
    ys, xs = np.nonzero(np.all(image == FRAME, axis=2))
    assert ys.size, "no atlas frame in the screenshot"
    assert (ys.max() - ys.min() + 1, xs.max() - xs.min() + 1) == (640, 640)
    return int(ys.min()), int(xs.min())


def test_the_json_is_the_file_beside_the_history(trained):
    server, made = trained
    served = get(server, "/atlas.json")
    assert served["path"] == made["path"] and served["path"].endswith(".atlas.json")  # in the cache dir, by the history
    assert served["verdict"] == made["verdict"] and served["model"]["name"] == "olmoe-16x64"
    assert httpx.get(server.url + "/atlas.json").status_code == 401
    for path in ("/atlas", "/static/atlas.js", "/static/atlas.css"):  # the page's files hold no data
        r = httpx.get(server.url + path)
        assert r.status_code == 200 and "default-src 'none'" in r.headers["content-security-policy"]


def test_the_page_draws_every_expert_where_and_as_the_atlas_says(trained, browser):
    server, _ = trained
    atlas = get(server, "/atlas.json")
    browser.open(f"{server.url}/atlas#key={KEY}")
    browser.wait_for("document.body.dataset.drawn")
    tiers = get(server, "/dashboard.json")["experts"]["tiers"]
    browser.wait_for("document.body.dataset.updated")
    image = screenshot(browser)
    assert get(server, "/dashboard.json")["experts"]["tiers"] == tiers  # nothing routed meanwhile
    top, left = frame_origin(image)
    drawn = layout(atlas)
    assert int(browser.eval("document.body.dataset.drawn")) == len(drawn) == atlas["summary"]["experts_routed"]
    checked = 0
    for layer, expert, x, y, h, _ in drawn:
        on_top = owner(drawn, x, y)
        if on_top is None:
            continue
        want = TIERS[tiers[on_top[0]][on_top[1]]]
        pixel = image[top + y, left + x].astype(int)
        assert np.abs(pixel - want).max() <= 3, f"layer {layer} expert {expert} at ({x}, {y}): {pixel} != {want}"
        checked += 1
    assert checked >= len(drawn) // 4, (checked, len(drawn))
    # specialists are larger: a specialist alone on top shows its colour 3 pixels out, a generalist's edge is 2 out
    for layer, expert, x, y, h, _ in drawn:
        if owner(drawn, x + 3, y, margin=0) is None or owner(drawn, x + 3, y, margin=0)[:2] != (layer, expert):
            continue
        assert h == 3 and np.abs(image[top + y, left + x + 3].astype(int) - TIERS[tiers[layer][expert]]).max() <= 3

    # a click shows that expert
    _, _, x, y, _, _ = next(d for d in reversed(drawn) if owner(drawn, d[2], d[3]) == d)
    rect = browser.eval("(() => { const r = document.getElementById('atlas-map').getBoundingClientRect();"
                        " return [r.left, r.top]; })()")
    for kind in ("mousePressed", "mouseReleased"):
        browser._send("Input.dispatchMouseEvent", {"type": kind, "x": rect[0] + x, "y": rect[1] + y, "button": "left",
                                                  "clickCount": 1}, browser.session)
    clicked = next(d for d in reversed(drawn) if owner(drawn, x, y) == d)
    record = next(e for e in atlas["experts"] if (e["layer"], e["expert"]) == clicked[:2])
    browser.wait_for("document.getElementById('panel').dataset.layer !== undefined")
    panel = browser.eval("(() => { const p = document.getElementById('panel');"
                         " return [p.dataset.layer, p.dataset.expert, p.textContent]; })()")
    assert panel[:2] == [str(record["layer"]), str(record["expert"])]
    assert f"MoE layer {record['layer']}, expert {record['expert']}" in panel[2]
    assert f"{record['entropy_bits']:.3f} bits" in panel[2] and TIERS and record["top_domains"][0] in panel[2]
    assert ("specialist" if record["specialist"] else "generalist") in panel[2]


def test_a_turn_lights_up_its_experts(trained, browser):
    server, _ = trained
    atlas = get(server, "/atlas.json")
    browser.open(f"{server.url}/atlas#key={KEY}")
    browser.wait_for("document.body.dataset.updated")
    before = get(server, "/dashboard.json")["experts"]["heat"]
    browser.wait_for(f"document.body.dataset.updated > {get(server, '/dashboard.json')['time']}")  # the page saw `before`
    r = httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=120,
                   json={"model": "olmoe-16x64", "prompt": "def parse(text):", "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text
    after = get(server, "/dashboard.json")
    routed = {(l, e) for l, row in enumerate(after["experts"]["heat"]) for e, n in enumerate(row) if n > before[l][e]}
    assert routed
    shown = {(e["layer"], e["expert"]) for e in atlas["experts"] if e["profile"]} & routed
    browser.wait_for(f"document.body.dataset.lit === '{len(routed)}'", timeout=30)
    image = screenshot(browser)
    top, left = frame_origin(image)
    drawn = layout(atlas, routed)
    tiers = after["experts"]["tiers"]
    rings = plain = 0
    for item in drawn:
        layer, expert, x, y, h, lit = item
        ring = (x - h - 1, y)  # the ring's left edge, or the background just left of an unlit square
        on_top = owner(drawn, *ring, margin=0)
        pixel = image[top + ring[1], left + ring[0]].astype(int)
        if lit and on_top is item:
            assert np.abs(pixel - LIT).max() <= 3, f"layer {layer} expert {expert} was routed: no ring, {pixel}"
            rings += 1
        elif not lit and on_top is None and owner(drawn, *ring, margin=1) is None:
            assert np.abs(pixel - LIT).max() > 40, f"layer {layer} expert {expert} was not routed but is lit"
            plain += 1
    assert rings > 0 and plain > 0
    assert shown


def test_no_atlas_then_a_random_model_has_nothing_to_show(random_served, browser, tmp_path):
    server, model, cache = random_served
    r = httpx.get(server.url + "/atlas.json", headers=AUTH)
    assert r.status_code == 404 and "colibri atlas --model" in r.json()["error"]["message"]
    browser.open(f"{server.url}/atlas#key={KEY}")
    browser.wait_for("document.getElementById('status').textContent === 'no atlas'")
    assert "colibri atlas --model" in browser.eval("document.getElementById('verdict').textContent")

    prompts = tmp_path / "prompts"
    prompts.mkdir()
    (prompts / "python.txt").write_text(Path(json.__file__).read_text())
    (prompts / "prose.txt").write_text((Path(__file__).resolve().parents[3] / "docs" / "serving.md").read_text())
    made = make_atlas(model, cache, "--prompts", prompts)
    assert not made["verdict"]["specialised"], made
    served = get(server, "/atlas.json")
    assert served["path"] == str(model / "colibri-atlas.json")  # a writable model directory: beside its history
    browser.open(f"{server.url}/atlas#key={KEY}")
    browser.wait_for("document.getElementById('verdict').textContent.startsWith('Nothing to show')")
    assert browser.eval("document.getElementById('atlas-map').hidden") is True
