"""`ferrolm chat`: a conversation with a chat model in the terminal.

Each line read is a user message; the reply streams as it is generated (the inference
engine, as in `ferrolm generate`), ends at the chat end token, and joins the history, so
that the next message is answered in context. ``/reset`` clears the history (the system
message stays), ``/exit`` or the end of input quits, Ctrl-C stops a reply mid-way (that
turn is dropped). Standard input may be a pipe: one message a line, no prompt shown.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import Any, Callable, Optional

from ferrolm._util import ForgivingStream, fix_surrogates, say_where_possible
from ferrolm.app.args import add_device, add_model, add_sampling

COMMANDS: list = []

RESET, EXIT = "/reset", "/exit"


def add_chat_command(sub) -> None:
    p = sub.add_parser(
        "chat",
        help="talk with a chat model in the terminal",
        description="A conversation with a model fine-tuned for chat (`ferrolm train --config sft`): type a "
        f"message, the reply streams back; the history is kept. {RESET} clears it, {EXIT} or end of input "
        "(Ctrl-D) quits, Ctrl-C stops a reply. Reads one message a line from a pipe too.",
    )
    add_model(p)
    p.add_argument("--system", default=None, metavar="TEXT", help="a system message that opens the conversation")
    add_sampling(p, max_new_tokens=512)
    add_device(p)
    p.set_defaults(run=_run_chat)


COMMANDS.append(add_chat_command)


class ChatSession:
    """A conversation with ``model``: ``ask(text)`` renders the history and the new user
    message (``ferrolm.lm.chat.render_prompt``), samples the reply up to the chat end token
    and keeps both in ``messages``; ``reset()`` keeps only the system message."""

    def __init__(self, model: Any, tokenizer: Any, sampling: tuple, *, system: Optional[str] = None):
        from ferrolm.lm import chat

        try:
            self.end_id = chat.chat_token_ids(tokenizer)[chat.END_TOKEN]
        except ValueError as e:
            raise ValueError(f"this model cannot chat: {e}") from None
        self.model, self.tokenizer, self.sampling = model, tokenizer, sampling
        self.system = system
        self.messages: list[dict[str, str]] = []
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system is not None else []

    def token_bytes(self, t: int) -> bytes:
        # A model may have more ids than its tokenizer (a rounded-up vocab_size): no text.
        return self.tokenizer.token_bytes(t) if t < self.tokenizer.vocab_size else "\ufffd".encode()

    def ask(self, text: str, on_piece: Optional[Callable[[str], None]] = None) -> str:
        """The reply to the user message ``text``, streamed to ``on_piece`` as it comes."""
        from ferrolm.lm import chat
        from ferrolm.lm.generate import generate_text

        turn = [*self.messages, {"role": "user", "content": text}]
        ids = chat.render_prompt(self.tokenizer, turn)
        stream = None if on_piece is None else (lambda _, piece: on_piece(piece))
        reply = generate_text(
            self.model, ids, self.token_bytes, *self.sampling, end_ids=(self.end_id,), on_piece=stream
        )[0]
        self.messages = [*turn, {"role": "assistant", "content": reply}]
        return reply


def converse(session: ChatSession, lines: Iterable[str], emit: Callable[[str], None], note: Callable[[str], None]):
    """Answer each line of ``lines`` in ``session`` (see the module docstring); the replies
    go to ``emit``, each followed by a newline, and what is not a reply to ``note``."""
    for line in lines:
        text = fix_surrogates(line.rstrip("\r\n"))
        command = text.strip()
        if command == EXIT:
            return
        if command == RESET:
            session.reset()
            note("(history cleared)")
            continue
        if not command:
            continue
        try:
            session.ask(text, emit)
        except KeyboardInterrupt:
            note("\n(reply stopped; that turn is dropped)")
            continue
        finally:
            emit("\n")


def _input_lines(prompt: str) -> Iterator[str]:
    """Standard input a line at a time: with line editing and a prompt on a terminal, else
    UTF-8 lines (an invalid byte as U+FFFD) with no prompt."""
    if sys.stdin.isatty():
        while True:
            try:
                yield input(prompt)
            except EOFError:
                print(file=sys.stderr)
                return
    raw = getattr(sys.stdin, "buffer", None)
    for line in raw if raw is not None else sys.stdin:
        yield line.decode("utf-8", "replace") if isinstance(line, bytes) else line


def _report(line: str) -> None:
    say_where_possible(line, ForgivingStream(sys.stderr), ForgivingStream(sys.stdout))


def _emit(text: str) -> None:
    """``text`` on stdout as UTF-8 whatever the locale, flushed: a reply shows as it comes."""
    out = getattr(sys.stdout, "buffer", None)
    if out is None:
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    out.write(text.encode("utf-8"))
    out.flush()


def _run_chat(args) -> int:
    import torch

    from ferrolm.lm.checkpoint import load_model
    from ferrolm.lm.config import SEED_LIMIT
    from ferrolm.lm.generate import check_sampling_args, resolve_device

    check_sampling_args(args.temperature, args.top_k, args.top_p)  # before any loading
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.seed is not None and not 0 <= args.seed < SEED_LIMIT:
        raise ValueError(f"--seed must be an int in [0, 2**63), got {args.seed}")
    device = resolve_device(args.device)
    model, tok, info = load_model(args.checkpoint, device, tokenizer=args.tokenizer, require_tokenizer=True)
    seed = args.seed
    if seed is None:
        seed = torch.Generator().seed() % SEED_LIMIT
        if args.temperature > 0:
            _report(f"seed {seed}")
    generator = torch.Generator(device=device).manual_seed(seed)
    sampling = (args.max_new_tokens, args.temperature, args.top_k, args.top_p, tok.eos_id, generator)
    system = None if args.system is None else fix_surrogates(args.system)
    try:
        session = ChatSession(model, tok, sampling, system=system)
    except ValueError as e:
        where = info.get("tokenizer_source") or args.tokenizer
        raise ValueError(f"{e} (tokenizer: {where})" if where else str(e)) from None
    if sys.stdin.isatty():
        _report(f"chatting with {args.checkpoint}: {RESET} clears the history, {EXIT} or Ctrl-D quits")
    converse(session, _input_lines("> "), _emit, _report)
    return 0
