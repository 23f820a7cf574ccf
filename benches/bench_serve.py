"""Serving speed: `ferrolm serve` with 1 and 16 concurrent streams, time to first token, and
one stream's decode speed against `generate` (what `ferrolm generate` runs).

The model has the `cpu-small` preset's shape with random weights (speed does not depend on
what the weights learned), vocab 10,000, beside a byte-level tokenizer without an
end-of-text token, so every request runs to max_tokens. The server runs in a subprocess
with --threads 2 --max-batch 16 (and --stream-interval as given, by default the server's) on
127.0.0.1; clients are plain HTTP threads reading the
server-sent events (light, since they share the machine with the server). Each request
sends a 32-token prompt (ids) and streams 128 tokens sampled with temperature 1.0, top-k
50, top-p 0.95.

    one stream      requests one after another: tokens/s over the whole request (prefill,
                    HTTP and all), and decode tokens/s (tokens after the first / the time
                    from the first token to the last)
    16 streams      16 clients, each sending its requests back to back: all tokens / wall time
    TTFT            median time from sending a request to its first token, idle server
    generate        generate() in its own process (2 threads), the same model, prompt and
                    sampling: decode tokens/s measured as for one stream, its runs
                    alternated with the one-stream requests (a shared machine's load
                    then weighs on both alike); medians. Also on 1 thread: on a loaded
                    machine 2 threads can be far slower than 1 in the main thread

    python benches/bench_serve.py                    # writes nothing; prints a markdown table
    python benches/bench_serve.py --requests 4 --streams 16
    python benches/bench_serve.py --stream-interval 0     # every token handed over as it comes

--prefill measures prompts instead, on the same shape with a context of 640 and a 512-token
prompt (max_tokens 1), the server with --max-batch 17 (a row for the new request beside the
16 streams'):

    shared prefix   TTFT of n=8 choices (the last choice's first token) against n=1, on an
                    idle server, the two alternating: the choices share one prefill
    under load      16 streams decoding (32-token prompts, logprobs 0 so that each chunk
                    counts its tokens) while a new request prefills the 512-token prompt:
                    its TTFT against the idle one, and the 16 streams' tokens/s in the
                    second before it was sent against those while it prefilled (from its
                    sending to its first token); medians over --ttft such requests

    python benches/bench_serve.py --prefill                       # the server's --prefill-chunk
    python benches/bench_serve.py --prefill --prefill-chunk 128
    python benches/bench_serve.py --prefill --prefill-chunk 0     # each prompt whole
    python benches/bench_serve.py --quick [--prefill]             # a smoke test of the script, no measurement
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

CPU_SMALL = dict(
    vocab_size=10_000, context_length=256, d_model=256, num_layers=4, num_heads=8, d_ff=683, rope_theta=10_000.0
)
PROMPT = [(7919 * i) % 10_000 for i in range(1, 33)]  # 32 ids, fixed
NEW_TOKENS = 128
SAMPLING = {"temperature": 1.0, "top_k": 50, "top_p": 0.95}
THREADS = 2
JSON = {"Content-Type": "application/json"}


LONG_CONTEXT = 640  # the --prefill model's: a 512-token prompt and the streams' tokens fit
LONG_PROMPT = [(104_729 * i) % 10_000 for i in range(1, 513)]  # 512 ids, fixed


def make_model(folder: Path, context_length: int = CPU_SMALL["context_length"]) -> Path:
    import torch

    from ferrolm.bpe.tokenizer import Tokenizer
    from ferrolm.lm.checkpoint import save_checkpoint
    from ferrolm.lm.model import TransformerLM

    tok = Tokenizer({i: bytes([i]) for i in range(256)}, [], [])  # bytes only, no end-of-text
    tok.save(folder / "tok")
    torch.manual_seed(0)
    model = TransformerLM(**{**CPU_SMALL, "context_length": context_length})
    ckpt = folder / "bench" / "model.pt"
    save_checkpoint(
        model, None, 0, ckpt, config={"model": model.config.to_dict()}, tokenizer_fingerprint=tok.fingerprint
    )
    return ckpt


def start_server(
    ckpt: Path,
    tok: Path,
    stream_interval: Optional[float] = None,
    prefill_chunk: Optional[int] = None,
    max_batch: int = 16,
):
    cmd = [sys.executable, "-m", "ferrolm", "serve", "--checkpoint", str(ckpt), "--tokenizer", str(tok)]
    cmd += ["--port", "0", "--device", "cpu", "--threads", str(THREADS), "--max-batch", str(max_batch)]
    if stream_interval is not None:
        cmd += ["--stream-interval", str(stream_interval)]
    if prefill_chunk is not None:
        cmd += ["--prefill-chunk", str(prefill_chunk)]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    line = proc.stderr.readline()
    if "serving " not in line:
        proc.kill()
        raise SystemExit(f"the server did not start: {line}{proc.stderr.read()}")
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
    port = int(line.split("http://127.0.0.1:")[1].split("/")[0])
    return proc, port, line.split()[1]


def stream_once(port: int, model: str, max_tokens: int = NEW_TOKENS) -> dict:
    """One streamed request: when it was sent, its first and last token arrived, and its token count."""
    body = json.dumps(
        {
            "model": model,
            "prompt": PROMPT,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            **SAMPLING,
        }
    )
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    sent = time.perf_counter()
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    first = last = None
    tokens = 0
    for line in resp:
        if not line.startswith(b"data: {"):
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            raise RuntimeError(chunk["error"]["message"])
        if chunk["choices"] and chunk["choices"][0]["text"]:
            last = time.perf_counter()
            first = first or last
        elif not chunk["choices"]:
            tokens = chunk["usage"]["completion_tokens"]
    conn.close()
    return {"sent": sent, "first": first, "last": last, "done": time.perf_counter(), "tokens": tokens}


class GenerateProcess:
    """generate() in its own process (2 threads), the model loaded once; ``speed()`` runs one
    generation there and returns its decode tokens/s. Alternated with the server's single
    stream, so the two see the same load on a shared machine."""

    CODE = f"""
