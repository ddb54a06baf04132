"""colibri-core's public API for plugin authors: the modules a plugin may import from and,
in each, the names it may use. Everything else in colibri_core is internal and may change
without notice. ``None`` means the module's own ``__all__``. docs/plugins.md lists the
same; ``colibri_core.testing.public_api.private_imports`` checks a plugin against it
(light: the standard library only)."""

from __future__ import annotations

ERRORS = ("ColibriError", "ModelFormatError", "NonFiniteError", "UnsupportedModelError", "PluginError", "BudgetError",
          "UsageError", "BackendError", "ResourceError")

PUBLIC_API: dict[str, tuple[str, ...] | None] = {
    "colibri_core": ("hookimpl", "load", "__version__"),
    "colibri_core.errors": ERRORS,
    "colibri_core.plugins.registry": ("FamilySpec", "QuantSpec", "TierSpec", "BackendSpec", "LoadOptionsSpec",
                                      "DraftSpec", "family_hook"),
    # a draft source for speculative decoding
    "colibri_core.engine.speculative": ("Drafter", "DraftSource"),
    # a plugin's options on the commands that load a model, and a compute tier
    "colibri_core.cli.extend": ("LoadOptions",),
    "colibri_core.experts.tiers": ("CachedTier", "ComputeTier", "DeviceTier", "ExpertWeights", "RamTier", "routed_output"),
    # a family: its config, its blocks, its assembly
    "colibri_core.model.config": ("ModelArgs", "bounded"),
    "colibri_core.model.family": ("Family",),
    "colibri_core.nn": None,
    "colibri_core.nn.assembly": ("DecoderArgs", "LayerBlock", "Names", "build_decoder"),
    "colibri_core.model.builders": ("SigmoidMoEArgs", "MLAArgs", "DSAArgs", "DeepseekV3Args", "softmax_moe", "sigmoid_moe",
                                 "sigmoid_moe_mlp", "mla_mixer", "mla_attention", "lightning_indexer",
                                    "MLAMoEFamily", "mamba2"),
    # a backend
    "colibri_core.compute.backend": ("Backend", "Array", "COMPOSITE_OPS", "GatedActivation", "UngatedActivation",
                                     "FLOAT_DTYPES", "ITEMSIZE", "allocated_dtype"),
    "colibri_core.compute.host": ("check_visible", "delta_chunked", "expert_groups", "grouped_shapes", "top_k_indices"),
    # tests
    "colibri_core.testing": ("registered_plugin", "edit_config", "copy_model", "DELETE"),
    "colibri_core.testing.oracle": ("FamilyOracleSuite", "FusedLayoutCheck", "OracleCase", "random_correction_bias"),
    "colibri_core.testing.backend_kit": ("BackendConformanceSuite",),
    "colibri_core.testing.venv": ("FreshVenv", "fresh_venv"),
    "colibri_core.testing.cli": ("colibri_env", "run_colibri"),
    "colibri_core.testing.fp8": ("fp8_rewrite",),
    "colibri_core.testing.mxfp4": ("mxfp4_rewrite", "quantize_mxfp4"),
    "colibri_core.testing.rewrite": ("rewrite_checkpoint",),
    "colibri_core.testing.public_api": ("private_imports",),
}


def public_names(module: str) -> frozenset[str] | None:
    """The names ``module`` offers plugins, or None when it is not public (imports it)."""
    if module not in PUBLIC_API:
        return None
    names = PUBLIC_API[module]
    if names is None:
        import importlib

        names = tuple(importlib.import_module(module).__all__)
    return frozenset(names)
