"""Structured output on a randomly initialised model: whatever it samples, every output is strict
JSON valid for its schema (or of its structural tag's shape), and it ends by itself, well within
max_tokens. What OpenAI's fields ask for, tool calls included, is tests/protocol's."""

import json
import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import replace

import jsonschema
import pytest
import torch
import xgrammar as xgr

from pagedbatch.engine import LLM, SamplingParams
from pagedbatch.engine.config import EngineArgs
from pagedbatch.engine.llm_engine import LLMEngine
from pagedbatch.engine.sample.grammar_runtime import GrammarRuntime, GrammarTooCostly, too_costly
from pagedbatch.engine.sample.structured_output import (
    MAX_GRAMMAR_CHARS,
    OutputLimits,
    StructuredOutput,
)
from pagedbatch.protocol.structured_output import costly_output_format

Matcher = Callable[[StructuredOutput], xgr.GrammarMatcher]

N = 200  # outputs per schema
MAX_TOKENS = 1024
# Tight bounds keep these tests quick; they work the same at any size, and one test below runs
# the defaults.
LIMITS = OutputLimits(max_string_length=16, max_items=4, max_number=10**6)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
        "manager": {"type": ["string", "null"], "maxLength": 30},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city"],
        },
    },
    "required": ["name", "age", "role", "address"],
}
ORDER = {
    "type": "object",
    "properties": {
        "lines": {
            "type": "array",
            "minItems": 1,
            "maxItems": 4,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "maxLength": 12},
                    "qty": {"type": "integer", "minimum": 1},
                    "price": {"type": "number", "exclusiveMinimum": 0},
                    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}},
                },
                "required": ["sku", "qty", "price"],
            },
        },
        "total": {"type": "number"},
        "note": {"type": "null"},
    },
    "required": ["lines", "total"],
}
# What the openai SDK's `parse` helper sends: strict, $defs, nullable by anyOf.
STEPS = {
    "type": "object",
    "properties": {
        "steps": {"type": "array", "items": {"$ref": "#/$defs/step"}},
        "final_answer": {"type": "string"},
    },
    "required": ["steps", "final_answer"],
    "additionalProperties": False,
    "$defs": {
        "step": {
            "type": "object",
            "properties": {
                "explanation": {"type": "string"},
                "output": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            },
            "required": ["explanation", "output"],
            "additionalProperties": False,
        }
    },
}
# Parts left free: any object, any value, and an array of mixed alternatives at the root.
FREE = {
    "type": "object",
    "properties": {"id": {"type": "integer"}, "meta": {"type": "object"}, "extra": {}},
    "required": ["id", "meta", "extra"],
}
MIXED = {
    "type": "array",
    "minItems": 2,
    "items": {"anyOf": [{"const": "x"}, {"type": "boolean"}, {"type": "integer", "maximum": -7}]},
}
SCHEMAS = {"person": PERSON, "order": ORDER, "steps": STEPS, "free": FREE, "mixed": MIXED}


@pytest.fixture(scope="module")
def llm(tiny_llama):
    # Few KV blocks: some requests are preempted and recomputed mid-grammar.
    return LLM(tiny_llama, max_num_seqs=256, num_kv_blocks=1200)


@pytest.fixture(scope="module")
def matcher(llm) -> Matcher:
    """A fresh matcher for a constraint, compiled by the engine's runtime against its tokenizer."""
    return lambda structured: xgr.GrammarMatcher(llm.engine.grammars.compile(structured).result())


def sample(llm, prompt, structured, n=N, max_tokens=MAX_TOKENS, **params):
    """n outputs at temperature 1, one seed each, in one batch."""
    return llm.generate(
        [prompt] * n,
        [
            SamplingParams(max_tokens=max_tokens, seed=seed, structured=structured, **params)
            for seed in range(n)
        ],
    )


def chat_prompt(llm):
    messages = [{"role": "user", "content": "What is the weather in Paris? Answer in JSON."}]
    return llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def assert_finished_well_within(output, max_tokens=MAX_TOKENS):
    assert output.finish_reason == "stop", output.text
    assert len(output.token_ids) < max_tokens // 2


