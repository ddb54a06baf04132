"""The demo models: by default the trained OLMoE-geometry model of colibri-trained
(``trained_demo_path``); with ``--size full`` a synthetic OLMoE-shaped checkpoint with
random weights, described below.

It is built once under the user cache dir (bf16 safetensors shards with an index, a
small BPE tokenizer trained on a paragraph of text, a chat template) and then run with a
RAM budget that holds only a quarter of the experts, so they must stream from disk.
The weights are random, so the generated text is noise: the demo proves the machinery
(loading, validation, streaming, caching, sampling, statistics), not a language model.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from colibri_core.formats.base import f32_to_bf16
from colibri_core.io.safetensors import save_file

FORMAT_VERSION = 1
MARKER = "colibri-demo.json"
DEMO_MODEL_TYPE, DEMO_ARCHITECTURE = "olmoe", "OlmoeForCausalLM"

CORPUS = """\
The hummingbird is the smallest of birds, yet it crosses seas. It does not carry the ocean;
it carries only what the next mile needs. A large model is the same: it does not have to fit,
it has to be placed. Dense weights stay near, experts wait on the disk until they are called.
Once upon a time, a small bird lived at the edge of a great forest. Every morning it flew from
flower to flower, and every evening it returned to its nest in the old oak tree. The forest was
full of sounds: the river, the wind in the leaves, the calls of other birds. The small bird knew
which flowers opened first and which held the most nectar, and it remembered the paths that
were quick. When winter came, it travelled south over mountains and water, resting where it
could, and in spring it came home again. People who watched it wondered how something so light
could go so far. The answer was simple: it never carried more than it needed, and it always
knew where to find the rest. Engineers learned from the bird. They built machines that keep
what is used often close at hand and fetch the rest when it is asked for. They measured what
was hot and what was cold, and they moved things between fast memory and slow memory, never
changing the answer, only the time it took to find it.
"""

SPECIAL_TOKENS = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|endoftext|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass(frozen=True)
class DemoSpec:
    hidden_size: int = 1024
    num_hidden_layers: int = 8
    num_attention_heads: int = 16
    num_experts: int = 64
    num_experts_per_tok: int = 8
    intermediate_size: int = 384
    tokenizer_vocab: int = 1024
    max_position_embeddings: int = 4096
    shard_bytes: int = 256 << 20
    router_std: float = 0.08  # wide enough that tokens spread over the experts
    seed: int = 0
    cached_experts_per_layer: int = 16  # the default budget's cache: a quarter of 64

    @property
    def vocab_size(self) -> int:
        return -(-self.tokenizer_vocab // 64) * 64

    @property
    def expert_numel(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def dense_numel(self) -> int:
        h, e = self.hidden_size, self.num_experts
        per_layer = 4 * h * h + 4 * h + e * h
        return 2 * self.vocab_size * h + self.num_hidden_layers * per_layer + h

    @property
    def disk_bytes(self) -> int:
        """Weight bytes on disk (bf16)."""
        return 2 * (self.dense_numel + self.num_hidden_layers * self.num_experts * self.expert_numel)

    def default_budget(self, model_dir, backend=None) -> int:
        """Dense weights plus a quarter of the experts, as the backend will hold them
        (``backend``: an object or a name; default the CPU)."""
        return quarter_budget(model_dir, backend, self.cached_experts_per_layer)

    def digest(self) -> str:
        blob = json.dumps({"format": FORMAT_VERSION, **asdict(self)}, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


DEFAULT_SPEC = DemoSpec()

# the trained demo model continues code best: a function it has seen the like of
TRAINED_PROMPT = 'import os\n\n\ndef read_config(path):\n    """'


def quarter_budget(model_dir, backend=None, cached_per_layer: int = 16) -> int:
    """Dense weights plus ``cached_per_layer`` experts of each MoE layer (plus one layer's
    top-k being read at once), as ``backend`` (an object or a name; default the CPU)
    will hold them."""
    from colibri_core.model.blueprint import inspect_model

    bp = inspect_model(model_dir, backend)
    try:
        return bp.dense_bytes + (cached_per_layer * len(bp.moe) + bp.top_k) * bp.expert_ram_bytes
    finally:
        bp.close()


def trained_demo_path() -> Path:
    """The trained OLMoE-geometry model colibri-trained installs; a UsageError saying how
    to get it when it is not installed."""
    from colibri_core.errors import UsageError

    try:
        import colibri_trained
    except ImportError:
        raise UsageError("the demo's trained model comes with colibri-trained: pip install colibri-trained (from a "
                         "clone: pip install ./models/colibri-trained), or run colibri demo --size full for the "
                         "synthetic full-size model") from None
    try:
        return colibri_trained.path("olmoe")
    except LookupError as exc:
        raise UsageError(f"colibri-trained: {exc}") from None


def default_demo_dir() -> Path:
    import platformdirs

    return Path(platformdirs.user_cache_dir("colibri")) / "demo-olmoe"


def is_complete(path: Path, spec: DemoSpec) -> bool:
    from colibri_core.errors import ColibriError
    from colibri_core.io import smallfile

    try:
        marker = smallfile.read_json(path / MARKER, smallfile.CONFIG_BYTES, "demo marker")
    except ColibriError:  # missing or damaged: rebuilt
        return False
    return isinstance(marker, dict) and marker.get("digest") == spec.digest()


