"""optimizer.sparse_bigram: the bigram table's gradient as the rows read (a sparse tensor) and
AdamW's deferred update of the rows, against dense AdamW written out row by row; gradient
clipping over a sparse gradient; resuming; and runs with it that learn as dense AdamW does."""

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
LR, BETAS = 0.1, (0.8, 0.95)


def dense_adamw_reference(w, m, v, grad, step, lr, eps):
    """One step of AdamW on every row, literally (no decay): an unread row's gradient is 0."""
    for row in range(w.shape[0]):
        g = grad[row]
        m[row] = BETAS[0] * m[row] + (1 - BETAS[0]) * g
        v[row] = BETAS[1] * v[row] + (1 - BETAS[1]) * g * g
        m_hat = m[row] / (1 - BETAS[0] ** step)
        v_hat = v[row] / (1 - BETAS[1] ** step)
        w[row] -= lr * m_hat / (v_hat.sqrt() + eps)


# every row is read at step 1 (an unread row's 0/0 is dense AdamW's NaN at eps 0); then row 3 is
# not read for 40 steps, past a settle (DEFERRED_SPAN), and rows repeat within a step
READS = [list(range(12)), [1, 4, 4, 7], [4, 9, 1, 1, 2], [11, 0]] + [[5, 6, 5]] * 38 + [[3, 8]]


def deferred_and_dense(how: dict, eps: float, scale: float):
    """Yield (the optimizer's settled weight, m, v; dense AdamW's) after some of READS' steps."""
    torch.manual_seed(0)
    table = Embedding(12, 5, dtype=torch.float64)
    table.sparse_grad = True
    dense = torch.nn.Parameter(torch.randn(3, 5, dtype=torch.float64))  # a dense parameter beside it
    opt = AdamW([table.weight, dense], lr=LR, betas=BETAS, eps=eps, weight_decay=0.0, **how)
    w, m, v = (
        table.weight.detach().clone(),
        torch.zeros(12, 5, dtype=torch.float64),
        torch.zeros(12, 5, dtype=torch.float64),
    )
    for step, ids in enumerate(READS, start=1):
        lr = LR * (1 - step / 60)  # a schedule: the missed steps each have their own rate
        for group in opt.param_groups:
            group["lr"] = lr
        ids = torch.tensor(ids)
        upstream = scale * torch.randn(len(ids), 5, dtype=torch.float64)
        (table(ids) * upstream).sum().backward()
        dense.grad = torch.randn_like(dense)
        assert table.weight.grad.is_sparse
        opt.step()
        opt.zero_grad(set_to_none=True)
        grad = torch.zeros(12, 5, dtype=torch.float64).index_add_(0, ids, upstream)
        dense_adamw_reference(w, m, v, grad, step, lr, eps)
        if step in (2, 3, 30, len(READS)):
            state = opt.state_dict()["state"][0]  # state_dict settles the deferred rows
            yield (table.weight.detach(), state["exp_avg"], state["exp_avg_sq"]), (w, m, v)


@pytest.mark.parametrize("how", [{"foreach": False}, {"foreach": True, "fused": False}, {"fused": None}])
def test_deferred_rows_are_dense_adamw(how):
    for ours, reference in deferred_and_dense(how, eps=0.0, scale=1.0):
        for a, b in zip(ours, reference):
            torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-12)


def test_epsilon_in_the_missed_steps_where_gradients_are_as_small():
    """Gradients near ε: the missed steps' ε is held at its first step's weight, 10 times
    closer to dense AdamW than leaving it out (which misses by 70 % of the movement)."""
    torch.manual_seed(0)
    start = Embedding(12, 5, dtype=torch.float64).weight.detach()
    for (w, _, _), (w_dense, _, _) in deferred_and_dense({}, eps=1e-8, scale=1e-8):
        moved = (w_dense - start).abs().max()
        assert (w - w_dense).abs().max() < 0.1 * moved


