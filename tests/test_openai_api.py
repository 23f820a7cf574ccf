"""The OpenAI API's plain functions without HTTP: every field of a request body, valid and
not (the error's status, param, code and message), and the shapes of replies, stream
chunks and usage built from engine events."""

from __future__ import annotations

import json

import pytest

from ferrolm.app import openai_api as api
from ferrolm.app.openai_api import ApiError, ModelInfo
from ferrolm.lm.engine import Failed, Finished, Piece, PromptLogprobs, TokenLogprob

INFO = ModelInfo(
    name="m", encode=lambda s: list(s.encode()), eos_id=256, vocab_size=300, context_length=48, max_tokens_limit=100
)


def completion(**fields):
    return api.parse_completion({"model": "m", "prompt": "hi", **fields}, INFO)


def refused(call, *args, **kwargs) -> ApiError:
    with pytest.raises(ApiError) as info:
        call(*args, **kwargs)
    return info.value


def error(e: ApiError) -> tuple:
    body = e.body["error"]
    return e.status, body["param"], body["code"], body["type"]


# ----------------------------------------------------------------------------- body ---


def test_parse_json_refuses_what_is_not_json_and_deep_nesting():
    assert api.parse_json(b'{"a": [1, {"b": "[[[{{{"}]}') == {"a": [1, {"b": "[[[{{{"}]}
    e = refused(api.parse_json, b'{"model": ')
    assert error(e) == (400, None, None, "invalid_request_error")
    assert "not valid JSON" in str(e)
    assert refused(api.parse_json, b"\xff\xfe{").status == 400
    at_limit = b"[" * api.MAX_JSON_DEPTH + b"]" * api.MAX_JSON_DEPTH
    assert api.parse_json(at_limit) is not None
    e = refused(api.parse_json, b"[" * (api.MAX_JSON_DEPTH + 1) + b"]" * (api.MAX_JSON_DEPTH + 1))
    assert f"nests deeper than {api.MAX_JSON_DEPTH}" in str(e)
    # Brackets inside strings, many of them, are no nesting.
    wide = json.dumps({"s": "[{" * 1000, "l": [[1]] * 100}).encode()
    assert api.parse_json(wide)["s"] == "[{" * 1000


def test_check_body_wants_an_object_naming_the_served_model():
    assert "JSON object" in str(refused(api.check_body, [1], "m"))
    e = refused(api.check_body, {"prompt": "x"}, "m")
    assert error(e) == (400, "model", None, "invalid_request_error")
    e = refused(api.check_body, {"model": 3}, "m")
    assert error(e)[:2] == (400, "model")
    e = refused(api.check_body, {"model": "other"}, "m")
    assert error(e) == (404, "model", "model_not_found", "invalid_request_error")
    assert "'other' does not exist" in str(e) and "'m'" in str(e)


@pytest.mark.parametrize("name", sorted(api.NEUTRAL))
def test_unimplemented_parameters_pass_only_at_their_neutral_value(name):
    for value in api.NEUTRAL[name]:
        api.check_body({"model": "m", name: value}, "m")
    e = refused(api.check_body, {"model": "m", name: "something"}, "m")
    assert error(e) == (400, name, "unsupported_parameter", "invalid_request_error")
    assert str(e) == f"{name} is not supported by this server"


# -------------------------------------------------------------------------- prompts ---


def test_the_four_prompt_shapes():
    assert completion(prompt="ab").prompts == [[97, 98]]
    assert completion(prompt=["a", "bc"]).prompts == [[97], [98, 99]]
    assert completion(prompt=[5, 6]).prompts == [[5, 6]]
    assert completion(prompt=[[5], [6, 7]]).prompts == [[5], [6, 7]]
    assert completion(prompt="").prompts == [[256]]  # an empty prompt starts a new document


@pytest.mark.parametrize("prompt", [None, 3, [], [1, "a"], [[1], "a"], {"a": 1}])
def test_a_prompt_of_no_known_shape_is_refused(prompt):
    e = refused(completion, prompt=prompt)
    assert error(e)[:2] == (400, "prompt")
    assert "prompt must be a string, a list of strings" in str(e)


@pytest.mark.parametrize("ids", [[300], [-1], [True], [1.0], [[1], [299, 300]]])
def test_token_ids_outside_the_vocabulary_are_refused(ids):
    e = refused(completion, prompt=ids)
    assert error(e) == (400, "prompt", "invalid_token_id", "invalid_request_error")
    assert "outside the model's vocabulary [0, 300)" in str(e)


