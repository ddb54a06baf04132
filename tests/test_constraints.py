"""Constrained decoding (colibri_core.engine.constraints) on the batched engine: regular
expressions, Lark and GBNF grammars and JSON Schemas shape what the trained OLMoE-geometry
model writes; the grammar's end stops the sequence; a bad constraint is one line naming it;
a constrained and an unconstrained request share a batch without touching each other."""

import json
import re

import jsonschema
import pytest

import colibri_core
from colibri_core.engine.constraints import ConstraintSpec, for_model
from colibri_core.engine.scheduler import Request, Scheduler
from colibri_core.engine.sampling import SamplingParams
from colibri_core.errors import UsageError
from colibri_core.testing.cli import run_colibri

colibri_trained = pytest.importorskip("colibri_trained", reason="colibri-trained is not installed")


@pytest.fixture(scope="module")
def model():
    with colibri_core.load(colibri_trained.path("olmoe"), history=False) as m:
        yield m


def run(model, requests):
    sched = Scheduler(model, slots=len(requests))
    handles = [sched.submit(r) for r in requests]
    while sched.step():
        pass
    return handles


def request(model, prompt, constraint=None, seed=0, max_tokens=48):
    return Request(model.encode(prompt), max_tokens, SamplingParams(temperature=1.0, seed=seed),
                   stop_ids=frozenset(model.eos_ids), constraint=constraint)


