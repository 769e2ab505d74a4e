"""The flat full-tensor form the test workers dump a training state in, for bit-exact comparisons
(the workers import it as a sibling: they run as scripts; the harness as tests.workers.state_dump)."""
from __future__ import annotations

import torch


def flatten(model_state: dict, optim_state: dict) -> dict[str, torch.Tensor]:
    """A full model and optimizer state dict (`get_state_dict`'s layout, as DCP saves it too) as
    flat tensors: `param/<fqn>` and `<moment>/<fqn>`."""
    out = {f"param/{k}": v.detach().clone() for k, v in model_state.items()}
    for name, state in optim_state["state"].items():
        for key, value in state.items():
            out[f"{key}/{name}"] = torch.as_tensor(value).detach().clone()
    return out