def test_empty_prompts_without_an_end_of_text_token():
    e = refused(completion, prompt=[[1], []])
    assert error(e)[:2] == (400, "prompt") and "at least one id" in str(e)
    no_eos = ModelInfo("m", lambda s: list(s.encode()), None, 300, 48)
    e = refused(api.parse_completion, {"model": "m", "prompt": ""}, no_eos)
    assert error(e)[:2] == (400, "prompt") and "lacks" in str(e)


def test_a_prompt_past_the_context_is_refused():
    assert completion(prompt="x" * 48).prompts == [[120] * 48]
    e = refused(completion, prompt="x" * 49)
    assert error(e) == (400, "prompt", "context_length_exceeded", "invalid_request_error")
    assert str(e) == "the prompt is 49 tokens; the model's context is 48"


# ------------------------------------------------------------------------- sampling ---


def test_defaults():
    req = completion()
    assert (req.n, req.max_tokens, req.temperature, req.top_k, req.top_p) == (1, 16, 1.0, None, None)
    assert (req.seed, req.stop, req.stream, req.choices) == (None, (), False, 1)


def test_max_tokens_and_max_completion_tokens():
    assert completion(max_tokens=100).max_tokens == 100
    assert completion(max_tokens=5, max_completion_tokens=7).max_tokens == 7
    for bad in (0, 101, 1.5, True, "3"):
        e = refused(completion, max_tokens=bad)
        assert error(e)[:2] == (400, "max_tokens")
        assert str(e) == f"max_tokens must be an integer in [1, 100], got {json.dumps(bad)}"
    assert error(refused(completion, max_completion_tokens=0))[1] == "max_completion_tokens"


@pytest.mark.parametrize(
    "name, good, bad, interval",
    [
        ("temperature", [0, 0.5, 2], [-0.1, 2.01, float("nan"), float("inf"), True, "1"], "[0, 2]"),
        ("top_p", [0.01, 1], [0, -1, 1.01, float("nan"), False], "(0, 1]"),
    ],
)
def test_numbers_in_their_intervals(name, good, bad, interval):
    for x in good:
        assert completion(**{name: x}) is not None
    for x in bad:
        e = refused(completion, **{name: x})
        assert error(e)[:2] == (400, name)
        assert str(e).startswith(f"{name} must be a number in {interval}, got ")


def test_top_p_of_one_is_no_top_p_and_the_numbers_are_floats():
    assert completion(top_p=1).top_p is None
    assert completion(top_p=0.5).top_p == 0.5
    req = completion(temperature=0)
    assert req.temperature == 0.0 and isinstance(req.temperature, float)


def test_top_k_and_n():
    assert completion(top_k=1).top_k == 1 and completion(top_k=api.TOP_K_MAX).top_k == api.TOP_K_MAX
    for bad in (0, api.TOP_K_MAX + 1, 2.0, False):
        assert error(refused(completion, top_k=bad))[:2] == (400, "top_k")
    assert completion(n=api.MAX_N).n == api.MAX_N
    for bad in (0, api.MAX_N + 1, 1.0):
        e = refused(completion, n=bad)
        assert error(e)[:2] == (400, "n") and f"[1, {api.MAX_N}]" in str(e)
    assert completion(prompt=["a"] * 4, n=api.MAX_N).choices == api.MAX_CHOICES
    e = refused(completion, prompt=["a"] * 5, n=api.MAX_N)
    assert error(e)[:2] == (400, "n") and str(api.MAX_CHOICES) in str(e)


def test_stream_and_seed():
    assert completion(stream=True).stream is True and completion(stream=None).stream is False
    for bad in (1, "true"):
        e = refused(completion, stream=bad)
        assert error(e)[:2] == (400, "stream") and str(e) == "stream must be a boolean"
    assert completion(seed=-1).seed == (1 << 63) - 1  # any integer, taken modulo 2**63
    for bad in (1.5, True, "1"):
        e = refused(completion, seed=bad)
        assert error(e)[:2] == (400, "seed") and str(e) == f"seed must be an integer, got {json.dumps(bad)}"


