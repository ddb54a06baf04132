"""The expert atlas: what each routed expert is used for, from routing counts on labelled
text (``colibri_core.engine.domain_routing``), and where its file lives.

Per expert (MoE layer ``l``, expert ``e``), from ``counts[l, e, d]``, the tokens of
domain ``d`` its router sent to it:

- ``tokens``: all its tokens; ``share[d]``: the part of them from domain ``d``.
- ``affinity[d]``: ``share[d]`` over domain ``d``'s part of all the layer's routed tokens
  (1: as often as chance; 2: twice as often).
- ``profile``: the affinities normalised to sum 1, i.e. the expert's domain mix as if
  every domain had given as many tokens; ``entropy_bits`` its entropy, ``entropy`` that
  over log2(domains) (1: a generalist used evenly by all, 0: one domain only), and
  ``specialisation`` = 1 - ``entropy``.

Chance is what random routers give on the same inputs (``null[l, r, e, d]``): a model
with random weights routes by its hidden states, which carry the text's domain (the
words differ), so even random routing is domain-dependent. Hence:

- the layer's domain information ``mi_bits``: the mutual information between expert and
  domain (domains weighted equally, the Jensen-Shannon divergence of the domains' expert
  distributions), against the random routers' on the same layer;
- an expert is a ``specialist`` when its ``specialisation`` exceeds the 99th percentile
  of the random routers' experts of its layer (about 1 % of a random model's are), both
  counting only experts with at least ``SPECIALIST_MIN_SHARE`` of the layer's mean tokens
  per routed expert (a few tokens make a one-domain mix by chance);
- the verdict: the model's routing is specialised when the layers' mean ``mi_bits``
  exceeds every random router's and by at least ``Z_MIN`` of their standard deviations;
  else the atlas has nothing to show.
"""

from __future__ import annotations

import hashlib
import math
import time
from pathlib import Path

import numpy as np

from colibri_core.experts.history import FILENAME as HISTORY_FILE, cache_path, save_targets
from colibri_core.io import smallfile

FILENAME = "colibri-atlas.json"  # next to the model; in the cache dir, KEY.atlas.json beside KEY.json
FORMAT_VERSION = 1
ATLAS_BYTES = 64 << 20
Z_MIN = 3.0
SPECIALIST_QUANTILE = 0.99
# an expert with fewer tokens than this part of its layer's mean per routed expert is no
# specialist whatever its mix: a handful of tokens makes a one-domain profile by chance
SPECIALIST_MIN_SHARE = 0.1


# -- the numbers ------------------------------------------------------------------------
def domain_profiles(counts: np.ndarray) -> dict[str, np.ndarray]:
    """Per-expert statistics of ``counts`` (..., experts, domains); NaN for experts
    never routed."""
    counts = np.asarray(counts, dtype=np.float64)
    tokens = counts.sum(-1)
    per_domain = counts.sum(-2, keepdims=True)  # the layer's routed tokens per domain
    with np.errstate(divide="ignore", invalid="ignore"):
        share = counts / tokens[..., None]
        domain_share = per_domain / per_domain.sum(-1, keepdims=True)
        affinity = share / domain_share
        profile = affinity / affinity.sum(-1, keepdims=True)
        logs = np.where(profile > 0, np.log2(np.where(profile > 0, profile, 1.0)), 0.0)
        entropy_bits = -(profile * logs).sum(-1)
    entropy_bits = np.where(tokens > 0, entropy_bits, np.nan)
    domains = counts.shape[-1]
    entropy = entropy_bits / math.log2(domains) if domains > 1 else np.full_like(entropy_bits, np.nan)
    return {"tokens": tokens, "share": share, "affinity": affinity, "profile": profile, "entropy_bits": entropy_bits,
            "entropy": entropy, "specialisation": 1.0 - entropy}


