"""Kimi K2 and K2.5: the DeepSeek-V3 architecture on colibri's shared blocks
(transformers: models/kimi_k25).

Kimi K2 is a DeepSeek-V3 config with ``model_type: kimi_k2``. Kimi K2.5 wraps the same
text model with a vision tower: its config nests the text model in ``text_config`` and
its checkpoint prefixes the text weights (``language_model.model.*`` and
``language_model.lm_head.weight`` on the Hub; transformers' own naming,
``model.language_model.*``, is read too). Only the text model runs: the vision tower
and projector are never loaded, and prompts holding image or video placeholder tokens
are refused.
"""

from __future__ import annotations

from colibri_core.errors import ModelFormatError, UnsupportedModelError
from colibri_core.model.family import Family
from colibri_core.nn.assembly import Names, build_decoder
from colibri_core.model.builders import DeepseekV3Args, mla_mixer, sigmoid_moe_mlp

TEXT_PREFIXES = ("language_model.model.", "model.language_model.")
LM_HEADS = ("language_model.lm_head", "lm_head")
MEDIA_TOKENS = {"media_placeholder_token_id": "media", "image_token_id": "image", "video_token_id": "video"}
PLACEHOLDERS_EMBEDDED_AS_ZERO = ("image_token_id", "video_token_id")  # transformers' Kimi_K25Model.forward


class Kimi(Family):
    name = "kimi"

    def build(self, config, w):
        src = w.config_source
        if "text_config" not in config:  # Kimi K2: a plain DeepSeek-V3 config
            return _build(DeepseekV3Args.from_dict(config, src), config, w)
        text = config["text_config"]
        if not isinstance(text, dict):
            raise ModelFormatError(f"{src}: text_config must be an object")
        if text.get("model_type", "deepseek_v3") not in ("deepseek_v3", "kimi_k2"):
            raise UnsupportedModelError(f"{src}: text_config model_type {text.get('model_type')!r} is not supported "
                                        "(Kimi K2.5's text model is deepseek_v3 / kimi_k2)")
        a = DeepseekV3Args.from_dict(text, f"{src}: text_config")
        names = _names(w)
        # transformers ties K2.5's lm_head to the embeddings by the top-level flag (default
        # true); a checkpoint without that flag but with its own lm_head keeps its lm_head
        tie = config.get("tie_word_embeddings")
        a.tie_word_embeddings = bool(tie) if tie is not None else names.lm_head not in _present(w, LM_HEADS)
        if not a.tie_word_embeddings and names.lm_head not in _present(w, LM_HEADS):
            raise ModelFormatError(f"{w.checkpoint.model_dir}: tie_word_embeddings is false but there is no lm_head "
                                   f"(looked for {', '.join(h + '.weight' for h in LM_HEADS)})")
        # the text model is all colibri runs: a prompt holding a vision placeholder is refused
        refused = {config[key]: f"Kimi K2.5's {what} placeholder: colibri runs the text model only; image and video "
                                "input are not supported" for key, what in MEDIA_TOKENS.items() if isinstance(config.get(key), int)}
        # ... yet the model may generate one: transformers then embeds it as token 0 (its
        # image and video placeholders, replaced before the embedding when no media is given)
        as_zero = {config[key]: 0 for key in PLACEHOLDERS_EMBEDDED_AS_ZERO if isinstance(config.get(key), int)}
        return _build(a, text, w, names, refused_tokens=refused, embedded_as=as_zero)


def _build(a: DeepseekV3Args, config: dict, w, names: Names = Names(),
           refused_tokens: dict[int, str] | None = None, embedded_as: dict[int, int] | None = None):
    """The DeepSeek-V3 text model of ``config``, its tensors under ``names``."""
    return build_decoder(a, w, mla_mixer(a, config, w), sigmoid_moe_mlp(a, w), names, refused_tokens=refused_tokens,
                         embedded_as=embedded_as)


def _present(w, heads) -> list[str]:
    return [h for h in heads if f"{h}.weight" in w.checkpoint]


def _names(w) -> Names:
    for prefix in TEXT_PREFIXES:
        if f"{prefix}embed_tokens.weight" in w.checkpoint:
            # transformers 5 writes the text layers as "blocks" (its renaming of the vision
            # tower's blocks applies to every key); the Hub checkpoint has "layers"
            layers = "blocks" if f"{prefix}blocks.0.input_layernorm.weight" in w.checkpoint else "layers"
            heads = _present(w, LM_HEADS)
            return Names(model=prefix, layers=layers, lm_head=heads[0] if heads else LM_HEADS[0])
    raise ModelFormatError(f"{w.checkpoint.model_dir}: no Kimi K2.5 text model found (looked for "
                           f"{' and '.join(p + 'embed_tokens.weight' for p in TEXT_PREFIXES)})")
