"""Chat templates for `ferrolm serve`: which one, its sandbox, and the processes that render it.

A chat template is a Jinja template over ``messages`` (each with ``role`` and ``content``) and
``add_generation_prompt``, as Hugging Face tokenizers carry them; the first found of
``--chat-template FILE``, ``chat_template.jinja`` in the tokenizer folder, and the
``chat_template`` string in its ``tokenizer_config.json``; else the plain-text default
``PLAIN_CHAT_TEMPLATE`` ("User: ...", "Assistant: ..." turns, blank-line separated), with
which a reply also ends where the model starts a new "User:" line (``PLAIN_CHAT_STOP``).
Templates get transformers' ``raise_exception(msg)`` (a 400 with the message),
``strftime_now(fmt)`` and its ``{% generation %}`` block (rendered as its body), and render in Jinja's sandbox in worker processes, within
TEMPLATE_TIME_LIMIT seconds, TEMPLATE_OUTPUT_LIMIT characters and TEMPLATE_MEMORY_LIMIT
bytes (see ``RenderWorkers``); past a limit the request gets a 400.

A tokenizer with ferrolm's chat tokens, served with its own template (or none) and no
``--chat-template``, skips all that: ``chat_prompt_ids`` renders the messages straight to
ids with ``ferrolm.lm.chat.render_prompt``, so that content stays text (a message holding
"<|end|>" cannot end its turn), and the reply ends at the chat end token.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import sys
from pathlib import Path
from typing import Any, Optional, Union

from ferrolm.app.openai_api import ApiError

__all__ = [
    "ChatTemplate",
    "PLAIN_CHAT_STOP",
    "PLAIN_CHAT_TEMPLATE",
    "RenderWorkers",
    "chat_prompt_ids",
    "missing_serve_extra",
    "uses_chat_tokens",
]

PLAIN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] }}\n\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
PLAIN_CHAT_STOP = ("\nUser:",)

TEMPLATE_OUTPUT_LIMIT = 4 << 20  # characters of a rendered chat prompt
TEMPLATE_TIME_LIMIT = 3.0  # seconds for a chat template to render (real ones take milliseconds)
TEMPLATE_MEMORY_LIMIT = 1 << 30  # bytes of address space of the process that renders templates
TEMPLATE_WORKERS = 2  # processes rendering chat templates


def missing_serve_extra(e: ImportError) -> ImportError:
    return ImportError(f'`ferrolm serve` needs the serve extra: pip install "ferrolm[serve]" ({e})')


class TemplateRefused(Exception):
    """A chat template called ``raise_exception(message)``: the messages are not for it."""


class ChatTemplate:
    """Renders chat messages to one prompt string with a Jinja template, in Jinja's immutable
    sandbox, with the globals transformers gives templates (``raise_exception``,
    ``strftime_now``) and limits: ``range`` (Jinja's sandbox: 100,000 items), a string or
    list repeated with ``*`` and the output itself stop at TEMPLATE_OUTPUT_LIMIT characters.
    ``render`` runs in the calling thread with no time limit: the server renders in a worker
    process with a deadline (``RenderWorkers``)."""

    def __init__(self, source: str, origin: str, default_stop: tuple[str, ...] = ()):
        try:
            from jinja2.exceptions import TemplateError
        except ImportError as e:
            raise missing_serve_extra(e) from None
        self._errors = TemplateError
        try:
            self.template = _sandbox().from_string(source)
        except TemplateError as e:
            raise ValueError(f"chat template {origin} does not parse: {e}") from None
        self.source = source
        self.origin = origin
        self.default_stop = default_stop

    @classmethod
    def find(cls, tokenizer_dir: Optional[Path], override: Optional[Union[str, os.PathLike]] = None) -> ChatTemplate:
        """The template to use (see the module docstring for the order)."""
        if override is not None:
            return cls(Path(override).read_text(encoding="utf-8"), os.fspath(override))
        if tokenizer_dir is not None:
            path = Path(tokenizer_dir) / "chat_template.jinja"
            if path.is_file():
                return cls(path.read_text(encoding="utf-8"), str(path))
            config = Path(tokenizer_dir) / "tokenizer_config.json"
            if config.is_file():
                try:
                    source = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
                except (ValueError, AttributeError):
                    source = None
                if isinstance(source, str) and source:
                    return cls(source, f"{config} (chat_template)")
        return cls(PLAIN_CHAT_TEMPLATE, "the plain-text default", PLAIN_CHAT_STOP)

    def render(self, messages: list[dict[str, str]], eos_token: str = "") -> str:
        """The prompt; ApiError (400) when the template fails, refuses or passes a limit."""
        context = {"messages": messages, "add_generation_prompt": True, "bos_token": "", "eos_token": eos_token}
        out, size = [], 0
        try:
            for piece in self.template.generate(**context):
                size += len(piece)
                if size > TEMPLATE_OUTPUT_LIMIT:
                    raise TemplateLimit(f"its output passed {TEMPLATE_OUTPUT_LIMIT:,} characters")
                out.append(piece)
        except TemplateRefused as e:
            raise ApiError(f"the chat template refused these messages: {e}", "messages") from None
        except (self._errors, TemplateLimit, MemoryError, RecursionError) as e:
            what = "ran out of memory" if isinstance(e, MemoryError) else str(e) or type(e).__name__
            raise ApiError(f"the chat template cannot render these messages: {what}", "messages") from None
        return "".join(out)


class TemplateLimit(Exception):
    """A chat template's render passed one of its limits."""


@functools.cache
def _sandbox():
    import datetime

    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Sandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*"})

        def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
            # A sequence times a count: its size is known before it is built.
            for seq, count in ((left, right), (right, left)):
                if (
                    isinstance(seq, (str, list, tuple))
                    and isinstance(count, int)
                    and len(seq) * count > TEMPLATE_OUTPUT_LIMIT
                ):
                    raise TemplateLimit(f"a value repeated with * would pass {TEMPLATE_OUTPUT_LIMIT:,} items")
            return super().call_binop(context, operator, left, right)

    def raise_exception(message: Any = "") -> None:
        raise TemplateRefused(str(message))

    def strftime_now(fmt: str) -> str:
        return datetime.datetime.now().strftime(str(fmt))

    env = Sandbox(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True, extensions=[_generation_tag()])
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    return env


def _generation_tag():
    """transformers' ``{% generation %}...{% endgeneration %}`` (it marks the assistant's
    tokens for a loss mask): here the body renders as it is."""
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    return Generation


def uses_chat_tokens(tokenizer: Any, template: ChatTemplate, override: Any) -> bool:
    """Whether to render chats with the tokenizer's chat tokens (``chat_prompt_ids``): it has
    them, no template was given, and the folder's template is ferrolm's own (or absent)."""
    from ferrolm.bpe.chat_format import CHAT_TEMPLATE, carries_chat

    own = template.source in (CHAT_TEMPLATE, PLAIN_CHAT_TEMPLATE)
    return override is None and own and carries_chat(tokenizer.special_tokens)


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The ids that ask for the assistant's reply (``ferrolm.lm.chat.render_prompt``);
    ApiError (400) naming the message when the roles are out of order."""
    from ferrolm.lm.chat import ConversationError, render_prompt

    try:
        return render_prompt(tokenizer, messages)
    except ConversationError as e:
        raise ApiError(f"messages: {e}", "messages") from None


# --------------------------------------------------------------------------------------
# Chat templates render in worker processes
# --------------------------------------------------------------------------------------
# A template is code from a model folder, steered by the messages; a loop in it, or a huge
# value built by one C call (a filter such as replace), can hold a thread and memory as long
# as it likes, and Python cannot stop a thread. So the server renders in worker processes:
# the event loop only waits on a pipe; a render past TEMPLATE_TIME_LIMIT has its process
# killed (a fresh one takes its place); each process's address space is capped. The sandbox's
# own limits inside make the common blow-ups fail at once, with a clear message.

_WORKER_CODE = "from ferrolm.app.chat_template import _render_worker_main; _render_worker_main()"
_WORKER_READY = b"ready\n"


def _render_worker_main() -> None:
    """A render process: one JSON request a line on stdin ({template, messages, eos_token}),
    one JSON reply a line on stdout ({"text"} or {"error"})."""
    import resource

    with contextlib.suppress(ValueError, OSError):  # a platform without the limit still renders
        resource.setrlimit(resource.RLIMIT_AS, (TEMPLATE_MEMORY_LIMIT, TEMPLATE_MEMORY_LIMIT))
    out = sys.stdout.buffer
    out.write(_WORKER_READY)
    out.flush()
    templates: dict[str, ChatTemplate] = {}
    for line in sys.stdin.buffer:
        with contextlib.suppress(ValueError, OSError):
            # A render past twice its time in CPU ends the process, should its server be gone.
            usage = resource.getrusage(resource.RUSAGE_SELF)
            cpu = int(usage.ru_utime + usage.ru_stime + 2 * TEMPLATE_TIME_LIMIT) + 1
            resource.setrlimit(resource.RLIMIT_CPU, (cpu, resource.getrlimit(resource.RLIMIT_CPU)[1]))
        try:
            req = json.loads(line)
            if req["template"] not in templates:
                templates.clear()  # one served template: keep the last one compiled
                templates[req["template"]] = ChatTemplate(req["template"], "served")
            reply = {"text": templates[req["template"]].render(req["messages"], req["eos_token"])}
        except ApiError as e:
            reply = {"error": e.body["error"]["message"]}
        except Exception as e:  # noqa: BLE001 -- a template's failure is the request's answer
            reply = {"error": f"the chat template cannot render these messages: {type(e).__name__}: {e}"}
        out.write(json.dumps(reply).encode() + b"\n")
        out.flush()


class RenderWorkers:
    """Up to ``size`` render processes (see above), started as needed and reused."""

    def __init__(self, size: int = TEMPLATE_WORKERS, time_limit: float = TEMPLATE_TIME_LIMIT):
        self.time_limit = time_limit
        self._size = size
        self._idle: list = []
        self._all: set = set()  # idle or rendering
        self._slots: Optional[asyncio.Semaphore] = None

    async def _spawn(self):
        package_root = str(Path(__file__).resolve().parents[2])  # the child imports this ferrolm
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _WORKER_CODE,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=env,
            limit=8 * TEMPLATE_OUTPUT_LIMIT,  # a reply line: the prompt JSON-escaped
        )
        self._all.add(proc)
        try:
            if await asyncio.wait_for(proc.stdout.readline(), 120) != _WORKER_READY:
                raise ApiError("the chat template's render process did not start", status=500)
        except BaseException:
            self._kill(proc)
            raise
        return proc

    async def warm(self) -> None:
        """Start one process ahead of the first chat request."""
        with contextlib.suppress(Exception):  # the first request starts one and reports what fails
            self._idle.append(await self._spawn())

    def _kill(self, proc) -> None:
        self._all.discard(proc)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()

    async def render(self, template: str, messages: list[dict[str, str]], eos_token: str) -> str:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self._size)
        async with self._slots:
            proc = self._idle.pop() if self._idle else await self._spawn()
            reply = None
            try:
                proc.stdin.write(
                    json.dumps({"template": template, "messages": messages, "eos_token": eos_token}).encode()
                )
                proc.stdin.write(b"\n")
                await proc.stdin.drain()
                reply = json.loads(await asyncio.wait_for(proc.stdout.readline(), self.time_limit) or b"null")
            except asyncio.TimeoutError:
                raise ApiError(
                    f"the chat template took over {self.time_limit:g} s to render these messages", "messages"
                ) from None
            except (ValueError, OSError):
                pass  # a reply too long, or a process that died: reply stays None
            finally:
                if isinstance(reply, dict):
                    self._idle.append(proc)
                else:  # killed at its deadline, cancelled mid-render, or dead: a new one next time
                    self._kill(proc)
        if not isinstance(reply, dict):
            raise ApiError("the chat template's render process failed (past its memory limit?)", "messages")
        if "error" in reply:
            raise ApiError(reply["error"], "messages")
        return reply["text"]

    def close(self) -> None:
        """Kill every render process, a rendering one too."""
        for proc in list(self._all):
            self._kill(proc)
        self._idle.clear()
