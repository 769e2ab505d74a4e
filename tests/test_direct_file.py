"""hooks/checkpoint/direct_file.py: a checkpoint file written with O_DIRECT holds exactly the
bytes written, whatever their sizes and alignment, and so does the buffered path it falls back to;
a descriptor the kernel refuses direct writes on (misaligned memory, real EINVAL) is written
buffered instead; an exception leaves the bounce buffer to the pool."""
from __future__ import annotations

import fcntl
import mmap
import os
import random
import zlib

import pytest

from spotguard.config import ConfigError

from spotguard.hooks.checkpoint import direct_file
from spotguard.hooks.checkpoint.direct_file import BLOCK, SequentialFile, direct_io_enabled, sequential_file

SIZES = [0, 1, 511, BLOCK - 1, BLOCK, BLOCK + 1, direct_file.BOUNCE - 1, direct_file.BOUNCE, direct_file.BOUNCE + 7]


def pieces(seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(size) for size in SIZES] + [rng.randbytes(rng.randrange(1, 3 * BLOCK)) for _ in range(200)]


@pytest.mark.parametrize("direct", [True, False])
def test_the_file_holds_exactly_the_bytes_written_and_their_crc(tmp_path, direct):
    data = pieces(1)
    path = tmp_path / "part.distcp"
    with sequential_file(path, direct=direct) as file:
        for piece in data:
            assert file.write(piece) == len(piece)
        assert file.direct is direct
    whole = b"".join(data)
    assert path.read_bytes() == whole
    assert (file.size, file.crc) == (len(whole), zlib.crc32(whole))


def test_a_file_of_one_piece_larger_than_the_bounce_buffer_from_a_numpy_array(tmp_path):
    import numpy

    array = numpy.arange(3 * direct_file.BOUNCE // 8 + 3, dtype=numpy.float64)
    with sequential_file(tmp_path / "a", direct=True) as file:
        file.write(array[1:])  # an address no block boundary
    assert (tmp_path / "a").read_bytes() == array[1:].tobytes()


def test_an_empty_file_is_empty(tmp_path):
    with sequential_file(tmp_path / "e", direct=True) as file:
        pass
    assert (tmp_path / "e").read_bytes() == b"" and file.size == 0 and file.crc == 0


def test_direct_writes_the_kernel_refuses_fall_back_to_buffered_with_the_same_bytes(tmp_path):
    """Memory one byte off a block boundary: ext4 (and most file systems) answer EINVAL to an
    O_DIRECT write from it, which is what a file system without direct I/O answers too."""
    path = tmp_path / "refused"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    backing = mmap.mmap(-1, 2 * direct_file.BOUNCE)
    try:
        with pytest.raises(OSError):  # the premise: this kernel refuses it
            os.write(fd, memoryview(backing)[1:1 + BLOCK])
        file = SequentialFile(fd, memoryview(backing)[1:1 + direct_file.BOUNCE])
        data = pieces(2)
        for piece in data:
            file.write(piece)
        file.finish()
        assert not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT
        file.release()
    finally:
        os.close(fd)
        backing.close()
    assert path.read_bytes() == b"".join(data)


def test_an_exception_in_the_block_closes_the_file_and_keeps_the_buffer_for_the_next(tmp_path):
    with pytest.raises(RuntimeError), sequential_file(tmp_path / "x", direct=True) as file:
        file.write(b"a" * (BLOCK + 3))
        raise RuntimeError("the writer failed")
    pooled = len(direct_file._pool)
    assert pooled >= 1
    with sequential_file(tmp_path / "y", direct=True) as again:
        again.write(b"b" * 10)
        assert len(direct_file._pool) == pooled - 1  # the same buffer, taken again
    assert (tmp_path / "y").read_bytes() == b"b" * 10


def test_the_switch_reads_the_environment():
    assert direct_io_enabled({})
    assert direct_io_enabled({"SPOTGUARD_DIRECT_IO": "1"})
    assert not direct_io_enabled({"SPOTGUARD_DIRECT_IO": "0"})
    assert not direct_io_enabled({"SPOTGUARD_DIRECT_IO": "off"})
    with pytest.raises(ConfigError, match="SPOTGUARD_DIRECT_IO"):
        direct_io_enabled({"SPOTGUARD_DIRECT_IO": "maybe"})
