"""Chat and agents (issue 39, item 4), against a real server on 127.0.0.1 over the shipped model
(the session's ``shipped_runner``: nothing compiles here) with the official ``openai`` client:
forced tool calls (a named function, "required"), whole and streamed; tool results in the
conversation; a Hugging Face style chat template (``bos_token``, ``raise_exception``, ``tools``);
vLLM's guided_choice, guided_regex, guided_grammar; compact JSON unless a request asks for other
whitespace; and every field asking for what this server does not do refused by name."""

import json
import re

import httpx
import jsonschema
import openai
import pytest

from runner import grammar
from server import Server
from server.chat import ChatTemplate
from server.protocol import ChatCompletionRequest, CompletionRequest
from server.tools import CallReader
from tests.test_server import LiveServer

MODEL = "austen-moe"
MESSAGES = [{"role": "user", "content": "What is the weather in Bath?"}]
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Bath", "London", "Pemberley"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"$ref": "#/$defs/small"}},
       "required": ["a", "b"], "additionalProperties": False, "$defs": {"small": {"type": "integer", "minimum": 0,
                                                                                 "maximum": 9}}}
NOTE = {"type": "object", "properties": {"text": {"type": "string", "maxLength": 12}}, "required": ["text"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": ADD}},
         {"type": "function", "function": {"name": "take-note", "parameters": NOTE}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}

# A ChatML template in the style of those published beside models on Hugging Face: the BOS token,
# the tools listed in a system turn, tool calls and results, and a refusal of two user turns in a row.
HF_TEMPLATE = """{{ bos_token }}
{%- if tools %}<|im_start|>system
You may call these functions:
{% for tool in tools %}- {{ tool.function.name }}: {{ tool.function.description }}
{% endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "user" and loop.previtem is defined and loop.previtem.role == "user" %}
{{- raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
{%- endif %}
<|im_start|>{{ message.role }}
{% if message.tool_calls %}
{%- for call in message.tool_calls %}<tool_call>{{ call.function | tojson }}</tool_call>{% endfor %}
{%- elif message.role == "tool" %}<tool_response id="{{ message.tool_call_id }}">{{ message.content }}</tool_response>
{%- else %}{{ message.content }}{% endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.fixture(scope="module")
def served(shipped_runner):
    server = Server(shipped_runner, MODEL, chat_template=ChatTemplate(HF_TEMPLATE, origin="the test's template"))
    live = LiveServer(server)
    yield shipped_runner, live
    live.stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[1].url + "/v1", api_key="unused", max_retries=0)


def post(live, path, **body):
    return httpx.post(live.url + path, json={"model": MODEL, **body}, timeout=120)


def chat(live, **body):
    return post(live, "/v1/chat/completions", **{"messages": MESSAGES, **body})


def refused(response, param: str, *words: str) -> dict:
    """The 400's error, checked to name ``param`` and contain ``words``."""
    assert response.status_code == 400, response.text[:500]
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    for word in words:
        assert word in error["message"], (word, error["message"])
    return error


def outside_strings(text: str) -> str:
    """The characters of (a prefix of) JSON text outside its strings."""
    out, in_string, escaped = [], False, False
    for c in text:
        if in_string:
            escaped, in_string = (False, True) if escaped else (c == "\\", c != '"')
        elif c == '"':
            in_string = True
        else:
            out.append(c)
    return "".join(out)


def reassembled(chunks) -> tuple[list[tuple[str, str, str]], str]:
    """A streamed chat's tool calls (id, name, arguments), joined by index, and its finish reason;
    checked on the way: a call's first delta brings its id, type and name, the later ones none."""
    calls: dict[int, list] = {}
    finish = None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        assert choice.delta.content is None
        for part in choice.delta.tool_calls or ():
            if part.index not in calls:
                assert part.id.startswith("call_") and part.type == "function" and part.function.name, part
                calls[part.index] = [part.id, part.function.name, part.function.arguments or ""]
            else:
                assert part.id is None and part.function.name is None, part
                calls[part.index][2] += part.function.arguments
        finish = choice.finish_reason or finish
    assert sorted(calls) == list(range(len(calls)))
    return [tuple(calls[i]) for i in sorted(calls)], finish


# ---- forced tool calls ---------------------------------------------------------------------------
def test_a_named_function_is_called_with_arguments_of_its_schema(client):
    for seed in range(3):
        r = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=TOOLS, seed=seed, temperature=1.0, max_tokens=80,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        [call] = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    # $defs resolve in the function's own schema
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, seed=5, max_tokens=80,
                                       tool_choice={"type": "function", "function": {"name": "add"}})
    assert r.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(r.choices[0].message.tool_calls[0].function.arguments), ADD)