@pytest.mark.parametrize("spec, check", [
    (ConstraintSpec.regex(r"[0-9]{3}-[a-z]{2,4}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
    (ConstraintSpec.grammar('start: "def " NAME "(" NAME ")"\nNAME: /[a-z_]{1,8}/', "lark"),
     lambda t: re.fullmatch(r"def [a-z_]{1,8}\([a-z_]{1,8}\)", t)),
    (ConstraintSpec.grammar('root ::= ("yes" | "no") " " [0-9]', "gbnf"), lambda t: re.fullmatch(r"(yes|no) [0-9]", t)),
])
def test_grammars_shape_the_output_and_their_end_stops_it(model, spec, check):
    compiled = for_model(model, spec)
    for seed in range(4):
        (h,) = run(model, [request(model, "import os\n\n\ndef main():\n    ", compiled, seed)])
        text = model.tokenizer.decode(h.token_ids)
        assert h.finish_reason == "stop" and check(text), (text, h.finish_reason)


def test_a_json_schema_is_followed_beside_an_unconstrained_request(model):
    schema = {"type": "object", "properties": {"path": {"type": "string", "maxLength": 20},
                                               "lines": {"type": "integer", "minimum": 1},
                                               "kind": {"enum": ["module", "script"]}},
              "required": ["path", "lines", "kind"], "additionalProperties": False}
    compiled = for_model(model, ConstraintSpec.json_schema(schema))
    free_alone = run(model, [request(model, "def read(path):\n", None, seed=5)])[0].token_ids
    constrained, free = run(model, [request(model, "def read(path):\n", compiled, seed=1, max_tokens=80),
                                    request(model, "def read(path):\n", None, seed=5)])
    assert constrained.finish_reason == "stop"
    jsonschema.validate(json.loads(model.tokenizer.decode(constrained.token_ids)), schema)
    assert free.token_ids == free_alone  # the batch neighbour is untouched


@pytest.mark.parametrize("spec, message", [
    (ConstraintSpec.regex("[0-9"), r"^regex: .*unclosed"),
    (ConstraintSpec.json_schema("{nope"), r"^JSON schema: not JSON \(Expecting property name"),
    (ConstraintSpec.json_schema({"type": "objekt"}), r"^JSON schema: Invalid type: objekt$"),
    (ConstraintSpec.json_schema([1, 2]), r"^JSON schema: a JSON Schema is an object, not list$"),
    (ConstraintSpec.grammar("start: foo", "lark"), r"^grammar: .*unknown name"),
    (ConstraintSpec("yaml", "x"), r"^constraint kind 'yaml': choose one of json_object, json_schema, regex, lark, gbnf$"),
])
def test_a_bad_constraint_is_one_line_naming_it(model, spec, message):
    with pytest.raises(UsageError, match=message) as exc:
        for_model(model, spec)
    assert "\n" not in str(exc.value)


def test_colibri_run_takes_a_grammar_file_and_refuses_bad_flags_before_loading(tmp_path):
    model_dir = str(colibri_trained.path("olmoe"))
    grammar = tmp_path / "answer.gbnf"
    grammar.write_text('root ::= "answer: " ("yes" | "no")\n')
    out = run_colibri("run", "--model", model_dir, "--grammar", str(grammar), "--json", "--temperature", "1", "--seed", "2",
                      "def f():")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["text"] in ("answer: yes", "answer: no") and result["finish_reason"] == "stop"
    out = run_colibri("run", "--model", model_dir, "--regex", "[0-9]{2}-[a-z]{3}", "--json", "--temperature", "1",
                      "--seed", "4", "def f():")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert re.fullmatch("[0-9]{2}-[a-z]{3}", result["text"]) and result["finish_reason"] == "stop", result
    schema = tmp_path / "bad.json"
    schema.write_text("{nope")
    for args, message in ((("--json-schema", str(schema)), f"error: --json-schema {schema}: not JSON"),
                          (("--json-schema", str(tmp_path / "missing.json")), "missing.json: --json-schema file not found"),
                          (("--grammar", str(schema)), "name a .lark or .gbnf file"),
                          (("--regex", "(", ), "error: --regex: ")):
        bad = run_colibri("run", "--model", model_dir, *args, "hello")
        assert bad.returncode == 2 and message in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, bad.stderr


def test_tokens_a_schema_forces_are_drafted_and_change_nothing(model):
    """With drafting on, what the grammar allows alone (the keys of a schema's required
    properties, its punctuation) is drafted and verified in one forward pass: the same
    tokens as without drafts, greedy and seeded, in fewer forward passes."""
    schema = {"type": "object", "properties": {"filename": {"type": "string", "maxLength": 12},
                                               "line_count": {"type": "integer", "minimum": 0, "maximum": 999},
                                               "is_executable": {"type": "boolean"}},
              "required": ["filename", "line_count", "is_executable"], "additionalProperties": False}
    compiled = for_model(model, ConstraintSpec.json_schema(schema))
    prompt = model.encode("import os\n")
    for sampling in ({}, {"temperature": 0.9, "seed": 11}):
        plain = model.generate(token_ids=prompt, max_tokens=60, constraint=compiled, **sampling)
        drafted = model.generate(token_ids=prompt, max_tokens=60, constraint=compiled, draft="ngram", draft_depth=8,
                                 **sampling)
        assert drafted.token_ids == plain.token_ids and plain.finish_reason == drafted.finish_reason == "stop"
        s = drafted.stats
        assert s.draft_forced_tokens >= 6 and s.accepted_tokens >= 6, s
        assert s.tokens_per_forward > 1.2
        jsonschema.validate(json.loads(drafted.text), schema)
    with pytest.raises(UsageError, match="ConstraintSpec"):
        model.generate("x", constraint="[0-9]+")


GREEDY_GRAMMARS = [
    ConstraintSpec.regex(r'\{"n": [0-9]{1,3}, "s": "[a-z ]{0,12}"\}'),
    ConstraintSpec.json_schema({"type": "object", "properties": {
        "path": {"type": "string", "maxLength": 16}, "lines": {"type": "integer", "minimum": 1},
        "kind": {"enum": ["module", "script", "package"]}, "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["path", "lines", "kind"], "additionalProperties": False}),
    ConstraintSpec.grammar('start: "def " NAME "(" NAME ("," " " NAME)* "):"\nNAME: /[a-z_]{1,8}/', "lark"),
]


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("spec", GREEDY_GRAMMARS, ids=["regex", "json-schema", "lark"])
def test_greedy_under_a_grammar_takes_the_masked_argmax_without_the_mask(model, spec, ties):
    """Plain greedy decoding tries the likeliest tokens one by one before computing the
    whole mask (Constraint.choose): at every step it must take exactly the masked
    logits' argmax, lowest id first among ties, where the argmax is forbidden and where
    the seven likeliest are, and where the grammar forces text (the mask then allows only
    its canonical tokenization); and it must compute the mask only where it has to."""
    import numpy as np

    from colibri_core.engine.sampling import Sampler

    compiled = for_model(model, spec)
    lazy, masked = compiled.new(), compiled.new()
    greedy = Sampler(SamplingParams())
    rng = np.random.default_rng(7)
    vocab = model.lm.vocab_size
    lazy_masks = 0
    steps = 150
    for step in range(steps):
        if masked.finished:
            lazy, masked = compiled.new(), compiled.new()
        logits = rng.standard_normal(vocab).astype(np.float32)
        if ties:  # rounded: the likeliest few share values
            logits = np.round(logits * 2) / 2
        allowed = np.flatnonzero(masked.allowed())
        forbidden = np.setdiff1d(np.arange(vocab), allowed)
        top = logits.max()
        if step % 3 == 0 and len(allowed) >= 2:  # the argmax forbidden, allowed tokens tie next: the lowest id
            logits[forbidden[0]] = top + 2
            logits[allowed[-2:]] = top + 1
            logits[allowed[len(allowed) // 2]] = top + 1
        elif step % 3 == 1:  # seven forbidden tokens lead, every allowed one ties below them: the mask decides
            logits[forbidden[:7]] = top + 1 + np.arange(7)
            logits[allowed] = top
        want = int(np.argmax(masked.mask(logits)))
        masked.advance(want)
        calls = []
        real_mask = lazy.mask
        lazy.mask = lambda row: calls.append(1) or real_mask(row)
        got, logprob = lazy.choose(greedy, logits)
        del lazy.mask
        assert (got, logprob) == (want, None), (step, model.tokenizer.decode([got]), model.tokenizer.decode([want]))
        lazy_masks += len(calls)
    assert steps // 3 <= lazy_masks < steps, lazy_masks
