"""One rank's checkpoint file written buffered (the page cache, pages written back behind the
writer, fsync) and with direct I/O (`hooks/checkpoint/direct_file.py`), alternately, in one run:
wall seconds and the CPU seconds of the process (what an in-place change's survivors wait on
when four ranks write on two cores).

    .venv/bin/python bench/direct_write.py                 # 240 MiB (a rank's part in the user-path bench), 3 rounds
    .venv/bin/python bench/direct_write.py --mib 64 --rounds 2 --dir /tmp

Each round writes a file of fresh content from an unaligned offset of one source buffer (as a
tensor laid out inside a torch.save record is) and deletes it; the first buffered round pays for
page-cache pages the machine never touched (on a VM, a fault on the host per page).
"""
from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time
from pathlib import Path

from spotguard.hooks.checkpoint import fsutil
from spotguard.hooks.checkpoint.direct_file import sequential_file


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def buffered(path: Path, data: memoryview) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        with fsutil.flushing_behind(fd):
            fsutil.write_fd_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def direct(path: Path, data: memoryview) -> None:
    with sequential_file(path, direct=True) as file:
        file.write(data)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=240)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary folder here)")
    args = p.parse_args()
    source = bytearray(os.urandom(1 << 20) * (args.mib + 1))
    data = memoryview(source)[64:64 + (args.mib << 20)]
    with tempfile.TemporaryDirectory(dir=args.dir or Path(__file__).resolve().parent.parent) as folder:
        print(f"{args.mib} MiB per file, in {folder}")
        print("  round  buffered wall  cpu    direct wall  cpu")
        for round_ in range(args.rounds):
            row = []
            for write in (buffered, direct):
                path = Path(folder) / f"{write.__name__}-{round_}"
                t0, c0 = time.perf_counter(), cpu_seconds()
                write(path, data)
                row += [time.perf_counter() - t0, cpu_seconds() - c0]
                path.unlink()
            print(f"  {round_ + 1:5d}  {row[0]:12.3f}  {row[1]:5.3f}  {row[2]:10.3f}  {row[3]:5.3f}")


if __name__ == "__main__":
    main()