def test_required_calls_one_of_the_tools(client):
    names = set()
    for seed in range(4):
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, seed=seed, temperature=1.0, max_tokens=120)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        [call] = choice.message.tool_calls  # parallel_tool_calls false: exactly one
        assert call.function.name in SCHEMAS
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        names.add(call.function.name)
    # parallel (OpenAI's default): one call or more, each of a tool with arguments of its schema,
    # and each with an id of its own
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                       seed=1, temperature=1.0, max_tokens=150)
    calls, finish = r.choices[0].message.tool_calls, r.choices[0].finish_reason
    assert calls and len({c.id for c in calls}) == len(calls) and finish in ("tool_calls", "length")
    # every call but one cut by the token budget is complete
    for call in calls if finish == "tool_calls" else calls[:-1]:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_streamed_tool_calls_join_to_the_whole_response(client):
    cases = [({"tool_choice": {"type": "function", "function": {"name": "take-note"}}}, 0),
             ({"tool_choice": "required", "parallel_tool_calls": False}, 2),
             ({"tool_choice": "required"}, 3)]
    for fields, seed in cases:
        settings = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, seed=seed, temperature=1.0, max_tokens=120,
                        **fields)
        whole = client.chat.completions.create(**settings).choices[0]
        calls, finish = reassembled(client.chat.completions.create(stream=True, **settings))
        assert finish == whole.finish_reason, fields
        assert [(name, arguments) for _, name, arguments in calls] == \
            [(c.function.name, c.function.arguments) for c in whole.message.tool_calls], fields
        assert len({i for i, _, _ in calls}) == len(calls)
        for _, name, arguments in calls if finish == "tool_calls" else calls[:-1]:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_the_reader_reads_any_split_of_the_text_alike():
    text = (' [{"name":"get_weather","arguments":{"city":"Ba]t\\"h}","days":2}},'
            '{"name":"add","arguments":{"a":1,"b":[2]}}]')
    whole = CallReader(None)
    whole.feed(text)
    assert whole.calls == [["get_weather", '{"city":"Ba]t\\"h}","days":2}'], ["add", '{"a":1,"b":[2]}']]
    assert whole.complete
    for step in (1, 2, 5, 13):
        reader, joined = CallReader(None), {}
        for i in range(0, len(text), step):
            for index, name, arguments in reader.feed(text[i:i + step]):
                joined.setdefault(index, [name, ""])[1] += arguments
        assert [v for _, v in sorted(joined.items())] == whole.calls and reader.complete
    named = CallReader("add")
    named.feed(' {"a": 1, "b": 2}')
    assert named.calls == [["add", '{"a": 1, "b": 2}']] and named.complete


def test_tool_choice_none_answers_in_text(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                       max_tokens=8, temperature=0)
    choice = r.choices[0]
    assert isinstance(choice.message.content, str) and choice.message.tool_calls is None
    assert choice.finish_reason in ("stop", "length")


def test_tool_choice_auto_and_bad_tools_are_400s_naming_the_field(served):
    _, live = served
    refused(chat(live, tools=TOOLS, tool_choice="auto"), "tool_choice", "no tool-call format", "'required'")
    refused(chat(live, tools=TOOLS), "tools", "the default with tools", "no tool-call format")
    refused(chat(live, tool_choice="required"), "tool_choice", "needs tools")
    named = {"type": "function", "function": {"name": "fly"}}
    refused(chat(live, tools=TOOLS, tool_choice=named), "tool_choice", "'fly'", "get_weather")
    refused(chat(live, tools=TOOLS, tool_choice={"type": "function"}), "tool_choice", "expected")
    bad_name = [TOOLS[0], {"type": "function", "function": {"name": "get weather", "parameters": WEATHER}}]
    refused(chat(live, tools=bad_name, tool_choice="required"), "tools[1].function.name", "'get weather'", "a-z")
    long_name = [{"type": "function", "function": {"name": "x" * 65}}]
    refused(chat(live, tools=long_name, tool_choice="required"), "tools[0].function.name", "1 to 64")
    cases = [([{"type": "custom", "custom": {"name": "x"}}], "tools[0].type", "'function'"),
             ([{"type": "function"}], "tools[0].function", "expected an object"),
             ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
              "tools[0].function.parameters", "of type 'object'"),
             ([TOOLS[0], TOOLS[0]], "tools[1].function.name", "also the name of tools[0]"),
             ([TOOLS[0], {"type": "function", "function": {"name": "loop", "parameters": {
                 "type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}}}],
              "tools[1].function.parameters", "no finite JSON document"),
             ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
                 "a": {"type": "nonsense"}}}}}], "tools[0].function.parameters", "nonsense")]
    for tools, param, word in cases:
        refused(chat(live, tools=tools, tool_choice="required"), param, word)
    # one structured output a request: a forced call sets response_format aside (as vLLM), not others
    refused(chat(live, tools=TOOLS, tool_choice="required", guided_json=PERSON), "tool_choice", "guided_json",
            "tool_choice")
    refused(chat(live, tools=TOOLS, tool_choice="required", response_format={"type": "xml"}), "response_format",
            "'xml'")


