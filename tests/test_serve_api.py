"""`ferrolm serve`'s OpenAI conformance over HTTP: log-probabilities and echo against a direct
forward pass of the model (the official openai client, whole and streamed), fields OpenAI does
not define ignored and logged, the API key, CORS, and /metrics (with and without
prometheus_client)."""

from __future__ import annotations

import contextlib
import sys

import pytest
import torch
from test_serve import Server, files  # noqa: F401 -- the fixtures, shared

from ferrolm.app.openai_api import token_string

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")
openai = pytest.importorskip("openai")
pytestmark = pytest.mark.usefixtures("_single_thread")  # as the server runs (--threads 1)

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def server(files):  # noqa: F811
    s = Server("--checkpoint", str(files["ckpt"]), "--tokenizer", str(files["tok"]), "--api-key", KEY)
    yield s
    assert s.stop() == 0, "".join(s.log)


def _client(s: Server, key: str = KEY):
    return openai.OpenAI(base_url=s.url + "/v1", api_key=key, max_retries=0, timeout=120)


def _log_softmax(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).float()[0], dim=-1)


def _greedy(model, ids: list[int], n: int) -> list[tuple[int, float, torch.Tensor]]:
    """(token, its log-probability, the row's log-probabilities) of n greedy steps."""
    ids, out = list(ids), []
    for _ in range(n):
        row = _log_softmax(model, ids)[-1]
        t = int(row.argmax())
        out.append((t, row[t].item(), row))
        ids.append(t)
    return out


def _bytes(tok, t: int) -> bytes:
    return tok.token_bytes(t) if t < tok.vocab_size else "\ufffd".encode()  # the model's ids past the tokenizer's


def _text(tok, t: int) -> str:
    return token_string(_bytes(tok, t))


def test_completion_logprobs_are_the_models_whole_and_streamed(server, files):  # noqa: F811
    model, tok = files["model"], files["tokenizer"]
    prompt = tok.encode("the cat sat on")
    want = _greedy(model, prompt, 8)
    client = _client(server)
    r = client.completions.create(model=server.name, prompt=prompt, max_tokens=8, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp.tokens == [_text(tok, t) for t, _, _ in want]
    assert lp.token_logprobs == pytest.approx([v for _, v, _ in want], abs=1e-4)
    for top, (t, v, row) in zip(lp.top_logprobs, want):
        values, ids = row.topk(2)
        assert list(top) == [_text(tok, i) for i in ids.tolist()]  # greedy: the token is the likeliest
        assert list(top.values()) == pytest.approx(values.tolist(), abs=1e-4)
    lengths = [len(_bytes(tok, t).decode("utf-8", errors="replace")) for t, _, _ in want]
    assert lp.text_offset == [sum(lengths[:i]) for i in range(8)]  # each token's characters as it decodes alone
    # Sampled at a temperature, the log-probabilities are still the model's own (temperature 1).
    hot = client.completions.create(model=server.name, prompt=prompt, max_tokens=8, temperature=1.7, seed=5, logprobs=0)
    first, value = hot.choices[0].logprobs.tokens[0], hot.choices[0].logprobs.token_logprobs[0]
    row = _log_softmax(model, prompt)[-1]
    same = [row[i].item() for i in range(len(row)) if _text(tok, i) == first]
    assert any(v == pytest.approx(value, abs=1e-4) for v in same)

    chunks = list(
        client.completions.create(
            model=server.name, prompt=prompt, max_tokens=8, temperature=0, logprobs=2, stream=True
        )
    )
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs is not None]
    assert [t for c in streamed for t in c.tokens] == lp.tokens
    assert [v for c in streamed for v in c.token_logprobs] == pytest.approx(lp.token_logprobs, abs=1e-6)
    assert [o for c in streamed for o in c.text_offset] == lp.text_offset
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text