def domain_information(counts: np.ndarray) -> np.ndarray:
    """Mutual information (bits) between expert and domain per layer of ``counts``
    (..., experts, domains), the domains weighted equally: H(mean of the domains' expert
    distributions) - mean of their entropies."""
    counts = np.asarray(counts, dtype=np.float64)
    per_domain = counts.sum(-2, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(per_domain > 0, counts / per_domain, 0.0)  # P(expert | domain)

    def entropy(q, axis):
        return -(q * np.log2(np.where(q > 0, q, 1.0))).sum(axis)

    return entropy(p.mean(-1), -1) - entropy(p, -2).mean(-1)


def verdict(observed: float, random: np.ndarray) -> dict:
    """Specialised or not: ``observed`` (the model's mean domain information) against the
    same statistic of each random router."""
    random = np.asarray(random, dtype=np.float64)
    mean, top = float(random.mean()), float(random.max())
    std = float(random.std(ddof=1)) if random.size > 1 else 0.0
    z = (observed - mean) / std if std > 0 else None
    specialised = bool(observed > top and z is not None and z >= Z_MIN)
    return {"specialised": specialised, "observed_bits": observed, "random_mean_bits": mean, "random_std_bits": std,
            "random_max_bits": top, "random_routers": int(random.size), "z": z,
            "ratio": observed / mean if mean > 0 else None,
            "rule": f"specialised when the layers' mean expert-domain information exceeds every one of the "
                    f"{random.size} random routers' on the same inputs and their mean by >= {Z_MIN:g} standard deviations"}


def build(counts: np.ndarray, null: np.ndarray, domains: list[str]) -> dict:
    """The atlas's statistics from ``counts`` (layers, experts, domains) and the random
    routers' ``null`` (layers, routers, experts, domains)."""
    counts, null = np.asarray(counts), np.asarray(null)
    ours, theirs = domain_profiles(counts), domain_profiles(null)
    info, random_info = domain_information(counts), domain_information(null)  # (layers,), (layers, routers)
    layers, experts = counts.shape[:2]
    def enough(tokens):  # (..., experts) -> whether each has enough tokens to be called a specialist
        routed = tokens > 0
        mean = (tokens * routed).sum(-1, keepdims=True) / np.maximum(routed.sum(-1, keepdims=True), 1)
        return routed & (tokens >= SPECIALIST_MIN_SHARE * mean)

    thresholds = []
    for layer in range(layers):  # the random routers' experts under the same token rule
        chance = theirs["specialisation"][layer][enough(theirs["tokens"][layer])]
        thresholds.append(float(np.quantile(chance, SPECIALIST_QUANTILE)) if chance.size else math.inf)
    thresholds = np.asarray(thresholds)
    routed = ours["tokens"] > 0
    specialist = enough(ours["tokens"]) & (ours["specialisation"] > thresholds[:, None])
    rows = []
    for layer in range(layers):
        for e in range(experts):
            if not routed[layer, e]:
                rows.append({"layer": layer, "expert": e, "tokens": 0, "share": None, "affinity": None, "profile": None,
                             "entropy_bits": None, "entropy": None, "specialisation": None, "specialist": False,
                             "top_domains": []})
                continue
            affinity = ours["affinity"][layer, e]
            rows.append({"layer": layer, "expert": e, "tokens": int(ours["tokens"][layer, e]),
                         "share": _round(ours["share"][layer, e]), "affinity": _round(affinity),
                         "profile": _round(ours["profile"][layer, e]),
                         "entropy_bits": _round(ours["entropy_bits"][layer, e]), "entropy": _round(ours["entropy"][layer, e]),
                         "specialisation": _round(ours["specialisation"][layer, e]),
                         "specialist": bool(specialist[layer, e]),
                         "top_domains": [domains[d] for d in np.argsort(-affinity, kind="stable")]})
    per_layer = []
    for layer in range(layers):
        entropy = ours["entropy"][layer][routed[layer]]
        rand = random_info[layer]
        per_layer.append({"layer": layer, "mi_bits": _round(info[layer]), "random_mi_bits": _round(rand.mean()),
                          "random_mi_std": _round(rand.std(ddof=1)) if rand.size > 1 else 0.0,
                          "experts_routed": int(routed[layer].sum()), "specialists": int(specialist[layer].sum()),
                          "specialist_threshold": _round(thresholds[layer]),
                          "median_entropy": _round(np.median(entropy)) if entropy.size else None})
    entropy = ours["entropy"][routed]
    top = {}
    for d, name in enumerate(domains):
        aff = np.where(routed, np.nan_to_num(ours["affinity"][..., d], nan=-1.0), -1.0)
        layer, e = np.unravel_index(int(np.argmax(aff)), aff.shape)
        top[name] = {"layer": int(layer), "expert": int(e), "affinity": _round(aff[layer, e]),
                     "specialists": int((specialist & (np.argmax(np.nan_to_num(ours["affinity"], nan=-1), -1) == d)).sum())}
    summary = {"experts": layers * experts, "experts_routed": int(routed.sum()), "specialists": int(specialist.sum()),
               "specialist_share": _round(specialist.sum() / routed.sum()) if routed.any() else None,
               "median_entropy": _round(np.median(entropy)) if entropy.size else None,
               "random_median_entropy": _round(np.nanmedian(theirs["entropy"])) if np.isfinite(theirs["entropy"]).any() else None,
               "top_affinity": top}
    return {"domains": list(domains), "verdict": verdict(float(info.mean()), random_info.mean(0)), "summary": summary,
            "layers": per_layer, "experts": rows}


def _round(x):
    """Floats for the file: 6 significant digits (NaN as None), arrays element-wise."""
    if isinstance(x, np.ndarray):
        return [_round(v) for v in x.tolist()]
    x = float(x)
    return None if not math.isfinite(x) else float(f"{x:.6g}")


# -- the file -----------------------------------------------------------------------------
def beside(history: Path) -> Path:
    """The atlas's path beside a routing history file."""
    if history.name == HISTORY_FILE:
        return history.with_name(FILENAME)
    return history.with_name(history.stem + ".atlas.json")


def candidates(model_dir: Path) -> list[Path]:
    """Where a model's atlas may be, in the order it is looked for: where ``write`` puts
    it first, then the other places it may have gone."""
    model_dir = Path(model_dir)
    paths = [beside(t) for t in save_targets(model_dir)]
    return paths + [p for p in (beside(model_dir / HISTORY_FILE), beside(cache_path(model_dir))) if p not in paths]


def find(model_dir: Path) -> Path | None:
    return next((p for p in candidates(model_dir) if smallfile.present(p)), None)


def identity(model) -> dict:
    """What the atlas was made from: it is refused for any other model."""
    model_dir = Path(model.model_dir)
    config = smallfile.read_bytes(model_dir / "config.json", smallfile.CONFIG_BYTES, "model config")
    return {"dir": str(model_dir.resolve()), "name": model_dir.resolve().name, "family": model.family.spec.name,
            "model_type": model.model_type, "config_sha256": hashlib.sha256(config).hexdigest()}


def document(model, routing, domains: list[dict], stats: dict, *, window: int, max_tokens: int) -> dict:
    """The whole atlas.json: format, model identity, input, statistics and raw counts."""
    from colibri_core.version import __version__

    return {"format": FORMAT_VERSION, "kind": "colibri expert atlas", "colibri": __version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "model": {**identity(model), "moe_layers": int(routing.counts.shape[0]), "experts": int(routing.experts),
                      "top_k": int(routing.top_k)},
            "input": {"window": window, "max_tokens_per_file": max_tokens, "domains": domains},
            **stats, "counts": routing.counts.tolist()}


def write(doc: dict, model_dir: Path, out: Path | None = None) -> Path:
    """Write the atlas atomically to ``out``, else beside the model's routing history
    (the cache dir when the model directory cannot be written). Returns the path."""
    import json

    from colibri_core.errors import ResourceError

    text = json.dumps(doc, separators=(",", ":"))
    targets = [Path(out)] if out is not None else [beside(t) for t in save_targets(Path(model_dir))]
    problems = []
    for target in targets:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            smallfile.write_atomic(target, text)
            return target
        except OSError as exc:
            problems.append(f"{target}: {exc.strerror or exc}")
    raise ResourceError("could not write the atlas: " + "; ".join(problems))


def load(path: Path, model) -> dict:
    """The atlas at ``path``, checked against ``model``; ValueError with a one-line
    reason when it is unreadable or for another model."""
    from colibri_core.errors import ColibriError

    try:
        doc = smallfile.read_json(path, ATLAS_BYTES, "expert atlas")
    except (ColibriError, OSError) as exc:
        raise ValueError(str(exc)) from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_VERSION or not isinstance(doc.get("model"), dict):
        raise ValueError(f"{path}: not a version-{FORMAT_VERSION} colibri expert atlas")
    ours = identity(model)
    theirs = doc["model"]
    if theirs.get("config_sha256") != ours["config_sha256"] or theirs.get("family") != ours["family"]:
        raise ValueError(f"{path}: the atlas is for another model ({theirs.get('dir')}); make it again with "
                         f"colibri atlas --model {ours['dir']}")
    return doc
