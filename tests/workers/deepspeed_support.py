"""One rank, one process: the in-place support check on real DeepSpeed engines, and what a
joiner's warm-up leaves its first engine to import. Prints one JSON line:
{"first_engine_modules": N, "engines": {name: {"resizable": bool, "refusal": str | null}}, "warnings": N,
 "engines_alive": N (DeepSpeed engines still in memory after 3 rebuilds of one in this process),
 "rebuilt_equal": bool (the state after each rebuild equals the state before it),
 "scaler_carried": bool (the loss scaler's fields, set to values of their own before each rebuild,
 are the new engine's after it: fp32 here, so the mechanism fp16's dynamic scaler goes through),
 "cpu_info_processes": 0 or 1 (whether py-cpuinfo started a process for 3 questions once its first
 answer was kept by `keep_cpu_info`)}.

    python deepspeed_support.py PORT [--no-warm-up]
"""
from __future__ import annotations

import gc
import json
import logging
import os
import socket
import sys

import torch
import torch.distributed as dist

import deepspeed
from spotguard.hooks.adapters.deepspeed import DeepSpeedAdapter, config_at
from spotguard.hooks.adapters.deepspeed_zero import collect, install, reinitialize
from spotguard.trainer.elastic_job import batch
from spotguard.hooks.elastic.join import warm_up
from spotguard.trainer.elastic_job import base_model, build_deepspeed

CONFIGS = {
    "zero2-client-adamw": ({"stage": 2}, "adamw"),
    "zero1-client-adam": ({"stage": 1}, "adam"),
    "zero3": ({"stage": 3}, "adamw"),
    "zero2-client-sgd": ({"stage": 2}, "sgd"),
    "zero0": ({"stage": 0}, "adamw"),
    "zero2-round-robin": ({"stage": 2, "round_robin_gradients": True}, "adamw"),
}


def engine_for(zero: dict, optimizer: str):
    model = base_model()
    opt = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}[optimizer](
        model.parameters(), lr=1e-2)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "train_batch_size": 2,
              "zero_optimization": zero, "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9}
    return deepspeed.initialize(model=model, optimizer=opt, config=config)[0]


def rebuild_three_times(engine) -> tuple[int, bool, bool]:
    """What a survivor does in a change, three times at world size 1: the partitions collected,
    the group formed again, the engine made again (`reinitialize`) and the state installed, one step
    trained. (DeepSpeed engines alive afterwards, whether each rebuild kept the state exactly)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    from spotguard.hooks.adapters.deepspeed_zero import SCALER_FIELDS

    equal = carried = True
    for step in range(3):
        x, y = batch(step, 0, 1)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
        scaler = {"cur_scale": 2.0 ** (step + 1), "cur_iter": 40 + step, "last_overflow_iter": 30 + step,
                  "cur_hysteresis": 2}
        for key in SCALER_FIELDS:
            setattr(engine.optimizer.loss_scaler, key, scaler[key])
        shards = collect(engine)
        before = [piece.clone() for piece in shards.pieces]
        manifest, pieces = shards.manifest, {i: piece.clone() for i, piece in enumerate(shards.pieces)}
        del shards
        dist.destroy_process_group()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
        dist.init_process_group("gloo")
        engine = reinitialize(engine, config_at(engine, 1))
        install(engine, manifest, pieces)
        equal = equal and all(a.equal(b) for a, b in zip(before, collect(engine).pieces))
        carried = carried and {k: getattr(engine.optimizer.loss_scaler, k, None) for k in SCALER_FIELDS} == scaler
        engine.optimizer.loss_scaler.cur_scale = 1.0  # the next step trains unscaled, as fp32 does
    gc.collect()
    return sum(isinstance(o, DeepSpeedEngine) for o in gc.get_objects()), equal, carried


def cpu_info_processes() -> int:
    """Whether py-cpuinfo started a process while answering 3 times after `keep_cpu_info` (each
    answer starts one without it: about 1 s inside a change's pause for DeepSpeed's CPU Adam): 1
    when the CPU time of this process's waited-for children grew, else 0. The warm-up asked first."""
    import resource

    import cpuinfo

    from spotguard.hooks.elastic.join import keep_cpu_info

    keep_cpu_info()
    cpuinfo.get_cpu_info()  # the first answer (the warm-up's, or this one)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    answers = [cpuinfo.get_cpu_info() for _ in range(3)]
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert answers[0] == answers[2] and answers[0] is not answers[2]
    return int((after.ru_utime, after.ru_stime) != (before.ru_utime, before.ru_stime))


class Count(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record):
        if "changes membership by restarting" in record.getMessage():
            self.count += 1


def main() -> int:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if "--no-warm-up" not in sys.argv:
        warm_up()
    dist.init_process_group("gloo")
    before = set(sys.modules)
    built = [build_deepspeed(2, False)]
    first = len(set(sys.modules) - before)
    alive, equal, carried = rebuild_three_times(built.pop())  # the only reference to the first engine
    counter = Count()
    logging.getLogger("spotguard.hooks.adapters.deepspeed").addHandler(counter)
    engines = {}
    for name, (zero, optimizer) in CONFIGS.items():
        adapter = DeepSpeedAdapter(engine_for(zero, optimizer), checkpoint_dir=os.environ["CKPT"], in_place=True)
        engines[name] = {"resizable": adapter.resizable, "refusal": adapter.in_place_refusal}
        adapter.close()
    print(json.dumps({"first_engine_modules": first, "engines": engines, "warnings": counter.count,
                      "engines_alive": alive, "rebuilt_equal": equal, "scaler_carried": carried,
                      "cpu_info_processes": cpu_info_processes()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