# ---- schemas as agent libraries send them (issue 51) -----------------------------------------------
# pydantic's model_json_schema() of a model with two bounded fields, as instructor and LangChain
# send it: nothing says whether other keys are allowed
OPEN_PERSON = {"title": "Person", "type": "object", "properties": {
    "name": {"title": "Name", "type": "string", "maxLength": 12},
    "age": {"title": "Age", "type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"]}


def test_objects_are_closed_unless_the_schema_opens_them(served, client):
    """As vLLM's default backend (xgrammar) compiles a schema: an object takes the keys it lists,
    so a prose model cannot append keys of its own until max_tokens; in every place a schema
    enters. The runner's constraint is closed, and every answer has exactly the listed keys."""
    closed = dict(OPEN_PERSON, additionalProperties=False)
    _, live = served
    body = ChatCompletionRequest(model=MODEL, messages=MESSAGES,
                                 response_format={"type": "json_schema", "json_schema": {"name": "p",
                                                                                         "schema": OPEN_PERSON}})
    assert body.json_schema()["additionalProperties"] is False
    asks = [{"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": OPEN_PERSON}}},
            {"guided_json": OPEN_PERSON}, {"structured_outputs": {"json": OPEN_PERSON}}]
    for fields in asks:
        for seed in range(3):
            r = chat(live, max_tokens=60, temperature=1.0, seed=seed, **fields)
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] == "stop", (fields, choice)
            jsonschema.validate(json.loads(choice["message"]["content"]), closed)
    tool = [{"type": "function", "function": {"name": "person", "parameters": OPEN_PERSON}}]
    for seed in range(3):
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=tool, seed=seed, max_tokens=60,
                                           temperature=1.0, tool_choice={"type": "function",
                                                                         "function": {"name": "person"}})
        assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
        jsonschema.validate(json.loads(r.choices[0].message.tool_calls[0].function.arguments), closed)
    # json_object stays any object; an object the schema opens stays open
    assert ChatCompletionRequest(model=MODEL, messages=MESSAGES, response_format={"type": "json_object"}
                                 ).json_schema()["type"] == "object"
    opened = {"type": "object", "properties": {"tags": {"type": "object", "additionalProperties": {"type": "integer"}}}}
    assert ChatCompletionRequest(model=MODEL, messages=MESSAGES, guided_json=opened).json_schema()[
        "properties"]["tags"]["additionalProperties"] == {"type": "integer"}


def test_closing_objects_follows_every_subschema_and_leaves_all_of_alone():
    from runner.schema import closed_objects

    schema = {"type": "object", "properties": {
        "items": {"type": "array", "items": {"$ref": "#/$defs/Item"}},
        "maybe": {"anyOf": [{"type": "object", "properties": {"a": {}}}, {"type": "null"}]},
        "free": {"type": "object", "additionalProperties": True},
        "pattern": {"type": "object", "patternProperties": {"^x": {}}},
        "both": {"allOf": [{"type": "object", "properties": {"a": {}}}, {"properties": {"b": {}}}]}},
        "$defs": {"Item": {"properties": {"n": {"type": ["object", "null"], "properties": {}}}}}}
    closed = closed_objects(schema)
    assert "additionalProperties" not in json.dumps(schema).replace('"additionalProperties": true', "")  # a copy
    assert closed["additionalProperties"] is False
    assert closed["$defs"]["Item"]["additionalProperties"] is False
    assert closed["$defs"]["Item"]["properties"]["n"]["additionalProperties"] is False
    assert closed["properties"]["maybe"]["anyOf"][0]["additionalProperties"] is False
    assert closed["properties"]["free"]["additionalProperties"] is True
    assert "additionalProperties" not in closed["properties"]["pattern"]
    assert all("additionalProperties" not in m for m in closed["properties"]["both"]["allOf"])
    deep = current = {}
    for _ in range(3000):  # no recursion (the depth is the runner's to refuse)
        current["properties"] = {"x": {}}
        current = current["properties"]["x"]
    assert closed_objects(deep)["additionalProperties"] is False


