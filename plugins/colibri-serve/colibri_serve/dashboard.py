"""The web dashboard: ``GET /`` is a static page (HTML, one script, one style sheet,
shipped in this package, nothing fetched from anywhere else) that polls
``GET /dashboard.json`` about once a second and draws tokens/s, the queue, the slots
and a heat map of the routed experts (one row per MoE layer, one cell per expert; the
colour says which tier holds it, the intensity how often the router chose it).

The page and its two files hold no data and are open; ``/dashboard.json`` is behind the
API key like every other route (the page asks for the key and keeps it in
``sessionStorage``)."""

from __future__ import annotations

import time
from importlib.resources import files

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from colibri_serve.service import Service

# the page's files: route -> (file in colibri_serve/static, media type)
STATIC = {"/": ("index.html", "text/html; charset=utf-8"),
          "/static/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
          "/static/dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
          # the chat page: a plain client of the server's own OpenAI API
          "/chat": ("chat.html", "text/html; charset=utf-8"),
          "/static/chat.js": ("chat.js", "text/javascript; charset=utf-8"),
          "/static/chat.css": ("chat.css", "text/css; charset=utf-8")}
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


class Dashboard(BaseModel):
    model: str
    time: float = Field(description="Unix time of the snapshot")
    scheduler: SchedulerView
    lookups: Lookups
    reads: int = Field(description="Expert reads from disk")
    bytes_read: int = Field(description="Expert bytes read from disk")
    experts: ExpertMap | None = Field(description="null for a model without routed experts")


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
    }


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
