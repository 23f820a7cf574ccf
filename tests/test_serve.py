"""ferrolm serve: the continuous-batching engine against generate(), and the HTTP server
against the official openai client: completions, chat, streaming, stop strings, seeds that
give `ferrolm generate`'s text, a bounded load test, disconnects, bad input, a clean drain."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from ferrolm.lm.engine import Engine, Failed, Finished, Piece, PromptLogprobs, SamplingParams
from ferrolm.lm.generate import generate, iter_text
from ferrolm.lm.model import TransformerLM

CTX = 48
TEXT = (
    "the cat sat on the mat. the dog sat on the log. a bird sang in the tree, and the cat looked up.\n"
    "User: where is the cat?\nAssistant: on the mat.\n"
) * 20


pytestmark = pytest.mark.usefixtures("_single_thread")  # as the server runs (--threads 1)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tokenizer trained on TEXT and a random-init model saved as a `ferrolm train` checkpoint.
    The model's end-of-text row of the LM head is zero: its logit is 0, so greedy decoding
    never picks it (some other logit is positive) and greedy runs last as long as asked."""
    from ferrolm.bpe.tokenizer import Tokenizer
    from ferrolm.lm.checkpoint import save_checkpoint

    tmp = tmp_path_factory.mktemp("serve")
    tok = Tokenizer.train(iter([TEXT]), 320, ["<|endoftext|>"], progress=False)
    tok.save(tmp / "tok")
    torch.manual_seed(7)
    model = TransformerLM(tok.vocab_size + 4, CTX, d_model=32, num_layers=2, num_heads=4, d_ff=64).eval()
    with torch.no_grad():
        model.lm_head.weight[tok.eos_id] = 0
    save_checkpoint(
        model,
        None,
        0,
        tmp / "run" / "best.pt",
        config={"model": model.config.to_dict()},
        tokenizer_fingerprint=tok.fingerprint,
    )
    return {"dir": tmp, "tok": tmp / "tok", "ckpt": tmp / "run" / "best.pt", "tokenizer": tok, "model": model}


# ----------------------------------------------------------------------- the engine ---


def _engine_text(events: queue.Queue) -> tuple[str, object]:
    text = ""
    while True:
        event = events.get(timeout=60)
        if isinstance(event, Piece):
            text += event.text
        else:
            return text, event


def _wait_counts(engine: Engine, want: tuple[int, int], within: float = 10.0) -> None:
    deadline = time.monotonic() + within  # a row leaves the batch just after its last event
    while engine.counts() != want and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.counts() == want


def _alone(model, token_bytes, eos, prompt, n, seed, **kw) -> str:
    g = torch.Generator().manual_seed(seed)
    return "".join(
        iter_text((t for t in generate(model, prompt, n, generator=g, eos_id=eos, **kw) if t != eos), token_bytes)
    )


def test_engine_rows_joining_and_leaving_sample_what_generate_samples_alone():
    torch.manual_seed(0)
    model = TransformerLM(64, 16, d_model=32, num_layers=2, num_heads=4, d_ff=64).eval()

    def token_bytes(t: int) -> bytes:
        return bytes([97 + t % 26])

    engine = Engine(model, token_bytes, eos_id=63, max_batch=3).start()  # 12 sequences through 3 rows
    settings = [{"temperature": 0.0}, {"temperature": 0.8, "top_k": 10}, {"temperature": 1.0, "top_p": 0.9}]
    cases, queues = [], []
    g = torch.Generator().manual_seed(1)
    for i in range(12):
        prompt = torch.randint(0, 63, (1 + i % 9,), generator=g).tolist()
        n = 5 + 7 * i  # up to 82 tokens: rows slide past the 16-token context at different steps
        events: queue.Queue = queue.Queue()
        engine.submit(prompt, SamplingParams(max_tokens=n, seed=i, **settings[i % 3]), events.put)
        cases.append((prompt, n, i, settings[i % 3]))
        queues.append(events)
    reasons = set()
    for (prompt, n, seed, kw), events in zip(cases, queues):
        text, end = _engine_text(events)
        assert text == _alone(model, token_bytes, 63, prompt, n, seed, **kw), (seed, kw)
        assert isinstance(end, Finished)
        reasons.add(end.reason)
        if end.reason == "length":
            assert end.completion_tokens == n == len(text)
        else:
            assert end.completion_tokens == len(text) + 1  # the end-of-text token counts, and is not shown
    assert reasons == {"stop", "length"}
    _wait_counts(engine, (0, 0))
    engine.close(timeout=10)