def test_an_unread_row_waits_until_it_is_read_or_settled():
    table = Embedding(4, 2, dtype=torch.float64)
    table.sparse_grad = True
    opt = AdamW(table.parameters(), lr=LR, betas=BETAS, eps=0.0, weight_decay=0.0)
    for ids in ([0, 1], [1], [1]):
        table(torch.tensor(ids)).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    before = table.weight.detach().clone()
    opt.settle()
    assert not torch.equal(table.weight[0], before[0])  # row 0 missed two steps: they land now
    assert torch.equal(table.weight[1:], before[1:])  # row 1 was current; rows 2, 3 never moved


def test_a_decaying_sparse_parameter_is_refused_before_anything_moves():
    dense = torch.nn.Parameter(torch.ones(3))
    table = Embedding(4, 2)
    table.sparse_grad = True
    opt = AdamW([{"params": [dense], "weight_decay": 0.0}, {"params": table.parameters()}], weight_decay=0.1)
    (table(torch.tensor([1])).sum() + dense.sum()).backward()
    before = table.weight.detach().clone()
    with pytest.raises(ValueError, match="weight decay"):
        opt.step()
    assert torch.equal(dense.detach(), torch.ones(3))  # the group before it was not stepped
    assert torch.equal(table.weight.detach(), before) and not opt.state


def test_settle_skips_a_table_with_no_row_behind(monkeypatch):
    """Evaluation and saving settle; right after a settle (or before any step since) no row is
    behind, and the pass over the whole table is skipped."""
    table = Embedding(5, 3)
    table.sparse_grad = True
    opt = AdamW(table.parameters(), lr=0.1, weight_decay=0.0)
    passes = []
    settle_param = opt._settle_param
    monkeypatch.setattr(opt, "_settle_param", lambda *a: passes.append(1) or settle_param(*a))
    table(torch.tensor([0, 1])).sum().backward()
    opt.step()
    opt.settle()  # row 2 onwards missed step 1
    assert len(passes) == 1 and opt.state[table.weight]["drift_base"] == opt.state[table.weight]["step"]
    opt.settle()
    opt.state_dict()
    assert len(passes) == 1


def test_a_checkpoint_resumes_the_deferred_update():
    """A state saved mid-span (settled) and loaded into a fresh optimizer goes on as the first."""
    torch.manual_seed(3)
    tables = [Embedding(6, 3), Embedding(6, 3)]
    tables[1].load_state_dict(tables[0].state_dict())
    opts = []
    for t in tables:
        t.sparse_grad = True
        opts.append(AdamW(t.parameters(), lr=LR, betas=BETAS, weight_decay=0.0))
    steps = [torch.tensor(ids) for ids in ([0, 1, 2], [2, 3], [3], [0, 5], [5], [1, 4])]
    for k, ids in enumerate(steps):
        if k == 3:  # the second optimizer is rebuilt from a checkpoint
            saved = opts[1].state_dict()
            opts[1] = AdamW(tables[1].parameters(), lr=LR, betas=BETAS, weight_decay=0.0)
            opts[1].load_state_dict(saved)
            opts[0].settle()  # the straight run settles where the checkpoint was taken, as training does
        for t, opt in zip(tables, opts):
            (t(ids) * torch.arange(1.0, 4.0)).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    for opt in opts:
        opt.settle()
    assert torch.equal(tables[0].weight, tables[1].weight)
    assert opts[1].state[tables[1].weight]["row_step"].dtype == torch.long