def test_stream_options_include_usage():
    assert completion(stream=True).include_usage is False
    assert completion(stream=True, stream_options={"include_usage": True}).include_usage is True
    assert completion(stream=True, stream_options={"include_usage": False, "other": 1}).include_usage is False
    assert completion(stream=True, stream_options=None).include_usage is False
    e = refused(completion, stream_options={"include_usage": True})  # without a stream
    assert error(e)[:2] == (400, "stream_options") and "only allowed when stream is true" in str(e)
    e = refused(completion, stream=True, stream_options=[True])
    assert error(e)[:2] == (400, "stream_options")
    e = refused(completion, stream=True, stream_options={"include_usage": "yes"})
    assert error(e)[:2] == (400, "stream_options.include_usage")


def test_stop_strings():
    assert completion(stop="x").stop == ("x",)
    assert completion(stop=["a", "", "b", "a"]).stop == ("a", "b")  # empty ones dropped, repeats once
    assert completion(stop=["a"] * api.MAX_STOP_STRINGS).stop == ("a",)
    for bad in (["a"] * (api.MAX_STOP_STRINGS + 1), [1], 3, {"a": 1}):
        e = refused(completion, stop=bad)
        assert error(e)[:2] == (400, "stop")
        assert str(e) == f"stop must be a string or a list of at most {api.MAX_STOP_STRINGS} strings"


def test_sampling_params_seed_each_choice_with_seed_plus_its_index():
    req = completion(seed=(1 << 63) - 1, n=3, temperature=0.5, top_k=4, top_p=0.9, stop=["z"], max_tokens=9)
    params = [api.sampling_params(req, j) for j in range(req.n)]
    assert [p.seed for p in params] == [(1 << 63) - 1, 0, 1]
    p = params[0]
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.stop) == (9, 0.5, 4, 0.9, ("z",))
    assert api.sampling_params(completion(), 2).seed is None


# ----------------------------------------------------------------------------- chat ---


def chat(messages, **fields):
    return api.chat_turns({"model": "m", "messages": messages, **fields}, INFO)


def test_chat_turns():
    turns = chat(
        [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": "c", "name": "x"},
        ]
    )
    assert turns == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "c"},
    ]


@pytest.mark.parametrize(
    "messages, message",
    [
        (None, "messages must be a non-empty list"),
        ([], "messages must be a non-empty list"),
        ("hi", "messages must be a non-empty list"),
        ([{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}], "messages[1] must be an object"),
        (["hi"], "messages[0] must be an object"),
        ([{"content": "a"}], "messages[0] must be an object"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content: only text parts"),
        ([{"role": "user", "content": [{"type": "text", "text": 1}]}], "messages[0].content: only text parts"),
        ([{"role": "user"}], "messages[0].content must be a string"),
        ([{"role": "user", "content": 3}], "messages[0].content must be a string"),
    ],
)
def test_bad_messages_are_refused(messages, message):
    e = refused(chat, messages)
    assert error(e)[:2] == (400, "messages")
    assert str(e).startswith(message)


def test_chat_checks_the_body_first():
    assert error(refused(chat, [], model="other"))[:3] == (404, "model", "model_not_found")
    assert error(refused(chat, [], logprobs="yes"))[1] == "logprobs"


def test_parse_chat_runs_to_the_context_and_adds_the_template_stop():
    body = {"model": "m", "messages": [], "stop": ["a", "\nUser:"]}
    req = api.parse_chat(body, "User: hi\n\nAssistant:", INFO, ("\nUser:", "\n\n"))
    assert req.prompts == [list(b"User: hi\n\nAssistant:")]
    assert req.max_tokens == INFO.context_length
    assert req.stop == ("a", "\nUser:", "\n\n")  # the caller's, then the template's
    e = refused(api.parse_chat, body, "x" * 49, INFO)
    assert error(e)[:3] == (400, "messages", "context_length_exceeded")
    assert api.parse_chat(body, "", INFO).prompts == [[256]]


# -------------------------------------------------------------------------- replies ---

HEAD = {"id": "x-1", "object": "", "created": 5, "model": "m"}


def test_response_head():
    for chat_, prefix in ((True, "chatcmpl-"), (False, "cmpl-")):
        head = api.response_head("m", chat_)
        assert head["id"].startswith(prefix) and head["model"] == "m" and isinstance(head["created"], int)
    assert api.response_head("m", False)["id"] != api.response_head("m", False)["id"]


def whole_reply(chat_: bool) -> dict:
    req = completion(prompt=["ab", "c"], n=2)  # prompts of 2 and 1 tokens, two choices each
    reply = api.Reply(req)
    for index, event in [
        (2, Piece("x")),
        (0, Piece("he")),
        (0, Piece("llo")),
        (2, Finished("stop", 1)),
        (0, Finished("length", 2)),
        (1, Finished("stop", 0)),
        (3, Piece("")),
        (3, Finished("length", 4)),
    ]:
        reply.add(index, event)
    return reply.body(HEAD, chat_)


def test_a_whole_completion():
    body = whole_reply(False)
    assert body["object"] == "text_completion" and body["id"] == "x-1" and body["created"] == 5
    assert body["choices"] == [
        {"index": 0, "text": "hello", "logprobs": None, "finish_reason": "length"},
        {"index": 1, "text": "", "logprobs": None, "finish_reason": "stop"},
        {"index": 2, "text": "x", "logprobs": None, "finish_reason": "stop"},
        {"index": 3, "text": "", "logprobs": None, "finish_reason": "length"},
    ]
    # Prompt tokens count each prompt once, whatever n.
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10}


