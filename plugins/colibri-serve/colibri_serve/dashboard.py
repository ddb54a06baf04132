"""The web dashboard: ``GET /`` is a static page (HTML, one script, one style sheet,
shipped in this package, nothing fetched from anywhere else) that polls
``GET /dashboard.json`` about once a second and draws tokens/s, the queue, the slots
and a heat map of the routed experts (one row per MoE layer, one cell per expert; the
colour says which tier holds it, the intensity how often the router chose it).
``GET /profile`` draws the same JSON's ``turns``: where each of the last 30 requests'
time went, phase by phase (colibri_core.engine.profiling).

The pages and their files hold no data and are open; ``/dashboard.json`` is behind the
API key like every other route (the page asks for the key and keeps it in
``sessionStorage``)."""

from __future__ import annotations

import time
from importlib.resources import files

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from colibri_core.engine.profiling import PHASES
from colibri_serve.service import Service

# the page's files: route -> (file in colibri_serve/static, media type)
STATIC = {"/": ("index.html", "text/html; charset=utf-8"),
          # what every page shares: the key, the status line, reading the server's JSON
          "/static/page.js": ("page.js", "text/javascript; charset=utf-8"),
          "/static/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
          "/static/dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
          # the chat page: a plain client of the server's own OpenAI API
          "/chat": ("chat.html", "text/html; charset=utf-8"),
          "/static/chat.js": ("chat.js", "text/javascript; charset=utf-8"),
          "/static/chat.css": ("chat.css", "text/css; charset=utf-8"),
          # what the dashboard, the atlas and the profiling page share (tier colours)
          "/static/tiers.js": ("tiers.js", "text/javascript; charset=utf-8"),
          # the expert atlas page (its data: /atlas.json, colibri_serve/atlas.py)
          "/atlas": ("atlas.html", "text/html; charset=utf-8"),
          "/static/atlas.js": ("atlas.js", "text/javascript; charset=utf-8"),
          "/static/atlas.css": ("atlas.css", "text/css; charset=utf-8"),
          # the profiling page: the last turns' phases, from /dashboard.json's ``turns``
          "/profile": ("profile.html", "text/html; charset=utf-8"),
          "/static/profile.js": ("profile.js", "text/javascript; charset=utf-8"),
          "/static/profile.css": ("profile.css", "text/css; charset=utf-8")}
# the page loads nothing from elsewhere, and may not be framed
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                                           "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
                "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}


class SchedulerView(BaseModel):
    decode_tok_s: float = Field(description="Aggregate decode tokens per second over the last 10 s")
    ttft_s: float = Field(description="Median time to first token of recent requests, seconds")
    queue_depth: int = Field(description="Requests waiting for a slot")
    max_queue: int
    active: int = Field(description="Requests holding a slot")
    slots: int
    requests_total: int
    tokens_total: int
    prefill_tokens: int
    prefix_hits_tokens: int
    kv_budget_bytes: int
    kv_bytes: int
    kv_disk_bytes: int = Field(description="Prompt prefixes kept on disk (serve --kv-disk; 0 without)")
    kv_disk_files: int
    kv_disk_hit_tokens: int = Field(description="Prompt tokens whose prefill a prefix read from disk skipped")


class Lookups(BaseModel):
    """Routed-expert lookups since loading, by the tier that served them."""

    device: int
    ram_pinned: int
    ram_lru: int
    prefetched: int
    disk: int


class TierCounts(BaseModel):
    """Experts per tier now (each expert counted once, in the fastest tier holding it)."""

    device_pinned: int
    device_lru: int
    ram_pinned: int
    ram_lru: int
    disk: int


class Capacity(BaseModel):
    device_lru_per_layer: int
    device_pinned: int = Field(description="Across all layers")
    ram_lru_per_layer: int
    ram_pinned: int = Field(description="Across all layers")


class ExpertMap(BaseModel):
    layers: int = Field(description="MoE layers")
    experts: int = Field(description="Routed experts per layer")
    codes: dict[str, str] = Field(description="What each character of `tiers` means")
    tiers: list[str] = Field(description="Per MoE layer, one character per expert: D device pinned, d device LRU, "
                                         "R RAM pinned, r RAM LRU, . on disk only")
    heat: list[list[int]] | None = Field(description="Per MoE layer, per expert: times the router chose it since "
                                                     "loading (null without a routing history)")
    heat_max: int
    counts: TierCounts
    capacity: Capacity


class TierBar(BaseModel):
    """One tier's bar: what it holds against its budget, and the lookups it served."""

    tier: str = Field(description="device, ram or disk")
    bytes: int | None = Field(description="Expert bytes the tier holds now (null for the disk)")
    budget: int | None = Field(description="The tier's expert budget in bytes (null for the disk)")
    served: int = Field(description="Routed-expert lookups it served since loading (the RAM tier's include "
                                    "experts read ahead)")


class TurnHits(BaseModel):
    device: int
    ram: int = Field(description="Pinned and LRU")
    prefetched: int


