"""The CUDA IPC collectives' signal boards (rtxnet.collectives.gpu.board), on the CPU: words
posted by one process and read by another through /dev/shm, operation numbers that wrap, and
signature hashes equal across interpreters."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from rtxnet.collectives.gpu import board as board_mod
from rtxnet.collectives.gpu.board import DONE, FULL, HELLO, OFFER, Board, PeerBoard, seq32, sig_hash
from transport.shm import SHM_DIR, segment_name

pytestmark = pytest.mark.timeout(60)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def board(request):
    name = segment_name("boardtest", os.getpid(), abs(hash(request.node.name)) % 10**9)
    b = Board(name)
    yield b
    b.close()
    assert not os.path.exists(os.path.join(SHM_DIR, name))


def test_a_word_reads_only_for_its_operation(board):
    peer = PeerBoard(board.name)
    try:
        assert peer.read(HELLO, 0) is None and peer.seq(HELLO) is None   # never posted
        board.post(HELLO, 0, 0xDEADBEEF)
        board.post(OFFER, 0, FULL)
        assert peer.read(HELLO, 0) == 0xDEADBEEF
        assert peer.read(OFFER, 0) == FULL
        assert peer.read(HELLO, 1) is None and peer.read(DONE, 0) is None
        board.post(HELLO, 1, 0)
        assert peer.read(HELLO, 0) is None and peer.read(HELLO, 1) == 0 and peer.seq(HELLO) == 1
    finally:
        peer.close()


@pytest.mark.parametrize("seq", [0, 2**32 - 2, 2**32 - 1, 2**32, 5 * 2**32 + 7])
def test_operation_numbers_wrap_without_reading_as_never_posted(board, seq):
    assert seq32(seq) != 0
    peer = PeerBoard(board.name)
    try:
        board.post(DONE, seq, 7)
        assert peer.read(DONE, seq) == 7
        assert peer.read(DONE, seq + 1) is None
    finally:
        peer.close()


def test_posts_are_seen_by_another_process_and_the_file_can_go_once_mapped(board):
    """A peer process maps the board, the owner unlinks the file (as after a group's first
    operation), and the peer still sees every post through its mapping."""
    code = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {ROOT!r})
        from rtxnet.collectives.gpu.board import PeerBoard, HELLO
        peer = PeerBoard({board.name!r})
        print("mapped", flush=True)
        deadline = time.monotonic() + 20
        for seq in range(50):
            while peer.read(HELLO, seq) is None:
                if time.monotonic() > deadline:
                    print("timeout at", seq, flush=True)
                    sys.exit(1)
                time.sleep(0.0005)
            print(seq, peer.read(HELLO, seq), flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "mapped"
        board.unlink()
        seen = []
        for seq in range(50):
            board.post(HELLO, seq, seq * 3 + 1)
            seen.append(proc.stdout.readline().split())
        assert proc.wait(timeout=30) == 0
        assert seen == [[str(s), str(s * 3 + 1)] for s in range(50)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_signature_hash_is_the_same_in_another_interpreter():
    sig = ["all_reduce", "ipc", "sum", None, "bfloat16", 1 << 20, [1024, 1024], None]
    code = (f"import sys; sys.path.insert(0, {ROOT!r}); "
            f"from rtxnet.collectives.gpu.board import sig_hash; print(sig_hash({sig!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30,
                         env={**os.environ, "PYTHONHASHSEED": "12345"}, check=True)
    assert int(out.stdout) == sig_hash(sig)
    assert sig_hash(sig) != sig_hash(sig[:5] + [(1 << 20) + 1] + sig[6:])
    assert 0 <= sig_hash(sig) < 2**32


def test_a_bad_peer_board_name_is_refused():
    with pytest.raises(ValueError, match="not an rtxnet segment name"):
        PeerBoard("../../etc/passwd")
    with pytest.raises(FileNotFoundError):
        PeerBoard(segment_name("boardtest", os.getpid(), 999_999_999))
    assert board_mod.NBYTES % 8 == 0
