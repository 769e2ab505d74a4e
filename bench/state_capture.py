"""State capture: what a snapshot pays on the training loop before its copy starts.

    .venv/bin/python bench/state_capture.py
    .venv/bin/python bench/state_capture.py --blocks 300 --width 128 --repeat 100

TorchDCPAdapter snapshots `get_state_dict(model, optimizer)` (DCP's layout). torch's function
maps every state entry to its fully qualified name on every call, in Python; `StateCapture`
(hooks/adapters/dcp_state.py) learns that mapping once and renames `model.state_dict()` and
`optimizer.state_dict()` after it. Both are timed here, interleaved in one run, on the dry-run's
TinyMLP and on a stack of `--blocks` x (Linear + LayerNorm) (4 parameter tensors a block, AdamW
state after one step), as plain modules. The output of the two is checked equal (keys, and the
same live tensors) before timing. Printed: the median milliseconds of each and their ratio.
Goal: the capture costs no more than `model.state_dict()` + `optimizer.state_dict()` x 1.5.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

from spotguard.hooks.adapters.dcp_state import StateCapture
from spotguard.trainer.model import build_model


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--blocks", type=int, default=100, help="Linear + LayerNorm blocks of the large model (100)")
    p.add_argument("--width", type=int, default=64, help="features of each block (64)")
    p.add_argument("--repeat", type=int, default=200, help="timed calls of each method (200)")
    return p.parse_args(argv)


def models(args: argparse.Namespace) -> list[tuple[str, torch.nn.Module]]:
    blocks = [layer for _ in range(args.blocks)
              for layer in (torch.nn.Linear(args.width, args.width), torch.nn.LayerNorm(args.width))]
    return [("dry-run TinyMLP", build_model(0)),
            (f"{args.blocks} x (Linear + LayerNorm)", torch.nn.Sequential(*blocks))]


def same_tree(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.data_ptr() == b.data_ptr() and a.shape == b.shape
    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(same_tree(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_tree(x, y) for x, y in zip(a, b))
    return a == b


def timed(fn, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        out.append((time.perf_counter() - started) * 1000)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    for name, model in models(args):
        optimizer = torch.optim.AdamW(model.parameters())
        inputs = next(model.parameters()).shape[1]
        model(torch.randn(2, inputs)).sum().backward()
        optimizer.step()
        capture = StateCapture(model, optimizer)
        reference = dict(zip(("model", "optim"), get_state_dict(model, optimizer)))
        if not same_tree(capture.capture(), reference) or not same_tree(capture.capture(), reference):
            print(f"{name}: StateCapture differs from get_state_dict", file=sys.stderr)
            return 1
        times: dict[str, list[float]] = {"get_state_dict": [], "StateCapture": [], "state_dicts": []}
        for _ in range(5):  # interleaved, so a drift of the machine weighs on all three
            times["get_state_dict"] += timed(lambda: get_state_dict(model, optimizer), args.repeat // 5)
            times["StateCapture"] += timed(capture.capture, args.repeat // 5)
            times["state_dicts"] += timed(lambda: (model.state_dict(), optimizer.state_dict()), args.repeat // 5)
        med = {k: statistics.median(v) for k, v in times.items()}
        tensors = sum(1 for _ in model.parameters())
        ok = med["StateCapture"] <= 1.5 * med["state_dicts"]
        print(f"{name} ({tensors} parameter tensors): get_state_dict {med['get_state_dict']:.3f} ms, "
              f"StateCapture {med['StateCapture']:.3f} ms ({med['get_state_dict'] / med['StateCapture']:.1f}x "
              f"faster); model + optimizer state_dict() {med['state_dicts']:.3f} ms "
              f"[{'MET ' if ok else 'MISS'}] <= 1.5x of it: {med['StateCapture'] / med['state_dicts']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
