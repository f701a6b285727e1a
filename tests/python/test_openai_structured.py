"""Structured output and function calling on the OpenAI endpoints, with the official `openai`
client against the `smollm2` ensemble: `response_format` (json_object, json_schema), vLLM's
`guided_json` / `guided_regex` / `guided_choice`, and `tools` with every `tool_choice`, whole
and streamed. The answers are parsed and validated, not only their status codes: constrained
decoding must make even a 135M-parameter model answer valid JSON."""
import json
import os
import re

import jsonschema
import openai
import pytest
import requests

from conftest import ROOT, Server
from test_generation import link_model

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "languages": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}
WEATHER = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}, {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The current time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 40}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("structured")
    for name in ("smollm2", "smollm2_decoder", "llm_preprocessing", "llm_postprocessing"):
        link_model(str(repo), os.path.join(ROOT, "model_repository", name))
    s = Server(str(repo))
    yield s
    s.stop()


def client(server):
    return openai.OpenAI(base_url=f"http://{server.http}/v1", api_key="none", max_retries=0,
                         timeout=300)


def chat(server, **kwargs):
    params = dict(model="smollm2", messages=[{"role": "user", "content": "Describe a person."}],
                  temperature=0, max_tokens=80)
    params.update(kwargs)
    return client(server).chat.completions.create(**params)


def streamed(server, **kwargs):
    """The streamed answer's content, calls (merged by index as clients merge them) and finish."""
    text, calls, finish = "", {}, None
    for chunk in chat(server, stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        text += delta.content or ""
        for call in delta.tool_calls or []:
            c = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
            c["id"] = c["id"] or call.id
            c["name"] += (call.function.name or "") if call.function else ""
            c["arguments"] += (call.function.arguments or "") if call.function else ""
        finish = chunk.choices[0].finish_reason or finish
    return text, [calls[i] for i in sorted(calls)], finish


def schema_format(schema, name="person"):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def test_a_json_schema_answer_parses_and_validates(server):
    for seed, temperature in [(0, 0), (1, 1.0), (2, 1.0)]:
        r = chat(server, response_format=schema_format(PERSON), temperature=temperature, seed=seed,
                 max_tokens=120)
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def test_without_a_format_the_same_request_answers_free_text(server):
    r = chat(server)
    with pytest.raises(ValueError):
        json.loads(r.choices[0].message.content)


def test_a_json_object_answer_is_an_object(server):
    r = chat(server, messages=[{"role": "user", "content": "List three colors."}],
             response_format={"type": "json_object"}, temperature=0.7, seed=5, max_tokens=120)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_a_streamed_json_answer_is_the_whole_answer(server):
    whole = chat(server, response_format=schema_format(PERSON))
    text, calls, finish = streamed(server, response_format=schema_format(PERSON))
    assert text == whole.choices[0].message.content and calls == [] and finish == "stop"
    jsonschema.validate(json.loads(text), PERSON)


def test_every_choice_follows_the_schema(server):
    r = chat(server, response_format=schema_format(PERSON), n=3, temperature=1.0, seed=9,
             max_tokens=120)
    assert len(r.choices) == 3
    for choice in r.choices:
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_completions_take_a_response_format_too(server):
    r = client(server).completions.create(
        model="smollm2", prompt="A person, as JSON:", max_tokens=120, temperature=0,
        extra_body={"response_format": schema_format(PERSON)})
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)


def test_vllm_guided_fields_constrain_the_answer(server):
    r = chat(server, messages=[{"role": "user", "content": "Is the sky green?"}],
             extra_body={"guided_choice": ["yes", "no", "it depends"]})
    assert r.choices[0].message.content in ("yes", "no", "it depends")
    r = chat(server, messages=[{"role": "user", "content": "Give me a date."}],
             extra_body={"guided_regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"})
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", r.choices[0].message.content)
    r = chat(server, extra_body={"guided_json": json.dumps(PERSON)})
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def arguments_of(call):
    tool = next(t for t in WEATHER if t["function"]["name"] == call["name"])
    arguments = json.loads(call["arguments"])
    jsonschema.validate(arguments, tool["function"]["parameters"])
    return arguments


