"""Multi-token-prediction layers, which DeepSeek-V3's, Kimi K2's and GLM-4.5's checkpoints
carry past their decoder layers (``num_nextn_predict_layers``) and Qwen3-Next's and
Qwen3.5's under ``mtp.`` (``mtp_num_hidden_layers``): ignored unless asked for, and,
asked for, checked against a torch implementation written from the published inference
code (vLLM's ``deepseek_mtp`` and ``qwen3_next_mtp``: transformers has none)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

import colibri_core
from colibri_core.io.safetensors import write_safetensors
from colibri_core.testing import copy_model

MTP_OWN = ("enorm", "hnorm", "shared_head.norm")  # RMSNorm weights of the MTP layer; and eh_proj


def check_mtp_layer_is_ignored(model_dir: Path, tmp_path: Path, prompt: list[int],
                               attention: dict[str, tuple[int, ...]]) -> None:
    """A copy of ``model_dir`` given an MTP layer (its projection and norm, and the
    ``attention`` tensors of the family's attention, random, in a shard of their own) gives
    ``model_dir``'s logits over ``prompt``, its checkpoint listing the layer's tensors."""
    config = json.loads((model_dir / "config.json").read_text())
    layer, hidden = f"model.layers.{config['num_hidden_layers']}", config["hidden_size"]
    mtp_dir = copy_model(model_dir, tmp_path / "mtp", num_nextn_predict_layers=1)
    rng = np.random.default_rng(0)
    write_safetensors(mtp_dir / "model-mtp.safetensors", {
        f"{layer}.eh_proj.weight": rng.standard_normal((hidden, 2 * hidden)).astype(np.float32),
        f"{layer}.enorm.weight": np.ones(hidden, np.float32),
        **{f"{layer}.{name}": rng.standard_normal(shape).astype(np.float32) for name, shape in attention.items()},
    })
    with colibri_core.load(model_dir, history=False) as plain, colibri_core.load(mtp_dir, history=False) as mtp:
        assert f"{layer}.eh_proj.weight" in mtp.checkpoint.tensors
        np.testing.assert_array_equal(mtp.logits(prompt), plain.logits(prompt))


def add_mtp_layer(model_dir: Path, out: Path, seed: int = 0) -> Path:
    """A copy of ``model_dir`` (one ``model.safetensors``, as ``save_pretrained`` writes a
    small model) with an MTP layer in DeepSeek-V3's layout: its decoder layer a copy of the
    last one's tensors (so the reference can copy that layer's module), its own norms and
    projection random."""
    config = json.loads((model_dir / "config.json").read_text())
    n, hidden = config["num_hidden_layers"], config["hidden_size"]
    mtp_dir = copy_model(model_dir, out, num_nextn_predict_layers=1)
    from safetensors.numpy import load_file

    tensors = load_file(mtp_dir / "model.safetensors")
    last = f"model.layers.{n - 1}."
    rng = np.random.default_rng(seed)
    layer = {f"model.layers.{n}.{k[len(last):]}": v for k, v in tensors.items() if k.startswith(last)}
    layer |= {f"model.layers.{n}.{name}.weight": (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
              for name in MTP_OWN}
    layer[f"model.layers.{n}.eh_proj.weight"] = (rng.standard_normal((hidden, 2 * hidden)) / np.sqrt(2 * hidden)).astype(np.float32)
    write_safetensors(mtp_dir / "model-mtp.safetensors", layer)
    return mtp_dir


def reference_mtp_logits(model_dir: Path, ids: list[int]) -> np.ndarray:
    """Torch, float32: the MTP layer's logits at positions 0..T-2 of ``ids`` (each guessing
    the token two ahead), for a model made by ``add_mtp_layer``: its block is the last
    decoder layer's module copied (the same tensors), attending causally."""
    import copy

    import torch
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    config = model.config
    n = config.num_hidden_layers
    own = load_file(model_dir / "model-mtp.safetensors")
    weight = {k[len(f"model.layers.{n}."):]: torch.from_numpy(np.asarray(v, np.float32)) for k, v in own.items()}
    block = copy.deepcopy(model.model.layers[n - 1])
    return _reference_logits(model, block, ids, weight["enorm.weight"], weight["hnorm.weight"], weight["eh_proj.weight"],
                             weight["shared_head.norm.weight"], offset=False)


def _reference_logits(model, block, ids: list[int], embed_norm, hidden_norm, projection, head_norm, offset: bool):
    """The MTP computation both published layouts share (vLLM's deepseek_mtp and
    qwen3_next_mtp): block(projection([norm(embed(t+1)), norm(h_t)])), its output normed,
    through the model's LM head; ``offset``: the norms scale by (1 + w)."""
    import torch

    eps = model.config.rms_norm_eps

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * ((1 + w) if offset else w)

    with torch.no_grad():
        x = torch.tensor([ids])
        hidden = model.model(input_ids=x).last_hidden_state[:, :-1]  # final-normed, as the MTP layer reads it
        nxt = model.model.embed_tokens(x[:, 1:])
        t = nxt.shape[1]
        positions = torch.arange(t).unsqueeze(0)
        rope = model.model.rotary_emb(nxt, positions)
        h = torch.nn.functional.linear(torch.cat([rms(nxt, embed_norm), rms(hidden, hidden_norm)], dim=-1), projection)
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        out = block(h, attention_mask=mask, position_ids=positions, position_embeddings=rope)
        out = out[0] if isinstance(out, tuple) else out
        return model.lm_head(rms(out, head_norm))[0].numpy()


