"""lm-eval through `ferrolm serve`: lm-eval's own ``local-completions`` model (its OpenAI
completions client, scoring with ``echo`` and ``logprobs``) pointed at a running server
scores a small local task with the log-likelihoods of ferrolm's in-process adapter."""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("uvicorn")
pytest.importorskip("transformers")
pytest.importorskip("tenacity", reason="lm-eval's API models need lm-eval[api]")
pytest.importorskip("aiohttp", reason="lm-eval's API models need lm-eval[api]")

from test_serve import Server
from tiny_lm import tiny_run

MC = [
    {"question": "The parser reads the", "choices": ["command line", "moon", "argument strings of it"], "answer": 0},
    {"question": "JSON is a", "choices": ["lightweight data interchange format", "cat"], "answer": 0},
    {"question": "", "choices": ["This module", "logging"], "answer": 1},  # an empty context
    {"question": "A deque is ", "choices": ["a list-like container", "x"], "answer": 0},  # trailing space
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("served_eval")
    ckpt, _, _ = tiny_run(root)
    tasks = root / "tasks"
    tasks.mkdir()
    data = tasks / "served_mc.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in MC), encoding="utf-8")
    (tasks / "served_mc.yaml").write_text(
        f"task: served_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        f"  cache_dir: {root / 'hf-cache'}\ntest_split: test\n"
        'output_type: multiple_choice\ndoc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\nmetric_list:\n  - metric: acc\n',
        encoding="utf-8",
    )
    server = Server("--checkpoint", str(ckpt), "--tokenizer", str(root / "tok"))
    yield ckpt, root / "tok", tasks, server
    assert server.stop() == 0, "".join(server.log)


def _resps(results: dict) -> list:
    return [resp for s in results["samples"]["served_mc"] for (resp,) in s["resps"]]


def test_local_completions_through_the_server_scores_as_the_in_process_adapter(setup):
    from lm_eval import simple_evaluate
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from ferrolm.lm.harness import _task_manager, run_tasks

    ckpt, tok_dir, tasks, server = setup
    local = run_tasks(ckpt, "served_mc", include_path=tasks, device="cpu", log_samples=True, bootstrap_iters=0)
    remote_lm = LocalCompletionsAPI(
        model=server.name,
        base_url=f"{server.url}/v1/completions",
        tokenizer_backend="huggingface",  # the tokenizer folder's tokenizer.json, as transformers reads it
        tokenizer=str(tok_dir),
        max_length=64,  # the model's context
        max_retries=1,
    )
    remote = simple_evaluate(
        model=remote_lm,
        tasks=["served_mc"],
        task_manager=_task_manager(["served_mc"], tasks),
        log_samples=True,
        bootstrap_iters=0,
    )
    want, got = _resps(local), _resps(remote)
    assert len(got) == sum(len(r["choices"]) for r in MC)
    for (want_ll, want_greedy), (got_ll, got_greedy) in zip(want, got):
        assert float(got_ll) == pytest.approx(want_ll, abs=1e-4)
        assert got_greedy == want_greedy
    assert remote["results"]["served_mc"]["acc,none"] == local["results"]["served_mc"]["acc,none"]
