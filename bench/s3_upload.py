"""Object-store upload throughput: the store's background upload vs a plain boto3 upload of the same bytes.

    .venv/bin/python bench/s3_upload.py                  # 4 files, 512 MB in all (default)
    .venv/bin/python bench/s3_upload.py --size-mb 1024 --files 8

Starts a real S3-compatible server (SeaweedFS from the test extra, tests/s3_server.py) on
127.0.0.1, then, in one run and alternating order over --rounds: (a) plain boto3: `upload_file`
of each file with the same TransferConfig, files uploaded one after another; (b) spotguard:
`begin` -> files written on the local tier -> `finish_rank` -> `commit` -> `wait_uploaded`
(hard-link staging, files in parallel, part manifest, wait for parts, manifest, `latest`,
retention). The figure is (b)'s throughput from commit to object-store commit, over (a)'s.
Goal (issue 21): >= 0.8x. Also prints the time to durable on local disk (the local tier).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spotguard.hooks.checkpoint.objectstore.remote import transfer_config
from spotguard.hooks.checkpoint.objectstore.store import ObjectCheckpointStore
from tests.s3_server import BUCKET, S3Server


def plain_boto3(client, files: list[Path], prefix: str) -> float:
    config = transfer_config()
    t0 = time.perf_counter()
    for path in files:
        client.upload_file(str(path), BUCKET, f"{prefix}/{path.name}", Config=config)
    return time.perf_counter() - t0


def spotguard(store: ObjectCheckpointStore, files: list[Path], tag: str) -> tuple[float, float]:
    """(seconds to durable on local disk, seconds from commit to the object-store commit)."""
    t0 = time.perf_counter()
    pending = store.begin(tag)
    for path in files:
        os.link(path, pending.path(path.name))
        pending.adopt(path.name)
    pending.finish_rank(0)
    store.commit(tag, world_size=1, metadata={"step": 0, "reason": "periodic"})
    t1 = time.perf_counter()
    assert store.wait_uploaded(3600) and store.durable_tier(tag) == "object"
    return t1 - t0, time.perf_counter() - t1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=512)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="s3-bench-") as tmp:
        root = Path(tmp)
        server = S3Server(root / "server").start()
        try:
            os.environ.update(server.env())
            data = root / "data"
            data.mkdir()
            files = []
            for i in range(args.files):
                path = data / f"shard-{i}.bin"
                path.write_bytes(os.urandom(args.size_mb * (1 << 20) // args.files))
                files.append(path)
            total = sum(p.stat().st_size for p in files)
            client = server.client()
            store = ObjectCheckpointStore(f"s3://{BUCKET}/bench", keep_last=1, local_dir=root / "local")
            plain, ours, local = [], [], []
            for r in range(args.rounds):
                order = [0, 1] if r % 2 == 0 else [1, 0]
                for which in order:
                    if which == 0:
                        plain.append(plain_boto3(client, files, f"plain-{r}"))
                    else:
                        lo, up = spotguard(store, files, f"step-{r}")
                        local.append(lo)
                        ours.append(up)
            store.close(60)
        finally:
            server.stop()
    mb = total / 1e6
    p, o = statistics.median(plain), statistics.median(ours)
    print(f"s3 upload, {mb:.0f} MB in {args.files} files, local SeaweedFS, median of {args.rounds} rounds:")
    print(f"  plain boto3 upload_file      {p:6.2f} s  {mb / p:7.1f} MB/s")
    print(f"  spotguard commit -> object   {o:6.2f} s  {mb / o:7.1f} MB/s   {p / o:.2f}x plain (goal >= 0.8x)")
    print(f"  spotguard durable on local   {statistics.median(local):6.2f} s  (hard links + checksums here)")


if __name__ == "__main__":
    main()
