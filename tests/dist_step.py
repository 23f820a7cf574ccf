"""Six training steps on one fixed global batch per step, alone or as one of the processes of
`torchrun --nproc_per_node N tests/dist_step.py ddp|fsdp [OPTIMIZER ...]` (each takes every
N-th sequence), for each OPTIMIZER in turn: adamw (the default), muon (Muon's batched step)
or muon-loop (its reference loop). Prints one line per optimizer (rank 0): the mean loss of
each step, then the sum of the absolute values of all weights. Used by tests/test_train.py."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ferrolm.lm.functional import cross_entropy
from ferrolm.lm.model import TransformerLM
from ferrolm.lm.optim import AdamW, Muon, clip_grad_norm, muon_param_groups, param_groups_for_decay
from ferrolm.lm.sharding import shard_model


def run(mode: str, optimizer: str, rank: int, world: int) -> list[float]:
    """The six losses and the weights' absolute sum of one training run."""
    torch.manual_seed(0)
    model = TransformerLM(64, 16, 32, 2, 4, 48)
    if mode == "fsdp":
        shard_model(model, torch.device("cpu"))
    step_model = DistributedDataParallel(model) if mode == "ddp" else model
    if optimizer == "adamw":
        opt = AdamW(param_groups_for_decay(model, 0.1), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    else:
        groups = muon_param_groups(model, lr=0.05, embedding_lr=0.05, head_lr=0.01, scalar_lr=0.01, weight_decay=0.1)
        # float32 Newton-Schulz: bf16 (the default on a CPU with native bf16) would round the
        # all-reduced gradients' last-bit differences into visible ones
        opt = Muon(groups, lr=0.05, momentum=0.9, fast=optimizer == "muon", ns_dtype=torch.float32)
    ids = torch.randint(0, 64, (6, 8, 17), generator=torch.Generator().manual_seed(5))
    out = []
    for step in range(6):
        batch = ids[step, rank::world]
        loss = cross_entropy(step_model(batch[:, :-1]), batch[:, 1:])
        loss.backward()
        clip_grad_norm(model.parameters(), 0.5)  # active: the norm is above 0.5 here
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        if world > 1:
            dist.all_reduce(mean)
        out.append(float(mean) / world)
    with torch.no_grad():
        out.append(
            sum(float((p.full_tensor() if hasattr(p, "full_tensor") else p).abs().sum()) for p in model.parameters())
        )
    return out


def main(mode: str, *optimizers: str) -> None:
    torch.set_num_threads(1)
    rank, world = 0, 1
    if mode != "single":
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    for optimizer in optimizers or ("adamw",):
        values = run(mode, optimizer, rank, world)
        if rank == 0:
            print(" ".join(f"{v:.7f}" for v in values), flush=True)
    if world > 1:
        # Torn down as `ferrolm train` does: every rank past its last collective first, and
        # the sharded models (which hold the group's mesh) freed while the interpreter is whole
        # (each run's are garbage by now).
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