def test_a_required_call_is_answered_as_tool_calls(server):
    r = chat(server, messages=ASK, tools=WEATHER, tool_choice="required")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        arguments_of({"name": call.function.name, "arguments": call.function.arguments})
    text, calls, finish = streamed(server, messages=ASK, tools=WEATHER, tool_choice="required")
    assert finish == "tool_calls" and text == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        (c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]


def test_a_named_function_is_called_and_its_arguments_stream(server):
    named = {"type": "function", "function": {"name": "get_time"}}
    r = chat(server, messages=ASK, tools=WEATHER, tool_choice=named)
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_time"
    arguments_of({"name": "get_time", "arguments": call.function.arguments})
    text, calls, finish = streamed(server, messages=ASK, tools=WEATHER, tool_choice=named)
    assert text == "" and finish == "stop"
    assert [c["name"] for c in calls] == ["get_time"] and calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["arguments"]) == json.loads(call.function.arguments)


def test_auto_answers_a_call_when_the_model_makes_one(server):
    # The model has seen a call answered and asks again (temperature 0: the same every run).
    conversation = [
        {"role": "user", "content": "What is the weather in Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Rome", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 25 C"},
    ]
    r = chat(server, messages=conversation, tools=WEATHER)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    for call in choice.message.tool_calls:
        arguments_of({"name": call.function.name, "arguments": call.function.arguments})
    text, calls, finish = streamed(server, messages=conversation, tools=WEATHER)
    assert finish == "tool_calls" and text == "" and len(calls) == len(choice.message.tool_calls)


def test_auto_and_none_answer_text_when_no_call_is_made(server):
    for choice in ("auto", "none"):
        r = chat(server, messages=ASK, tools=WEATHER, tool_choice=choice)
        assert r.choices[0].finish_reason in ("stop", "length")
        assert r.choices[0].message.tool_calls is None
        assert r.choices[0].message.content and not r.choices[0].message.content.startswith("<")
        text, calls, _ = streamed(server, messages=ASK, tools=WEATHER, tool_choice=choice)
        assert calls == [] and text == r.choices[0].message.content


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}, None),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a+"}}, "guided_regex"),
    ({"tools": WEATHER, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools"),
    ({"tools": WEATHER, "response_format": {"type": "json_object"}}, "response_format"),
    ({"extra_body": {"guided_json": "[1, 2"}}, "guided_json"),
])
def test_bad_structures_are_refused_naming_the_field(server, fields, param):
    with pytest.raises(openai.BadRequestError) as e:
        chat(server, **fields)
    assert e.value.status_code == 400
    if param:
        assert e.value.body["param"] == param, e.value.body
    # and the server goes on answering
    assert chat(server, max_tokens=4).choices[0].finish_reason == "length"


def test_the_schema_error_names_what_is_wrong(server):
    with pytest.raises(openai.BadRequestError) as e:
        chat(server, response_format=schema_format({"type": "nonsense"}))
    assert "nonsense" in e.value.body["message"]