def test_engine_logprobs_are_the_models_log_softmax_and_only_where_asked():
    torch.manual_seed(0)
    model = TransformerLM(64, 32, d_model=32, num_layers=2, num_heads=4, d_ff=64).eval()
    engine = Engine(model, lambda t: bytes([97 + t % 26]), eos_id=None, max_batch=4)
    got: dict[str, list] = {"asked": [], "plain": [], "prompt": []}
    prompt = [5, 9, 2, 40, 7]
    asked = SamplingParams(max_tokens=12, temperature=0.8, top_k=20, seed=3, logprobs=3, prompt_logprobs=2)
    engine.submit(prompt, asked, got["asked"].append)
    engine.submit(prompt, SamplingParams(max_tokens=12, temperature=0.8, top_k=20, seed=3), got["plain"].append)
    engine.submit(prompt, SamplingParams(max_tokens=0, prompt_logprobs=1), got["prompt"].append)
    engine.run_until_done()

    first, *pieces, end = got["asked"]
    assert isinstance(first, PromptLogprobs) and end == Finished("length", 12)
    sampled = [e for p in pieces for e in p.logprobs]
    ids = prompt + [e.token for e in sampled]
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([ids])).float()[0], dim=-1)  # temperature 1, no top-k
    for pos, e in enumerate([*first.logprobs, *sampled], start=1):
        assert e.token == ids[pos] and e.logprob == pytest.approx(want[pos - 1, ids[pos]].item(), abs=1e-4)
        k = 2 if pos < len(prompt) else 3
        values, top = want[pos - 1].topk(k)
        assert [t for t, _ in e.top] == top.tolist()
        assert [v for _, v in e.top] == pytest.approx(values.tolist(), abs=1e-4)
    # Not asked: the same tokens (the draws do not change), no log-probabilities.
    assert all(isinstance(e, Piece) and e.logprobs == () for e in got["plain"][:-1])
    assert "".join(e.text for e in got["plain"][:-1]) == "".join(p.text for p in pieces)
    # max_tokens 0: the prompt's log-probabilities, then the end.
    only, end = got["prompt"]
    assert [e.token for e in only.logprobs] == prompt[1:] and end == Finished("length", 0)
    assert len(only.logprobs[0].top) == 1
    with pytest.raises(ValueError, match="prompt_logprobs must be None or an int >= 0, got -1"):
        SamplingParams(max_tokens=1, prompt_logprobs=-1)


def test_engine_cancel_frees_the_row_and_the_others_go_on():
    torch.manual_seed(0)
    model = TransformerLM(64, 32, d_model=32, num_layers=2, num_heads=4, d_ff=64).eval()
    engine = Engine(model, lambda t: b"x", eos_id=None, max_batch=2).start()
    gone, kept = queue.Queue(), queue.Queue()
    h = engine.submit([1, 2, 3], SamplingParams(max_tokens=100_000, temperature=0.0), gone.put)
    engine.submit([4, 5], SamplingParams(max_tokens=300, temperature=0.0), kept.put)
    gone.get(timeout=30)
    engine.cancel(h)
    _wait_counts(engine, (1, 0))
    text, end = _engine_text(kept)
    assert end == Finished("length", 300) and text == "x" * 300
    _wait_counts(engine, (0, 0))
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        engine.submit([64], SamplingParams(max_tokens=1), kept.put)
    engine.close(timeout=10)
    with pytest.raises(RuntimeError, match="shutting down"):
        engine.submit([1], SamplingParams(max_tokens=1), kept.put)
    assert not isinstance(end, Failed)


def test_engine_shares_rows_fairly_between_groups_and_parked_rows_resume_exactly():
    torch.manual_seed(0)
    model = TransformerLM(64, 16, d_model=32, num_layers=2, num_heads=4, d_ff=64).eval()

    def token_bytes(t: int) -> bytes:
        return bytes([97 + t % 26])

    engine = Engine(model, token_bytes, eos_id=None, max_batch=4).start()
    order: queue.Queue = queue.Queue()  # (group, index) of each sequence, as each one finishes
    cases = {}
    for group, count, n in (("big", 8, 150), ("small", 2, 10)):
        for i in range(count):
            events: queue.Queue = queue.Queue()

            def on_event(e, events=events, key=(group, i)):
                events.put(e)
                if isinstance(e, Finished):
                    order.put(key)

            prompt = [1 + i, 2, 3]
            engine.submit(prompt, SamplingParams(max_tokens=n, seed=i, temperature=0.8), on_event, group=group)
            cases[(group, i)] = (prompt, n, i, events)
        if group == "big":
            _wait_counts(engine, (4, 4))  # the big group holds every row
    finished = [order.get(timeout=60) for _ in cases]
    # the small group got its share of rows at once: it ended before any of the big one
    assert {finished[0][0], finished[1][0]} == {"small"}, finished
    for prompt, n, seed, events in cases.values():
        text, end = _engine_text(events)  # parked rows were recomputed: the same text as alone
        assert text == _alone(model, token_bytes, None, prompt, n, seed, temperature=0.8) and end.reason == "length"
    _wait_counts(engine, (0, 0))
    engine.close(timeout=10)


