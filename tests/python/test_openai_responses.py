"""OpenAI's Responses API (`POST /v1/responses`) with the official `openai` client against the
`smollm2` ensemble: a string or message input with instructions, whole and streamed (the
same text, events in order), `max_output_tokens` reported as an incomplete response, JSON
under a schema through `text.format`, and what is not served refused by name."""
import json

import jsonschema
import openai
import pytest

# The smollm2 pipeline's server, as the structured-output tests start it.
from test_openai_structured import server  # noqa: F401

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def client(server):
    return openai.OpenAI(base_url=f"http://{server.http}/v1", api_key="none", max_retries=0,
                         timeout=300)


def test_a_response_answers_the_input_as_chat_does(server):
    c = client(server)
    r = c.responses.create(model="smollm2", instructions="You are terse.",
                           input="What is the capital of France?", max_output_tokens=40,
                           temperature=0)
    assert r.object == "response" and r.model == "smollm2"
    assert r.status in ("completed", "incomplete"), r
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.output_text and r.output_text == r.output[0].content[0].text
    assert r.usage.output_tokens > 0 and r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    # The same conversation through chat completions answers the same text.
    chat = c.chat.completions.create(model="smollm2", max_tokens=40, temperature=0, messages=[
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the capital of France?"}])
    assert chat.choices[0].message.content == r.output_text


def test_message_items_and_a_cut_answer(server):
    r = client(server).responses.create(model="smollm2", max_output_tokens=5, temperature=0,
                                        input=[
        {"role": "developer", "content": "Answer in one word."},
        {"role": "user", "content": [{"type": "input_text", "text": "Tell me a long story."}]},
    ])
    assert r.status == "incomplete", r
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5


def test_a_streamed_response_says_the_same_in_events(server):
    c = client(server)
    whole = c.responses.create(model="smollm2", input="Name three colors.",
                               max_output_tokens=30, temperature=0)
    kinds, deltas, final = [], [], None
    for event in c.responses.create(model="smollm2", input="Name three colors.",
                                    max_output_tokens=30, temperature=0, stream=True):
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"], kinds
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done",
                            "response.output_item.done"], kinds
    assert "".join(deltas) == whole.output_text == final.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_text_format_json_schema_answers_valid_json(server):
    r = client(server).responses.create(
        model="smollm2", input="Describe a person.", max_output_tokens=60, temperature=0,
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                         "strict": True}})
    jsonschema.validate(json.loads(r.output_text), PERSON)
    assert r.status == "completed"


@pytest.mark.parametrize("fields,param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input"),
    ({"text": {"format": {"type": "grammar"}}}, "text"),
])
def test_what_is_not_served_is_refused_by_name(server, fields, param):
    args = dict(model="smollm2", input="hi", max_output_tokens=4)
    args.update(fields)
    with pytest.raises(openai.BadRequestError) as e:
        client(server).responses.create(**args)
    assert e.value.body.get("param") == param, e.value.body
