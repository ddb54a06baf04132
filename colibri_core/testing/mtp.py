"""Multi-token-prediction layers, which DeepSeek-V3's, Kimi K2's and GLM-4.5's checkpoints
carry past their decoder layers (``num_nextn_predict_layers``), Qwen3-Next's and
Qwen3.5's under ``mtp.`` (``mtp_num_hidden_layers``), MiMo-V2-Flash's under
``model.mtp.layers.`` and DeepSeek-V4's under ``mtp.{j}.`` (``num_nextn_predict_layers``):
ignored unless asked for, and, asked for, checked against a torch implementation written
from the published inference code (vLLM's ``deepseek_mtp``, ``qwen3_next_mtp``,
``mimo_v2_mtp`` and ``deepseek_v4_mtp``: transformers has none)."""

from __future__ import annotations

import json
import re
import shutil
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


def _write_mtp_shard(mtp_dir: Path, layer: dict) -> None:
    """The MTP layer's tensors in a shard of their own, named in the index where the copy
    has one (a sharded save)."""
    write_safetensors(mtp_dir / "model-mtp.safetensors", layer)
    index = mtp_dir / "model.safetensors.index.json"
    if index.exists():
        doc = json.loads(index.read_text())
        doc["weight_map"].update({name: "model-mtp.safetensors" for name in layer})
        index.write_text(json.dumps(doc))


def check_mtp_drafts_change_nothing(mtp_dir: Path, prompt: list[int], backend: str) -> None:
    """Greedy and seeded sampling with ``draft="mtp"`` (depth 1 and 3), experts streaming
    through one cached expert per layer, give the tokens and bit-identical logits of
    decoding without drafts, and drafts were made and verified."""
    from colibri_core.testing.oracle import assert_same_logits

    with colibri_core.load(mtp_dir, backend=backend, mtp=True, cap=1, history=False) as model:
        for sampling in ({}, {"temperature": 0.8, "top_k": 12, "seed": 5}):
            plain = model.generate(token_ids=prompt, max_tokens=16, ignore_eos=True, return_logits=True, **sampling)
            for depth in (1, 3):
                run = model.generate(token_ids=prompt, max_tokens=16, ignore_eos=True, return_logits=True,
                                     draft="mtp", draft_depth=depth, **sampling)
                label = f"depth {depth}, {sampling or 'greedy'}"
                assert run.token_ids == plain.token_ids, label
                assert_same_logits(run.logits, plain.logits, label)
                assert run.stats.drafted_tokens > 0 and run.stats.draft_verifications > 0, label


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
    layer |= {f"model.layers.{n}.{name}.weight": rng.uniform(0.25, 2.0, hidden).astype(np.float32)  # far from 1
              for name in MTP_OWN}
    layer[f"model.layers.{n}.eh_proj.weight"] = (rng.standard_normal((hidden, 2 * hidden)) / np.sqrt(2 * hidden)).astype(np.float32)
    write_safetensors(mtp_dir / "model-mtp.safetensors", layer)
    return mtp_dir


def _deepseek_reference(model_dir: Path):
    """Torch, float32, from vLLM's ``deepseek_mtp``: the main model and ``_reference_layer``
    of the MTP layer of a model made by ``add_mtp_layer``: its block the last decoder
    layer's module copied (the same tensors), attending causally; a chained draft reads
    the block's output before the head's norm (what ``deepseek_mtp`` returns)."""
    import copy

    import torch
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    n = model.config.num_hidden_layers
    own = load_file(model_dir / "model-mtp.safetensors")
    weight = {k[len(f"model.layers.{n}."):]: torch.from_numpy(np.asarray(v, np.float32)) for k, v in own.items()}
    block = copy.deepcopy(model.model.layers[n - 1])
    return model, _reference_layer(model, block, weight["enorm.weight"], weight["hnorm.weight"], weight["eh_proj.weight"],
                                   weight["shared_head.norm.weight"], offset=False, chains_normed=False)


def reference_mtp_logits(model_dir: Path, ids: list[int]) -> np.ndarray:
    """The MTP layer's logits at positions 0..T-2 of ``ids`` (each guessing the token two
    ahead), for a model made by ``add_mtp_layer`` (``_deepseek_reference``)."""
    return _reference_logits(_deepseek_reference(model_dir), ids)


def _main_hidden(reference, x):
    """The main model's hidden states of the token ids ``x`` (1, T) as a ``reference``'s
    MTP layer reads them: final-normed, or what its third item makes of ``x``."""
    import torch

    with torch.no_grad():
        return reference[2](x) if len(reference) > 2 else reference[0].model(input_ids=x).last_hidden_state