def test_engine_queue_limit_counts_waiting_groups_and_close_can_cancel_everything():
    from ferrolm.lm.engine import QueueFull

    torch.manual_seed(0)
    model = TransformerLM(64, 32, d_model=32, num_layers=2, num_heads=4, d_ff=64).eval()
    engine = Engine(model, lambda t: b"x", eos_id=None, max_batch=1, max_queue=1).start()
    running, waiting = queue.Queue(), queue.Queue()
    forever = SamplingParams(max_tokens=10**9, temperature=0.0)
    engine.submit([1], forever, running.put, group="a")
    running.get(timeout=30)
    engine.submit([2], forever, waiting.put, group="b")
    with pytest.raises(QueueFull, match="1 requests already wait"):
        engine.submit([3], forever, waiting.put, group="c")
    engine.submit([4], forever, waiting.put, group="b")  # one more of a queued group is no new request
    assert engine.counts() == (1, 2)
    started = time.monotonic()
    engine.close(timeout=30, cancel=True)
    assert not engine._thread.is_alive() and time.monotonic() - started < 30
    assert waiting.empty()
    idle = Engine(model, lambda t: b"x", eos_id=None, max_batch=1, max_queue=0)  # none may wait
    idle.submit([1], forever, waiting.put, group="a")  # a row is free for it
    with pytest.raises(QueueFull):
        idle.submit([2], forever, waiting.put, group="b")
    idle.close(cancel=True)


def test_chat_template_comes_from_the_tokenizer_folder_else_plain_text(tmp_path):
    pytest.importorskip("jinja2")
    from ferrolm.app.serve import PLAIN_CHAT_STOP, ChatTemplate

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    plain = ChatTemplate.find(tmp_path)
    assert plain.render(messages) == "System: Be brief.\n\nUser: Hi\n\nAssistant:"
    assert plain.default_stop == PLAIN_CHAT_STOP == ("\nUser:",)
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"})
    )
    assert ChatTemplate.find(tmp_path).render(messages) == "<system>Be brief.<user>Hi<assistant>"
    assert ChatTemplate.find(tmp_path).default_stop == ()
    (tmp_path / "chat_template.jinja").write_text("{{ messages[-1].content }}{{ eos_token }}")
    assert ChatTemplate.find(tmp_path).render(messages, "<|endoftext|>") == "Hi<|endoftext|>"
    override = tmp_path / "mine.jinja"
    override.write_text("{% if add_generation_prompt %}Q: {{ messages[-1]['content'] }}\nA:{% endif %}")
    assert ChatTemplate.find(tmp_path, override).render(messages) == "Q: Hi\nA:"
    override.write_text("{% for %}")
    with pytest.raises(ValueError, match="does not parse"):
        ChatTemplate.find(tmp_path, override)


def test_serve_without_the_extra_names_it_and_bad_options_are_errors(files, monkeypatch, capsys):
    from ferrolm.app.cli import main

    base = ["serve", "--checkpoint", str(files["ckpt"]), "--tokenizer", str(files["tok"])]
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "uvicorn", None)  # import uvicorn now raises ImportError
        assert main(base) == 2
        assert 'pip install "ferrolm[serve]"' in capsys.readouterr().err
    pytest.importorskip("uvicorn")
    for bad, message in (
        (["--port", "70000"], "--port must be in"),
        (["--max-batch", "0"], "--max-batch"),
        (["--stream-interval", "-1"], "--stream-interval"),
        (["--stream-interval", "nan"], "--stream-interval"),
        (["--max-queue", "-1"], "--max-queue"),
        (["--prefill-chunk", "-1"], "--prefill-chunk"),
        (["--write-timeout", "0"], "--write-timeout"),
        (["--shutdown-grace", "nan"], "--shutdown-grace"),
    ):
        assert main(base + bad) == 2
        assert message in capsys.readouterr().err


def test_outbox_hands_over_the_first_event_at_once_then_bunches_until_the_interval_or_an_end():
    import asyncio

    from ferrolm.app.serve import _Outbox

    async def scenario(interval: float) -> list[list]:
        outbox = _Outbox(asyncio.get_running_loop(), interval)

        def engine_thread() -> None:  # events as the engine's thread emits them
            for i in range(6):
                outbox.put(("piece", i), urgent=False)
                time.sleep(0.01)
            outbox.put(("end", 6), urgent=True)

        worker = threading.Thread(target=engine_thread)
        worker.start()
        bunches = []
        while not bunches or bunches[-1][-1][0] != "end":
            bunches.append(await asyncio.wait_for(outbox.get(), 10))
        worker.join()
        return bunches

    long = asyncio.run(scenario(60.0))  # nothing is due within the test but the first and the end
    assert long == [[("piece", 0)], [("piece", i) for i in range(1, 6)] + [("end", 6)]]
    every = asyncio.run(scenario(0.0))  # each event is due at once: nothing held back, order kept
    assert [e for bunch in every for e in bunch] == [("piece", i) for i in range(6)] + [("end", 6)]
    assert len(every) >= 4  # events 10 ms apart, the loop idle: hardly any share a hand-over


# ----------------------------------------------------------------------- the server ---


