"""The real NVML backend on a machine with GPUs: every backend call, then the GPU health source.

    python3 bench/nvml_probe.py                 # every visible GPU; ~10 s
    python3 bench/nvml_probe.py --seconds 30 --load   # the source watched while a GPU is busy

Part 1, `NvmlBackend` (agent/gpu/nvml_backend.py) call by call, on every GPU: the UUID and PCI
bus id, the event mask actually registered (of `WANTED_EVENTS`), `wait_event` with nothing
happening (must raise pynvml's own `NVMLError_Timeout`), remapped rows, volatile double-bit ECC,
the recovery-action field, clock-event reasons, temperature and its thresholds; each call's median
time over 20 tries, or the pynvml error it raised (a NotSupported is a finding, not a failure:
the source skips that signal, as it would in the agent).
Part 2, `GpuHealthSource` (agent/sources/gpu.py) as the agent runs it, on the real backend, for
--seconds: the mode it settled in (events / polling), the GPUs it watches, the notices it
yielded (a healthy GPU yields none; any advisory is printed), its error counters, and the time
of one read of every persistent signal. With --load a matrix product runs on GPU 0 meanwhile.
Exit 0 when every check passed, 1 when one failed, 2 when no GPU is usable (nothing ran).
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import threading
import time


def timed(call, tries: int = 20):
    """(median seconds, last result) of `call()`, or (None, the exception it raised)."""
    seconds, result = [], None
    for _ in range(tries):
        started = time.perf_counter()
        try:
            result = call()
        except Exception as exc:  # a pynvml error is a finding, reported by its class
            return None, exc
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds), result


def probe_backend(backend, gb) -> bool:
    import pynvml

    ok = True
    real = type(backend).__name__ == "NvmlBackend"
    count = backend.device_count()
    driver = pynvml.nvmlSystemGetDriverVersion() if real else "(fake backend)"
    print(f"{type(backend).__name__}: driver {driver}, {count} GPU(s)")
    for index in range(count):
        name = pynvml.nvmlDeviceGetName(backend._handle(index)) if real else "fake"
        print(f"GPU {index}: {backend.uuid(index)} at {backend.pci_bus_id(index)} ({name})")
        try:
            registered = backend.register_events(index, gb.WANTED_EVENTS)
            names = [name for name, bit in vars(gb).items() if name.startswith("EVENT_") and registered & bit]
            print(f"  register_events: 0x{registered:x} of 0x{gb.WANTED_EVENTS:x} ({', '.join(names) or 'none'})")
        except pynvml.NVMLError as exc:
            print(f"  register_events: {type(exc).__name__} (the source falls back to polling)")
        calls = {
            "remapped_rows": lambda: backend.remapped_rows(index),
            "total_ecc_errors": lambda: backend.total_ecc_errors(index),
            "field_values(recovery)": lambda: backend.field_values(index, [gb.FI_GPU_RECOVERY_ACTION]),
            "clock_reasons": lambda: f"0x{backend.clock_reasons(index):x}",
            "temperature": lambda: backend.temperature(index),
            "threshold slowdown": lambda: backend.temperature_threshold(index, gb.THRESHOLD_SLOWDOWN),
            "threshold shutdown": lambda: backend.temperature_threshold(index, gb.THRESHOLD_SHUTDOWN),
        }
        for name, call in calls.items():
            median, result = timed(call)
            if median is None:
                bad = not isinstance(result, pynvml.NVMLError)  # only pynvml's own classes are allowed
                ok &= not bad
                print(f"  {'FAILED' if bad else 'ok':6} {name:24s} raised {type(result).__name__}")
            else:
                print(f"  ok     {name:24s} {median * 1e6:8.1f} us  {result}")
    if getattr(backend, "_event_set", True) is not None:
        started = time.perf_counter()
        try:
            event = backend.wait_event(200)
            print(f"  wait_event(200 ms): an event came: {event} (not expected on a healthy GPU)")
        except pynvml.NVMLError_Timeout:
            print(f"  ok     wait_event(200 ms) raised NVMLError_Timeout after {time.perf_counter() - started:.3f}s")
        except pynvml.NVMLError as exc:
            ok = False
            print(f"  FAILED wait_event(200 ms) raised {type(exc).__name__}")
    return ok


def busy_gpu(stop: threading.Event) -> None:
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    while not stop.is_set():
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


async def watch(backend, seconds: float, load: bool) -> bool:
    from spotguard.agent.sources.gpu import GpuHealthSource

    source = GpuHealthSource("probe-node", backend=backend, interval=1.0, wait_timeout_ms=500)
    stop = threading.Event()
    loader = threading.Thread(target=busy_gpu, args=(stop,), daemon=True) if load else None
    if loader is not None:
        loader.start()
    notices: dict[str, object] = {}
    polls = 0
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            for notice in await source.poll():
                notices[notice.id] = notice
            polls += 1
        reads = []
        for _ in range(5):
            started = time.perf_counter()
            await source._read()  # one read of every persistent signal, in a thread as the agent does
            reads.append(time.perf_counter() - started)
    finally:
        stop.set()
        await source.close()
        if loader is not None:
            loader.join(timeout=30)
    print(f"GpuHealthSource: mode {source.mode}, available {source.available}, "
          f"{len(source.gpus)} GPU(s), {polls} polls in {seconds:.0f}s{' under load' if load else ''}")
    print(f"  one read of every signal: median {statistics.median(reads) * 1e3:.2f} ms (5 reads)")
    print(f"  errors {dict(source.stats.errors) or '{}'}, warnings {dict(source.warnings) or '{}'}, "
          f"seen {dict(source.seen) or '{}'}")
    fatal = [n for n in notices.values() if getattr(n, "deadline", None) is not None]
    for notice in notices.values():
        print(f"  notice: {notice}")
    ok = bool(source.available) and source.mode in ("events", "polling") and not fatal and not source.stats.errors
    print(f"{'ok' if ok else 'FAILED':6} the source ran on {type(source.backend).__name__} "
          "with no fatal notice and no error")
    return ok


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="how long the source is watched (default 8)")
    parser.add_argument("--load", action="store_true", help="keep GPU 0 busy with a matrix product meanwhile")
    parser.add_argument("--backend", default="nvml", help="nvml (default), or fake:<scenario> to try the probe itself")
    args = parser.parse_args(argv)
    import pynvml

    from spotguard.agent.gpu import backend as gb
    from spotguard.agent.gpu.select import make_backend

    backend = make_backend(args.backend)
    try:
        backend.init()
    except pynvml.NVMLError as exc:
        print(f"no usable GPU: nvmlInit raised {type(exc).__name__}: nothing ran")
        return 2
    try:
        ok = probe_backend(backend, gb)
    finally:
        backend.shutdown()
    ok &= asyncio.run(watch(make_backend(args.backend), args.seconds, args.load))
    print("all checks passed" if ok else "some checks FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