import json, sys, time, torch
from ferrolm.lm.checkpoint import load_model
from ferrolm.lm.generate import generate
torch.set_num_threads({THREADS})
model, _, _ = load_model(sys.argv[1], "cpu", tokenizer=False)
for run, threads in enumerate(sys.stdin):
    torch.set_num_threads(int(threads))
    g = torch.Generator().manual_seed(run)
    stamps = [time.perf_counter() for _ in generate(model, {PROMPT}, {NEW_TOKENS}, generator=g, **{SAMPLING!r})]
    print(json.dumps((len(stamps) - 1) / (stamps[-1] - stamps[0])), flush=True)
"""

    def __init__(self, ckpt: Path):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", self.CODE, str(ckpt)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def speed(self, threads: int = THREADS) -> float:
        self.proc.stdin.write(f"{threads}\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def stream_choices(port: int, model: str, prompt: list[int], max_tokens: int, *, n: int = 1, on_chunk=None) -> dict:
    """One streamed request of ``n`` choices, with logprobs 0 (each chunk lists its tokens):
    when it was sent and when each choice's first token came; ``on_chunk(time, tokens)`` per chunk."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "n": n, "stream": True, "logprobs": 0}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    sent = time.perf_counter()
    conn.request("POST", "/v1/completions", body=json.dumps({**body, **SAMPLING}), headers=JSON)
    first: dict[int, float] = {}
    for line in conn.getresponse():
        if not line.startswith(b"data: {"):
            continue
        chunk, now = json.loads(line[6:]), time.perf_counter()
        if "error" in chunk:
            raise RuntimeError(chunk["error"]["message"])
        for choice in chunk["choices"]:
            tokens = len((choice.get("logprobs") or {}).get("tokens") or ())
            if tokens or choice["text"] or choice.get("finish_reason"):
                first.setdefault(choice["index"], now)
            if on_chunk is not None and tokens:
                on_chunk(now, tokens)
    conn.close()
    assert len(first) == n, "a choice sent nothing"
    return {"sent": sent, "first": max(first.values())}


