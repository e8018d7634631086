"""Model and optimizer state in a form that does not depend on how many processes hold it.

Both are keyed by parameter name (fully qualified name, FQN) instead of by position::

    {"state": {"blocks.0.attn.qkv.weight": {"step": t, "exp_avg": t, "exp_avg_sq": t}, ...},
     "param_groups": [{"params": ["wte.weight", ...], "lr_mult": 1.0, "weight_decay": 0.0, ...}]}

so one process, N DDP replicas and N FSDP ranks describe the same values with the same keys. Under
FSDP2 the tensors are this rank's ``DTensor`` shards (``torch.distributed.checkpoint.state_dict`` with
``full_state_dict=False``: no gathering, no copy): a checkpoint stores each rank's rows
(``train/checkpoint/shards.py``) and a resume on any number of ranks reads back the rows each needs.
Nothing here gathers a whole model into one process.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from densebatch import torch_features


def is_sharded(model: nn.Module) -> bool:
    """True when FSDP2 has turned the parameters into DTensor shards."""
    return any(hasattr(p, "full_tensor") for p in model.parameters())


def _options(full: bool):
    torch_features.require(
        torch_features.dcp_state_dict(), "torch.distributed.checkpoint.state_dict's helpers", "a sharded (FSDP2) state"
    )
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=full)


def _holds_shards(tree: Any) -> bool:
    if isinstance(tree, dict):
        return any(_holds_shards(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return any(_holds_shards(v) for v in tree)
    return hasattr(tree, "to_local")


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict: whole tensors, or this rank's DTensor shards under FSDP (every rank calls)."""
    if not is_sharded(model):
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options(False))


def load_model_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load ``state`` (whole tensors, or DTensor shards shaped like the model's own) into ``model``."""
    if not is_sharded(model):
        model.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, state, options=_options(not _holds_shards(state)))


def _names(model: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name (this rank's DTensor shards under FSDP; every rank
    calls). An optimizer that has not stepped yet gets its state made first (zeros, as its first step would)."""
    if is_sharded(model):
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(model, optimizer, options=_options(False))
    names = _names(model)
    sd = optimizer.state_dict()
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]  # position -> name
    groups = [dict(g, params=[order[i] for i in g["params"]]) for g in sd["param_groups"]]
    return {"state": {order[i]: s for i, s in sd["state"].items()}, "param_groups": groups}


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    if is_sharded(model):
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(model, optimizer, state, options=_options(not _holds_shards(state)))
        return
    names = _names(model)
    if len(state["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(
            f"optimizer state has {len(state['param_groups'])} parameter groups, the optimizer {len(optimizer.param_groups)}"
        )
    groups, index, pos = [], {}, 0
    for saved, current in zip(state["param_groups"], optimizer.param_groups):
        mine = [names[id(p)] for p in current["params"]]
        if set(mine) != set(saved["params"]):
            missing, extra = sorted(set(mine) - set(saved["params"])), sorted(set(saved["params"]) - set(mine))
            raise ValueError(
                f"optimizer state does not match the model's parameters (missing {missing[:3]}, unknown {extra[:3]})"
            )
        # load_state_dict pairs saved and current parameters by position: use the current order.
        index.update({name: pos + i for i, name in enumerate(mine)})
        groups.append(dict(saved, params=list(range(pos, pos + len(mine)))))
        pos += len(mine)
    optimizer.load_state_dict({"state": {index[n]: s for n, s in state["state"].items()}, "param_groups": groups})
