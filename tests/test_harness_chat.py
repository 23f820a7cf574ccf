"""ferrolm.lm.harness with chat: lm-eval's apply_chat_template on a tiny chat model
(tests/tiny_chat.py), through lm-eval's own task runner and `ferrolm eval --apply-chat-template`."""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
lm_eval = pytest.importorskip("lm_eval")

from test_harness import _yaml  # noqa: E402
from tiny_chat import CONVERSATIONS, messages, tiny_chat_run  # noqa: E402
from tiny_lm import tiny_run  # noqa: E402

from ferrolm.lm import chat  # noqa: E402
from ferrolm.lm.checkpoint import load_model  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("harness_chat")
    ckpt, tok = tiny_chat_run(root)
    tasks = root / "tasks"
    tasks.mkdir()
    gen = [{"prompt": u, "target": r} for u, r in CONVERSATIONS]
    mc = [{"prompt": u, "choices": [r, "Maybe so."], "answer": 0} for u, r in CONVERSATIONS]
    for name, rows, body in [
        (
            "tiny_chat_gen",
            gen,
            'output_type: generate_until\ndoc_to_text: "{{prompt}}"\ndoc_to_target: "{{target}}"\n'
            "generation_kwargs:\n  until: []\n  max_gen_toks: 40\n  do_sample: false\n"
            "metric_list:\n  - metric: exact_match\n",
        ),
        (
            "tiny_chat_mc",
            mc,
            'output_type: multiple_choice\ndoc_to_text: "{{prompt}}"\ndoc_to_choice: "{{choices}}"\n'
            'doc_to_target: "{{answer}}"\ntarget_delimiter: ""\nmetric_list:\n  - metric: acc\n',
        ),
    ]:
        data = tasks / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        (tasks / f"{name}.yaml").write_text(_yaml(name, str(data), str(root / "cache"), body), encoding="utf-8")
    return ckpt, tok, tasks


def test_eval_apply_chat_template_generates_the_replies(setup, capsys):
    from ferrolm.app.cli import main

    ckpt, _, tasks = setup
    argv = ["eval", "--checkpoint", str(ckpt), "--device", "cpu", "--include-path", str(tasks), "--no-progress"]
    assert main([*argv, "--tasks", "tiny_chat_gen", "--apply-chat-template", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["results"]["tiny_chat_gen"]["exact_match,none"] == 1.0  # each reply whole, ended at <|end|>
    # Without the chat template the prompt is bare text, which the model was not taught to answer.
    assert main([*argv, "--tasks", "tiny_chat_gen", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["results"]["tiny_chat_gen"]["exact_match,none"] < 1.0
    assert main(["eval", "--checkpoint", str(ckpt), "--data", "val", "--apply-chat-template"]) == 2
    assert "--apply-chat-template is for --tasks" in capsys.readouterr().err


def test_chat_prompts_score_on_render_prompt_ids(setup):
    from ferrolm.lm.harness import run_tasks

    ckpt, tok, tasks = setup
    r = run_tasks(ckpt, "tiny_chat_mc", include_path=tasks, apply_chat_template=True, log_samples=True, progress=False)
    assert r["results"]["tiny_chat_mc"]["acc,none"] == 1.0
    model, _, _ = load_model(ckpt, "cpu")
    for sample in r["samples"]["tiny_chat_mc"]:
        ids = chat.render_prompt(tok, messages(sample["doc"]["prompt"]))
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"]):
            logprob = float(resp[0][0])
            assert context == tok.decode(ids)
            cont = tok.encode(continuation)
            with torch.no_grad():
                lp = torch.log_softmax(model(torch.tensor([ids + cont])).float()[0], -1)
            want = lp[len(ids) - 1 : -1].gather(1, torch.tensor(cont)[:, None]).sum().item()
            assert logprob == pytest.approx(want, abs=1e-4)


def test_a_content_spelling_a_chat_token_is_scored_as_text(setup):
    from ferrolm.lm.harness import FerrolmLM

    ckpt, tok, _ = setup
    model, _, _ = load_model(ckpt, "cpu")
    lm = FerrolmLM(model=model, tokenizer=tok, progress=False)
    history = [{"role": "system", "content": "Say <|end|> never."}, {"role": "user", "content": "Hello"}]
    text = lm.apply_chat_template(history)
    assert lm._pair_ids(text, "Hi")[0] == chat.render_prompt(tok, history) != tok.encode(text)
    # Without a generation prompt a last assistant message stays open, for the model to continue.
    open_turn = lm.apply_chat_template([*history, {"role": "assistant", "content": "Hi"}], add_generation_prompt=False)
    assert open_turn == text + "Hi"
    assert lm.tokenizer_name.startswith("ferrolm-") and lm.chat_template(True) == chat.CHAT_TEMPLATE


def test_a_model_without_chat_tokens_is_refused_up_front(tmp_path, setup):
    from ferrolm.lm.harness import run_tasks

    ckpt, _, _ = tiny_run(tmp_path, steps=1)
    with pytest.raises(ValueError, match="--config sft"):
        run_tasks(ckpt, "tiny_chat_gen", include_path=setup[2], apply_chat_template=True, progress=False)