def _reference_logits(reference, ids: list[int]) -> np.ndarray:
    """The logits of ``reference``'s layer (a ``_*_reference``: (main model, run[, hidden]))
    at positions 0..T-2 of ``ids``, from the main model's hidden states and the tokens
    after each."""
    import torch

    x = torch.tensor([ids])
    return reference[1](_main_hidden(reference, x)[:, :-1], x[:, 1:])[0]


def _reference_layer(model, block, embed_norm, hidden_norm, projection, head_norm, offset: bool, rope=None,
                     window: int | None = None, chains_normed: bool = True):
    """The MTP computation the published layouts share (vLLM's deepseek_mtp, qwen3_next_mtp
    and mimo_v2_mtp): block(projection([norm(embed(t+1)), norm(h_t)])), its output normed,
    through the model's LM head; ``offset``: the norms scale by (1 + w); ``rope(x,
    positions)``: the block's (cos, sin) (default: the model's rotary embedding);
    ``window``: the block sees that many positions (its own included), else all before.
    Returns run(hidden (1, T, H), next_ids (1, T)) -> (logits (T, V), what a chained
    draft reads as the hidden state: the normed output, or with ``chains_normed`` False
    the block's output before that norm)."""
    import torch

    eps = model.config.rms_norm_eps
    rope = rope or model.model.rotary_emb

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * ((1 + w) if offset else w)

    def run(hidden, next_ids):
        with torch.no_grad():
            nxt = model.model.embed_tokens(next_ids)
            t = nxt.shape[1]
            positions = torch.arange(t).unsqueeze(0)
            h = torch.nn.functional.linear(torch.cat([rms(nxt, embed_norm), rms(hidden, hidden_norm)], dim=-1), projection)
            i = torch.arange(t)
            unseen = (i[None, :] > i[:, None]) | ((i[:, None] - i[None, :] >= window) if window else False)
            mask = torch.zeros(t, t).masked_fill(unseen, float("-inf"))[None, None]
            out = block(h, attention_mask=mask, position_ids=positions, position_embeddings=rope(nxt, positions))
            block_out = out[0] if isinstance(out, tuple) else out
            out = rms(block_out, head_norm)
            return model.lm_head(out)[0].numpy(), out if chains_normed else block_out

    return run


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
    _write_mtp_shard(mtp_dir, layer)
    return mtp_dir


