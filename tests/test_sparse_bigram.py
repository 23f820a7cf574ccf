"""optimizer.sparse_bigram: the bigram table's gradient as the rows read (a sparse tensor) and
AdamW's lazy update of those rows, against the update written out row by row; gradient
clipping over a sparse gradient; and a run that trains with it and leaves unread rows alone."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from test_train import final_weights, shards, tiny_config  # noqa: F401  (shards: a fixture)

from ferrolm.lm.model import Embedding, TransformerLM, bigram_hash
from ferrolm.lm.optim import AdamW, Muon, clip_grad_norm, muon_param_groups
from ferrolm.lm.train import build_optimizer, train

torch.set_num_threads(1)
LR, BETAS, EPS, WD = 0.1, (0.8, 0.95), 1e-8, 0.05


def lazy_adamw_reference(w, m, v, reads, step, wd=WD):
    """One step of lazy AdamW, literally: each row read gets the sum of its reads' gradients
    and AdamW's lines on that row alone; an unread row keeps its weight and moments."""
    summed: dict[int, torch.Tensor] = {}
    for row, g in reads:
        summed[row] = summed.get(row, 0) + g
    for row, g in summed.items():
        w[row] *= 1 - LR * wd
        m[row] = BETAS[0] * m[row] + (1 - BETAS[0]) * g
        v[row] = BETAS[1] * v[row] + (1 - BETAS[1]) * g * g
        m_hat = m[row] / (1 - BETAS[0] ** step)
        v_hat = v[row] / (1 - BETAS[1] ** step)
        w[row] -= LR * m_hat / (v_hat.sqrt() + EPS)


def reads_of(ids: torch.Tensor, upstream: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    return [(int(i), upstream[k]) for k, i in enumerate(ids.tolist())]


@pytest.mark.parametrize("how", [{"foreach": False}, {"foreach": True, "fused": False}, {"fused": None}])
def test_lazy_update_is_adamw_on_the_rows_read(how):
    torch.manual_seed(0)
    table = Embedding(12, 5, dtype=torch.float64)
    table.sparse_grad = True
    dense = torch.nn.Parameter(torch.randn(3, 5, dtype=torch.float64))  # a dense parameter beside it
    opt = AdamW([table.weight, dense], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **how)
    w, m, v = (
        table.weight.detach().clone(),
        torch.zeros(12, 5, dtype=torch.float64),
        torch.zeros(12, 5, dtype=torch.float64),
    )
    for step, ids in enumerate([[1, 4, 4, 7], [4, 9, 1, 1, 2], [11, 0]], start=1):
        ids = torch.tensor(ids)
        upstream = torch.randn(len(ids), 5, dtype=torch.float64)
        out = table(ids)
        (out * upstream).sum().backward()
        dense.grad = torch.randn_like(dense)
        assert table.weight.grad.is_sparse
        opt.step()
        opt.zero_grad(set_to_none=True)
        lazy_adamw_reference(w, m, v, reads_of(ids, upstream), step)
        state = opt.state[table.weight]
        torch.testing.assert_close(table.weight.detach(), w, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(state["exp_avg"], m, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(state["exp_avg_sq"], v, rtol=1e-12, atol=1e-12)
    unread = [3, 5, 6, 8, 10]
    assert torch.equal(state["exp_avg"][unread], torch.zeros(5, 5, dtype=torch.float64))


def test_first_step_equals_dense_adamw():
    """Moments start at 0, so dense AdamW moves an unread row by 0 on its first step: there the
    lazy update and the dense one agree on every row."""
    torch.manual_seed(1)
    tables = [Embedding(10, 4), Embedding(10, 4)]
    tables[1].load_state_dict(tables[0].state_dict())
    tables[1].sparse_grad = True
    ids, upstream = torch.tensor([2, 5, 5, 8]), torch.randn(4, 4)
    for t in tables:
        opt = AdamW(t.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)
        (t(ids) * upstream).sum().backward()
        opt.step()
    torch.testing.assert_close(tables[0].weight, tables[1].weight, rtol=0, atol=1e-7)


def test_clipping_a_sparse_gradient_measures_and_scales_the_dense_one():
    torch.manual_seed(2)
    tables = [Embedding(10, 4), Embedding(10, 4)]
    tables[1].load_state_dict(tables[0].state_dict())
    tables[1].sparse_grad = True
    ids, upstream = torch.tensor([1, 3, 3, 3, 9]), 10 * torch.randn(5, 4)
    for t in tables:
        (t(ids) * upstream).sum().backward()
    norms = [clip_grad_norm(t.parameters(), 1.0) for t in tables]
    torch.testing.assert_close(norms[0], norms[1])
    assert norms[0] > 1.0  # it clipped
    torch.testing.assert_close(tables[1].weight.grad.to_dense(), tables[0].weight.grad)
    assert math.isclose(float(tables[1].weight.grad.to_dense().norm()), 1.0, rel_tol=1e-5)


def test_muon_updates_the_sparse_table_in_its_embedding_group():
    model = TransformerLM(
        vocab_size=32, context_length=8, d_model=32, num_layers=1, num_heads=2, d_ff=64, bigram_buckets=64
    )
    model.bigram_embeddings.sparse_grad = True
    groups = muon_param_groups(model, lr=0.02, embedding_lr=0.1, head_lr=0.01, scalar_lr=0.01)
    opt = Muon(groups, lr=0.02)
    ids = torch.randint(0, 32, (2, 8))
    before = model.bigram_embeddings.weight.detach().clone()
    F.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
    assert model.bigram_embeddings.weight.grad.is_sparse
    opt.step()
    prev = model._previous_ids(ids, None, 0, None)
    read = set(bigram_hash(prev, ids, 64).flatten().tolist())
    moved = set((model.bigram_embeddings.weight != before).any(dim=1).nonzero().flatten().tolist())
    assert moved and moved <= read


def test_a_run_trains_with_it(shards, tmp_path):  # noqa: F811
    sections = {"model": {"bigram_buckets": 4096}, "schedule": {"max_steps": 6}, "run": {"checkpoint_every": 6}}
    tables = {}
    for sparse in (False, True):
        cfg = tiny_config(shards, tmp_path / str(sparse), optimizer={"sparse_bigram": sparse}, **sections)
        summary = train(cfg)
        assert summary.status == "done" and math.isfinite(summary.final_val_loss)
        tables[sparse] = final_weights(tmp_path / str(sparse), 6)["bigram_embeddings.weight"]
    moved = [int((w != 0).any(dim=1).sum()) for w in (tables[False], tables[True])]  # the table starts at 0
    assert 0 < moved[1] == moved[0] < 4096  # the rows read (the same batches) and no others
    # dense AdamW kept moving rows read earlier (more than the summation order's rounding)
    assert float((tables[False] - tables[True]).abs().max()) > 1e-4


def test_build_optimizer_marks_only_the_bigram_table(shards, tmp_path):  # noqa: F811
    cfg = tiny_config(shards, tmp_path, model={"bigram_buckets": 64}, optimizer={"sparse_bigram": True})
    model = TransformerLM.from_config(cfg.model)
    build_optimizer(model, cfg.optimizer)
    sparse = [name for name, m in model.named_modules() if isinstance(m, Embedding) and m.sparse_grad]
    assert sparse == ["bigram_embeddings"]