def test_schema_outputs_are_strict_json_that_validates_and_ends(llm):
    prompt = chat_prompt(llm)
    specs = [
        StructuredOutput.json_schema(schema, strict=name == "steps", limits=LIMITS)
        for name, schema in SCHEMAS.items()
    ]
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, seed=seed, structured=spec)
        for spec in specs
        for seed in range(N)
    ]
    outputs = llm.generate([prompt] * len(params), params)
    for i, schema in enumerate(SCHEMAS.values()):
        validator = jsonschema.Draft202012Validator(schema)
        for output in outputs[i * N : (i + 1) * N]:
            assert_finished_well_within(output)
            validator.validate(json.loads(output.text))  # strict: no raw control characters
    assert llm.get_stats()["preemptions"] > 0


def test_json_object_outputs_are_objects(llm):
    for output in sample(llm, chat_prompt(llm), StructuredOutput.json_object(LIMITS)):
        assert_finished_well_within(output)
        assert isinstance(json.loads(output.text), dict)


def test_default_limits_end_well_within_max_tokens_too(llm):
    prompt, max_tokens = chat_prompt(llm), 1800  # the most the tiny model's context leaves
    for structured, schema in (
        (StructuredOutput.json_object(), {"type": "object"}),
        (StructuredOutput.json_schema(FREE), FREE),
    ):
        for output in sample(llm, prompt, structured, n=32, max_tokens=max_tokens):
            assert_finished_well_within(output, max_tokens)
            jsonschema.validate(json.loads(output.text), schema)


def test_greedy_constrained_output_is_deterministic_and_batch_independent(llm):
    prompt = chat_prompt(llm)
    structured = StructuredOutput.json_schema(PERSON)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured=structured)
    (alone,) = llm.generate([prompt], greedy)
    batch = llm.generate(
        [prompt] * 8, [greedy] + [SamplingParams(max_tokens=64, seed=s) for s in range(7)]
    )
    assert batch[0].token_ids == alone.token_ids
    assert_finished_well_within(alone)
    jsonschema.validate(json.loads(alone.text), PERSON)


def test_a_finished_grammar_stops_the_request_without_sampling_eos(llm):
    structured = StructuredOutput.json_schema({"enum": ["yes", "no"]})
    for ignore_eos in (False, True):
        for output in sample(llm, "Well?", structured, n=20, ignore_eos=ignore_eos):
            assert output.text in ('"yes"', '"no"')
            assert output.finish_reason == "stop"
            assert output.token_ids[-1] not in llm.engine.eos_token_ids


def test_each_of_n_completions_follows_its_own_grammar(llm):
    structured = StructuredOutput.json_schema(ORDER)
    (output,) = llm.generate(
        "Order:", SamplingParams(n=6, max_tokens=MAX_TOKENS, seed=1, structured=structured)
    )
    for completion in output.outputs:
        assert completion.finish_reason == "stop"
        jsonschema.validate(json.loads(completion.text), ORDER)
    assert len({c.text for c in output.outputs}) == 6


def test_strings_refuse_raw_control_characters(matcher):
    for schema in ({"type": "string", "maxLength": 5}, {"type": "string"}):
        structured = StructuredOutput.json_schema(schema)
        assert matcher(structured).accept_string('"ab"')
        for raw in ("\x01", "\t", "\n", "\x1f"):
            assert not matcher(structured).accept_string(f'"a{raw}')


def test_special_tokens_never_appear_inside_json(llm, matcher):
    in_string = matcher(StructuredOutput.json_schema({"type": "string", "maxLength": 40}))
    assert in_string.accept_string('"a')
    vocab = llm.engine.model_config.vocab_size
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    in_string.fill_next_token_bitmask(bitmask)
    logits = torch.zeros(1, vocab)
    xgr.apply_token_bitmask_inplace(logits, bitmask)
    assert logits.isfinite().sum() > 1000  # most of the vocabulary can go in a string...
    for token in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):  # ...but none of these
        assert logits[0, llm.tokenizer.convert_tokens_to_ids(token)] == float("-inf")


