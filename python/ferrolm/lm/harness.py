"""ferrolm as a model of EleutherAI's lm-evaluation-harness (``pip install "ferrolm[eval]"``):
any of its tasks (hellaswag, arc_easy, lambada, your own YAML) scores a ferrolm checkpoint.

    ferrolm eval --checkpoint runs/x/best.pt --tasks hellaswag,arc_easy
    python -m ferrolm.lm.harness --model ferrolm --model_args checkpoint=runs/x/best.pt --tasks hellaswag
    run_tasks("runs/x/best.pt", ["hellaswag"])        # lm-eval's results dict

Importing this module registers the model under the name "ferrolm" in lm-eval's registry.
lm-eval finds models only in its registry (it reads no entry points), so a plain
``lm_eval --model ferrolm`` cannot see it; ``python -m ferrolm.lm.harness`` is lm-eval's own
command line with ferrolm registered first, and takes the same arguments.

The three request types, exactly:

- ``loglikelihood(context, continuation)``: whitespace at the end of the context moves to
  the start of the continuation (byte-level BPE tokens carry their leading space); the
  two are encoded apart, and the result is the sum over the continuation's tokens of
  log softmax(logits) of the model run on context + continuation, with ``is_greedy`` true
  when every one of them is the argmax. An empty context is the end-of-text token (a
  document starts after it). When context + continuation exceed the context length the
  context loses its oldest tokens; a continuation longer than the context is an error.
- ``loglikelihood_rolling(text)``: the log-likelihood of every token of the text, the
  first predicted from the end-of-text token, in windows of context_length predictions;
  the last window is filled with earlier tokens so each window has the most context
  (lm-eval's ``get_rolling_token_windows`` with context_len = 1).
- ``generate_until(context, {"until", "max_gen_toks", "do_sample", "temperature", "top_k",
  "top_p"})``: greedy unless do_sample with a temperature > 0, with
  ``ferrolm.lm.generate.generate_text`` (the inference engine, each request its own row);
  the text is cut before the first stop string, and ends at the end-of-text token. Other
  generation kwargs are refused by name.

Chat (lm-eval's ``--apply_chat_template``, ``ferrolm eval --apply-chat-template``), for a
model whose tokenizer has the chat tokens: ``apply_chat_template`` renders an lm-eval benchmark's
messages with ``ferrolm.lm.chat`` and keeps the ids of each prompt it hands back, so the
prompt is scored on exactly those ids (a content spelling "<|end|>" stays text); the
reply of ``generate_until`` also ends at ``<|end|>``. ``tokenizer_name`` and
``chat_template`` name the tokenizer and the template for lm-eval's caches and results.

Requests run in batches of ``batch_size`` rows, longest first, right-padded (a causal
model's logits at a position do not depend on what follows it), with a progress bar.
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any, Optional, Union

import torch

try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
except ImportError:
    raise ImportError('lm-evaluation-harness tasks need the lm-eval package: pip install "ferrolm[eval]"') from None

__all__ = ["FerrolmLM", "run_tasks", "main"]

PathLike = Union[str, "os.PathLike[str]"]
DEFAULT_MAX_GEN_TOKS = 256


def _load(checkpoint: PathLike, tokenizer: Any, device: str):
    """(model on ``device`` in eval mode, its tokenizer) for anything ``load_model`` reads."""
    from ferrolm.lm.checkpoint import load_model

    model, tok, _ = load_model(checkpoint, device, tokenizer=tokenizer, require_tokenizer=True)
    return model.eval(), tok


def _positive_int(value: Any, name: str) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if isinstance(value, bool) or n < 1 or str(n) != str(value).strip():
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return n


class FerrolmLM(LM):
    """A ferrolm checkpoint as an lm-eval model (see the module docstring).

    ``checkpoint``: a ``ferrolm train`` checkpoint (or a ferrolm .safetensors file);
    ``tokenizer``: its folder (default: the run config's data.tokenizer); ``device``:
    auto (CUDA, then MPS, then CPU), cpu, cuda, ...; ``batch_size``: rows per forward pass
    (lm-eval's ``--batch_size``; "auto" is not supported); ``max_gen_toks``: the
    default limit of new tokens for generate_until. ``model``/``tokenizer`` objects may
    be given instead of paths (``FerrolmLM(model=m, tokenizer=tok)``).
    """

    def __init__(
        self,
        checkpoint: Optional[PathLike] = None,
        tokenizer: Any = None,
        device: Optional[str] = "auto",
        batch_size: Any = 8,
        max_gen_toks: Any = DEFAULT_MAX_GEN_TOKS,
        max_batch_size: Any = None,  # lm-eval passes it; batches here have one fixed size
        model: Any = None,
        progress: bool = True,
    ):
        super().__init__()
        if (checkpoint is None) == (model is None):
            raise ValueError("give a checkpoint path (model_args checkpoint=PATH) or a model, not both")
        self.batch_size = _positive_int(batch_size, "batch_size")
        self.max_gen_toks = _positive_int(max_gen_toks, "max_gen_toks")
        if model is None:
            model, tokenizer = _load(checkpoint, tokenizer, device or "auto")
        elif tokenizer is None or isinstance(tokenizer, (str, os.PathLike)):
            raise ValueError("a model object needs its Tokenizer object")
        self.model = model.eval()
        self.tok = tokenizer
        self.eos_id = tokenizer.eos_id
        if self.eos_id is None:
            raise ValueError("the tokenizer has no <|endoftext|> special token; the harness starts text after it")
        self._device = next(model.parameters()).device
        self.context_length = model.config.context_length
        self.progress = progress
        self._end_ids = _chat_end_ids(tokenizer)
        self._chat_prompts: dict[str, list[int]] = {}  # prompt text -> its ids, from apply_chat_template

    # ---- tokens ----------------------------------------------------------------------

    def _token_bytes(self, t: int) -> bytes:
        # A model may have more ids than its tokenizer (a rounded-up vocab_size): no text.
        return self.tok.token_bytes(t) if t < self.tok.vocab_size else b""

    def _pair_ids(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        if context in self._chat_prompts:
            return self._chat_prompts[context], self.tok.encode(continuation)
        stripped = context.rstrip()
        context, continuation = stripped, context[len(stripped) :] + continuation
        ctx = self.tok.encode(context) if context else [self.eos_id]
        return ctx, self.tok.encode(continuation)

    # ---- scoring ---------------------------------------------------------------------

    def _bar(self, total: int, desc: str, disable: bool):
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, disable=disable or not self.progress, unit="req")

    @torch.inference_mode()
    def _score(self, pairs: list[tuple[list[int], list[int]]], desc: str, disable: bool) -> list[tuple[float, bool]]:
        """(sum of log p(cont | ctx), cont is the greedy choice) for each (ctx, cont) of ids."""
        L = self.context_length
        rows = []
        for ctx, cont in pairs:
            if len(cont) > L:
                raise ValueError(f"a continuation of {len(cont)} tokens does not fit the context length {L}")
            rows.append((ctx + cont)[-(L + 1) :][:-1])
        results: list[tuple[float, bool]] = [(0.0, True)] * len(pairs)
        order = sorted((i for i, (_, cont) in enumerate(pairs) if cont), key=lambda i: -len(rows[i]))
        with self._bar(len(pairs), desc, disable) as bar:
            bar.update(len(pairs) - len(order))  # empty continuations: log 1
            for b in range(0, len(order), self.batch_size):
                batch = order[b : b + self.batch_size]
                width = len(rows[batch[0]])
                x = torch.full((len(batch), width), self.eos_id, dtype=torch.long)
                for r, i in enumerate(batch):
                    x[r, : len(rows[i])] = torch.tensor(rows[i])
                logprobs = torch.log_softmax(self.model(x.to(self._device)).float(), dim=-1).cpu()
                for r, i in enumerate(batch):
                    cont = pairs[i][1]
                    n = len(rows[i])
                    lp = logprobs[r, n - len(cont) : n]
                    target = torch.tensor(cont)
                    total = lp.gather(1, target[:, None]).sum().item()
                    results[i] = (total, bool((lp.argmax(dim=-1) == target).all()))
                bar.update(len(batch))
        return results

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [self._pair_ids(*req.args) for req in requests]
        results = self._score(pairs, "ferrolm loglikelihood", disable_tqdm)
        for req, res in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", req.args, res)
        return results

    def _rolling_windows(self, ids: list[int]) -> list[tuple[list[int], list[int]]]:
        """(context, targets) windows covering ``ids``, each predicting at most context_length tokens."""
        L = self.context_length
        seq = [self.eos_id] + ids
        windows = []
        for start in range(0, len(ids), L):
            end = min(start + L, len(ids))
            first = max(0, end - L)  # the window's first input position in seq
            windows.append((seq[first : start + 1], ids[start:end]))
        return windows

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        owners, pairs = [], []
        for n, req in enumerate(requests):
            for window in self._rolling_windows(self.tok.encode(req.args[0])):
                owners.append(n)
                pairs.append(window)
        totals = [0.0] * len(requests)
        for n, (logprob, _) in zip(owners, self._score(pairs, "ferrolm loglikelihood_rolling", disable_tqdm)):
            totals[n] += logprob
        for req, res in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, res)
        return totals

    # ---- chat ------------------------------------------------------------------------

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The prompt text of ``chat_history`` (see the module docstring); without a generation
        prompt a last assistant message stays open, for the model to continue."""
        from ferrolm.lm import chat

        chat.chat_token_ids(self.tok)  # a clear error for a model that cannot chat
        if add_generation_prompt:
            ids = chat.render_prompt(self.tok, chat_history)
        elif chat_history and chat_history[-1].get("role") == "assistant":
            ids = chat.render(self.tok, chat_history)[0][:-1]  # its end token dropped
        else:
            ids = chat.render_prompt(self.tok, chat_history)[:-1]  # no assistant token
        text = self.tok.decode(ids)
        self._chat_prompts[text] = ids
        return text

    @property
    def tokenizer_name(self) -> str:
        return f"ferrolm-{self.tok.fingerprint[:16]}"

    def chat_template(self, chat_template: Union[bool, str] = False) -> Optional[str]:
        """ferrolm's chat template (the same rendering as Jinja) when asked for; ValueError
        for a model whose tokenizer has no chat tokens."""
        if not chat_template:
            return None
        from ferrolm.lm import chat

        chat.chat_token_ids(self.tok)
        return chat.CHAT_TEMPLATE

    # ---- generation ------------------------------------------------------------------

    def _sampling(self, kwargs: dict) -> tuple[list[str], int, tuple]:
        """(stop strings, max new tokens, (temperature, top_k, top_p)) from a task's generation kwargs."""
        from ferrolm.lm.generate import check_sampling_args

        kwargs = dict(kwargs)
        until = kwargs.pop("until", None) or []
        stops = [until] if isinstance(until, str) else list(until)
        max_new = _positive_int(kwargs.pop("max_gen_toks", self.max_gen_toks), "max_gen_toks")
        temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
        top_k, top_p = kwargs.pop("top_k", None), kwargs.pop("top_p", None)
        if not kwargs.pop("do_sample", False):
            temperature, top_k, top_p = 0.0, None, None
        if kwargs:
            raise ValueError(f"generation kwargs ferrolm has no use for: {', '.join(sorted(kwargs))}")
        check_sampling_args(temperature, top_k, top_p)
        return stops, max_new, (temperature, top_k, top_p)

    def _generate_batch(self, contexts: list[str], stops: list[str], max_new: int, sampling: tuple) -> list[str]:
        from ferrolm.lm.generate import generate_text

        rows = [self._chat_prompts.get(c) or self.tok.encode(c) for c in contexts]  # an empty one starts from eos
        generator = torch.Generator(device=self._device).manual_seed(1234)
        return generate_text(
            self.model,
            rows,
            self._token_bytes,
            max_new,
            *sampling,
            eos_id=self.eos_id,
            generator=generator,
            stop=stops,
            end_ids=self._end_ids,
        )

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        groups: dict[str, list[int]] = defaultdict(list)
        for n, req in enumerate(requests):
            groups[repr(sorted(req.args[1].items()))].append(n)
        out: list[str] = [""] * len(requests)
        with self._bar(len(requests), "ferrolm generate_until", disable_tqdm) as bar:
            for members in groups.values():
                stops, max_new, sampling = self._sampling(requests[members[0]].args[1])
                members.sort(key=lambda n: -len(requests[n].args[0]))
                for b in range(0, len(members), self.batch_size):
                    batch = members[b : b + self.batch_size]
                    texts = self._generate_batch([requests[n].args[0] for n in batch], stops, max_new, sampling)
                    for n, text in zip(batch, texts):
                        out[n] = text
                        self.cache_hook.add_partial("generate_until", requests[n].args, text)
                    bar.update(len(batch))
        return out


def _chat_end_ids(tokenizer: Any) -> tuple[int, ...]:
    """(the chat end token's id,) for a tokenizer with the chat tokens, else ()."""
    from ferrolm.bpe.chat_format import END_TOKEN, carries_chat

    return (tokenizer.special_token_ids[END_TOKEN],) if carries_chat(tokenizer.special_tokens) else ()


# Run as ``python -m ferrolm.lm.harness`` this file is __main__; the class registered is
# then the one of the module proper, imported below (one name cannot hold two classes).
if __name__ != "__main__":
    register_model("ferrolm")(FerrolmLM)


def _task_manager(tasks: list[str], include_path: Optional[PathLike]):
    """lm-eval's TaskManager; with ``include_path`` holding every task asked for, only that
    folder is indexed (indexing lm-eval's thousands of built-in YAMLs takes a while)."""
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        local = TaskManager(include_path=os.fspath(include_path), include_defaults=False)
        if len(local.match_tasks(tasks)) == len(tasks):
            return local
        return TaskManager(include_path=os.fspath(include_path))
    return TaskManager()


def run_tasks(
    checkpoint: PathLike,
    tasks: Union[str, list[str]],
    tokenizer: Any = None,
    *,
    num_fewshot: Optional[int] = None,
    limit: Optional[float] = None,
    batch_size: int = 8,
    device: str = "auto",
    include_path: Optional[PathLike] = None,
    log_samples: bool = False,
    bootstrap_iters: int = 100_000,
    progress: bool = True,
    apply_chat_template: bool = False,
) -> dict:
    """Score ``checkpoint`` on lm-eval ``tasks`` (names or a comma-separated string); return
    lm-eval's results dict ("results" per task; "samples" too with ``log_samples``).

    ``include_path``: a folder of task YAMLs of your own; ``limit``: examples per task (a
    fraction when < 1); tasks that need a download fetch their data through HF datasets.
    ``bootstrap_iters``: lm-eval's resamples for the standard errors of some metrics (0: none).
    ``apply_chat_template``: prompts as conversations of a chat model (few-shot examples as
    turns), as lm-eval's ``--apply_chat_template``.
    """
    from lm_eval import simple_evaluate

    names = [t.strip() for t in tasks.split(",")] if isinstance(tasks, str) else list(tasks)
    names = [t for t in names if t]
    if not names:
        raise ValueError("no task given: name lm-eval tasks, e.g. hellaswag,arc_easy")
    if num_fewshot is not None and (
        isinstance(num_fewshot, bool) or not isinstance(num_fewshot, int) or num_fewshot < 0
    ):
        raise ValueError(f"num_fewshot must be an int >= 0, got {num_fewshot!r}")
    if limit is not None and (isinstance(limit, bool) or not 0 < limit < float("inf")):
        raise ValueError(f"limit must be a finite number > 0 (a fraction of each task when below 1), got {limit!r}")
    lm = FerrolmLM(checkpoint, tokenizer, device=device, batch_size=batch_size, progress=progress)  # fails fast
    if apply_chat_template:
        lm.chat_template(True)  # a model that cannot chat fails here, before any task is read
    manager = _task_manager(names, include_path)
    unknown = [t for t in names if not manager.match_tasks([t])]
    if unknown:
        raise ValueError(f"unknown lm-eval task(s): {', '.join(unknown)} (`lm_eval ls tasks` lists them)")
    results = simple_evaluate(
        model=lm,
        tasks=names,
        num_fewshot=num_fewshot,
        limit=limit,
        task_manager=manager,
        log_samples=log_samples,
        bootstrap_iters=bootstrap_iters,
        apply_chat_template=bool(apply_chat_template),
    )
    if results is None:  # pragma: no cover - only ranks other than 0 get None
        raise RuntimeError("lm-eval returned no results")
    return results


def main(argv: Optional[list[str]] = None) -> None:
    """lm-eval's command line, with "ferrolm" registered (``python -m ferrolm.lm.harness ...``)."""
    import sys

    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    from ferrolm.lm.harness import main as registered_main

    registered_main()
