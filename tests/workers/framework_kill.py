"""One Accelerate process for the crash test: its integration's adapter (the one engine) saves step 1,
then step 2, which the test kills with SIGKILL while the engine persists it.

    python -m tests.workers.framework_kill CKPT OUT

Writes `OUT/params-<step>.pt` (the weights the checkpoint of that step must hold) before each save and
`OUT/saved-<step>` after it. About 100 MB of state, so a persist takes long enough to be killed in."""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from accelerate import Accelerator

from spotguard.integrations.accelerate import AcceleratorSave


def main(ckpt: str, out: str) -> int:
    records = Path(out)
    records.mkdir(parents=True, exist_ok=True)
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    adapter = AcceleratorSave(accelerator, ckpt)
    for step in (1, 2):
        model(torch.randn(4, 1024)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        if not adapter.prepared:
            adapter.prepare()
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, records / f"params-{step}.pt")
        adapter.save(step)
        (records / f"saved-{step}").write_text(str(step))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