def test_response_format_beside_a_forced_tool_call_gives_the_call(client):
    """The OpenAI Agents SDK sends response_format (its output type) with tools and tool_choice
    'required': the call is what is generated, as vLLM does."""
    output = {"type": "json_schema", "json_schema": {"name": "final", "schema": OPEN_PERSON, "strict": True}}
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                           response_format=output, parallel_tool_calls=False, seed=2,
                                           max_tokens=120)
        answer = r.choices[0]
        assert answer.finish_reason == "tool_calls" and answer.message.content is None, answer
        [call] = answer.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_tool_results_in_the_conversation_reach_the_template(served):
    runner, live = served
    conversation = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Bath", "days": 1})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Rain, as ever."}]
    tokens = post(live, "/tokenize", messages=conversation, tools=TOOLS).json()["tokens"]
    text = runner.tokenizer.decode(tokens)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Bath", "days": 1}}</tool_call>' in text
    assert '<tool_response id="call_1">Rain, as ever.</tool_response>' in text
    assert "- add: Add two numbers\n- take-note: \n" in text
    r = chat(live, messages=conversation, tools=TOOLS, tool_choice="none", max_tokens=5, temperature=0)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(tokens)
    wrong = conversation[:2] + [{**conversation[2], "tool_call_id": "call_9"}]
    refused(chat(live, messages=wrong, max_tokens=5), "messages[2].tool_call_id", "'call_9'", "call_1")
    bad_call = [conversation[0], {**conversation[1], "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "get_weather", "arguments": "{not json"}}]}]
    refused(chat(live, messages=bad_call, max_tokens=5), "messages[1].tool_calls[0].function.arguments", "JSON")


# ---- the chat template -----------------------------------------------------------------------------
def test_a_hugging_face_template_gets_bos_and_eos_as_ids_and_refuses_with_its_message(served):
    runner, live = served
    sp = runner.tokenizer.sp
    tokens = post(live, "/tokenize", messages=[{"role": "user", "content": "Is it <s> or </s>?"}]).json()["tokens"]
    assert tokens[0] == sp.bos_id() and tokens.count(sp.bos_id()) == 1 and sp.eos_id() not in tokens
    assert "Is it <s> or </s>?" in runner.tokenizer.decode(tokens)  # a message's "<s>" is its text
    assert runner.tokenizer.decode(tokens).endswith("<|im_start|>assistant\n")
    twice = [{"role": "user", "content": "Hello"}, {"role": "user", "content": "Hello again"}]
    error = refused(chat(live, messages=twice, max_tokens=5), "messages",
                    "Conversation roles must alternate user/assistant/user/assistant/...")
    assert error["message"].startswith("messages: the chat template refused them")
    refused(post(live, "/tokenize", messages=twice), "messages", "Conversation roles must alternate")
    # vLLM's template options
    plain = post(live, "/tokenize", messages=MESSAGES, add_generation_prompt=False).json()["tokens"]
    assert runner.tokenizer.decode(plain).endswith("Bath?<|im_end|>\n")
    opening = MESSAGES + [{"role": "assistant", "content": "It is"}]
    r = post(live, "/tokenize", messages=opening, add_generation_prompt=False, continue_final_message=True)
    assert runner.tokenizer.decode(r.json()["tokens"]).endswith("<|im_start|>assistant\nIt is")
    refused(chat(live, messages=opening, continue_final_message=True), "continue_final_message",
            "add_generation_prompt=false")
    refused(chat(live, chat_template_kwargs={"bos_token": "x"}), "chat_template_kwargs", "bos_token")


def test_a_template_is_read_from_a_file_naming_it_in_errors(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(HF_TEMPLATE)
    template = ChatTemplate.from_file(str(path))
    text = template.render(MESSAGES, special_tokens={"bos_token": "<s>", "eos_token": "</s>"})
    assert text == "<s><|im_start|>user\nWhat is the weather in Bath?<|im_end|>\n<|im_start|>assistant\n"
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": [{"name": "default", "template": HF_TEMPLATE}]}))
    assert ChatTemplate.from_file(str(config)).render(MESSAGES) == text[3:]
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}\n{{ m.content }")
    for bad, words in ((tmp_path / "missing.jinja", ["missing.jinja", "cannot read"]),
                       (broken, ["broken.jinja", "not a valid Jinja2 template", "line 2"]),
                       (tmp_path, ["cannot read"])):
        with pytest.raises(ValueError) as e:
            ChatTemplate.from_file(str(bad))
        assert all(w in str(e.value) for w in words), str(e.value)


# ---- vLLM's guided decoding ----------------------------------------------------------------------
def test_guided_choice_regex_and_grammar_on_both_endpoints(served):
    _, live = served
    choices = ["Elizabeth Bennet", "Mr Darcy", "Jane"]
    regex = r"(Miss|Mrs) [A-Z][a-z]{2,8}, [0-9]{1,2} years"
    lark = 'start: greeting " " name "!"\ngreeting: "Dear" | "Hello"\nname: /[A-Z][a-z]{1,8}/'
    gbnf = 'root ::= "yes" | "no" | "perhaps"'
    for path, prompt in (("/v1/completions", {"prompt": "Her name was"}), ("/v1/chat/completions",
                                                                          {"messages": MESSAGES})):
        for seed in range(2):
            def text(**fields):
                r = post(live, path, **prompt, max_tokens=40, temperature=1.0, seed=seed, **fields)
                assert r.status_code == 200, r.text[:300]
                choice = r.json()["choices"][0]
                assert choice["finish_reason"] == "stop", choice
                return choice["text"] if "text" in choice else choice["message"]["content"]

            assert text(guided_choice=choices) in choices
            assert re.fullmatch(regex, text(guided_regex=regex))
            assert re.fullmatch(r"(Dear|Hello) [A-Z][a-z]{1,8}!", text(guided_grammar=lark))
            assert text(guided_grammar=gbnf) in ("yes", "no", "perhaps")


def test_malformed_or_conflicting_guided_fields_are_400s_before_anything_runs(served):
    _, live = served
    for path, prompt in (("/v1/completions", {"prompt": "Her name was"}), ("/v1/chat/completions",
                                                                          {"messages": MESSAGES})):
        def ask(**fields):
            return post(live, path, **prompt, max_tokens=5, **fields)

        refused(ask(guided_regex="(unclosed"), "guided_regex", "unclosed group")
        refused(ask(guided_grammar="start: missing"), "guided_grammar", "unknown name", "missing")
        refused(ask(guided_choice=[]), "guided_choice", "at least one")
        refused(ask(guided_choice=["a"], guided_regex="b"), "guided_choice", "guided_regex")
        refused(ask(guided_json=PERSON, guided_grammar='start: "x"'), "guided_grammar", "guided_json")
        refused(ask(guided_whitespace_pattern="[ ]?"), "guided_whitespace_pattern", "asks for none")
        refused(ask(guided_json=PERSON, guided_whitespace_pattern=r"\s*"), "guided_whitespace_pattern",
                "more than JSON whitespace")
        refused(ask(guided_json=PERSON, guided_whitespace_pattern="("), "guided_whitespace_pattern", "unclosed")
        refused(ask(guided_json={"x-lark": 'start: "x"'}), "guided_json", "reserved")


@pytest.mark.parametrize("field, value", [
    ("functions", [{"name": "f", "parameters": {"type": "object"}}]), ("function_call", {"name": "f"}),
    ("audio", {"voice": "alloy", "format": "wav"}), ("modalities", ["text", "audio"]),
    ("prediction", {"type": "content", "content": "x"}), ("web_search_options", {}), ("reasoning_effort", "low"),
    ("verbosity", "low"), ("echo", True), ("chat_template", "{{ messages }}"), ("documents", [{"text": "x"}]),
    ("use_beam_search", True), ("bad_words", ["ball"]), ("allowed_token_ids", [5]), ("logits_processors", ["x"]),
    ("include_stop_str_in_output", True), ("guided_decoding_backend", "xgrammar"), ("priority", 3),
    ("structural_tag", "{}"), ("truncate_prompt_tokens", 5), ("return_tokens_as_token_ids", True),
    ("cache_salt", "s"), ("add_special_tokens", True), ("prompt_logprobs", 1)])
def test_fields_asking_for_what_is_not_done_are_400s_naming_them(served, field, value):
    _, live = served
    refused(chat(live, max_tokens=3, **{field: value}), field, field, "not supported")
    if field not in ("functions", "function_call", "audio", "modalities", "prediction", "web_search_options",
                     "reasoning_effort", "verbosity", "echo", "chat_template", "documents"):
        refused(post(live, "/v1/completions", prompt="the", max_tokens=3, **{field: value}), field, field)


def test_fields_asking_for_nothing_are_accepted(served):
    _, live = served
    harmless = {"modalities": ["text"], "function_call": "none", "guided_decoding_backend": "guidance",
                "prompt_cache_key": "k", "safety_identifier": "u-1", "use_beam_search": False, "priority": 0}
    assert chat(live, max_tokens=3, **harmless).status_code == 200


# ---- JSON whitespace ---------------------------------------------------------------------------------
def test_json_is_compact_unless_a_request_asks_for_other_whitespace(served, client):
    _, live = served
    asks = [{"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}},
            {"guided_json": PERSON}, {"response_format": {"type": "json_object"}}]
    for fields in asks:
        for path, prompt in (("/v1/completions", {"prompt": "A person, as JSON:"}),
                             ("/v1/chat/completions", {"messages": MESSAGES})):
            r = post(live, path, **prompt, max_tokens=60, temperature=1.0, seed=3, **fields)
            choice = r.json()["choices"][0]
            text = choice["text"] if "text" in choice else choice["message"]["content"]
            # one leading space is the grammar's (a SentencePiece reply starts with "▁"); none after it
            assert text and not re.search(r"\s", outside_strings(text.removeprefix(" "))), (fields, text)
            if choice["finish_reason"] == "stop" and "guided_json" in fields:
                jsonschema.validate(json.loads(text), PERSON)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, seed=4, max_tokens=120,
                                       tool_choice={"type": "function", "function": {"name": "take-note"}})
    arguments = r.choices[0].message.tool_calls[0].function.arguments
    assert not re.search(r"\s", outside_strings(arguments)), arguments
    # flexible whitespace on request: accepted, and what it writes still validates
    spaced = r"[ \n]{0,2}"
    r = post(live, "/v1/completions", prompt="A person, as JSON:", max_tokens=80, seed=3, guided_json=PERSON,
             guided_whitespace_pattern=spaced)
    assert r.status_code == 200, r.text
    if r.json()["choices"][0]["finish_reason"] == "stop":
        jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), PERSON)
    r = chat(live, tools=TOOLS, tool_choice="required", guided_whitespace_pattern=spaced, max_tokens=120, seed=1)
    assert r.status_code == 200, r.text


def test_the_grammar_takes_compact_json_by_default_and_spaced_json_when_asked(served):
    """What the constraint a body asks for allows, fed to the runner's grammar token by token."""
    runner, _ = served
    token_grammar = grammar.for_tokenizer(runner.tokenizer, runner.config.vocab_size)
    compact, spaced = '{"name":"Emma Woodhouse","age":21}', '{\n "name": "Emma Woodhouse",\n "age": 21\n}'

    def takes(constraint, text: str) -> bool:
        matcher = grammar.Matcher(token_grammar.compile_grammar("json_schema", constraint))
        return all(matcher.accept(t) for t in token_grammar.pieces(text)) and matcher.done

    body = {"model": MODEL, "prompt": "x", "guided_json": PERSON}
    default = CompletionRequest.model_validate(body).json_schema()
    flexible = CompletionRequest.model_validate({**body, "guided_whitespace_pattern": r"[ \n]{0,2}"}).json_schema()
    assert takes(default, compact) and not takes(default, spaced)
    assert takes(flexible, compact) and takes(flexible, spaced)
    # a forced call's arguments alike
    tools = {"model": MODEL, "messages": MESSAGES, "tools": [{"type": "function", "function": {
        "name": "person", "parameters": PERSON}}], "tool_choice": "required", "parallel_tool_calls": False}
    default = ChatCompletionRequest.model_validate(tools).json_schema()
    flexible = ChatCompletionRequest.model_validate({**tools, "guided_whitespace_pattern": r"[ \n]{0,2}"}).json_schema()
    for arguments, compact_ok, spaced_ok in ((compact, True, True), (spaced, False, True)):
        call = '[{"name":"person","arguments":' + arguments + "}]"
        assert takes(default, call) == compact_ok and takes(flexible, call) == spaced_ok
