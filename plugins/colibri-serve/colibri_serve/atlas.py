"""The expert atlas page: ``GET /atlas`` (static, in ``static/``: atlas.html, atlas.js,
atlas.css) draws the atlas that ``colibri atlas`` wrote beside the loaded model's
routing history, which ``GET /atlas.json`` serves (checked against the model; a 404
saying how to make one when there is none). The experts' tiers and the live highlight
come from ``/dashboard.json``, which the page polls."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from colibri_serve.service import ApiError, Service


class Atlas(BaseModel):
    """The atlas file as ``colibri atlas`` wrote it (docs/serving.md, Expert atlas), plus where it was read."""

    model_config = ConfigDict(extra="allow")
    path: str = Field(description="The file served")
    format: int
    model: dict = Field(description="The model it was made from: dir, name, family, model_type, config_sha256, "
                                    "moe_layers, experts, top_k")
    domains: list[str]
    verdict: dict = Field(description="specialised (true/false), the domain information against random routers, z")
    summary: dict
    layers: list[dict]
    experts: list[dict] = Field(description="One per (layer, expert): tokens, share, affinity, profile, entropy, "
                                            "specialist, top_domains")


def read(service: Service) -> dict:
    """The loaded model's atlas, or an ApiError (404) saying why there is none."""
    from colibri_core.experts import atlas

    model = service.model
    path = atlas.find(model.model_dir)
    if path is None:
        looked = " or ".join(str(p) for p in atlas.candidates(model.model_dir))
        raise ApiError("no_route", f"no expert atlas for this model (looked for {looked}); make one with: "
                                   f"colibri atlas --model {model.model_dir} --prompts DIR_OF_DOMAIN_FILES")
    try:
        doc = atlas.load(path, model)
    except ValueError as exc:
        raise ApiError("no_route", str(exc)) from None
    return {"path": str(path), **doc}


def router(service: Service) -> APIRouter:
    api = APIRouter()

    @api.get("/atlas.json", response_model=Atlas)
    def atlas_json():  # a plain def: the file is read on a worker thread
        service.require_ready()
        return JSONResponse(read(service), headers={"Cache-Control": "no-store"})

    return api