def _qwen_reference(model_dir: Path):
    """Torch, float32, from vLLM's ``qwen3_next_mtp``: the main model and
    ``_reference_layer`` of the MTP layer of a model made by ``add_qwen_mtp_layer`` (its
    block the donor's layer, attending causally; the norms Qwen3-Next's (1 + w) RMSNorms;
    a chained draft reads the normed output, what ``qwen3_next_mtp`` returns)."""
    import torch
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    donor = AutoModelForCausalLM.from_pretrained(model_dir.parent / "donor", dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    own = {k: torch.from_numpy(np.asarray(v, np.float32)) for k, v in load_file(model_dir / "model-mtp.safetensors").items()}
    return model, _reference_layer(model, donor.model.layers[0], own["mtp.pre_fc_norm_embedding.weight"],
                                   own["mtp.pre_fc_norm_hidden.weight"], own["mtp.fc.weight"], own["mtp.norm.weight"],
                                   offset=True)


def reference_qwen_mtp_logits(model_dir: Path, ids: list[int]) -> np.ndarray:
    """The MTP layer's logits at positions 0..T-2 of ``ids`` (``_qwen_reference``)."""
    return _reference_logits(_qwen_reference(model_dir), ids)


def _sliding_donor(model_dir: Path, mlp: str, seed: int):
    """A seeded one-layer model of ``model_dir``'s config whose layer is a sliding-attention
    one with an ``mlp`` ("dense" or "moe") MLP, as vLLM builds MiMo's and DeepSeek-V4's MTP
    blocks; its vectors (norms, sinks, hyper-connections' base and scale) moved off their
    initial values, so a missed one shows."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    config.num_hidden_layers = 1
    config.layer_types, config.mlp_layer_types = ["sliding_attention"], [mlp]
    torch.manual_seed(seed)
    donor = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in donor.model.layers[0].parameters():
            if param.dim() == 1:
                param.add_(0.2 * torch.randn_like(param))
    return donor


def add_mimo_mtp_layer(model_dir: Path, out: Path, seed: int = 0, layers: int = 2) -> Path:
    """A copy of ``model_dir`` (a MiMo-V2-Flash model as ``save_pretrained`` writes it) with
    ``layers`` MTP layers in MiMo-V2-Flash's layout (``model.mtp.layers.{j}``). Layer 0's
    decoder layer is the one layer of a seeded *donor* model (the same config, one sliding
    attention layer with a dense MLP, as vLLM's ``mimo_v2_mtp`` builds it; its norms and
    sinks perturbed), saved by transformers and renamed, its post-attention norm
    ``pre_mlp_layernorm``; its ``enorm``, ``hnorm``, ``eh_proj`` and ``final_layernorm``
    random. The later layers are random too (vLLM reads the first only). The donor stays
    in ``out/donor`` for the reference."""
    from safetensors.numpy import load_file

    hidden = json.loads((model_dir / "config.json").read_text())["hidden_size"]
    mtp_dir = copy_model(model_dir, out / "model", num_nextn_predict_layers=layers)
    donor = _sliding_donor(model_dir, "dense", seed)
    donor.save_pretrained(out / "donor", max_shard_size="1GB")
    rng = np.random.default_rng(seed)
    block = {k[len("model.layers.0."):].replace("post_attention_layernorm", "pre_mlp_layernorm"): v
             for k, v in load_file(out / "donor" / "model.safetensors").items() if k.startswith("model.layers.0.")}
    block |= {f"{name}.weight": rng.uniform(0.25, 2.0, hidden).astype(np.float32)  # far from 1: a missed norm shows
              for name in ("enorm", "hnorm", "final_layernorm")}
    block["eh_proj.weight"] = (rng.standard_normal((hidden, 2 * hidden)) / np.sqrt(2 * hidden)).astype(np.float32)
    layer = {f"model.mtp.layers.0.{k}": v for k, v in block.items()}
    for j in range(1, layers):
        layer |= {f"model.mtp.layers.{j}.{k}": (0.1 * rng.standard_normal(v.shape)).astype(np.float32)
                  for k, v in block.items()}
    _write_mtp_shard(mtp_dir, layer)
    return mtp_dir


def _mimo_reference(model_dir: Path):
    """Torch, float32, from vLLM's ``mimo_v2_mtp`` (``MiMoV2MTPLayer``): the main model
    and ``_reference_layer`` of MTP layer 0 of a model made by ``add_mimo_mtp_layer``: its
    block the donor's sliding layer, with the sliding layers' rope, seeing the sliding
    window; ``enorm`` / ``hnorm`` / ``eh_proj`` / ``final_layernorm`` plain RMSNorms."""
    import torch
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    donor = AutoModelForCausalLM.from_pretrained(model_dir.parent / "donor", dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    own = {k[len("model.mtp.layers.0."):]: torch.from_numpy(np.asarray(v, np.float32))
           for k, v in load_file(model_dir / "model-mtp.safetensors").items() if k.startswith("model.mtp.layers.0.")}

    def rope(x, positions):
        return donor.model.rotary_emb(x, positions, "sliding_attention")

    return model, _reference_layer(model, donor.model.layers[0], own["enorm.weight"], own["hnorm.weight"],
                                   own["eh_proj.weight"], own["final_layernorm.weight"], offset=False, rope=rope,
                                   window=model.config.sliding_window)


def reference_mimo_mtp_logits(model_dir: Path, ids: list[int]) -> np.ndarray:
    """The MTP layer's logits at positions 0..T-2 of ``ids`` (``_mimo_reference``)."""
    return _reference_logits(_mimo_reference(model_dir), ids)


def add_v4_mtp_layer(model_dir: Path, out: Path, seed: int = 0, kv_norm: str = "kv_norm") -> Path:
    """A copy of ``model_dir`` (a DeepSeek-V4 model as ``save_pretrained`` writes it) with an
    MTP layer in DeepSeek-V4's layout (``mtp.0.``, DeepSeek's spelling). Its block is the
    one layer of a seeded *donor* model (the same config, one sliding-attention layer with
    a score-routed MoE, as vLLM's ``deepseek_v4_mtp`` builds it; its vectors perturbed and
    its routing bias random), saved by transformers and renamed, its KV norm ``attn.{kv_norm}``
    (DeepSeek's ``kv_norm``, or transformers' ``norm``); its ``enorm``, ``hnorm``, ``e_proj``,
    ``h_proj``, ``hc_head_{fn,base,scale}`` and ``norm`` random. The donor stays in
    ``out/donor`` for the reference."""
    import torch
    from safetensors.numpy import load_file

    config = json.loads((model_dir / "config.json").read_text())
    hidden, n = config["hidden_size"], config["hc_mult"]
    mtp_dir = copy_model(model_dir, out / "model", num_nextn_predict_layers=1)
    donor = _sliding_donor(model_dir, "moe", seed)
    with torch.no_grad():
        for name, buffer in donor.model.layers[0].named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.3 * torch.randn_like(buffer))
    donor.save_pretrained(out / "donor", max_shard_size="1GB")
    layer = {"mtp.0." + re.sub(r"^attn\.norm\.", f"attn.{kv_norm}.", k[len("model.layers.0."):]): v
             for k, v in load_file(out / "donor" / "model.safetensors").items() if k.startswith("model.layers.0.")}
    rng = np.random.default_rng(seed)
    layer |= {f"mtp.0.{name}.weight": rng.uniform(0.25, 2.0, hidden).astype(np.float32)  # far from 1: a missed norm shows
              for name in ("enorm", "hnorm", "norm")}
    layer |= {f"mtp.0.{name}.weight": (rng.standard_normal((hidden, hidden)) / np.sqrt(hidden)).astype(np.float32)
              for name in ("e_proj", "h_proj")}
    layer["mtp.0.hc_head_fn"] = (0.1 * rng.standard_normal((n, n * hidden))).astype(np.float32)
    layer["mtp.0.hc_head_base"] = (0.2 * rng.standard_normal(n)).astype(np.float32)
    layer["mtp.0.hc_head_scale"] = rng.uniform(0.5, 1.5, 1).astype(np.float32)
    _write_mtp_shard(mtp_dir, layer)
    return mtp_dir