class Server:
    """`ferrolm serve` in a subprocess on a free port of 127.0.0.1."""

    def __init__(self, *args: str, timeout: float = 120):
        cmd = [sys.executable, "-m", "ferrolm", "serve", *args, "--port", "0", "--device", "cpu", "--threads", "1"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.log: list[str] = []
        ready = threading.Event()

        def drain() -> None:  # keep reading stderr so the server never blocks on a full pipe
            for line in self.proc.stderr:
                self.log.append(line)
                if "serving " in line:
                    ready.set()

        threading.Thread(target=drain, daemon=True).start()
        if not ready.wait(timeout):
            self.proc.kill()
            raise RuntimeError("the server did not start:\n" + "".join(self.log))
        line = next(x for x in self.log if "serving " in x)
        self.name = line.split()[1]
        self.port = int(re.search(r"http://[^ ]+:(\d+)/v1", line).group(1))
        self.url = f"http://127.0.0.1:{self.port}"

    def request(self, method: str, path: str, body=None, timeout: float = 60) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        data = body if isinstance(body, (bytes, str)) or body is None else json.dumps(body)
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
        conn.close()
        return resp.status, json.loads(raw)

    def client(self):
        openai = pytest.importorskip("openai")
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def rss_kb(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            return int(next(line for line in f if line.startswith("VmRSS")).split()[1])

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


@pytest.fixture(scope="module")
def server(files):
    pytest.importorskip("uvicorn")
    pytest.importorskip("starlette")
    pytest.importorskip("openai")
    s = Server("--checkpoint", str(files["ckpt"]), "--tokenizer", str(files["tok"]), "--max-batch", "8")
    yield s
    assert s.stop() == 0, "".join(s.log)


def _generate_cli(files, capsys, prompt: str, n: int, seed: int, *extra) -> str:
    """What `ferrolm generate` prints after the prompt (its trailing newline dropped)."""
    from ferrolm.app.cli import main

    capsys.readouterr()
    argv = ["generate", "--checkpoint", files["ckpt"], "--tokenizer", files["tok"], "--device", "cpu"]
    argv += ["--prompt", prompt, "--max-new-tokens", n, "--seed", seed, *extra]
    assert main([str(a) for a in argv]) == 0
    out = capsys.readouterr().out
    assert out.startswith(prompt) and out.endswith("\n")
    return out[len(prompt) : -1]


def test_models_and_health(server):
    assert server.name == "run/best"
    assert not any("warning" in line for line in server.log)  # 127.0.0.1: no warning
    assert [m.id for m in server.client().models.list().data] == ["run/best"]
    status, body = server.request("GET", "/health")
    assert status == 200 and body["status"] == "ok" and body["model"] == "run/best"


def test_completion_with_a_seed_is_what_ferrolm_generate_prints(server, files, capsys):
    client = server.client()
    sampling = {"temperature": 0.9, "top_p": 0.95}
    for prompt, seed in (("the cat", 5), ("a bird sang", 11), ("", 3)):
        want = _generate_cli(files, capsys, prompt, 40, seed, "--temperature", 0.9, "--top-p", 0.95)
        r = client.completions.create(model=server.name, prompt=prompt, max_tokens=40, seed=seed, **sampling)
        assert r.choices[0].text == want
        n_prompt = max(1, len(files["tokenizer"].encode(prompt)))  # '' starts from end-of-text
        assert r.usage.prompt_tokens == n_prompt and r.usage.total_tokens == n_prompt + r.usage.completion_tokens
        assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens <= 40
        stream = client.completions.create(
            model=server.name, prompt=prompt, max_tokens=40, seed=seed, stream=True, **sampling
        )
        # The client loop most code has: every chunk has a choice (no usage unless asked for).
        assert "".join(chunk.choices[0].text for chunk in stream) == want
        chunks = list(
            client.completions.create(
                model=server.name,
                prompt=prompt,
                max_tokens=40,
                seed=seed,
                stream=True,
                stream_options={"include_usage": True},
                **sampling,
            )
        )
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want
        assert all(c.usage is None for c in chunks[:-1])
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    # top_k, and n choices: choice j is seeded with seed + j
    r = client.completions.create(
        model=server.name, prompt="the dog", max_tokens=30, seed=8, n=3, extra_body={"top_k": 20}
    )
    for j, choice in enumerate(r.choices):
        assert choice.index == j
        assert choice.text == _generate_cli(files, capsys, "the dog", 30, 8 + j, "--top-k", 20)


def test_chat_goes_through_the_plain_template_and_stops_at_a_new_user_turn(server, files, capsys):
    client = server.client()
    messages = [{"role": "system", "content": "You answer."}, {"role": "user", "content": "where is the cat?"}]
    prompt = "System: You answer.\n\nUser: where is the cat?\n\nAssistant:"
    want = _generate_cli(files, capsys, prompt, 60, 4, "--temperature", 0.7, "--stop", "\nUser:")
    r = client.chat.completions.create(model=server.name, messages=messages, max_tokens=60, seed=4, temperature=0.7)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want
    assert r.usage.prompt_tokens == len(files["tokenizer"].encode(prompt))
    chunks = list(
        client.chat.completions.create(
            model=server.name,
            messages=messages,
            max_tokens=60,
            seed=4,
            temperature=0.7,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-2].choices[0].finish_reason == r.choices[0].finish_reason
    assert chunks[-1].usage.total_tokens == r.usage.total_tokens
    # A caller's stop strings come on top of the template's.
    want = _generate_cli(files, capsys, prompt, 60, 4, "--temperature", 0.7, "--stop", "\nUser:", "--stop", "the")
    r = client.chat.completions.create(
        model=server.name, messages=messages, max_tokens=60, seed=4, temperature=0.7, stop="the"
    )
    assert r.choices[0].message.content == want


def test_stop_strings_cut_the_text_and_end_the_sequence(server):
    client = server.client()
    full = client.completions.create(model=server.name, prompt="the mat", max_tokens=40, temperature=0).choices[0]
    assert full.finish_reason == "length" and len(full.text) > 12  # greedy never picks end-of-text here
    stop = full.text[8:11]
    want = full.text[: full.text.index(stop)]
    for stream in (False, True):
        r = client.completions.create(
            model=server.name,
            prompt="the mat",
            max_tokens=40,
            temperature=0,
            stop=[stop, "never there"],
            stream=stream,
            **({"stream_options": {"include_usage": True}} if stream else {}),
        )
        if stream:
            chunks = list(r)
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            usage = chunks[-1].usage
        else:
            text, reason, usage = r.choices[0].text, r.choices[0].finish_reason, r.usage
        assert (text, reason) == (want, "stop")
        assert usage.completion_tokens < 40


def test_load_16_concurrent_clients_200_requests_all_correct_memory_flat(server, files, capsys):
    client = server.client()
    cases = [(p, s) for p in ("the cat", "a dog", "on the log", "the tree, and") for s in (1, 2)]
    want = {c: _generate_cli(files, capsys, c[0], 16, c[1], "--temperature", 0.8) for c in cases}

    def one(i: int) -> bool:
        prompt, seed = cases[i % len(cases)]
        if i % 3 == 0:
            chunks = client.completions.create(
                model=server.name, prompt=prompt, max_tokens=16, seed=seed, temperature=0.8, stream=True
            )
            text = "".join(c.choices[0].text for c in chunks if c.choices)
        else:
            text = (
                client.completions.create(model=server.name, prompt=prompt, max_tokens=16, seed=seed, temperature=0.8)
                .choices[0]
                .text
            )
        return text == want[(prompt, seed)]

    with ThreadPoolExecutor(16) as pool:
        assert all(pool.map(one, range(32)))  # warm up: allocator pools, lazy imports
        before = server.rss_kb()
        started = time.monotonic()
        results = list(pool.map(one, range(200)))
        elapsed = time.monotonic() - started
    grown_mb = (server.rss_kb() - before) / 1024
    assert results == [True] * 200
    assert grown_mb < 32, f"server memory grew {grown_mb:.1f} MB over 200 requests"
    status, body = server.request("GET", "/health")
    assert (body["running"], body["waiting"]) == (0, 0)
    print(f"200 requests, 16 clients: {elapsed:.1f} s, memory {grown_mb:+.1f} MB")


def _open_stream(server, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}))
    resp = conn.getresponse()
    assert resp.status == 200
    return conn, resp


def _wait_running(server, want: int, within: float = 10.0) -> float:
    started = time.monotonic()
    while time.monotonic() - started < within:
        if server.request("GET", "/health")[1]["running"] == want:
            return time.monotonic() - started
        time.sleep(0.02)
    raise AssertionError(f"running never became {want}")


def test_a_slow_or_gone_client_blocks_no_one_and_frees_its_row(server):
    client = server.client()
    long = {"model": server.name, "prompt": "the cat", "max_tokens": 4000, "temperature": 0}
    # A client that stops reading: its tokens queue on the server; the others still finish.
    slow_conn, slow = _open_stream(server, long)
    slow.readline()
    _wait_running(server, 1)
    r = client.completions.create(model=server.name, prompt="the dog", max_tokens=20, temperature=0)
    assert r.choices[0].finish_reason == "length"
    # Clients that disconnect mid-stream, or before a non-streamed reply: their rows free at once.
    gone_conn, gone = _open_stream(server, long)
    gone.readline()
    _wait_running(server, 2)
    gone_conn.sock.shutdown(2)
    gone_conn.close()
    assert _wait_running(server, 1, within=5) < 5
    slow_conn.sock.shutdown(2)
    slow_conn.close()
    _wait_running(server, 0, within=5)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps(long))
    _wait_running(server, 1)
    conn.sock.shutdown(2)
    conn.close()
    _wait_running(server, 0, within=5)