def test_echo_with_no_new_tokens_scores_the_prompt(server, files):  # noqa: F811
    model, tok = files["model"], files["tokenizer"]
    text = "the dog sat on the log."
    prompt = tok.encode(text)
    want = _log_softmax(model, prompt)
    client = _client(server)
    for asked in (text, prompt):  # a string, or its ids
        r = client.completions.create(model=server.name, prompt=asked, max_tokens=0, echo=True, logprobs=1)
        (choice,) = r.choices
        assert choice.text == text and choice.finish_reason == "length"
        assert choice.logprobs.tokens == [_text(tok, t) for t in prompt]
        assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
        picked = [want[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
        assert choice.logprobs.token_logprobs[1:] == pytest.approx(picked, abs=1e-4)
        for i, top in enumerate(choice.logprobs.top_logprobs[1:], start=1):
            assert max(top.values()) == pytest.approx(want[i - 1].max().item(), abs=1e-4)
        assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 0
    # Echo and new tokens, streamed: the prompt first, then the reply.
    chunks = list(client.completions.create(model=server.name, prompt=text, max_tokens=3, echo=True, stream=True))
    whole = client.completions.create(model=server.name, prompt=text, max_tokens=3, echo=True, temperature=0)
    assert chunks[0].choices[0].text == text and whole.choices[0].text.startswith(text)
    refused = pytest.raises(openai.BadRequestError, match="max_tokens must be an integer in")
    with refused:
        client.completions.create(model=server.name, prompt=text, max_tokens=0)


def test_chat_logprobs_in_openais_shape_whole_and_streamed(server):
    client = _client(server)
    messages = [{"role": "user", "content": "where is the cat?"}]
    r = client.chat.completions.create(
        model=server.name, messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert b"".join(bytes(c.bytes) for c in content).decode("utf-8", errors="replace") == r.choices[0].message.content
    for c in content:
        assert token_string(bytes(c.bytes)) == c.token and len(c.top_logprobs) == 3
        assert c.top_logprobs[0].token == c.token and c.top_logprobs[0].logprob == pytest.approx(c.logprob)
        assert c.logprob <= 0 and [t.logprob for t in c.top_logprobs] == sorted(
            (t.logprob for t in c.top_logprobs), reverse=True
        )
    stream = client.chat.completions.create(
        model=server.name, messages=messages, max_tokens=6, temperature=0, logprobs=True, stream=True
    )
    streamed = [
        e for chunk in stream if chunk.choices and chunk.choices[0].logprobs for e in chunk.choices[0].logprobs.content
    ]
    assert [e.token for e in streamed] == [c.token for c in content]
    assert all(e.top_logprobs == [] for e in streamed)  # top_logprobs not asked: none listed
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs set to true"):
        client.chat.completions.create(model=server.name, messages=messages, max_tokens=2, top_logprobs=2)


def test_unknown_fields_are_ignored_and_logged_openais_unimplemented_refused(server):
    client = _client(server)
    r = client.completions.create(
        model=server.name, prompt="the", max_tokens=2, extra_body={"frobnicate_level": 3, "user": "me"}
    )
    assert r.choices[0].finish_reason in ("length", "stop")
    assert any("'frobnicate_level'" in line and "'user'" not in line for line in server.log)
    with pytest.raises(openai.BadRequestError, match="presence_penalty is not supported"):
        client.completions.create(model=server.name, prompt="the", max_tokens=2, presence_penalty=1.0)


def test_the_api_key_guards_the_v1_routes_only(server):
    assert [m.id for m in _client(server).models.list().data] == [server.name]
    with pytest.raises(openai.AuthenticationError) as e:
        _client(server, "wrong").models.list()
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    status, body = server.request("POST", "/v1/completions", {"model": server.name, "prompt": "x"})
    assert status == 401 and body["error"]["type"] == "invalid_request_error"
    assert server.request("GET", "/health")[0] == 200
    assert not any("warning" in line for line in server.log)


# ---------------------------------------------------------------- in-process app ---


@pytest.fixture(scope="module")
def served(files):  # noqa: F811
    from ferrolm.app.serve import load_served_model

    return load_served_model(files["ckpt"], files["tok"], device="cpu", name="m")


@contextlib.contextmanager
def _app(served, **options):
    """A client of the app, without its lifespan (which would start chat-template render
    processes that outlive the client's event loop): the engine is started here."""
    from starlette.testclient import TestClient

    from ferrolm.app.serve import create_app
    from ferrolm.lm.engine import Engine

    engine = Engine(served.model, served.token_bytes, served.tokenizer.eos_id, max_batch=2).start()
    try:
        yield TestClient(create_app(served, engine, **options))
    finally:
        engine.close(10.0, cancel=True)


def test_cors_answers_preflight_for_the_allowed_origins_before_the_key(served):
    with _app(served, api_key=KEY, allowed_origins=["https://app.example"]) as c:
        ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
        r = c.options("/v1/chat/completions", headers={"Origin": "https://app.example", **ask})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        r = c.options("/v1/chat/completions", headers={"Origin": "https://evil.example", **ask})
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
        r = c.get("/v1/models", headers={"Origin": "https://app.example"})  # no key: refused, readable by the page
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "https://app.example"
        assert r.json()["error"]["code"] == "invalid_api_key"
        r = c.get("/v1/models", headers={"Origin": "https://app.example", "Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200
    with _app(served) as c:  # no origins given: no CORS headers
        r = c.get("/v1/models", headers={"Origin": "https://app.example"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def _samples(text: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_count_requests_tokens_and_first_tokens(served):
    pytest.importorskip("prometheus_client")
    prompt = served.tokenizer.encode("the cat sat")
    body = {"model": "m", "prompt": prompt, "max_tokens": 5, "temperature": 0, "n": 2}
    with _app(served, api_key=KEY) as c:
        assert c.post("/v1/completions", json=body).status_code == 401
        r = c.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200
        assert c.get("/no/such/route").status_code == 404
        m = c.get("/metrics")
    assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")
    got = _samples(m.text)
    route = lambda path, status: ("ferrolm_requests_total", (("route", path), ("status", status)))  # noqa: E731
    assert got[route("/v1/completions", "401")] == 1 and got[route("/v1/completions", "200")] == 1
    assert got[route("other", "404")] == 1
    assert got[("ferrolm_prompt_tokens_total", ())] == len(prompt)
    assert got[("ferrolm_generation_tokens_total", ())] == r.json()["usage"]["completion_tokens"] == 10
    assert got[("ferrolm_time_to_first_token_seconds_count", ())] == 2  # one a choice
    assert got[("ferrolm_running_sequences", ())] == 0 and got[("ferrolm_queue_length", ())] == 0


def test_metrics_without_prometheus_client_name_the_extra_and_the_rest_serves(served, monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import fails as if not installed
    with _app(served) as c:
        r = c.get("/metrics")
        assert r.status_code == 501 and 'pip install "ferrolm[serve]"' in r.json()["error"]["message"]
        assert c.get("/v1/models").status_code == 200


def test_serve_options_key_from_the_environment_and_bad_origins(files, capsys, monkeypatch):  # noqa: F811
    from ferrolm.app.cli import main

    argv = ["serve", "--checkpoint", str(files["ckpt"]), "--tokenizer", str(files["tok"]), "--device", "cpu"]
    monkeypatch.setenv("FERROLM_API_KEY", KEY)
    assert main([*argv, "--host", "192.0.2.1", "--port", "0"]) == 2  # a documentation address: not ours
    err = capsys.readouterr().err
    assert "cannot listen on 192.0.2.1" in err and "warning" not in err  # a key is set: no warning
    monkeypatch.delenv("FERROLM_API_KEY")
    assert main([*argv, "--host", "192.0.2.1", "--port", "0"]) == 2
    assert "no authentication (--api-key or FERROLM_API_KEY sets a key)" in capsys.readouterr().err
    assert main([*argv, "--allowed-origins", "https://a.example/path"]) == 2
    assert "--allowed-origins takes * or origins such as https://example.com" in capsys.readouterr().err
    assert main([*argv, "--api-key", " "]) == 2
    assert "--api-key (or FERROLM_API_KEY) must not be empty" in capsys.readouterr().err