def _deepseek_v4_reference(model_dir: Path):
    """Torch, float32, from vLLM's ``deepseek_v4_mtp`` (``DeepSeekV4MultiTokenPredictorLayer``)
    and DeepSeek's ``MTPBlock``: (the main model, run, hidden) for MTP layer 0 of a model
    made by ``add_v4_mtp_layer`` (or its float32 copy: ``model_dir``'s tensors are read,
    the block's too: transformers loads the donor with them, as the donor's layer 0;
    the donor gives the module). ``hidden(x)``: the main model's streams before its
    ``hc_head`` (1, T, N, D); ``run``: ``e_proj(enorm(embed(t))).unsqueeze(-2) +
    h_proj(hnorm(streams))`` through the donor's block (sliding window, the main rope),
    then the layer's own hc_head, ``norm`` and the model's LM head; a chained draft reads
    the block's output streams (what vLLM's layer returns; hc_head comes in its
    compute_logits). The embedding at position 0 is not zeroed (vLLM's masking there is
    not in DeepSeek's MTPBlock, nor in the other references)."""
    import torch
    import torch.nn.functional as F
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    own = {k[len("mtp.0."):]: np.asarray(v, np.float32)
           for k, v in load_file(model_dir / "model-mtp.safetensors").items() if k.startswith("mtp.0.")}
    donor_dir, block_dir = model_dir.parent / "donor", model_dir.parent / f"{model_dir.name}-mtp-block"
    shutil.rmtree(block_dir, ignore_errors=True)
    shutil.copytree(donor_dir, block_dir)
    tensors = load_file(donor_dir / "model.safetensors")
    for name in [k for k in tensors if k.startswith("model.layers.0.")]:
        rest = name[len("model.layers.0."):]
        tensors[name] = own[rest] if rest in own else own[re.sub(r"^attn\.norm\.", "attn.kv_norm.", rest)]
    write_safetensors(block_dir / "model.safetensors", tensors)
    donor = AutoModelForCausalLM.from_pretrained(block_dir, dtype=torch.float32, attn_implementation="eager").eval()
    own = {k: torch.from_numpy(v) for k, v in own.items()}
    cfg, block = model.config, donor.model.layers[0]

    def rms(x, w=None):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)
        return x if w is None else x * w

    seen: list = []
    model.model.hc_head.register_forward_hook(lambda module, args, out: seen.append(args[0]))

    def hidden(x):
        seen.clear()
        model.model(input_ids=x)
        return seen[-1]

    def run(streams, next_ids):
        with torch.no_grad():
            e = rms(model.model.embed_tokens(next_ids), own["enorm.weight"])
            t = e.shape[1]
            positions = torch.arange(t).unsqueeze(0)
            x = F.linear(e, own["e_proj.weight"]).unsqueeze(-2) + F.linear(rms(streams, own["hnorm.weight"]),
                                                                           own["h_proj.weight"])
            i = torch.arange(t)
            unseen = (i[None, :] > i[:, None]) | (i[:, None] - i[None, :] >= cfg.sliding_window)
            mask = torch.zeros(t, t).masked_fill(unseen, float("-inf"))[None, None]
            rope = {kind: model.model.rotary_emb(e, positions, layer_type=kind) for kind in ("main", "compress")}
            x = block(x, position_embeddings=rope, position_ids=positions, attention_mask=mask)
            pre = torch.sigmoid(F.linear(rms(x.flatten(2)), own["hc_head_fn"]) * own["hc_head_scale"]
                                + own["hc_head_base"]) + cfg.hc_eps
            out = rms((pre.unsqueeze(-1) * x).sum(2), own["norm.weight"])
            return model.lm_head(out)[0].numpy(), x

    return model, run, hidden