BAD = [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    ({"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    ({"prompt": "hi"}, 400, "model"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": ["a", 1]}, 400, "prompt"),
    ({"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 10**12}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": "10"}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 2.5}, 400, "max_tokens"),
    ({"prompt": "hi", "temperature": -0.1}, 400, "temperature"),
    ({"prompt": "hi", "temperature": 2.5}, 400, "temperature"),
    ({"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "hi", "top_k": 0}, 400, "top_k"),
    ({"prompt": "hi", "top_k": True}, 400, "top_k"),
    ({"prompt": "hi", "n": 0}, 400, "n"),
    ({"prompt": "hi", "n": "2"}, 400, "n"),
    ({"prompt": ["hi"] * 9, "n": 64}, 400, "n"),
    ({"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ({"prompt": "hi", "stop": 3}, 400, "stop"),
    ({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"prompt": "hi", "seed": "x"}, 400, "seed"),
    ({"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "hi", "echo": "yes"}, 400, "echo"),
    ({"prompt": "hi", "best_of": 3}, 400, "best_of"),
    ({"prompt": "the cat sat on the mat. " * 20}, 400, "prompt"),
    ({"prompt": list(range(CTX + 1))}, 400, "prompt"),
    ({"prompt": [1, 2, 10**6]}, 400, "prompt"),
    ({"prompt": [1, -1]}, 400, "prompt"),
    ({"prompt": [[1, 2], [3, "4"]]}, 400, "prompt"),
]
BAD_CHAT = [
    ({"messages": []}, 400, "messages"),
    ({"messages": "hi"}, 400, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "the cat sat on the mat. " * 20}]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -5}, 400, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": 2}, 400, "logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, "top_logprobs"),
]


def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(server):
    for path, cases in (("/v1/completions", BAD), ("/v1/chat/completions", BAD_CHAT)):
        for body, status, param in cases:
            if isinstance(body, dict) and "model" not in body and param != "model":
                body = {"model": server.name, **body}
            got, reply = server.request("POST", path, body)
            assert got == status, (body, reply)
            err = reply["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"], (body, reply)
            assert err["param"] == param and err["type"] == "invalid_request_error", (body, reply)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Length", str(9 << 20))  # refused on its length, before any of it is read
    conn.endheaders(b"{")
    resp = conn.getresponse()
    assert resp.status == 413 and json.loads(resp.read())["error"]["message"].startswith("the request body is over")
    conn.close()
    assert server.request("GET", "/v1/nothing")[0] == 404
    assert server.request("GET", "/v1/completions")[0] == 405
    openai = pytest.importorskip("openai")
    client = server.client()
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=server.name, prompt="hi", temperature=3)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    r = client.completions.create(model=server.name, prompt=[[5, 6], [7]], max_tokens=3, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3] and r.usage.prompt_tokens == 3
    assert server.request("GET", "/health")[1]["status"] == "ok"


def test_an_exported_folder_serves_the_same_text_and_sigterm_drains(server, files, tmp_path):
    from ferrolm.lm.export import export_hf

    folder = export_hf(files["ckpt"], tmp_path / "exported", files["tok"])
    exported = Server("--checkpoint", str(folder))
    try:
        assert exported.name == "exported"
        body = {"prompt": "the cat", "max_tokens": 30, "temperature": 0}
        _, want = server.request("POST", "/v1/completions", {"model": server.name, **body})
        _, got = exported.request("POST", "/v1/completions", {"model": "exported", **body})
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
        # SIGTERM while a long reply is running: it is finished, then the process exits 0.
        conn, resp = _open_stream(
            exported,
            {
                "model": "exported",
                "prompt": "the",
                "max_tokens": 300,
                "temperature": 0,
                "stream_options": {"include_usage": True},
            },
        )
        resp.readline()
        exported.proc.send_signal(signal.SIGTERM)
        text, reasons, usage = "", [], None
        for line in resp:
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"]:
                    text += chunk["choices"][0]["text"]
                    reasons.append(chunk["choices"][0]["finish_reason"])
                else:
                    usage = chunk["usage"]
        conn.close()
        assert reasons[-1] == "length" and usage["completion_tokens"] == 300
        assert exported.proc.wait(60) == 0, "".join(exported.log)
    finally:
        if exported.proc.poll() is None:
            exported.proc.kill()
    assert os.path.isdir(folder)


# ----------------------------------------------------------------------- stop strings ---


def _first_stop_naive(text: str, stops: list[str]) -> str:
    """The text before the stop string that ends first (the longest of those ending together)."""
    for end in range(1, len(text) + 1):
        found = [s for s in stops if s and text[:end].endswith(s)]
        if found:
            return text[: end - max(map(len, found))]
    return text


def test_stop_text_equals_the_naive_matcher_on_random_texts_pieces_and_stops():
    import random

    from ferrolm.lm.generate import StopText

    rng = random.Random(3)
    for case in range(3000):
        alphabet = "ab" if case % 2 else "abc\n"
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(0, 4))]
        cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, len(text) + 1)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        stop, shown, seen = StopText(stops), "", ""
        for piece in pieces:
            shown += stop.feed(piece)
            seen += piece
            want = _first_stop_naive(seen, stops)
            if want != seen:  # a stop string appeared: the text before it, and done
                assert (shown, stop.done) == (want, True), (text, stops, pieces)
                break
            # held back: exactly the longest end of the text that begins some stop string
            held = max((k for s in stops for k in range(1, len(s)) if seen.endswith(s[:k])), default=0)
            assert shown == seen[: len(seen) - held] and not stop.done, (text, stops, pieces)
        shown += stop.flush()
        assert shown == _first_stop_naive(text, stops), (text, stops, pieces)
        assert StopText(stops).cut(text) == shown


