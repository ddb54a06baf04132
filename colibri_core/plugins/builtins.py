"""colibri-core's own plugin: the pieces that ship with the core register through the
same hooks as third-party plugins do."""

from colibri_core.plugins.hookspecs import hookimpl
from colibri_core.plugins.registry import BackendSpec, DraftSpec, QuantSpec, TierSpec


@hookimpl
def colibri_register_quants(register):
    register(QuantSpec("f32", "colibri_core.formats.base:F32", "32-bit float, stored as is", dtypes=("F32",)))
    register(QuantSpec("bf16", "colibri_core.formats.base:BF16", "bfloat16; computed as is by the CPU kernels", dtypes=("BF16",)))
    register(QuantSpec("f16", "colibri_core.formats.base:F16", "IEEE half, widened to f32 for compute", dtypes=("F16",)))
    register(QuantSpec("index-table", "colibri_core.formats.base:IndexTable",
                       "I64 / I32 integer tables (DeepSeek-V4's token-to-expert map), exact below 2**24",
                       dtypes=("I64", "I32")))
    register(QuantSpec("fp8-e4m3-b128", "colibri_core.formats.fp8:FP8E4M3Block",
                       "float8 e4m3 with <name>_scale_inv (or DeepSeek-V4's <m>.scale) 128x128 block scales "
                       "(DeepSeek, Kimi, GLM), read natively", storage="F8_E4M3 + <name>_scale_inv"))
    register(QuantSpec("int8-row", "colibri_core.formats.integer:Int8Row", "int8, one scale per output row (colibri container)",
                       storage="I8 + <name>.qs F32"))
    register(QuantSpec("int4-gs64", "colibri_core.formats.integer:Int4GS64",
                       "int4, one scale per 64 inputs (colibri container; the default for experts)",
                       storage="U8 + <name>.qs BF16 (F32 read too)"))
    register(QuantSpec("mxfp4", "colibri_core.formats.integer:MXFP4", "e2m1 values, one UE8M0 exponent per 32 inputs "
                       "(colibri container)", storage="U8 + <name>.qs U8"))
    register(QuantSpec("ct-int4-g32", "colibri_core.formats.compressed_tensors:CompressedTensorsInt4",
                       "compressed-tensors pack-quantized int4, one scale per 32 inputs (Kimi K2.5 / K2-Thinking "
                       "experts), read natively", storage="<name>_packed I32 + <name>_scale BF16 + <name>_shape"))
    register(QuantSpec("mxfp4-hub", "colibri_core.formats.mxfp4_hub:MXFP4Hub",
                       "MXFP4 as gpt-oss ships it (e2m1 pairs, one exponent per 32 inputs), read natively",
                       storage="<name>_blocks U8 + <name>_scales U8"))
    register(QuantSpec("fp4-e2m1-g32", "colibri_core.formats.fp4_e2m1:FP4E2M1Group32",
                       "fp4 e2m1 pairs with one ue8m0 exponent per 32 inputs (DeepSeek-V4's routed experts), read "
                       "natively", storage="<m>.weight I8 + <m>.scale F8_E8M0"))


@hookimpl
def colibri_register_tiers(register):
    register(TierSpec("disk", "colibri_core.experts.tiers:DiskTier",
                      "the shards on the primary drive and mirrors: merged preadv reads, fadvise or O_DIRECT", role="disk"))
    register(TierSpec("ram", "colibri_core.experts.tiers:RamTier",
                      "experts in host memory, as stored or decoded: pinned hot set + per-layer LRU, within --ram", role="ram"))
    register(TierSpec("device", "colibri_core.experts.tiers:DeviceTier",
                      "experts prepared in a backend's own memory (VRAM), fed from RAM: pinned hot set + per-layer LRU, "
                      "within --vram; a backend may bring its own", role="device"))


@hookimpl
def colibri_register_backends(register):
    register(
        BackendSpec(
            "cpu",
            "colibri_core.compute.cpu.backend:CpuBackend",
            probe="colibri_core.compute.cpu.probe:cpu_unavailable_reason",
            description="numpy float32 with BLAS, plus compiled kernels for packed weights",
            device="cpu",
        )
    )


@hookimpl
def colibri_register_draft_sources(register):
    register(DraftSpec("ngram", "colibri_core.engine.speculative:NgramSource",
                       "prompt lookup: the longest recent suffix that occurred before, continued as it went on then "
                       "(no weights)"))
    register(DraftSpec("mtp", "colibri_core.engine.speculative:MTPSource",
                       "the checkpoint's own multi-token-prediction layer (DeepSeek-V3 / Kimi K2 / GLM layout), "
                       "loaded int8 or better"))
    register(DraftSpec("auto", "colibri_core.engine.speculative:AutoSource",
                       "the model's MTP layer when loaded with it, else ngram; verified per sequence only as deep as its "
                       "measured acceptance and cost say pays"))
