"""ferrolm.lm.harness: ferrolm as an lm-evaluation-harness model. Small tasks defined here
(YAML + local JSON lines, no download) run through lm-eval's own task manager and
evaluator; the log-likelihoods it records equal sums of log-softmax of ferrolm's logits,
computed here one request at a time, and greedy generations equal ferrolm's sampler's."""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
lm_eval = pytest.importorskip("lm_eval")

from tiny_lm import tiny_run

from ferrolm.lm.checkpoint import load_model
from ferrolm.lm.generate import generate

torch.set_num_threads(1)

MC = [
    {"question": "The parser reads the", "choices": ["command line", "moon", "argument strings of it"], "answer": 0},
    {"question": "JSON is a", "choices": ["lightweight data interchange format", "cat"], "answer": 0},
    {"question": "", "choices": ["This module", "logging"], "answer": 1},  # an empty context
    {"question": "A deque is ", "choices": ["a list-like container", "x"], "answer": 0},  # trailing space
]
GEN = [{"prompt": "The parser", "target": "x"}, {"prompt": "Log", "target": "x"}, {"prompt": "JSON", "target": "x"}]


def _yaml(name: str, data: str, cache: str, body: str) -> str:
    head = (
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        f"  cache_dir: {cache}\ntest_split: test\n"
    )
    return head + body


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("harness")
    ckpt, tok, text = tiny_run(root)
    tasks = root / "tasks"
    tasks.mkdir()
    words = text.split()
    rolling = [{"text": " ".join(words[:200])}, {"text": "JSON encoder"}, {"text": " ".join(words[300:308])}]
    cache = root / "hf-cache"
    for name, rows, body in [
        (
            "tiny_mc",
            MC,
            'output_type: multiple_choice\ndoc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\n'
            'doc_to_target: "{{answer}}"\nmetric_list:\n  - metric: acc\n',
        ),
        (
            "tiny_rolling",
            rolling,
            'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
            "metric_list:\n  - metric: word_perplexity\n",
        ),
        (
            "tiny_gen",
            GEN,
            'output_type: generate_until\ndoc_to_text: "{{prompt}}"\ndoc_to_target: "{{target}}"\n'
            'generation_kwargs:\n  until: [".", "\\n"]\n  max_gen_toks: 12\n  do_sample: false\n'
            "metric_list:\n  - metric: exact_match\n",
        ),
    ]:
        data = tasks / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        (tasks / f"{name}.yaml").write_text(_yaml(name, str(data), str(cache), body), encoding="utf-8")
    model, _, _ = load_model(ckpt, tokenizer=False)
    return ckpt, tok, model, tasks


def _logprobs(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).float()[0], dim=-1)


def _reference_loglikelihood(model, tok, context, continuation):
    """log p(continuation | context) and greedy-ness from one unbatched, unpadded forward pass."""
    spaces = context[len(context.rstrip()) :]
    context, continuation = context.rstrip(), spaces + continuation
    ctx = tok.encode(context) if context else [tok.eos_id]
    cont = tok.encode(continuation)
    lp = _logprobs(model, ctx + cont[:-1])[len(ctx) - 1 :]
    picked = lp[torch.arange(len(cont)), torch.tensor(cont)]
    return picked.sum().item(), bool((lp.argmax(-1) == torch.tensor(cont)).all())


def test_registered_in_lm_eval_registry():
    from lm_eval.api.registry import get_model

    from ferrolm.lm.harness import FerrolmLM

    assert get_model("ferrolm") is FerrolmLM


def test_tasks_score_as_ferrolm_logits_say(setup):
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    from ferrolm.lm.harness import run_tasks

    ckpt, tok, model, tasks = setup
    r = run_tasks(
        ckpt,
        "tiny_mc,tiny_rolling,tiny_gen",
        include_path=tasks,
        batch_size=3,  # rows of several lengths share a padded batch
        device="cpu",
        log_samples=True,
        bootstrap_iters=0,
        progress=False,
    )
    samples = r["samples"]

    assert len(samples["tiny_mc"]) == len(MC)
    for s in samples["tiny_mc"]:
        for (context, continuation), (got,) in zip(s["arguments"], s["resps"]):
            want_ll, want_greedy = _reference_loglikelihood(model, tok, context, continuation)
            assert got[0] == pytest.approx(want_ll, abs=1e-4) and got[1] == want_greedy
    picks = [max(range(len(s["resps"])), key=lambda i: s["resps"][i][0][0]) for s in samples["tiny_mc"]]
    acc = sum(p == row["answer"] for p, row in zip(picks, MC)) / len(MC)
    assert r["results"]["tiny_mc"]["acc,none"] == pytest.approx(acc)

    L = model.config.context_length
    long_text = 0
    for s in samples["tiny_rolling"]:
        (text,) = s["arguments"][0]
        ids = tok.encode(text)
        long_text += len(ids) > L
        want = 0.0
        for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(ids, tok.eos_id, L, 1)):
            lp = _logprobs(model, ctx + cont[:-1])[len(ctx) - 1 :]
            want += lp[torch.arange(len(cont)), torch.tensor(cont)].sum().item()
        assert s["resps"][0][0] == pytest.approx(want, abs=1e-4)
    assert long_text == 1  # one text spans several windows

    for s in samples["tiny_gen"]:
        context, kwargs = s["arguments"][0]
        ids = list(generate(model, tok.encode(context), 12, temperature=0.0, eos_id=tok.eos_id))
        text = tok.decode([t for t in ids if t != tok.eos_id])
        cut = min([i for i in (text.find("."), text.find("\n")) if i >= 0], default=len(text))
        assert s["resps"][0][0] == text[:cut]