class Turn(BaseModel):
    """A finished request, and where the engine's time for it went
    (colibri_core.engine.profiling): a batched step's time, lookups and bytes are shared
    among its requests by the tokens each brought."""

    id: int
    time: float = Field(description="Unix time it ended")
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    steps: int = Field(description="Decode steps it took part in")
    wall_s: float = Field(description="From submission to the end, waiting included")
    queued_s: float = Field(description="Waiting for a slot")
    ttft_s: float | None
    seconds: dict[str, float] = Field(description="Seconds per phase, keys as profile.phases; the forward stages "
                                                  "are its decode steps' (its prefill is one phase)")
    prefill_stages: dict[str, float] = Field(description="The prefill's seconds per forward stage")
    lookups: int = Field(description="Routed-expert lookups (its share)")
    misses: int = Field(description="Of those, read from disk")
    hits: TurnHits
    hit_rate: float | None = Field(description="1 - misses / lookups; null without lookups")
    bytes_read: int = Field(description="Expert bytes read from disk (its share)")


class ProfileInfo(BaseModel):
    phases: list[str] = Field(description="A turn's phases in drawing order")
    backend: str
    deferred: bool = Field(description="The backend queues work until the host reads a result: a phase's time is "
                                       "where the engine waited for it")


class Dashboard(BaseModel):
    model: str
    time: float = Field(description="Unix time of the snapshot")
    scheduler: SchedulerView
    lookups: Lookups
    reads: int = Field(description="Expert reads from disk")
    bytes_read: int = Field(description="Expert bytes read from disk")
    experts: ExpertMap | None = Field(description="null for a model without routed experts")
    tier_bars: list[TierBar] = Field(description="Device (on a backend with one), RAM and disk: bytes held, budget and "
                                                 "lookups served; empty for a model without routed experts")
    profile: ProfileInfo
    turns: list[Turn] = Field(description="The last 30 finished requests, oldest first")


def snapshot(service: Service) -> dict:
    """The dashboard's data, read from the scheduler and the expert store (both read
    from this thread while the engine runs, as /metrics reads them)."""
    stats = service.scheduler.stats()
    store = service.model.store
    experts = None
    if store is not None:
        experts = store.expert_map()
        heat = experts["heat"]
        experts["codes"] = dict(store.TIER_CODES)
        experts["heat_max"] = max((max(row, default=0) for row in heat), default=0) if heat else 0
    return {
        "model": service.model_name, "time": time.time(),
        "scheduler": {k: stats.get(k, 0) for k in SchedulerView.model_fields},
        "lookups": {"device": stats.get("hits_device", 0), "ram_pinned": stats.get("hits_pinned", 0),
                    "ram_lru": stats.get("hits_lru", 0), "prefetched": stats.get("hits_prefetched", 0),
                    "disk": stats.get("misses", 0)},
        "reads": stats.get("reads", 0), "bytes_read": sum((stats.get("bytes_by_drive") or {}).values()),
        "experts": experts,
        "tier_bars": tier_bars(service.model, stats) if store is not None else [],
        "profile": {"phases": list(PHASES), "backend": service.model.backend.name,
                    "deferred": bool(service.model.backend.deferred)},
        "turns": service.scheduler.profiler.turns(),
    }


def tier_bars(model, stats: dict) -> list[dict]:
    """The dashboard's tier bars: each resident tier's experts (counted in every tier
    holding them) times its expert size, against its budget less what its pinned set and
    LRU slots cannot use; the lookups each tier served."""
    store, placement = model.store, model.placement
    bars = []
    for name, tier, plan, served in (
            ("device", store.device, placement.device, stats.get("hits_device", 0)),
            ("ram", store.ram, placement, stats.get("hits_pinned", 0) + stats.get("hits_lru", 0)
             + stats.get("hits_prefetched", 0))):
        if tier is None or plan is None:
            continue
        held = sum(len(tier.cached(layer)) + len(tier.pinned_experts(layer)) for layer in range(len(store.layouts)))
        capacity = (plan.slots * placement.moe_layers + plan.pinned) * plan.expert_bytes
        bars.append({"tier": name, "bytes": held * plan.expert_bytes, "budget": capacity, "served": served})
    bars.append({"tier": "disk", "bytes": None, "budget": None, "served": stats.get("misses", 0)})
    return bars


def _static(name: str, media_type: str):
    body = files("colibri_serve").joinpath("static", name).read_bytes()

    async def serve():
        return Response(body, media_type=media_type, headers=PAGE_HEADERS)

    return serve


def router(service: Service) -> APIRouter:
    api = APIRouter()

    @api.get("/dashboard.json", response_model=Dashboard)
    def dashboard():  # a plain def: FastAPI runs it on a worker thread, off the event loop
        service.require_ready()
        return JSONResponse(snapshot(service), headers={"Cache-Control": "no-store"})

    for path, (name, media_type) in STATIC.items():
        api.add_api_route(path, _static(name, media_type), methods=["GET", "HEAD"], include_in_schema=False)
    return api