@pytest.mark.parametrize(
    ("schema", "strict", "message"),
    [
        ({"type": "strng"}, False, "unknown type 'strng'"),
        ({"type": "string", "minLength": 5, "maxLength": 2}, False, "minLength 5 exceeds"),
        ({"$ref": "#/$defs/missing"}, False, "points nowhere"),
        ({"$ref": "https://example.com/s.json"}, False, "only local $refs"),
        ({"type": "array", "items": 3}, False, "#/items: a schema is an object or a boolean"),
        ({"enum": []}, False, "enum must be a non-empty array"),
        ({"type": "string", "pattern": "(unclosed"}, False, "Regex"),
        (
            {"type": "object", "properties": {"a": {}}, "required": ["b"]},
            False,
            "required property 'b' is not in properties",
        ),
        ({"type": "array", "uniqueItems": True}, True, "'uniqueItems' at #"),
        ({"properties": {"a": {"not": {"type": "null"}}}}, True, "'not' at #/properties/a"),
        ({"oneOf": [{"type": "string"}, {"type": "null"}]}, True, "'oneOf'"),
        ({"type": "number", "multipleOf": 0.5}, True, "'multipleOf'"),
        (False, False, "no output can match"),
    ],
)
def test_bad_schemas_are_refused_naming_the_problem(schema, strict, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        StructuredOutput.json_schema(schema, strict=strict)


def test_a_schema_too_large_to_compile_quickly_is_refused_before_compiling():
    def wide(n: int) -> dict:
        return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}

    assert len(StructuredOutput.json_schema(wide(300)).grammar) <= MAX_GRAMMAR_CHARS
    with pytest.raises(ValueError, match="too large to enforce"):
        StructuredOutput.json_schema(wide(2000))


def test_keywords_the_grammar_cannot_enforce_are_dropped_unless_strict(matcher):
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "contains": {}}
    with pytest.raises(ValueError, match="unsupported JSON schema keyword 'contains'"):
        StructuredOutput.json_schema(schema, strict=True)
    assert matcher(StructuredOutput.json_schema(schema)).accept_string("[1, 1]")  # best effort


def test_a_structural_tag_shapes_the_output_around_its_contents(llm, matcher):
    number = StructuredOutput.json_schema({"type": "integer", "minimum": 0, "maximum": 99})
    tag = {
        "type": "tag",
        "begin": "<n>",
        "content": {"type": "grammar", "grammar": number.grammar},
        "end": "</n>",
    }
    tagged = StructuredOutput.structural_tag(tag)
    for output in sample(llm, "Pick a number.", tagged, n=20):
        assert_finished_well_within(output)
        assert re.fullmatch(r"<n>(0|[1-9][0-9]?)</n>", output.text), output.text
    # Free text until the trigger, then the tag in full.
    triggered = StructuredOutput.structural_tag(
        {"type": "triggered_tags", "triggers": ["<n>"], "tags": [tag]}
    )
    assert matcher(triggered).accept_string("Some text <n>42</n> and more <n>7</n>.")
    assert not matcher(triggered).accept_string("Some text <n>100")
    with pytest.raises(ValueError, match=r"invalid structural tag: .*min must be <= max"):
        StructuredOutput.structural_tag({"type": "repeat", "min": 2, "max": 1, "content": tag})


def test_min_tokens_cannot_be_combined_with_a_grammar():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=3, structured=StructuredOutput.json_object())


def test_limits_bound_strings_arrays_and_numbers(matcher):
    limits = OutputLimits(max_string_length=3, max_items=2, max_number=9)
    schema = {"type": "array", "items": {"anyOf": [{"type": "string"}, {"type": "integer"}]}}
    structured = StructuredOutput.json_schema(schema, limits=limits)
    assert matcher(structured).accept_string('["abc", -9]')
    for too_much in ('["abcd"', '["a", "b", "c"', "[10", '["a\\"'):
        assert not matcher(structured).accept_string(too_much), too_much
    unbounded = StructuredOutput.json_schema(schema, limits=OutputLimits(max_string_length=None))
    assert matcher(unbounded).accept_string('["' + "a\\n" * 300 + '"]')
    with pytest.raises(ValueError, match="max_items"):
        OutputLimits(max_items=0)