def test_eval_cli_runs_tasks_and_refuses_unknown_ones(setup, capsys, monkeypatch):
    from lm_eval.tasks import TaskManager

    from ferrolm.app.cli import main

    ckpt, _, _, tasks = setup
    argv = ["eval", "--checkpoint", str(ckpt), "--device", "cpu", "--include-path", str(tasks)]
    assert main(argv + ["--tasks", "tiny_mc", "--limit", "2", "--json"]) == 0
    printed = capsys.readouterr()
    assert "ferrolm loglikelihood: 100%" in printed.err  # the progress bar
    out = json.loads(printed.out)
    assert set(out["results"]) == {"tiny_mc"} and out["n-samples"]["tiny_mc"]["effective"] == 2
    # A name not in the folder is looked up among lm-eval's own tasks too; indexing those
    # takes a minute, so here the index holds the folder alone.
    real_init = TaskManager.__init__
    monkeypatch.setattr(
        TaskManager, "__init__", lambda self, **kw: real_init(self, **{**kw, "include_defaults": False})
    )
    assert main(argv + ["--tasks", "tiny_mc,no_such_task"]) == 2
    assert "unknown lm-eval task(s): no_such_task" in capsys.readouterr().err
    assert main(argv + ["--tasks", "tiny_mc", "--max-tokens", "5"]) == 2
    assert "--max-tokens is for --data" in capsys.readouterr().err
    assert main(["eval", "--checkpoint", str(ckpt), "--data", "val", "--limit", "3"]) == 2
    assert "--limit is for --tasks" in capsys.readouterr().err
    for both_or_neither in ([], ["--data", "val", "--tasks", "tiny_mc"]):
        assert main(["eval", "--checkpoint", str(ckpt), *both_or_neither]) == 2
        assert "give --data SHARD (loss, bits per byte) or --tasks NAMES" in capsys.readouterr().err


def test_lm_eval_command_line_with_ferrolm_registered(setup):
    """``python -m ferrolm.lm.harness`` is lm-eval's own command line, "ferrolm" a model in it."""
    import subprocess
    import sys

    ckpt, _, _, tasks = setup
    argv = ["--model", "ferrolm", "--model_args", f"checkpoint={ckpt}", "--device", "cpu", "--batch_size", "2"]
    argv += ["--tasks", "tiny_mc", "--include_path", str(tasks), "--limit", "2"]
    # lm-eval indexes its own thousands of task YAMLs too (a minute); the local folder is enough here.
    script = (
        "import runpy, sys\n"
        "from lm_eval.tasks import TaskManager\n"
        "init = TaskManager.__init__\n"
        "TaskManager.__init__ = lambda self, **kw: init(self, **{**kw, 'include_defaults': False})\n"
        f"sys.argv = ['harness', *{argv!r}]\n"
        "runpy.run_module('ferrolm.lm.harness', run_name='__main__', alter_sys=True)\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "ferrolm ({'checkpoint'" in r.stdout and "|tiny_mc|" in r.stdout.replace(" ", "")


def test_generate_until_samples_when_asked_and_refuses_unknown_kwargs(setup):
    from lm_eval.api.instance import Instance

    from ferrolm.lm.harness import FerrolmLM

    _, tok, model, _ = setup
    lm = FerrolmLM(model=model, tokenizer=tok, batch_size=2, progress=False)

    def request(kwargs):
        return Instance("generate_until", {}, ("The parser", kwargs), 0)

    greedy = lm.generate_until([request({"until": [], "max_gen_toks": 8})])[0]
    ids = [t for t in generate(model, tok.encode("The parser"), 8, temperature=0.0, eos_id=tok.eos_id)]
    assert greedy == tok.decode([t for t in ids if t != tok.eos_id])
    # top_k=1 keeps only the argmax: sampling then gives the greedy text
    assert lm.generate_until([request({"max_gen_toks": 8, "do_sample": True, "temperature": 5.0, "top_k": 1})]) == [
        greedy
    ]
    with pytest.raises(ValueError, match="generation kwargs ferrolm has no use for: num_beams"):
        lm.generate_until([request({"until": ["."], "num_beams": 4})])
    with pytest.raises(ValueError, match="model object needs its Tokenizer"):
        FerrolmLM(model=model)


def test_run_tasks_refuses_a_negative_fewshot_or_limit_before_loading():
    from ferrolm.lm.harness import run_tasks

    with pytest.raises(ValueError, match=r"num_fewshot must be an int >= 0, got -1"):
        run_tasks("no-such-run", "tiny_mc", num_fewshot=-1)
    for limit in (-1, 0, float("nan")):
        with pytest.raises(ValueError, match=r"limit must be a finite number > 0"):
            run_tasks("no-such-run", "tiny_mc", limit=limit)


def test_generate_until_outputs_are_pinned(setup):
    """Greedy generations recorded before the harness ran on the inference engine: a batch
    of contexts (an empty one among them) cut at a stop string, and a context longer than the
    model's, whose window slides."""
    from lm_eval.api.instance import Instance
    from tiny_lm import stdlib_text

    from ferrolm.lm.harness import FerrolmLM

    _, tok, model, _ = setup
    lm = FerrolmLM(model=model, tokenizer=tok, batch_size=4, progress=False)
    kwargs = {"until": ["."], "max_gen_toks": 24}
    reqs = [Instance("generate_until", {}, (c, kwargs), 0) for c in ["The parser", "Log", "", "JSON is"]]
    assert lm.generate_until(reqs) == [
        " efoooding e e e e e e e e",
        "efoooooooooooooooooooooo",
        "",
        " efooooooooooooooooooooo",
    ]
    long_context = " ".join(stdlib_text().split()[40:120])
    req = Instance("generate_until", {}, (long_context, {"until": ["zzz"], "max_gen_toks": 70}), 0)
    assert lm.generate_until([req]) == ["l" + "o" * 69]