def add_qwen_mtp_layer(model_dir: Path, out: Path, seed: int = 0) -> Path:
    """A copy of ``model_dir`` (a Qwen3-Next model as ``save_pretrained`` writes it) with an
    MTP layer in Qwen3-Next's layout: its decoder layer the one layer of a seeded *donor*
    model (the same config, one full-attention layer: MoE or dense as layer 0 is, as vLLM
    builds the MTP layer), saved by transformers and renamed ``mtp.layers.0.``; its own
    norms and projection random. The donor stays in ``out/donor`` for the reference."""
    import torch
    from safetensors.numpy import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = json.loads((model_dir / "config.json").read_text())
    hidden = config["hidden_size"]
    mtp_dir = copy_model(model_dir, out / "model", mtp_num_hidden_layers=1)
    donor_config = AutoConfig.from_pretrained(model_dir)
    donor_config.num_hidden_layers, donor_config.layer_types = 1, ["full_attention"]
    torch.manual_seed(seed)
    donor = AutoModelForCausalLM.from_config(donor_config, dtype=torch.float32)
    donor.save_pretrained(out / "donor", max_shard_size="1GB")
    tensors = load_file(out / "donor" / "model.safetensors")
    layer = {"mtp.layers.0." + k[len("model.layers.0."):]: v for k, v in tensors.items() if k.startswith("model.layers.0.")}
    rng = np.random.default_rng(seed)
    layer |= {f"mtp.{name}.weight": (0.1 * rng.standard_normal(hidden)).astype(np.float32)  # (1 + w) norms
              for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
    layer["mtp.fc.weight"] = (rng.standard_normal((hidden, 2 * hidden)) / np.sqrt(2 * hidden)).astype(np.float32)
    write_safetensors(mtp_dir / "model-mtp.safetensors", layer)
    index = mtp_dir / "model.safetensors.index.json"
    if index.exists():  # a sharded save: the index names every tensor's shard
        doc = json.loads(index.read_text())
        doc["weight_map"].update({name: "model-mtp.safetensors" for name in layer})
        index.write_text(json.dumps(doc))
    return mtp_dir


def reference_qwen_mtp_logits(model_dir: Path, ids: list[int]) -> np.ndarray:
    """Torch, float32, from vLLM's ``qwen3_next_mtp``: the MTP layer's logits at positions
    0..T-2 of ``ids``, for a model made by ``add_qwen_mtp_layer`` (its block the donor's
    layer, attending causally; the norms Qwen3-Next's (1 + w) RMSNorms)."""
    import torch
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    donor = AutoModelForCausalLM.from_pretrained(model_dir.parent / "donor", dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    own = {k: torch.from_numpy(np.asarray(v, np.float32)) for k, v in load_file(model_dir / "model-mtp.safetensors").items()}
    return _reference_logits(model, donor.model.layers[0], ids, own["mtp.pre_fc_norm_embedding.weight"],
                             own["mtp.pre_fc_norm_hidden.weight"], own["mtp.fc.weight"], own["mtp.norm.weight"], offset=True)


def mtp_logits(model, ids: list[int]) -> np.ndarray:
    """colibri's MTP logits at positions 0..T-2 of ``ids`` (``model`` loaded with
    ``mtp=True``): the main model's hidden states, then the MTP layer position by
    position on its own cache, as drafting runs it."""
    ops, lm = model.backend, model.lm
    hidden: list = []
    lm.forward(np.asarray(ids), lm.new_cache(ops), ops, hidden=hidden)
    layer = lm.mtp[0]
    cache = layer.new_cache(ops, lm.max_context)
    return np.stack([layer(hidden[0][i : i + 1], np.asarray([ids[i + 1]]), cache, ops)[0] for i in range(len(ids) - 1)])


def check_mtp_layer_matches_reference(model_dir: Path, tmp_path: Path, prompt: list[int], backend: str = "cpu",
                                      layout: str = "deepseek") -> None:
    """An MTP layer added to ``model_dir`` (``add_mtp_layer``; ``layout`` "qwen":
    ``add_qwen_mtp_layer``) gives the torch reference's logits within 1e-4, and drafting
    with it changes no token."""
    if layout == "qwen":
        mtp_dir, reference = add_qwen_mtp_layer(model_dir, tmp_path / "with-mtp"), reference_qwen_mtp_logits
    else:
        mtp_dir, reference = add_mtp_layer(model_dir, tmp_path / "with-mtp"), reference_mtp_logits
    with colibri_core.load(mtp_dir, backend=backend, history=False, mtp=True) as model:
        ours = mtp_logits(model, prompt)
        off = model.generate(token_ids=prompt, max_tokens=12, ignore_eos=True)
        drafted = model.generate(token_ids=prompt, max_tokens=12, ignore_eos=True, draft="mtp", draft_depth=2)
    np.testing.assert_allclose(ours, reference(mtp_dir, prompt), atol=1e-4, rtol=1e-4)
    assert drafted.token_ids == off.token_ids
    assert drafted.stats.drafted_tokens > 0
