"""Whether a DeepSpeed job can change its data-parallel size in place (pure: facts in, a refusal out).

`refusal(facts)` -> None when the in-place path supports the engine the facts describe, else one
sentence naming what it does not support. Supported: ZeRO stage 1 or 2, no pipeline parallelism,
an Adam or AdamW optimizer (DeepSpeed's own from the config, or a client torch / DeepSpeed one),
the optimizer on the accelerator or offloaded to the CPU, gradients in their natural order (no
`round_robin_gradients`), and data parallelism only (no tensor, sequence or expert parallelism).
Everything else keeps the restart path: the adapter logs the refusal once, at start, and says it
is not resizable.
"""
from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_STAGES = (1, 2)
SUPPORTED_OPTIMIZERS = frozenset({"adam", "adamw", "deepspeedcpuadam", "fusedadam", "cpuadam"})
SUPPORTED_OFFLOAD = frozenset({"none", "cpu"})


@dataclass(frozen=True)
class EngineFacts:
    """What the support check reads off an engine (`deepspeed_zero.facts_of`)."""

    zero_stage: int
    pipeline: bool  # a PipelineEngine
    optimizer: str  # the basic optimizer's class or config name, lower-case
    offload_optimizer: str  # "none", "cpu" or "nvme"
    offload_param: str  # "none", "cpu" or "nvme"
    round_robin_gradients: bool
    model_parallel_size: int  # tensor (model) parallel ranks
    sequence_parallel_size: int
    expert_parallel: bool  # MoE parameter groups


def refusal(facts: EngineFacts) -> str | None:
    """None: the in-place path supports this engine; else why not (module docstring)."""
    if facts.pipeline:
        return "pipeline parallelism is not supported in place"
    if facts.zero_stage not in SUPPORTED_STAGES:
        return f"ZeRO stage {facts.zero_stage} is not supported in place (stages 1 and 2 are)"
    if facts.optimizer.lower() not in SUPPORTED_OPTIMIZERS:
        return f"optimizer {facts.optimizer!r} is not supported in place (Adam and AdamW are)"
    for what, device in (("offload_optimizer", facts.offload_optimizer), ("offload_param", facts.offload_param)):
        if device not in SUPPORTED_OFFLOAD:
            return f"{what} to {device!r} is not supported in place (none or cpu are)"
    if facts.round_robin_gradients:
        return "round_robin_gradients is not supported in place"
    if facts.model_parallel_size > 1:
        return f"tensor parallelism ({facts.model_parallel_size} ranks) is not supported in place"
    if facts.sequence_parallel_size > 1:
        return f"sequence parallelism ({facts.sequence_parallel_size} ranks) is not supported in place"
    if facts.expert_parallel:
        return "expert parallelism (MoE) is not supported in place"
    return None