def test_tensorrt_llm_guided_decoding_inputs_on_generate(server):
    body = {"text_input": "Is the sky blue? Answer:", "max_tokens": 10, "temperature": 0,
            "guided_decoding_guide_type": "regex", "guided_decoding_guide": " (yes|no)"}
    r = requests.post(f"http://{server.http}/v2/models/smollm2/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    assert r.json()["text_output"] in (" yes", " no")
    body["guided_decoding_guide_type"] = "ebnf_grammar"
    r = requests.post(f"http://{server.http}/v2/models/smollm2/generate", json=body, timeout=300)
    assert r.status_code == 400 and "guided_decoding_guide_type" in r.json()["error"]


def test_penalties_user_and_stop_lists_change_the_answer_as_documented(server):
    ask = [{"role": "user", "content": "Write the word cat twenty times."}]
    plain = chat(server, messages=ask, max_tokens=48).choices[0].message.content
    words = lambda text: re.findall(r"[a-z]+", text.lower())  # noqa: E731
    most = lambda text: max(words(text).count(w) for w in set(words(text)))  # noqa: E731
    # A frequency penalty grows with each repeat: fewer repeats. A presence penalty is paid once
    # per token: the answer moves (here to another spelling) but may repeat as much.
    for field, fewer in (("frequency_penalty", True), ("presence_penalty", False)):
        penalised = chat(server, messages=ask, max_tokens=48, **{field: 2.0}).choices[0].message.content
        assert penalised != plain, field
        assert most(penalised) < most(plain) if fewer else most(penalised) <= most(plain), (
            field, plain, penalised)
    # `user` is for the caller's records: the same answer.
    assert chat(server, messages=ask, max_tokens=48, user="user-1234").choices[0].message.content == plain
    # A list of stop strings: the answer ends before the first one that appears.
    first = re.findall(r"[A-Za-z]+", plain)[0]
    r = chat(server, messages=ask, max_tokens=48, stop=["zebra", first])
    assert first not in r.choices[0].message.content and r.choices[0].finish_reason == "stop"
    assert plain.startswith(r.choices[0].message.content)


def open_schemas():
    """Fifty schemas as users write them: strings, integers and numbers with no bounds,
    nested objects, arrays, enums, booleans, optional fields."""
    leaves = [
        {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"},
        {"type": "string", "enum": ["red", "green", "blue"]},
        {"type": "array", "items": {"type": "string"}},
        {"type": "array", "items": {"type": "integer"}},
        {"type": "object", "properties": {"city": {"type": "string"},
                                          "zip": {"type": "integer"}},
         "required": ["city", "zip"]},
        {"type": ["string", "null"]},
        {"type": "number", "minimum": 0, "maximum": 1},
    ]
    names = ["name", "age", "score", "active", "color", "tags", "counts", "address", "note",
             "ratio", "title", "id", "weight", "valid", "mood"]
    schemas = []
    for i in range(50):
        width = 1 + i % 4
        props = {}
        for k in range(width):
            props[names[(i + 3 * k) % len(names)]] = leaves[(i * 7 + k * 3) % len(leaves)]
        required = list(props) if i % 3 else list(props)[:1]
        schemas.append({"type": "object", "properties": props, "required": required})
    return schemas


def shortest(schema):
    """The shortest instance of one of these schemas (required fields only)."""
    if "enum" in schema:
        return schema["enum"][0]
    kind = schema["type"][0] if isinstance(schema["type"], list) else schema["type"]
    if kind == "object":
        return {k: shortest(schema["properties"][k]) for k in schema.get("required", [])}
    return {"array": [], "string": "", "integer": 0, "number": 0, "boolean": False,
            "null": None}[kind]


def test_fifty_open_schemas_with_small_budgets_all_parse_and_validate(server):
    """Issue 46: numbers and strings with no bounds and a small max_tokens used to end cut
    mid-value ({"name": "A person", "age": 1000000000000000...); the grammar bounds them and
    the decoder steers to close the answer as the budget runs out, so every answer parses,
    validates and says finish_reason "stop". Each budget is small: the shortest valid
    answer's length in bytes (a token can be a single byte) and a few tokens more."""
    from concurrent.futures import ThreadPoolExecutor
    schemas = open_schemas()
    budgets = [len(json.dumps(shortest(s))) + 8 for s in schemas]
    asks = ["Describe a person.", "Describe a city.", "Give some data.", "Write a record."]

    def ask(i):
        r = chat(server, response_format=schema_format(schemas[i], name="s%d" % i),
                 messages=[{"role": "user", "content": asks[i % len(asks)]}],
                 max_tokens=budgets[i], temperature=0.8 if i % 2 else 0, seed=i)
        return i, r.choices[0].message.content, r.choices[0].finish_reason

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(len(schemas))))
    broken = []
    for i, content, finish in answers:
        try:
            jsonschema.validate(json.loads(content), schemas[i])
            assert finish == "stop", finish
        except (ValueError, AssertionError, jsonschema.ValidationError) as e:
            broken.append((i, content, finish, str(e)[:100]))
    assert not broken, broken


def test_the_issue_s_schema_closes_within_sixty_four_tokens(server):
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"]}
    for seed in range(3):
        r = chat(server, response_format=schema_format(schema), max_tokens=64,
                 temperature=1.0, seed=seed)
        answer = json.loads(r.choices[0].message.content)
        jsonschema.validate(answer, schema)
        assert abs(answer["age"]) < 10 ** 16, answer
