"""The profiling page at /profile: /dashboard.json's ``turns`` (where each finished
request's time went, colibri_core.engine.profiling) and the page in headless Chromium
drawing them as its script's header says: every phase of every turn a segment of its
bar, in its colour, at the height the JSON's seconds give."""

import httpx
import numpy as np
import pytest

from cdp import CHROMIUM, Browser
from colibri_core.engine.profiling import PHASES
from conftest import Server
from test_serve_atlas import screenshot
from test_serve_dashboard import EMPTY, FRAME

KEY = "profile-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
# the drawing contract of colibri_serve/static/profile.js (see its header)
COLOURS = {"tokenize": (100, 116, 139), "prefill": (99, 102, 241), "embed": (6, 182, 212), "attention": (59, 130, 246),
           "prefetch": (168, 85, 247), "routers": (234, 179, 8), "routed_experts": (239, 68, 68),
           "expert_reads": (249, 115, 22), "shared_experts": (236, 72, 153), "dense_mlp": (34, 197, 94),
           "lm_head": (132, 204, 22), "other": (113, 113, 122), "drafting": (217, 70, 239),
           "sampling": (20, 184, 166), "detokenize": (250, 250, 210)}
W, H, BAR, GAP = 932, 302, 24, 6
BOTTOM, PLOT = H - 2, H - 12


@pytest.fixture(scope="module")
def served(random_model):
    # one expert slot per layer: lookups miss, so reads and their waits show
    server = Server(random_model, "--api-key", KEY, "--cap", "1", "--history", "read").wait_ready()
    yield server
    server.stop()


def dashboard(server) -> dict:
    r = httpx.get(server.url + "/dashboard.json", headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def complete(server, prompt: str, n: int) -> dict:
    r = httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=60,
                   json={"model": "random-olmoe", "prompt": prompt, "max_tokens": n, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def test_each_request_becomes_a_turn_with_its_phases(served):
    before = dashboard(served)
    assert before["profile"] == {"phases": list(PHASES), "backend": "cpu", "deferred": False}
    replies = [complete(served, f"the profiling test, prompt {i} " * (i + 1), 4 + 2 * i) for i in range(3)]
    turns = dashboard(served)["turns"][len(before["turns"]):]
    assert len(turns) == 3
    for turn, reply in zip(turns, replies):
        assert turn["prompt_tokens"] == reply["usage"]["prompt_tokens"]
        assert turn["completion_tokens"] == reply["usage"]["completion_tokens"]
        assert turn["finish_reason"] == "length" and turn["misses"] > 0 and turn["bytes_read"] > 0
        s = turn["seconds"]
        # waiting on reads may be none at all: the layer's misses are read together and can
        # all be in before the experts need them (tests/test_profiling.py ties it to the store)
        assert s["tokenize"] > 0 and s["prefill"] > 0 and s["routed_experts"] > 0 and s["expert_reads"] >= 0
        assert sum(s.values()) <= turn["wall_s"] + s["tokenize"]


def frame(image: np.ndarray) -> tuple[int, int]:
    ys, xs = np.nonzero(np.all(image == FRAME, axis=2))
    assert ys.size, "no chart frame in the screenshot"
    assert (ys.max() - ys.min() + 1, xs.max() - xs.min() + 1) == (H, W)
    return int(ys.min()), int(xs.min())


def segments(turns: list[dict]) -> list[tuple[int, str, int, int]]:
    """(turn index, phase, top row, bottom row) of every segment drawn, as the contract says."""
    total = [sum(t["seconds"][p] for p in PHASES) for t in turns]
    scale = PLOT / max(total)
    out = []
    for i, t in enumerate(turns):
        below, cumulative = 0, 0.0
        for p in PHASES:
            cumulative += t["seconds"][p]
            top = int(np.floor(scale * cumulative + 0.5))
            if top > below:
                out.append((i, p, BOTTOM - top + 1, BOTTOM - below))
            below = top
    return out


@pytest.mark.skipif(not CHROMIUM.exists(), reason="headless Chromium (/usr/bin/chromium, Debian package chromium) "
                                                  "is not installed")
def test_the_page_draws_every_turns_phases_as_the_json_says(served, tmp_path):
    for i in range(4):  # prompts long and short: bars of several heights
        complete(served, "a longer prompt " * (5 if i % 2 else 1), 3 + 3 * i)
    turns = dashboard(served)["turns"][-30:]
    browser = Browser(tmp_path / "profile")
    try:
        browser.open(f"{served.url}/profile#key={KEY}")
        ids = ",".join(str(t["id"]) for t in turns)
        browser.wait_for(f"document.body.dataset.turns === '{ids}'")
        image = screenshot(browser)
        assert dashboard(served)["turns"][-30:] == turns  # nothing finished meanwhile
        rows = browser.eval("document.querySelectorAll('#turn-rows tr').length")
    finally:
        browser.close()
    assert rows == len(turns)
    top, left = frame(image)
    drawn = segments(turns)
    checked = []
    for i, phase, y0, y1 in drawn:
        x = 1 + GAP + i * (BAR + GAP)
        if y1 - y0 < 2:  # a row or two: too thin to aim at safely
            continue
        pixel = image[top + (y0 + y1) // 2, left + x + BAR // 2].astype(int)
        assert np.abs(pixel - COLOURS[phase]).max() <= 3, f"turn {turns[i]['id']} {phase}: {pixel}"
        checked.append((i, phase))
    tall = {i for i in range(len(turns)) if BOTTOM - min(y0 for j, _, y0, _ in drawn if j == i) >= 12}
    assert tall <= {i for i, _ in checked} and len(tall) >= 3 and len({p for _, p in checked}) >= 3, checked
    for i, t in enumerate(turns):  # above each bar and between bars: nothing drawn
        x = 1 + GAP + i * (BAR + GAP)
        tallest = min(y0 for j, _, y0, _ in drawn if j == i)
        if tallest > 2:
            assert np.abs(image[top + tallest - 2, left + x + 1].astype(int) - EMPTY).max() <= 3
        assert np.abs(image[top + BOTTOM, left + x - 2].astype(int) - EMPTY).max() <= 3
    # the tallest bar reaches PLOT rows
    assert min(y0 for _, _, y0, _ in drawn) == BOTTOM - PLOT + 1