def _ttft_ms(port: int, name: str, prompt: list[int], count: int, ns: tuple[int, ...] = (1,)) -> list[float]:
    """The median TTFT of ``count`` requests of each ``n`` in ``ns``, the n alternating (a drift in
    the machine's speed then weighs on each alike)."""
    runs: dict[int, list[float]] = {n: [] for n in ns}
    for _ in range(count):
        for n in ns:
            r = stream_choices(port, name, prompt, 1, n=n)
            runs[n].append((r["first"] - r["sent"]) * 1e3)
    return [statistics.median(runs[n]) for n in ns]


def _rate(chunks: list[tuple[float, int]], start: float, end: float) -> float:
    return sum(k for t, k in chunks if start < t <= end) / (end - start)


def prefill_under_load(port: int, name: str, prompt: list[int], args, stream_tokens: int) -> list[tuple]:
    """(TTFT ms, streams' tokens/s the second before, tokens/s while it prefilled) of ``args.ttft``
    requests of ``prompt``, one after another, while ``args.streams`` clients stream."""
    stop, chunks = threading.Event(), []

    def client() -> None:
        while not stop.is_set():
            stream_choices(port, name, PROMPT, stream_tokens, on_chunk=lambda t, k: chunks.append((t, k)))

    out = []
    with ThreadPoolExecutor(args.streams) as pool:
        clients = [pool.submit(client) for _ in range(args.streams)]
        try:
            time.sleep(0.5 if args.quick else 3.0)  # every stream past its prompt
            for _ in range(args.ttft):
                time.sleep(1.0)
                r = stream_choices(port, name, prompt, 1)
                sent, first = r["sent"], r["first"]
                out.append(((first - sent) * 1e3, _rate(chunks, sent - 1.0, sent), _rate(chunks, sent, first)))
        finally:
            stop.set()
            for c in clients:
                c.result()
    return out


def prefill_bench(args) -> None:
    """Shared-prefix TTFT (n=8 against n=1) and a prefill's TTFT and cost under decoding streams."""
    prompt = LONG_PROMPT[:64] if args.quick else LONG_PROMPT
    context = 128 if args.quick else LONG_CONTEXT
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_model(Path(tmp), context)
        # a row beside the streams' for the new request: it waits for no stream to end
        rows = args.streams + 1
        proc, port, name = start_server(ckpt, Path(tmp) / "tok", args.stream_interval, args.prefill_chunk, rows)
        try:
            for n in (1, 8):  # warm-up: every chunk's shapes once
                stream_choices(port, name, prompt, 4, n=n)
            idle, shared = _ttft_ms(port, name, prompt, args.ttft, (1, 8))
            loaded = prefill_under_load(port, name, prompt, args, context - len(PROMPT) - 8)
        finally:
            proc.terminate()
            proc.wait(60)
    ttft, before, during = (statistics.median(col) for col in zip(*loaded))
    print(
        machine_line(args)
        + f"; server --prefill-chunk {'default' if args.prefill_chunk is None else args.prefill_chunk}"
    )
    print()
    print("| measure | result | target |")
    print("|---|---:|---|")
    print(f"| TTFT, {len(prompt)}-token prompt, idle server, n=1 | {idle:.1f} ms | |")
    print(f"| TTFT, {len(prompt)}-token prompt, idle server, n=8 (the last choice's first token) | {shared:.1f} ms | |")
    print(f"| n=8 / n=1 (TTFT) | {shared / idle:.2f}x | <= 1.2x |")
    print(f"| TTFT, {len(prompt)}-token prompt, under {args.streams} decoding streams | {ttft:.1f} ms | |")
    print(f"| under {args.streams} streams / idle (TTFT) | {ttft / idle:.2f}x | < 3x |")
    print(f"| {args.streams} streams' tokens/s, the second before | {before:.1f} | |")
    print(f"| {args.streams} streams' tokens/s, while it prefills | {during:.1f} | |")
    print(f"| drop while it prefills | {100 * (1 - during / before):.0f} % | <= 25 % |")