def check_family() -> None:
    """Refuse, before a byte is written, when no installed family runs the demo's
    model_type: building it takes a gigabyte and half a minute that would be wasted."""
    from colibri_core.plugins.discovery import get_registry

    get_registry().family_for(DEMO_MODEL_TYPE, [DEMO_ARCHITECTURE])


def ensure_demo_model(path: str | Path, spec: DemoSpec = DEFAULT_SPEC, *, rebuild: bool = False, console=None,
                      quiet: bool = False) -> Path:
    """Return the demo model directory, building it first if it is missing or stale."""
    path = Path(path)
    check_family()
    if not rebuild and is_complete(path, spec):
        return path
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    path.parent.mkdir(parents=True, exist_ok=True)
    # a half-built directory from an interrupted run is discarded, never used
    for stale in path.parent.glob(f".{path.name}.partial-*"):
        shutil.rmtree(stale, ignore_errors=True)
    partial = path.parent / f".{path.name}.partial-{os.getpid()}"
    if console is not None and not quiet:
        console.print(f"Building the demo model once ({spec.disk_bytes / 1e9:.2f} GB, random weights) in {path}")
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True), TimeRemainingColumn(),
                      console=console, disable=quiet or console is None, transient=False) as bar:
            task = bar.add_task("writing shards", total=spec.disk_bytes)
            build_demo_model(partial, spec, progress=lambda n: bar.advance(task, n))
        if path.exists():
            shutil.rmtree(path)
        os.replace(partial, path)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return path


def build_tokenizer(spec: DemoSpec):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=spec.tokenizer_vocab, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    return tok


def _tensor_plan(spec: DemoSpec):
    """(name, shape, std) of every tensor, in the order they are written."""
    h, i, e = spec.hidden_size, spec.intermediate_size, spec.num_experts
    yield "model.embed_tokens.weight", (spec.vocab_size, h), 0.5
    for layer in range(spec.num_hidden_layers):
        p = f"model.layers.{layer}"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            yield f"{p}.self_attn.{proj}.weight", (h, h), 1 / np.sqrt(h)
        yield f"{p}.self_attn.q_norm.weight", (h,), None
        yield f"{p}.self_attn.k_norm.weight", (h,), None
        yield f"{p}.input_layernorm.weight", (h,), None
        yield f"{p}.post_attention_layernorm.weight", (h,), None
        yield f"{p}.mlp.gate.weight", (e, h), spec.router_std
        for x in range(e):
            yield f"{p}.mlp.experts.{x}.gate_proj.weight", (i, h), 1 / np.sqrt(h)
            yield f"{p}.mlp.experts.{x}.up_proj.weight", (i, h), 1 / np.sqrt(h)
            yield f"{p}.mlp.experts.{x}.down_proj.weight", (h, i), 1 / np.sqrt(i)
    yield "model.norm.weight", (h,), None
    yield "lm_head.weight", (spec.vocab_size, h), 1 / np.sqrt(h)


def build_demo_model(out: Path, spec: DemoSpec = DEFAULT_SPEC, progress=None) -> None:
    """Write the demo model into ``out`` (a new directory), shard by shard: memory
    stays bounded by one shard."""
    out.mkdir(parents=True, exist_ok=False)
    tok = build_tokenizer(spec)
    tok.save(str(out / "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|endoftext|>", "bos_token": None, "chat_template": CHAT_TEMPLATE,
        "model_max_length": spec.max_position_embeddings}, indent=2))
    config = {
        "architectures": [DEMO_ARCHITECTURE], "model_type": DEMO_MODEL_TYPE, "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size, "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers, "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_attention_heads, "num_experts": spec.num_experts,
        "num_experts_per_tok": spec.num_experts_per_tok, "norm_topk_prob": False,
        "max_position_embeddings": spec.max_position_embeddings, "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "hidden_act": "silu",
        "tie_word_embeddings": False, "eos_token_id": eos, "pad_token_id": eos, "torch_dtype": "bfloat16",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}, indent=2))

    rng = np.random.default_rng(spec.seed)
    weight_map: dict[str, str] = {}
    shard_bytes = 0
    total = 0

    def flush(index: int, tensors) -> None:
        name = f"model-{index + 1:05d}.safetensors"
        # a shard is held in memory anyway: the safetensors library's own serializer writes it
        save_file(out / name, dict(tensors), metadata={"format": "pt", "colibri.demo": spec.digest()})
        for tensor_name, _ in tensors:
            weight_map[tensor_name] = name

    pending: list[tuple[str, tuple[str, np.ndarray]]] = []
    index = 0
    for name, shape, std in _tensor_plan(spec):
        if std is None:
            values = np.ones(shape, dtype=np.float32)
        else:
            values = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
        data = f32_to_bf16(values)
        if pending and shard_bytes + data.nbytes > spec.shard_bytes:
            flush(index, pending)
            index += 1
            pending, shard_bytes = [], 0
        pending.append((name, ("BF16", data)))
        shard_bytes += data.nbytes
        total += data.nbytes
        if progress:
            progress(data.nbytes)
    flush(index, pending)
    n_shards = index + 1
    # shards were named before the count was known: rename to the HF "-of-" convention
    renamed = {}
    for i in range(n_shards):
        old = f"model-{i + 1:05d}.safetensors"
        new = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        os.replace(out / old, out / new)
        renamed[old] = new
    index_json = {"metadata": {"total_size": total}, "weight_map": {k: renamed[v] for k, v in weight_map.items()}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2))
    (out / MARKER).write_text(json.dumps({"digest": spec.digest(), "spec": asdict(spec)}, indent=2))