def test_a_whole_chat_reply():
    body = whole_reply(True)
    assert body["object"] == "chat.completion"
    assert body["choices"][0] == {
        "index": 0,
        "message": {"role": "assistant", "content": "hello"},
        "logprobs": None,
        "finish_reason": "length",
    }
    assert [c["message"]["content"] for c in body["choices"]] == ["hello", "", "x", ""]
    assert body["usage"]["total_tokens"] == 10


def events_of(data: bytes) -> list:
    assert data.endswith(b"\n\n")
    return [json.loads(part[len(b"data: ") :]) for part in data.split(b"\n\n")[:-1]]


def test_completion_stream_chunks():
    req = completion(n=2)
    head = api.stream_head(HEAD, False)
    assert head["object"] == "text_completion" and "usage" not in head
    assert api.role_chunk(head, req, False) == b""  # completions open with their first text
    data, tokens = api.stream_bunch(head, [(1, Piece("a")), (0, Piece("b")), (1, Finished("stop", 3))], False)
    assert tokens == 3
    chunks = events_of(data)
    assert [c["choices"] for c in chunks] == [
        [{"index": 1, "text": "a", "logprobs": None, "finish_reason": None}],
        [{"index": 0, "text": "b", "logprobs": None, "finish_reason": None}],
        [{"index": 1, "text": "", "logprobs": None, "finish_reason": "stop"}],
    ]
    assert all(c["id"] == "x-1" and c["object"] == "text_completion" and c["model"] == "m" for c in chunks)
    (last,) = events_of(api.usage_chunk(head, req, 3))
    assert last["choices"] == [] and last["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    assert api.DONE == b"data: [DONE]\n\n"


def test_a_stream_that_asks_for_usage_carries_a_null_usage_until_its_last_chunk():
    req = completion(stream=True, stream_options={"include_usage": True})
    head = api.stream_head(HEAD, False, req)
    (piece,) = events_of(api.event_chunk(head, 0, Piece("a"), False))
    assert piece["usage"] is None and piece["choices"][0]["text"] == "a"
    (last,) = events_of(api.usage_chunk(head, req, 1))
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 1
    assert "usage" not in api.stream_head(HEAD, False, completion(stream=True))


def test_chat_stream_chunks():
    req = completion(n=2)
    head = api.stream_head(HEAD, True)
    assert head["object"] == "chat.completion.chunk"
    (opening,) = events_of(api.role_chunk(head, req, True))
    assert opening["choices"] == [
        {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        for i in range(2)
    ]
    (piece,) = events_of(api.event_chunk(head, 1, Piece("hi"), True))
    assert piece["choices"] == [{"index": 1, "delta": {"content": "hi"}, "logprobs": None, "finish_reason": None}]
    (end,) = events_of(api.event_chunk(head, 0, Finished("length", 2), True))
    assert end["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}]
    assert end["object"] == "chat.completion.chunk"


def test_bunch_ends_counts_finished_choices_and_refuses_a_failure():
    assert api.bunch_ends([(0, Piece("a")), (0, Finished("stop", 1)), (1, Finished("length", 2))]) == 2
    assert api.bunch_ends([(0, Piece("a"))]) == 0
    e = refused(api.bunch_ends, [(0, Piece("a")), (1, Failed("out of memory"))])
    assert error(e) == (500, None, None, "server_error") and str(e) == "out of memory"
    e = refused(api.event_chunk, HEAD, 0, Failed("boom"), False)
    assert e.status == 500


def test_error_shapes():
    e = ApiError("busy", status=429, kind="rate_limit_error", code="queue_full")
    assert e.body == {"error": {"message": "busy", "type": "rate_limit_error", "param": None, "code": "queue_full"}}
    assert events_of(api.error_chunk(e)) == [e.body]
    assert ApiError("x", status=503).body["error"]["type"] == "server_error"
    assert api.http_error(404, "Not Found").body["error"]["code"] == "not_found"
    assert api.http_error(405, "Method Not Allowed").body["error"]["code"] == "method_not_allowed"
    e = api.http_error(400, "bad")
    assert error(e) == (400, None, None, "invalid_request_error")


# ------------------------------------------------------------------ log-probabilities ---

BYTES_INFO = ModelInfo(
    "m", lambda s: list(s.encode()), 256, 300, 48, 100, token_bytes=lambda t: bytes([t]) if t < 256 else b"<eot>"
)


def test_logprobs_and_echo_fields_are_checked_by_name():
    def ask(**fields):
        return api.parse_completion({"model": "m", "prompt": "hi", **fields}, BYTES_INFO)

    assert (ask().logprobs, ask().echo) == (None, False)
    assert (ask(logprobs=0).logprobs, ask(logprobs=5, echo=True).echo) == (0, True)
    for bad in (-1, api.MAX_LOGPROBS + 1, True, 1.5, "2"):
        assert str(refused(ask, logprobs=bad)).startswith(f"logprobs must be an integer in [0, {api.MAX_LOGPROBS}]")
    assert error(refused(ask, echo="yes"))[:2] == (400, "echo")
    assert ask(echo=True, max_tokens=0, logprobs=1).max_tokens == 0  # lm-eval's scoring request
    assert "max_tokens must be an integer in [1, 100]" in str(refused(ask, max_tokens=0))
    assert api.sampling_params(ask(echo=True, logprobs=2), 0).prompt_logprobs == 2
    assert api.sampling_params(ask(logprobs=2), 0).prompt_logprobs is None

    def chat_(**fields):
        return api.parse_chat({"model": "m", "messages": [], **fields}, "hi", BYTES_INFO)

    assert chat_().logprobs is None and chat_(logprobs=False).logprobs is None
    assert chat_(logprobs=True).logprobs == 0 and chat_(logprobs=True, top_logprobs=3).logprobs == 3
    e = refused(api.chat_turns, {"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, INFO)
    assert error(e)[:2] == (400, "top_logprobs") and "needs logprobs set to true" in str(e)
    assert error(refused(chat_, logprobs=True, top_logprobs=21))[:2] == (400, "top_logprobs")


def test_fields_openai_does_not_define_are_ignored_and_logged_once(caplog):
    with caplog.at_level("WARNING", logger="ferrolm.serve"):
        req = completion(user="u", metadata={"a": "b"}, echo=False, top_k=3)
        assert not caplog.records  # OpenAI's own fields, and top_k (ferrolm's), are not news
        req = completion(best_of_n=3, repetition_penalty=1.1)
    assert req.prompts == [[104, 105]]
    (record,) = caplog.records
    assert "'best_of_n', 'repetition_penalty'" in record.getMessage()
    caplog.clear()
    with caplog.at_level("WARNING", logger="ferrolm.serve"):
        api.chat_turns({"model": "m", "messages": [{"role": "user", "content": "x"}], "foo": 1}, INFO)
        assert api.chat_turns({"model": "m", "messages": [{"role": "user", "content": "x"}], "echo": 1}, INFO)
    assert ["'foo'" in r.getMessage() for r in caplog.records] == [True, False]  # echo is not chat's field
    assert "'echo'" in caplog.records[1].getMessage()
    caplog.clear()
    with caplog.at_level("WARNING", logger="ferrolm.serve"):
        completion(**{"x\ny" + "z" * 100: 1}, **{f"f{i}": i for i in range(25)})
    (line,) = caplog.records
    assert "'x\\nyzz" in line.getMessage() and "z" * 70 not in line.getMessage()  # escaped, cut short
    assert "'f18'" in line.getMessage() and "'f19'" not in line.getMessage() and line.getMessage().endswith(", ...")


def test_token_strings_are_text_or_openai_bytes_notation():
    assert api.token_string(b" cat") == " cat"
    assert api.token_string(b"\xe2\x82") == "bytes:\\xe2\\x82"
    assert api.token_string("\u20ac".encode()) == "\u20ac"


def lp(token: int, value: float, *top) -> TokenLogprob:
    return TokenLogprob(token, value, tuple(top))


def test_a_whole_completion_with_echo_and_logprobs():
    req = api.parse_completion({"model": "m", "prompt": "ab", "echo": True, "logprobs": 1}, BYTES_INFO)
    reply = api.Reply(req)
    reply.add(0, PromptLogprobs((lp(98, -2.0, (99, -0.5)),)))
    reply.add(0, Piece("c", (lp(99, -0.25, (99, -0.25)),)))
    reply.add(0, Piece("", (lp(0xE2, -1.5, (120, -0.1)),)))  # a character's first byte: no text yet
    reply.add(0, Finished("length", 2))
    (choice,) = reply.body(HEAD, False)["choices"]
    assert choice["text"] == "abc"
    assert choice["logprobs"] == {
        "tokens": ["a", "b", "c", "bytes:\\xe2"],
        "token_logprobs": [None, -2.0, -0.25, -1.5],
        "top_logprobs": [None, {"c": -0.5, "b": -2.0}, {"c": -0.25}, {"x": -0.1, "bytes:\\xe2": -1.5}],
        "text_offset": [0, 1, 2, 3],
    }
    # Not asked: no logprobs, and echo gives the text of ids as well as of strings.
    req = api.parse_completion({"model": "m", "prompt": [[104, 105]], "echo": True}, BYTES_INFO)
    reply = api.Reply(req)
    reply.add(0, Piece("!"))
    reply.add(0, Finished("stop", 1))
    assert reply.body(HEAD, False)["choices"][0] == {
        "index": 0,
        "text": "hi!",
        "logprobs": None,
        "finish_reason": "stop",
    }


def test_a_whole_chat_reply_with_logprobs():
    req = api.parse_chat({"model": "m", "messages": [], "logprobs": True, "top_logprobs": 2}, "hi", BYTES_INFO)
    reply = api.Reply(req)
    reply.add(0, Piece("ok", (lp(111, -0.5, (111, -0.5), (112, -1.0)), lp(107, -0.1, (107, -0.1), (108, -3.0)))))
    reply.add(0, Finished("length", 2))
    (choice,) = reply.body(HEAD, True)["choices"]
    first = choice["logprobs"]["content"][0]
    assert first == {
        "token": "o",
        "logprob": -0.5,
        "bytes": [111],
        "top_logprobs": [
            {"token": "o", "logprob": -0.5, "bytes": [111]},
            {"token": "p", "logprob": -1.0, "bytes": [112]},
        ],
    }
    assert [c["token"] for c in choice["logprobs"]["content"]] == ["o", "k"]


def test_streamed_logprobs_and_echo():
    req = api.parse_completion({"model": "m", "prompt": "ab", "echo": True, "logprobs": 0, "stream": True}, BYTES_INFO)
    head = api.stream_head(HEAD, False, req)
    assert api.role_chunk(head, req, False) == b""  # the prompt goes out with its log-probabilities
    data, _ = api.stream_bunch(
        head, [(0, PromptLogprobs((lp(98, -2.0),))), (0, Piece("cd", (lp(99, -1.0),)))], False, req
    )
    echo, piece = [c["choices"][0] for c in events_of(data)]
    assert echo["text"] == "ab" and echo["logprobs"]["token_logprobs"] == [None, -2.0]
    assert piece["text"] == "cd" and piece["logprobs"]["text_offset"] == [2]  # offsets run on across chunks
    assert piece["logprobs"]["top_logprobs"] == [{"c": -1.0}]
    plain = api.parse_completion({"model": "m", "prompt": ["ab", "c"], "echo": True, "stream": True}, BYTES_INFO)
    opening = [c["choices"][0]["text"] for c in events_of(api.role_chunk(head, plain, False))]
    assert opening == ["ab", "c"]
    chat_req = api.parse_chat({"model": "m", "messages": [], "logprobs": True, "stream": True}, "hi", BYTES_INFO)
    (chunk,) = events_of(api.event_chunk(head, 0, Piece("o", (lp(111, -0.5),)), True, chat_req))
    assert chunk["choices"][0]["logprobs"] == {
        "content": [{"token": "o", "logprob": -0.5, "bytes": [111], "top_logprobs": []}]
    }