def machine_line(args) -> str:
    from ferrolm.app.serve import STREAM_INTERVAL

    interval = STREAM_INTERVAL if args.stream_interval is None else args.stream_interval
    return (
        f"Machine: {cpu_name()}, {os.cpu_count()} cores; torch threads {THREADS}; load average {os.getloadavg()[0]:.1f}; "
        f"server --stream-interval {interval:g}"
    )


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=4, help="requests per client (default 4)")
    ap.add_argument("--streams", type=int, default=16, help="concurrent clients (default 16)")
    ap.add_argument("--ttft", type=int, default=10, help="requests timed for TTFT (default 10)")
    ap.add_argument(
        "--stream-interval", type=float, default=None, help="the server's --stream-interval (default: its default)"
    )
    ap.add_argument("--prefill", action="store_true", help="measure shared-prefix and chunked prefill instead")
    ap.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        metavar="N",
        help="the server's --prefill-chunk (default: its default)",
    )
    ap.add_argument("--quick", action="store_true", help="a few short requests: checks the script, measures nothing")
    args = ap.parse_args(argv)
    for name in ("requests", "streams", "ttft"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1")
    if args.quick:
        args.requests, args.streams, args.ttft = 1, 2, 1
    return args


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    if args.prefill:
        return prefill_bench(args)
    new_tokens = 8 if args.quick else NEW_TOKENS

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_model(Path(tmp))
        gen = GenerateProcess(ckpt)
        proc, port, name = start_server(ckpt, Path(tmp) / "tok", args.stream_interval)
        try:
            stream_once(port, name, 16)  # warm-ups
            gen.speed()
            ttft = [(r["first"] - r["sent"]) * 1e3 for r in (stream_once(port, name, 1) for _ in range(args.ttft))]
            singles, gen_speeds, gen1_speeds = [], [], []
            for _ in range(args.requests):  # alternated: all see the same load
                gen_speeds.append(gen.speed())
                singles.append(stream_once(port, name, new_tokens))
                gen1_speeds.append(gen.speed(1))
            gen.close()
            gen_speed, gen1_speed = statistics.median(gen_speeds), statistics.median(gen1_speeds)
            one_total = sum(r["tokens"] for r in singles) / sum(r["done"] - r["sent"] for r in singles)
            one_decode = statistics.median((r["tokens"] - 1) / (r["last"] - r["first"]) for r in singles)
            started = time.perf_counter()
            with ThreadPoolExecutor(args.streams) as pool:
                many = list(
                    pool.map(lambda _: stream_once(port, name, new_tokens), range(args.streams * args.requests))
                )
            wall = time.perf_counter() - started
            many_total = sum(r["tokens"] for r in many) / wall
            ttft_loaded = statistics.median((r["first"] - r["sent"]) * 1e3 for r in many)
            assert all(r["tokens"] == new_tokens for r in singles + many), "a request ended early"
        finally:
            proc.terminate()
            proc.wait(60)

    print(machine_line(args))
    print()
    print("| measure | result | target |")
    print("|---|---:|---|")
    print(f"| one stream, tokens/s (whole requests) | {one_total:.1f} | |")
    print(f"| one stream, decode tokens/s | {one_decode:.1f} | >= generate |")
    print(f"| `generate`, decode tokens/s | {gen_speed:.1f} | |")
    print(f"| `generate` on 1 thread, decode tokens/s | {gen1_speed:.1f} | |")
    print(f"| one stream / generate (decode) | {one_decode / gen_speed:.2f}x | >= 1.0x |")
    print(f"| one stream / generate on 1 thread (decode) | {one_decode / gen1_speed:.2f}x | |")
    print(f"| {args.streams} streams, tokens/s (all) | {many_total:.1f} | |")
    print(f"| {args.streams} streams / one stream | {many_total / one_total:.2f}x | >= 4x |")
    print(f"| TTFT, idle server, median of {args.ttft} | {statistics.median(ttft):.1f} ms | < 100 ms |")
    print(f"| TTFT under {args.streams} streams, median | {ttft_loaded:.1f} ms | |")


if __name__ == "__main__":
    main()
