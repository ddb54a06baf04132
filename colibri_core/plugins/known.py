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
    "ernie4_5_moe": "colibri-baidu",
    "gpt_oss": "colibri-gpt-oss",
}


def install_hint(model_type: str | None) -> str:
    """What to install for ``model_type``: its distribution, or where the families are."""
    distribution = FAMILY_DISTRIBUTIONS.get(model_type or "")
    if distribution is not None:
        return f"install its family: pip install {distribution}"
    return ("no published family runs it: the families are " + ", ".join(sorted(set(FAMILY_DISTRIBUTIONS.values())))
            + " (docs/plugins.md tells how to write one)")