def test_stop_strings_as_long_as_the_output_cost_time_linear_in_it():
    from ferrolm.lm.generate import StopText

    # A text that keeps matching most of each stop string: the held-back end and the
    # candidate prefixes are as long as the stop strings, every step.
    n = 200_000
    stops = ["a" * (n // 2) + "b", "a" * (n // 3) + "c", "ab" * (n // 4) + "d", "x" * n]
    stop = StopText(stops)
    started = time.monotonic()
    shown = "".join(stop.feed("a") for _ in range(n)) + stop.flush()
    assert time.monotonic() - started < 30  # a matcher quadratic in the stop length takes hours here
    assert shown == "a" * n and not stop.done
    stop = StopText(stops)
    assert stop.feed("a" * (n // 3) + "c" + "tail") == "" and stop.done


# ----------------------------------------------------------------------- abuse ---


def _stalled_stream(port: int, body: dict) -> socket.socket:
    """A streaming request from a client that never reads (a tiny receive buffer: the
    server's sends block soon)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    data = json.dumps({**body, "stream": True}).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}"
    sock.sendall(head.encode() + b"\r\n\r\n" + data)
    return sock


def _stop_within(s: Server, seconds: float, *signals: int) -> int:
    """Send ``signals`` (0.5 s apart); the exit status, which must come within ``seconds``."""
    try:
        for sig in signals:
            s.proc.send_signal(sig)
            time.sleep(0.5)
        return s.proc.wait(seconds)
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait()


STALL = {"prompt": "the cat", "n": 16, "max_tokens": 4096, "temperature": 0}


@pytest.mark.parametrize("case", ["two signals", "one signal", "write timeout"])
def test_a_client_that_never_reads_cannot_hold_the_server(files, case):
    pytest.importorskip("uvicorn")
    # two signals: the defaults (30 s of write timeout and of shutdown grace): the second forces
    # the exit; one signal: the grace runs out; write timeout: the stream ends with no signal.
    extra = {"two signals": [], "one signal": ["--shutdown-grace", "2"], "write timeout": ["--write-timeout", "1"]}
    s = Server("--checkpoint", str(files["ckpt"]), "--tokenizer", str(files["tok"]), *extra[case])
    sock = None
    try:
        sock = _stalled_stream(s.port, {"model": s.name, **STALL})
        _wait_running(s, 16)
        if case == "write timeout":
            # Its sequences are cancelled and the connection dropped: the rest is never sent.
            _wait_running(s, 0, within=30)
            sock.settimeout(10)
            received = b""
            with contextlib.suppress(ConnectionResetError):
                while chunk := sock.recv(1 << 16):
                    received += chunk
            assert received.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in received
            assert s.request("GET", "/health")[1]["running"] == 0
            assert _stop_within(s, 60, signal.SIGTERM) == 0, "".join(s.log)
            return
        time.sleep(1)  # its sends block now: the buffers between it and the server are full
        sent = (signal.SIGTERM,) * (2 if case == "two signals" else 1)
        assert _stop_within(s, 15, *sent) == 0, "".join(s.log)
    finally:
        if sock is not None:
            sock.close()
        if s.proc.poll() is None:
            s.proc.kill()


def test_fair_rows_a_request_of_many_sequences_does_not_keep_others_waiting(server):
    conn, resp = _open_stream(server, {"model": server.name, "prompt": "the cat", "n": 32, "max_tokens": 4000})
    done = threading.Event()

    def read() -> None:
        with contextlib.suppress(http.client.HTTPException, OSError, ValueError):  # until it is cut off
            for line in resp:
                if line.startswith(b"data: [DONE]"):
                    done.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        _wait_running(server, 8)  # the server's --max-batch: all rows to the big request
        r = server.client().completions.create(model=server.name, prompt="the dog", max_tokens=20, temperature=0)
        assert r.choices[0].finish_reason == "length"
        assert not done.is_set() and server.request("GET", "/health")[1]["running"] >= 1
    finally:
        conn.sock.shutdown(2)
        reader.join(30)
        conn.close()
    _wait_running(server, 0, within=10)


def test_deep_json_is_a_400_and_brackets_in_strings_are_text(server):
    for depth in (65, 100_000):
        body = f'{{"model": "{server.name}", "prompt": ' + "[" * depth + "1" + "]" * depth + "}"
        status, reply = server.request("POST", "/v1/completions", body)
        assert status == 400 and "nests deeper than 64" in reply["error"]["message"], reply
    status, reply = server.request("POST", "/v1/completions", body.replace("[", "{").replace("]", "}"))
    assert status == 400, reply
    text = "[" * 100 + "{" * 100
    body = {"model": server.name, "prompt": [[5, 6]] * 40, "max_tokens": 1, "stop": [text]}
    assert server.request("POST", "/v1/completions", body)[0] == 200


def test_a_non_local_host_is_warned_about(files, capsys):
    pytest.importorskip("uvicorn")
    from ferrolm.app.cli import main
    from ferrolm.app.serve import _is_loopback

    assert all(map(_is_loopback, ["localhost", "127.0.0.1", "127.3.2.1", "::1", "[::1]"]))
    assert not any(map(_is_loopback, ["0.0.0.0", "::", "192.168.1.2", "example.com", ""]))
    argv = ["serve", "--checkpoint", str(files["ckpt"]), "--tokenizer", str(files["tok"]), "--device", "cpu"]
    assert main([*argv, "--host", "192.0.2.1", "--port", "0"]) == 2  # a documentation address: not ours
    err = capsys.readouterr().err
    assert "warning: --host 192.0.2.1 serves anyone" in err and "cannot listen on 192.0.2.1" in err


CHAT_TEMPLATE = (
    "{% set last = messages[-1]['content'] %}"
    "{% if last == 'refuse' %}{{ raise_exception('only questions about cats') }}"
    "{% elif last == 'loop' %}{% for a in range(100000) %}{% for b in range(100000) %}x{% endfor %}{% endfor %}"
    "{% elif last == 'spin' %}{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
    "{% elif last == 'big' %}{{ 'x' * 400000000 }}"
    "{% elif last == 'grow' %}{{ ('x' * 1000) | replace('x', 'x' * 1000) | replace('x', 'x' * 1000) }}"
    "{% else %}{{ strftime_now('%Y') }} User: {{ last }}\nAssistant:{% endif %}"
)


@pytest.fixture(scope="module")
def guarded(files, tmp_path_factory):
    """A server with one batch row, a queue of one request and a chat template added to its tokenizer folder's tokenizer_config.json, the Hugging Face way."""
    pytest.importorskip("uvicorn")
    pytest.importorskip("openai")
    tok = tmp_path_factory.mktemp("edited") / "tok"
    tok.mkdir()
    for p in files["tok"].iterdir():
        (tok / p.name).write_bytes(p.read_bytes())
    config = json.loads((tok / "tokenizer_config.json").read_text())
    (tok / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    flags = ["--max-batch", "1", "--max-queue", "1"]
    s = Server("--checkpoint", str(files["ckpt"]), "--tokenizer", str(tok), *flags)
    try:
        yield s
        assert _chat(s, "hi")[0] == 200
        children = _children(s.proc.pid)  # the chat template's render processes
        assert children
    finally:
        assert _stop_within(s, 60, signal.SIGTERM) == 0, "".join(s.log)
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in children)  # none outlives its server


def _children(pid: int) -> list[int]:
    out = []
    for stat in os.listdir("/proc"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{stat}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(stat))
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _chat(s: Server, content: str) -> tuple[int, dict]:
    body = {"model": s.name, "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    return s.request("POST", "/v1/chat/completions", body)


def test_chat_template_from_tokenizer_config_with_transformers_globals(guarded, files):
    assert "tokenizer_config.json (chat_template)" in "".join(guarded.log)
    status, reply = _chat(guarded, "hi")
    assert status == 200, reply
    prompt = f"{time.strftime('%Y')} User: hi\nAssistant:"
    assert reply["usage"]["prompt_tokens"] == len(files["tokenizer"].encode(prompt))
    status, reply = _chat(guarded, "refuse")
    assert status == 400 and reply["error"]["param"] == "messages", reply
    assert reply["error"]["message"] == "the chat template refused these messages: only questions about cats"


@pytest.mark.parametrize("content", ["loop", "spin", "big", "grow"])
def test_a_runaway_chat_template_is_a_400_and_the_server_stays_responsive(guarded, content):
    before = guarded.rss_kb()
    with ThreadPoolExecutor(1) as pool:
        bad = pool.submit(_chat, guarded, content)
        slowest = 0.0
        while not bad.done():  # /health answers all along
            started = time.monotonic()
            assert guarded.request("GET", "/health", timeout=10)[0] == 200
            slowest = max(slowest, time.monotonic() - started)
            time.sleep(0.1)
        status, reply = bad.result()
    assert status == 400 and reply["error"]["param"] == "messages", reply
    assert "chat template" in reply["error"]["message"], reply
    assert slowest < 2.0, f"/health took {slowest:.1f} s during the render"
    assert (guarded.rss_kb() - before) < 100 << 10  # the server's memory: the render is elsewhere
    assert _chat(guarded, "hi")[0] == 200  # a fresh render process took over


def test_a_full_queue_is_a_429(guarded):
    openai = pytest.importorskip("openai")
    body = {"model": guarded.name, "prompt": "the", "max_tokens": 4000, "temperature": 0}
    first = _open_stream(guarded, body)  # the one row
    _wait_running(guarded, 1)
    second = _open_stream(guarded, body)  # the one place in the queue
    try:
        status, reply = guarded.request("POST", "/v1/completions", body)
        assert status == 429 and reply["error"]["code"] == "queue_full", reply
        assert reply["error"]["type"] == "rate_limit_error" and "retry later" in reply["error"]["message"]
        with pytest.raises(openai.RateLimitError):
            guarded.client().completions.create(**body)
    finally:
        for conn, _ in (first, second):
            conn.sock.shutdown(2)
            conn.close()
    _wait_running(guarded, 0, within=10)
