"""The RAM budget holds at every moment of a load, not only once it is done.

A model whose largest dense tensor is large against the budget (a 256 MiB embedding,
tied to the LM head in one case) is loaded in a child process with ``--ram`` just
above its dense weights. The child's peak resident memory (VmHWM) less what it held
before the load must stay within the budget plus ``SLACK`` (the decode of one chunk in
flight, allocator rounding). The child also runs in a memory cgroup limited to the
budget plus ``INTERPRETER`` (python, numpy, colibri imported) when this machine lets
us create one (root, cgroup v1 or v2): a load that overshoots is killed there.
Before the fix, a float32 checkpoint's embedding was read whole and then copied
(twice the tensor at once) and a float16 one read whole beside its float32 decode.
"""

import json
import subprocess
import sys

import numpy as np
import pytest

from colibri_core.cli.bench import Cgroup
from colibri_core.cli.demo import DemoSpec, build_tokenizer
from colibri_core.io.safetensors import write_safetensors

MiB = 1 << 20
SLACK = 24 * MiB
INTERPRETER = 256 * MiB

# a 65536 x 1024 embedding: 256 MiB in float32, half the model
SPEC = DemoSpec(hidden_size=1024, num_hidden_layers=2, num_attention_heads=8, num_experts=4, num_experts_per_tok=2,
                intermediate_size=64, tokenizer_vocab=65536)


def build(out, dtype: str, tied: bool):
    """An OLMoE-shaped model stored in ``dtype`` (F32 or F16), one shard."""
    out.mkdir()
    tok = build_tokenizer(DemoSpec(tokenizer_vocab=512))
    tok.save(str(out / "tokenizer.json"))
    h, i, e, v = SPEC.hidden_size, SPEC.intermediate_size, SPEC.num_experts, SPEC.vocab_size
    config = {"architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "vocab_size": v, "hidden_size": h,
              "intermediate_size": i, "num_hidden_layers": SPEC.num_hidden_layers,
              "num_attention_heads": SPEC.num_attention_heads, "num_key_value_heads": SPEC.num_attention_heads,
              "num_experts": e, "num_experts_per_tok": SPEC.num_experts_per_tok, "max_position_embeddings": 256,
              "rms_norm_eps": 1e-5, "tie_word_embeddings": tied, "eos_token_id": 0}
    (out / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(0)
    np_dtype = {"F32": np.float32, "F16": np.float16}[dtype]

    def t(*shape, std=0.02):
        return (rng.standard_normal(shape, dtype=np.float32) * std).astype(np_dtype)

    tensors = [("model.embed_tokens.weight", t(v, h)), ("model.norm.weight", np.ones(h, np_dtype))]
    if not tied:
        tensors.append(("lm_head.weight", t(v, h)))
    for layer in range(SPEC.num_hidden_layers):
        p = f"model.layers.{layer}"
        tensors += [(f"{p}.self_attn.{n}.weight", t(h, h)) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        tensors += [(f"{p}.self_attn.{n}.weight", np.ones(h, np_dtype)) for n in ("q_norm", "k_norm")]
        tensors += [(f"{p}.{n}.weight", np.ones(h, np_dtype)) for n in ("input_layernorm", "post_attention_layernorm")]
        tensors.append((f"{p}.mlp.gate.weight", t(e, h)))
        for x in range(e):
            tensors += [(f"{p}.mlp.experts.{x}.gate_proj.weight", t(i, h)), (f"{p}.mlp.experts.{x}.up_proj.weight", t(i, h)),
                        (f"{p}.mlp.experts.{x}.down_proj.weight", t(h, i))]
    write_safetensors(out / "model.safetensors", tensors)
    return out


CHILD = """
import json, sys
from colibri_core.model.blueprint import inspect_model
import colibri_core

def hwm():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))

model_dir = sys.argv[1]
bp = inspect_model(model_dir)
ram = bp.dense_bytes + (2 * len(bp.moe) + bp.top_k) * bp.expert_ram_bytes  # two experts cached per layer
largest = max(p.info.nbytes for p in bp.weights.params.values())
bp.close()
before = hwm()
with colibri_core.load(model_dir, ram=ram, history=False) as model:
    after = hwm()
    assert model.placement.slots == 2
print(json.dumps({"ram": ram, "before": before, "peak": after, "largest": largest}))
"""


@pytest.mark.parametrize("dtype, tied", [("F32", True), ("F32", False), ("F16", True)])
def test_the_budget_holds_while_the_dense_weights_load(tmp_path, dtype, tied):
    model = build(tmp_path / "model", dtype, tied)
    probe = subprocess.run([sys.executable, "-c", "import colibri_core.model.blueprint as b, sys; "
                            "bp = b.inspect_model(sys.argv[1]); print(bp.dense_bytes); bp.close()", str(model)],
                           capture_output=True, text=True, check=True)
    dense = int(probe.stdout)
    assert dense >= 256 * MiB  # the embedding alone (float32 on the CPU backend)
    try:
        group = Cgroup.create(dense + INTERPRETER + 64 * MiB)
    except Exception:  # no writable memory cgroup here: VmHWM alone
        group = None
    try:
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(model)], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        if group is not None:
            group.add(child.pid)  # before the imports are done, long before the load
        out, err = child.communicate(timeout=600)
    finally:
        if group is not None:
            group.remove()
    assert child.returncode == 0, err[-2000:]
    data = json.loads(out)
    grown = data["peak"] - data["before"]
    assert grown <= data["ram"] + SLACK, (f"peak grew {grown / MiB:.0f} MiB under a {data['ram'] / MiB:.0f} MiB budget "
                                          f"(largest tensor {data['largest'] / MiB:.0f} MiB)")
