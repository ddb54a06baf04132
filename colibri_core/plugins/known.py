"""The distributions published from the colibri repository that run each model type,
so that an error can name the one to install (``pip install colibri-glm``) rather than
a placeholder. tests/test_dists.py checks every name against the repository's
pyproject.toml files and every model type against the family that declares it."""

from __future__ import annotations

FAMILY_DISTRIBUTIONS: dict[str, str] = {
    "olmoe": "colibri-olmoe",
    "deepseek_v2": "colibri-deepseek",
    "deepseek_v3": "colibri-deepseek",
    "deepseek_v32": "colibri-deepseek",
    "deepseek_v4": "colibri-deepseek",
    "kimi_k2": "colibri-kimi",
    "kimi_k25": "colibri-kimi",
    "kimi_linear": "colibri-kimi",
    "qwen2_moe": "colibri-qwen",
    "qwen3_moe": "colibri-qwen",
    "qwen3_next": "colibri-qwen",
    "qwen3_5_moe": "colibri-qwen",
    "qwen3_5_moe_text": "colibri-qwen",
    "qwen3_vl_moe": "colibri-qwen",
    "glm4_moe": "colibri-glm",
    "glm4_moe_lite": "colibri-glm",
    "glm_moe_dsa": "colibri-glm",
    "glm5_next": "colibri-glm",
    "inkling_text": "colibri-inkling",
    "inkling_mm_model": "colibri-inkling",
    "mixtral": "colibri-mistral",
    "granitemoe": "colibri-ibm",
    "granitemoeshared": "colibri-ibm",
    "granitemoehybrid": "colibri-ibm",
    "ernie4_5_moe": "colibri-baidu",
    "dots1": "colibri-rednote",
    "flex_olmo": "colibri-olmoe",
    "minimax": "colibri-minimax",
    "minimax_m2": "colibri-minimax",
    "solar_open": "colibri-upstage",
    "exaone_moe": "colibri-lg",
    "cohere2_moe": "colibri-cohere",
    "afmoe": "colibri-arcee",
    "lfm2_moe": "colibri-liquid",
    "nemotron_h": "colibri-nvidia",
    "jamba": "colibri-ai21",
    "hunyuan_v1_moe": "colibri-hunyuan",
    "hy_v3": "colibri-hunyuan",
    "phimoe": "colibri-microsoft",
    "gpt_oss": "colibri-gpt-oss",
    "mimo_v2_flash": "colibri-xiaomi",
    "longcat_flash": "colibri-meituan",
    "llama4_text": "colibri-llama",
    "llama4": "colibri-llama",
}


# Mixture-of-experts causal-LM model types of the pinned transformers (5.23) that no family
# in this repository runs yet, and what they need; docs/families.md lists them beside the
# families (``colibri list-families --coverage``). tests/test_coverage.py finds every MoE
# causal-LM type of transformers in FAMILY_DISTRIBUTIONS or here.
NOT_YET: dict[str, str] = {
    "aria_text": "not studied yet",
    "axk1": "not studied yet",
    "axk2": "not studied yet",
    "bailing_hybrid": "linear-attention hybrid layers",
    "beam": "not studied yet",
    "doge": "not studied yet",
    "dots3_note": "not studied yet",
    "dots3_note_text": "not studied yet",
    "flint": "not studied yet",
    "granitemoe_swa": "granitemoe with sliding-window layers: not wired yet",
    "hy_v4": "not studied yet",
    "inkling2_text": "not studied yet",
    "jetmoe": "mixture-of-attention-heads: attention heads routed as experts",
    "kolibri1": "not studied yet",
    "laguna": "not studied yet",
    "mellum": "not studied yet",
    "minimax_m3_vl_text": "block-sparse attention: a lightning indexer choosing key blocks plus local blocks",
    "qwen4_exp": "hashed n-gram embeddings (PLE), low-rank gated residual streams, the QSA block indexer",
    "qwen4_exp_text": "not studied yet",
    "zaya": "not studied yet",
}
COVERAGE_DOC = "docs/families.md"


def install_hint(model_type: str | None) -> str:
    """What to install for ``model_type``: its distribution; for a MoE type colibri does
    not run yet, why and the nearest it runs; else where the families are."""
    distribution = FAMILY_DISTRIBUTIONS.get(model_type or "")
    if distribution is not None:
        return f"install its family: pip install {distribution}"
    if model_type in NOT_YET:
        import difflib

        near = difflib.get_close_matches(model_type, list(FAMILY_DISTRIBUTIONS), n=3, cutoff=0.4)
        return (f"colibri does not run {model_type} yet ({NOT_YET[model_type]})"
                + (f"; the nearest types it runs: {', '.join(near)}" if near else "")
                + f"; every MoE type and its status: {COVERAGE_DOC} (colibri list-families --coverage)")
    return ("no published family runs it: the families are " + ", ".join(sorted(set(FAMILY_DISTRIBUTIONS.values())))
            + " (docs/plugins.md tells how to write one)")