def reference_v4_mtp_logits(model_dir: Path, ids: list[int]) -> np.ndarray:
    """The MTP layer's logits at positions 0..T-2 of ``ids`` (``_deepseek_v4_reference``)."""
    return _reference_logits(_deepseek_v4_reference(model_dir), ids)


def reference_mtp_drafts(reference, tokens: list[int], k: int) -> list[int]:
    """The ``k`` greedy drafts to follow ``tokens`` chained as vLLM's proposer chains an
    MTP layer (``reference``: a ``_*_reference`` pair): the main model's hidden states of
    ``tokens[:-1]`` with the tokens after each, then per draft what the layer returns
    (its normed output, or its block's output: ``_reference_layer``) as the next
    position's hidden state, the draft before as its token."""
    import torch

    run = reference[1]
    with torch.no_grad():
        x = torch.tensor([tokens])
        hidden, nxt = _main_hidden(reference, x[:, :-1]), x[:, 1:]
        drafts: list[int] = []
        for _ in range(k):
            logits, out = run(hidden, nxt)
            drafts.append(int(np.argmax(logits[-1])))
            hidden, nxt = torch.cat([hidden, out[:, -1:]], 1), torch.cat([nxt, torch.tensor([drafts[-1:]])], 1)
    return drafts


def mtp_drafts(model, tokens: list[int], k: int, cut: int) -> tuple[list[int], list[int]]:
    """colibri's ``k`` MTP drafts to follow ``tokens[:cut]`` and then ``tokens`` (``model``
    loaded with ``mtp=True``), one drafter for both: the second proposal reads the layer's
    cache as the first left it, having forgotten its drafts' positions."""
    from colibri_core.engine.speculative import MTPSource

    ops, lm = model.backend, model.lm
    hidden: list = []
    lm.forward(np.asarray(tokens[:-1]), lm.new_cache(ops), ops, hidden=hidden)
    drafter = MTPSource(model).new_drafter()
    drafter.observe(hidden[0][: cut - 1])
    first = drafter.propose(tokens[:cut], k)
    drafter.observe(hidden[0][cut - 1 :])
    return first, drafter.propose(tokens, k)


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
                                      layout: str = "deepseek", rewrite=None, **load) -> None:
    """An MTP layer added to ``model_dir`` (``add_mtp_layer``; ``layout`` "qwen":
    ``add_qwen_mtp_layer``; "mimo": ``add_mimo_mtp_layer``; "deepseek-v4":
    ``add_v4_mtp_layer``) gives the torch reference's logits within 1e-4, its chained
    drafts (depth 3) are the reference's, and drafting with it changes no token.
    ``rewrite(dir)``: rewrites the model with its MTP layer in place (quantises it) and
    returns the float32 copy the reference reads; ``load``: more ``colibri_core.load``
    options."""
    add, reference = {"qwen": (add_qwen_mtp_layer, _qwen_reference), "mimo": (add_mimo_mtp_layer, _mimo_reference),
                      "deepseek-v4": (add_v4_mtp_layer, _deepseek_v4_reference)}.get(
        layout, (add_mtp_layer, _deepseek_reference))
    mtp_dir = add(model_dir, tmp_path / "with-mtp")
    reference_dir = mtp_dir if rewrite is None else rewrite(mtp_dir)
    cut = len(prompt) - 4
    with colibri_core.load(mtp_dir, backend=backend, history=False, mtp=True, **load) as model:
        ours = mtp_logits(model, prompt)
        chained = mtp_drafts(model, prompt, 3, cut)
        off = model.generate(token_ids=prompt, max_tokens=12, ignore_eos=True)
        drafted = model.generate(token_ids=prompt, max_tokens=12, ignore_eos=True, draft="mtp", draft_depth=2)
    ref = reference(reference_dir)
    np.testing.assert_allclose(ours, _reference_logits(ref, prompt), atol=1e-4, rtol=1e-4)
    assert chained == (reference_mtp_drafts(ref, prompt[:cut], 3), reference_mtp_drafts(ref, prompt, 3))
    assert drafted.token_ids == off.token_ids
    assert drafted.stats.drafted_tokens > 0