def test_grammars_compile_once_and_the_engine_steps_on_meanwhile(tiny_llama, monkeypatch):
    engine = LLMEngine(EngineArgs(model=str(tiny_llama)))
    release = threading.Event()
    compiles = []
    original = GrammarRuntime._compile

    def slow_compile(self, grammar):
        compiles.append(grammar)
        release.wait(timeout=30)
        return original(self, grammar)

    monkeypatch.setattr(GrammarRuntime, "_compile", slow_compile)
    structured = StructuredOutput.json_schema(ORDER)
    params = SamplingParams(max_tokens=MAX_TOKENS, seed=0, structured=structured)
    engine.add_request("json-1", "Order:", params)
    engine.add_request("json-2", "Order:", params)
    engine.add_request("aborted", "Order:", params)
    engine.add_request("text", "Hello", SamplingParams(max_tokens=5, seed=0))
    engine.abort_request("aborted")
    done = {}
    for _ in range(5):
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert set(done) == {"text", "aborted"}  # the plain request ran; the others wait
    assert engine.get_stats()["waiting"] == engine.get_stats()["running"] == 0
    release.set()
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert len(compiles) == 1
    for request_id in ("json-1", "json-2"):
        jsonschema.validate(json.loads(done[request_id].text), ORDER)
    assert not engine.grammars._matchers  # released with their requests


def test_the_compiled_grammar_cache_drops_the_least_recently_used(llm):
    runtime = GrammarRuntime(llm.tokenizer, llm.engine.model_config.vocab_size, [0], cache_size=2)
    a, b, c = (StructuredOutput.json_schema({"const": i}) for i in range(3))
    first = runtime.compile(a)
    runtime.compile(b)
    assert runtime.compile(a) is first  # a is now the most recent
    runtime.compile(c)  # drops b
    assert runtime.compile(a) is first
    assert runtime.compile(b).result() is not None
    assert len(runtime._compiled) == 2


def enum_schema(seed: int, values: int = 1200, chars: int = 300) -> StructuredOutput:
    """An enum of long strings: a grammar well inside MAX_GRAMMAR_CHARS that takes seconds to
    compile (3,000 values of 300 characters took 20 s; these about 3 s on a 2-core machine)."""
    rng = random.Random(seed)
    letters = "abcdefghij klmnop"
    strings = ["".join(rng.choice(letters) for _ in range(chars)) for _ in range(values)]
    structured = StructuredOutput.json_schema({"enum": strings})
    assert len(structured.grammar) < MAX_GRAMMAR_CHARS
    return structured


def lanes_idle(runtime: GrammarRuntime, timeout: float = 120) -> bool:
    """Whether every lane's thread ended (xgrammar finishes what the budget abandoned)."""
    deadline = time.monotonic() + timeout
    while runtime._lanes and time.monotonic() < deadline:
        time.sleep(0.05)
    return not runtime._lanes


