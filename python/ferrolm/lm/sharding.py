"""FSDP2 (``run.parallel = "fsdp"``): the model's parameters sharded over the processes, and
checkpoints in the same plain format as every other run.

``shard_model`` shards each Transformer block, then the rest (embedding, final norm, LM
head), in place: the parameters become DTensor shards, so build the optimizer after it.
A checkpoint holds full tensors under the usual keys, and the optimizer state indexed like
``torch.optim.Optimizer.state_dict()``: a sharded run resumes from it, and so can any
other run (one process, DDP) and the other way round.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["shard_model", "full_state_dicts", "load_full_state_dicts"]


def shard_model(model: nn.Module, device: torch.device) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The parameter names in the optimizer's order (what its integer state keys count)."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    return [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]


def full_state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(model state, optimizer state) as full CPU tensors, optimizer keyed by index (a collective)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = get_model_state_dict(model, options=options)
    by_name = get_optimizer_state_dict(model, optimizer, options=options)
    index = {name: i for i, name in enumerate(_names(model, optimizer))}
    groups = [dict(g, params=[index[n] for n in g["params"]]) for g in by_name.get("param_groups", [])]
    return model_sd, {"state": {index[n]: s for n, s in by_name.get("state", {}).items()}, "param_groups": groups}


def load_full_state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer, model_sd: dict, optim_sd: dict) -> None:
    """Load full (unsharded) state dicts into the sharded model and its optimizer (a collective)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_sd, options=options)
    names = _names(model, optimizer)
    groups = [dict(g, params=[names[i] for i in g["params"]]) for g in optim_sd["param_groups"]]
    by_name = {"state": {names[i]: s for i, s in optim_sd["state"].items()}, "param_groups": groups}
    set_optimizer_state_dict(model, optimizer, by_name, options=options)