def test_first_step_equals_dense_adamw():
    """Moments start at 0, so dense AdamW moves an unread row by 0 on its first step: there the
    lazy update and the dense one agree on every row."""
    torch.manual_seed(1)
    tables = [Embedding(10, 4), Embedding(10, 4)]
    tables[1].load_state_dict(tables[0].state_dict())
    tables[1].sparse_grad = True
    ids, upstream = torch.tensor([2, 5, 5, 8]), torch.randn(4, 4)
    for t in tables:
        opt = AdamW(t.parameters(), lr=LR, betas=BETAS, weight_decay=0.0)
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


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_a_run_learns_as_with_dense_adamw(shards, tmp_path, optimizer):  # noqa: F811
    """The same run with and without the switch. Under AdamW (lr 3e-3) the tables stay within
    float32 rounding grown over 40 steps (leaving unread rows still, or losing the deferred
    steps, is off by more); Muon's embedding lr at this width (about 1) makes a tiny model
    chaotic, so there the losses are compared."""
    sections = {"model": {"bigram_buckets": 4096}, "schedule": {"max_steps": 40}, "run": {"checkpoint_every": 40}}
    tables, losses = {}, {}
    for sparse in (False, True):
        settings = {"sparse_bigram": sparse, "name": optimizer}
        cfg = tiny_config(shards, tmp_path / str(sparse), optimizer=settings, **sections)
        summary = train(cfg)
        assert summary.status == "done"
        tables[sparse] = final_weights(tmp_path / str(sparse), 40)["bigram_embeddings.weight"]
        losses[sparse] = summary.final_val_loss
    assert float(tables[False].abs().max()) > 1e-2  # it learned
    if optimizer == "adamw":
        torch.testing.assert_close(tables[True], tables[False], rtol=0, atol=2e-3)
    assert losses[True] == pytest.approx(losses[False], rel=0.05)


def test_build_optimizer_marks_only_the_bigram_table(shards, tmp_path):  # noqa: F811
    cfg = tiny_config(shards, tmp_path, model={"bigram_buckets": 64}, optimizer={"sparse_bigram": True})
    model = TransformerLM.from_config(cfg.model)
    build_optimizer(model, cfg.optimizer)
    sparse = [name for name, m in model.named_modules() if isinstance(m, Embedding) and m.sparse_grad]
    assert sparse == ["bigram_embeddings"]


def test_bigram_lr_gives_the_table_its_own_group():
    model = TransformerLM(
        vocab_size=32, context_length=8, d_model=32, num_layers=1, num_heads=2, d_ff=64, bigram_buckets=64
    )
    table = model.bigram_embeddings.weight
    kwargs = dict(lr=0.02, embedding_lr=0.1, head_lr=0.01, scalar_lr=0.01)
    shared = {g["role"]: g for g in muon_param_groups(model, **kwargs)}
    assert "bigram" not in shared and any(p is table for p in shared["embedding"]["params"])
    own = {g["role"]: g for g in muon_param_groups(model, **kwargs, bigram_lr=0.5)}
    assert own["bigram"]["params"] == [table] and own["bigram"]["lr_scale"] == pytest.approx(25.0)
    assert not any(p is table for p in own["embedding"]["params"]) and own["embedding"]["params"]


@pytest.mark.parametrize("value", ["-1", "nan"])
def test_a_bad_bigram_lr_is_named(shards, tmp_path, value):  # noqa: F811
    from ferrolm.lm.config import ConfigError

    with pytest.raises(ConfigError, match="optimizer.bigram_lr"):
        tiny_config(shards, tmp_path, optimizer={"bigram_lr": float(value)})


def test_build_optimizer_scales_bigram_lr_by_width(shards, tmp_path):  # noqa: F811
    settings = {"name": "muon", "lr": 0.02, "min_lr": 0.002, "bigram_lr": 0.4}
    cfg = tiny_config(shards, tmp_path, model={"bigram_buckets": 64}, optimizer=settings)
    groups = {g["role"]: g for g in build_optimizer(TransformerLM.from_config(cfg.model), cfg.optimizer).param_groups}
    assert groups["bigram"]["lr"] == pytest.approx(0.4 * (768 / cfg.model.d_model) ** 0.5)


def test_torchrun_refuses_it(shards, tmp_path):  # noqa: F811
    from ferrolm.lm.train import Dist, setup_run

    cfg = tiny_config(shards, tmp_path, model={"bigram_buckets": 64}, optimizer={"sparse_bigram": True})
    with pytest.raises(ValueError, match="optimizer.sparse_bigram runs in one process"):
        setup_run(cfg, Dist(rank=0, world=2), None)