def test_a_compile_past_its_budget_fails_and_holds_up_no_other_tenants_compile(llm):
    """Tenant A's two costly schemas each fail once past the budget; tenant B's JSON mode,
    asked for while A's first compiles, waits on neither (one compile thread took B 39 s)."""
    budget = 0.5
    vocab = llm.engine.model_config.vocab_size
    runtime = GrammarRuntime(llm.tokenizer, vocab, [0], compile_seconds=budget)
    runtime.compile(StructuredOutput.json_object(), "warm").result()  # the compiler, built once
    costly = [enum_schema(1), enum_schema(2)]
    started = time.monotonic()
    first, second = (runtime.compile(structured, "tenant-a") for structured in costly)
    asked = time.monotonic()
    json_mode = runtime.compile(StructuredOutput.json_object(), "tenant-b")
    assert json_mode.result(timeout=60) is not None
    waited = time.monotonic() - asked
    with pytest.raises(GrammarTooCostly, match="took more than 0.5 s to compile"):
        first.result(timeout=60)
    failed_after = time.monotonic() - started
    # Generous margins on a shared machine: B's compile takes about 0.1 s alone, and A's
    # compiles take seconds each.
    assert waited < 5
    assert budget <= failed_after < budget + 5
    with pytest.raises(GrammarTooCostly):
        second.result(timeout=120)  # after the first's compile ended, on A's lane
    # Refused again at once, from the cache, without compiling again.
    compiles = runtime.compiles
    again = runtime.compile(costly[0], "tenant-a")
    assert again.done() and isinstance(again.exception(), GrammarTooCostly)
    assert runtime.compiles == compiles
    assert lanes_idle(runtime)


def test_a_repeated_schema_compiles_once_per_cache_salt(llm):
    """Cached per salt (the tenant): a repeat is a cache hit; another tenant's same schema is
    compiled for it, so no tenant learns from a quick answer what another sent."""
    runtime = GrammarRuntime(llm.tokenizer, llm.engine.model_config.vocab_size, [0])
    structured = StructuredOutput.json_schema(PERSON)
    mine = runtime.compile(structured, "tenant-a")
    assert runtime.compile(structured, "tenant-a") is mine
    assert (runtime.compiles, runtime.cache_hits) == (1, 1)
    theirs = runtime.compile(structured, "tenant-b")
    assert theirs is not mine and theirs.result() is not None
    assert (runtime.compiles, runtime.cache_hits) == (2, 1)


def test_a_request_whose_grammar_is_too_costly_fails_alone_as_the_clients_error(tiny_llama):
    """Through the engine: the costly request ends with an error that the protocol answers
    with a 400 naming response_format; another tenant's constrained request runs meanwhile."""
    engine = LLMEngine(EngineArgs(model=str(tiny_llama), grammar_compile_seconds=0.5))
    costly = SamplingParams(max_tokens=8, structured=enum_schema(3))
    json_mode = SamplingParams(max_tokens=64, structured=StructuredOutput.json_object())
    engine.add_request("costly", "Pick:", costly, cache_salt="tenant-a")
    engine.add_request("json", "Answer:", json_mode, cache_salt="tenant-b")
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert too_costly(done["costly"].error)
    error = costly_output_format(done["costly"].error)
    assert error is not None and error.status_code == 400
    assert (error.body()["error"]["param"], error.body()["error"]["code"]) == (
        "response_format",
        "response_format_too_costly",
    )
    assert isinstance(json.loads(done["json"].outputs[0].text), dict)
    assert lanes_idle(engine.grammars)


def test_a_grammar_that_starts_after_a_token_leaves_the_output_free_until_it(llm):
    """`starts_after` (a reasoning model's `</think>`): each output is what it is without the
    grammar up to its first sampling of that token, and obeys the grammar from the next token;
    an output that never samples it is never constrained."""
    prompt, seeds = "Think first:", range(12)
    free = sample(llm, prompt, None, n=len(seeds), max_tokens=24)
    after = free[0].token_ids[3]  # a token one output samples early
    structured = replace(StructuredOutput.json_schema({"enum": ["yes", "no"]}), starts_after=after)
    outputs = sample(llm, prompt, structured, n=len(seeds), max_tokens=24)
    started = 0
    for unconstrained, output in zip(free, outputs, strict=True):
        tokens = unconstrained.token_ids
        if after not in tokens:
            assert output.token_ids == tokens
            continue
        started += 1
        thinking = tokens.index(after) + 1
        assert output.token_ids[:thinking] == tokens[:thinking]
        answer = llm.tokenizer.decode(output.token_ids[thinking:])
        assert answer in ('"yes"', '"no"') and output.finish_reason == "stop"
    assert started >= 1
