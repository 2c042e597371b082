"""rtxnet-run's copy of a rank's output (``rtxnet.launcher._pump``) into an unbuffered stream."""

import asyncio
import io
import os
import signal
import threading

import pytest

from rtxnet.launcher import _pump

pytestmark = pytest.mark.timeout(60)


def test_a_long_line_is_written_whole_though_signals_interrupt_the_write():
    # rtxnet-run under ``python -u`` (PYTHONUNBUFFERED): its stdout's binary layer is the raw
    # file, one write(2) per call; a SIGCHLD during a 200 KB line returned 128 KiB and the rest,
    # with the next line, was lost (1 run in 16 under load). Here SIGALRM every 0.5 ms, a slow
    # reader, and a 900 KB line.
    r, w = os.pipe()
    out = io.TextIOWrapper(io.FileIO(w, "wb"), write_through=True)
    assert isinstance(out.buffer, io.FileIO)
    got = bytearray()

    def drain():
        with io.FileIO(r, "rb") as f:
            while chunk := f.read(4096):
                got.extend(chunk)

    reader = threading.Thread(target=drain)
    reader.start()
    line = b"x" * 900_000   # under 1 MiB, which _pump writes in pieces
    previous = signal.signal(signal.SIGALRM, lambda *_: None)
    signal.setitimer(signal.ITIMER_REAL, 0.0005, 0.0005)

    async def main():
        stream = asyncio.StreamReader()
        stream.feed_data(line + b"\nafter the long line\n")
        stream.feed_eof()
        await _pump(stream, b"[rank0] ", out)

    try:
        asyncio.run(main())
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
        signal.signal(signal.SIGALRM, previous)
        out.close()
        reader.join(30)
    assert bytes(got) == b"[rank0] " + line + b"\n[rank0] after the long line\n", len(got)
