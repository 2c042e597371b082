"""Train an MLP on scikit-learn's handwritten digits with rtxnet DDP, committed steps and checkpoints.

    rtxnet-run --nproc 4 examples/train_digits.py --out OUTDIR [--steps N] [--checkpoint-every N]
                                                  [--resume] [--device {cpu,cuda}] [--rejoin-window S]
                                                  [--strategy {ddp,fsdp}]

The data set ships inside scikit-learn (``sklearn.datasets.load_digits``: 1797 images of 8x8
pixels, 10 classes; no download). A fixed stratified split keeps 25 % for testing. Every step
takes the next ``--global-batch`` samples of a seeded global order
(:class:`rtxnet.sampler.ElasticDistributedSampler`) and splits them among the ranks there are.

Gradients are **summed** over ranks (``ReduceOp.SUM``) and each rank scales its mean loss by
``local_n / global_n``, so a step equals one process on the whole global batch even when the
world shrank and the ranks hold unequal shares (64 samples over 3 ranks).

Each step runs inside :meth:`rtxnet.FaultTolerance.guard`: it counts only once every rank voted
it succeeded; after a lost rank the survivors roll back to the last committed step, re-split the
data and go on (start with ``--min-ranks`` below ``--nproc`` to allow a smaller world, and
``--max-restarts`` to let a replacement rejoin; below ``--min-ranks`` the survivors wait
``--rejoin-window`` seconds for one, then stop with one ``error: RendezvousError: ...`` line).
Every ``--checkpoint-every`` steps a sharded checkpoint is committed under ``OUTDIR/checkpoints``;
``--resume`` starts from the newest intact one (with none intact among step folders that exist,
every rank stops with one line before joining, exit code 2; with no step folder it starts afresh).
A run without ``--resume`` removes the step folders an earlier run left in ``OUTDIR/checkpoints``
(its rank 0 does, logging ``removed_earlier_checkpoints``, while the job has committed nothing).
A checkpoint records the options that shape the state it holds (``--strategy``, ``--hidden``,
``--global-batch``, ``--seed``); ``--resume`` with other values stops every rank with one line
naming them, before joining, exit code 2 (a checkpoint from before that record: once its load
fails, also one line and exit code 2). A bad ``--out`` (not creatable, not writable) or a
``--global-batch`` above the 1347 training samples stops every rank with one line before it joins
(and before ``--out`` is created). So does an ``--out`` that another run, still running, writes to
(``OUTDIR/.train_digits.lock`` holds its job id; the ranks of one run share it). Under rtxnet-run
the first rank to stop so stops the job: ranks that had not exited yet (even those that had
printed the same line) are reported "exited with code 143" (stopped by rtxnet-run), and the run's
exit code is that first rank's 2.

``--strategy fsdp`` shards the model and Adam's state over the ranks instead
(:class:`rtxnet.parallel.FullyShardedDataParallel`, CPU only) and runs ``FaultTolerance`` with
``sharded_state=True``: each rank's committed shards are also kept by its ring successor, so a lost
rank still costs one step; the state is resharded for whatever world goes on, and checkpoints hold
one shard per rank (``--resume`` reshards them for any world size too).

``--device cuda`` puts each rank's model and batches on GPU ``LOCAL_RANK % torch.cuda.device_count()``
(several ranks may share one GPU: rtxnet's GPU collectives then move gradients over CUDA IPC).
The data set (1797 x 64 floats) is copied to the GPU once; a rank without CUDA exits with an error.

Rank 0 shows a progress bar (steps, loss, samples/s), logs through structlog, prints
``test_accuracy=<value>`` at the end and writes ``OUTDIR/metrics.json`` and
``OUTDIR/loss_curve.png`` (failures and recoveries marked). "Rank 0" is whichever process holds
rank 0 at the time: when rank 0 dies a survivor is renumbered to 0 and takes over; the loss history
is part of the training state every rank keeps, so it has all of it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_interrupted = False


def _on_sigint(signum, frame):
    # A Ctrl-C in a terminal reaches every rank twice: from the terminal (rtxnet-run and its
    # ranks share its process group) and forwarded by rtxnet-run. The second is ignored: it would
    # interrupt the first one's clean exit with a traceback.
    global _interrupted
    if _interrupted:
        return
    _interrupted = True
    raise KeyboardInterrupt


# Importing torch takes seconds: a Ctrl-C of rtxnet-run that lands there is one line too. The flag
# catches one that some import's bare ``except:`` swallows (a race a test hit under load).
if __name__ == "__main__":
    import signal

    signal.signal(signal.SIGINT, _on_sigint)
try:
    import numpy as np
    import structlog
    import torch

    import rtxnet
    from rtxnet import checkpoint
    from rtxnet.parallel import DistributedDataParallel, FSDPState, FullyShardedDataParallel
    from rtxnet.sampler import ElasticDistributedSampler
except KeyboardInterrupt:
    if __name__ != "__main__":
        raise
    _interrupted = True
if _interrupted:
    sys.stderr.write("interrupted\n")   # one write: never glued into another thread's log line
    sys.exit(130)
if __name__ == "__main__":
    # Keep the flag: a KeyboardInterrupt raised inside a weakref callback or a destructor is
    # printed and dropped by Python ("Exception ignored in ..."), and the rank trained on until
    # rtxnet-run killed it 10 s later (1 of 9 Ctrl-Cs); the loop checks the flag every step.
    signal.signal(signal.SIGINT, _on_sigint)

log = structlog.get_logger("train_digits")


MAX_HIDDEN = 65536   # 2 x 65536^2 floats of hidden weights is already 32 GiB per rank


def _out_folder(text: str) -> Path:
    if not text.strip():   # Path("") is ".": the outputs would land wherever the ranks start
        raise argparse.ArgumentTypeError("must not be empty")
    return Path(text)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=_out_folder, help="output folder")
    p.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    p.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints")
    p.add_argument("--resume", action="store_true", help="start from the newest checkpoint in OUT")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cpu (default), or cuda: GPU LOCAL_RANK %% device count, GPU collectives")
    p.add_argument("--global-batch", type=int, default=64,
                   help="samples per step over all ranks, at most the training set's (default 64)")
    p.add_argument("--lr", type=float, default=2e-3, help="Adam learning rate, finite and > 0 (default 2e-3)")
    p.add_argument("--hidden", type=int, default=128, help=f"hidden width, 1..{MAX_HIDDEN} (default 128)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp"],
                   help="ddp (default: every rank holds the model) or fsdp (sharded; CPU only)")
    p.add_argument("--rejoin-window", type=float, default=60.0,
                   help="seconds to wait for replacements while the world is below --min-ranks (default 60)")
    a = p.parse_args(argv)
    for name in ("steps", "checkpoint_every", "global_batch", "hidden"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.hidden > MAX_HIDDEN:
        p.error(f"--hidden must be in 1..{MAX_HIDDEN}, got {a.hidden}")
    if not 0 <= a.seed < 2**32:   # scikit-learn's random_state (NumPy's legacy seed) range
        p.error(f"--seed must be in 0..{2**32 - 1}, got {a.seed}")
    if not 0 < a.lr < math.inf:   # NaN fails too
        p.error(f"--lr must be a finite number > 0, got {a.lr}")
    if not 0 < a.rejoin_window < math.inf:
        p.error(f"--rejoin-window must be a finite number of seconds > 0, got {a.rejoin_window}")
    if a.strategy == "fsdp" and a.device != "cpu":
        p.error(f"--strategy fsdp runs on the CPU only, got --device {a.device}")
    return a


def check_out_folder(out: Path) -> str | None:
    """Create ``out`` (and its parents) if needed and check this process can write files there.

    Every rank checks for itself before it joins the job, so a bad ``--out`` stops each one at
    once instead of leaving the others waiting for a rank that crashed.

    Returns:
        None when ``out`` is a writable folder, else one line naming the path and the reason.
    """
    if out.exists() and not out.is_dir():
        return f"--out {str(out)!r} exists and is not a folder"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"--out {str(out)!r}: cannot create the folder: {exc.strerror or exc}"
    try:
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as exc:
        return f"--out {str(out)!r}: cannot write in the folder: {exc.strerror or exc}"
    return None


OUT_LOCK = ".train_digits.lock"   # in --out: the job id of the run writing there


def this_run() -> str:
    """What names this run in ``--out``'s lock: :func:`rtxnet.checkpoint.run_id` (its job id, and
    its coordinator's address when its launcher started that coordinator for it)."""
    return checkpoint.run_id()


def claim_out_folder(out: Path, job: str, wait_s: float = 5.0) -> tuple[int | None, str | None]:
    """Share folder ``out`` with the other ranks of run ``job`` and keep other runs out (two runs
    writing one ``--out`` at once would interleave their checkpoints and metrics):
    :func:`rtxnet.checkpoint.claim_folder` on ``out/.train_digits.lock``, held until this process
    exits.

    Returns:
        ``(fd, None)``: the lock's descriptor, to keep open while the rank runs; or ``(None, why)``
        with one line naming the job of the run that holds ``out``.
    """
    fd, holder = checkpoint.claim_folder(out, job, lock_name=OUT_LOCK, wait_s=wait_s)
    if fd is not None:
        return fd, None
    if holder is None:   # free, but another user's lock file: this run goes on unlocked
        return None, None
    if holder.startswith("a process that held"):
        return None, (f"--out {str(out)!r} is locked by another process for more than {wait_s:g} s "
                      f"({out / OUT_LOCK}); give another --out")
    # (the holder as written: "job-a", or "job-a (coordinator tcp://...)"; quoting it whole
    # put the coordinator inside the job id's quotes: a fresh user's find)
    return None, (f"--out {str(out)!r} is in use by another run ({checkpoint.shown_holder(holder)}) "
                  f"that is still running; give another --out, or wait for that run to end")


def remove_earlier_checkpoints(ckpt_dir: Path) -> None:
    """Delete the step folders in ``ckpt_dir``, logging their steps: called by rank 0 of a fresh
    run (no ``--resume``) while its job has committed nothing, so every one there is an earlier
    run's. Kept, they outlived this run's pruning (the newest ``keep`` folders stay, and an
    earlier run's may be newer) and a later ``--resume`` loaded them, not this run's last state.
    A replacement rank, or a world restarted after every rank died, joins a job that committed
    steps, and keeps the folders (they are this run's).
    """
    import shutil

    earlier = sorted(p for p in ckpt_dir.glob("step-*") if p.is_dir())
    for path in earlier:
        shutil.rmtree(path, ignore_errors=True)
    if earlier:
        log.warning("removed_earlier_checkpoints", folder=str(ckpt_dir),
                    folders=[p.name for p in earlier], why="a fresh run (no --resume) of --out")


def pick_device(name: str) -> torch.device:
    """The device this rank trains on: the CPU, or GPU ``LOCAL_RANK % torch.cuda.device_count()``.

    Raises:
        SystemExit: ``cuda`` was asked for and torch sees no CUDA device (says why).
    """
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        build = torch.version.cuda
        why = (f"torch {torch.__version__} is a CPU-only build" if build is None
               else f"torch {torch.__version__} (CUDA {build}) finds no usable CUDA device")
        raise SystemExit(f"train_digits: --device cuda, but {why}; use --device cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


_DIGITS_NPZ = Path(__file__).resolve().parent / "data" / "digits_seed0.npz"


def load_data(seed: int = 0):
    """The UCI handwritten digits (scikit-learn's ``load_digits``, 1797 8x8 images, pixel values
    0..16 scaled to [0, 1]), split 75/25 stratified with ``random_state=seed``. Seed 0 reads that
    split from ``data/digits_seed0.npz`` (written from scikit-learn's output, identical arrays:
    ``tests/parallel/test_ddp_devices.py`` compares them), which spares every rank scikit-learn's
    import (about 1.4 s of CPU); other seeds ask scikit-learn."""
    if seed == 0 and _DIGITS_NPZ.exists():
        d = np.load(_DIGITS_NPZ)
        xtr, xte, ytr, yte = d["xtr"], d["xte"], d["ytr"], d["yte"]
    else:
        try:
            from sklearn.datasets import load_digits
            from sklearn.model_selection import train_test_split
        except ImportError:
            raise SystemExit(f"train_digits: --seed {seed} needs scikit-learn (pip install "
                             f"scikit-learn); seed 0 needs it only without {_DIGITS_NPZ}") from None
        x, y = load_digits(return_X_y=True)
        xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.25, random_state=seed, stratify=y)
    t = torch.from_numpy
    return (t((xtr / 16.0).astype(np.float32)), t(ytr.astype(np.int64)),
            t((xte / 16.0).astype(np.float32)), t(yte.astype(np.int64)))


def make_model(hidden: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(64, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, 10),
    )


# The options that shape the saved state (model and optimizer layout, sampler order): every
# checkpoint records them in its manifest's metadata, and --resume refuses other values.
SETUP_OPTIONS = ("strategy", "hidden", "global_batch", "seed")


def run_setup(args: argparse.Namespace) -> dict[str, Any]:
    return {k: getattr(args, k) for k in SETUP_OPTIONS}


def _options(setup: dict[str, Any]) -> str:
    return " ".join(f"--{k.replace('_', '-')} {v}" for k, v in setup.items())


def setup_mismatch(saved: dict[str, Any], args: argparse.Namespace) -> str | None:
    """``None`` when ``saved`` (a checkpoint's setup; options it lacks are not compared) agrees
    with this run's options, else ``"was saved with --hidden 128, got --hidden 64; resume with
    --hidden 128"``."""
    mine = run_setup(args)
    differ = [k for k in SETUP_OPTIONS if k in saved and saved[k] != mine[k]]
    if not differ:
        return None
    was = _options({k: saved[k] for k in differ})
    return f"was saved with {was}, got {_options({k: mine[k] for k in differ})}; resume with {was}"


def saved_setup(ckpt_dir: Path, step: int) -> dict[str, Any] | None:
    """The setup checkpoint ``step`` recorded (``None`` for one saved without it)."""
    try:
        setup = checkpoint.read_manifest(ckpt_dir, step).get("metadata", {}).get("setup")
    except (checkpoint.CheckpointError, OSError):   # the load that follows says what is wrong
        return None
    return setup if isinstance(setup, dict) else None


# What loading a state of another shape raises: torch's load_state_dict (RuntimeError, ValueError),
# rtxnet's FSDP and sampler loaders (ConfigError, a ValueError), a missing entry.
LOAD_MISMATCH_ERRORS = (RuntimeError, ValueError, KeyError, TypeError, IndexError)


class TrainState:
    """Everything a step changes: model, optimizer, sampler position, step, RNG, loss history.

    ``state_dict()`` holds tensors, numbers and lists only, so the fault-tolerance layer can
    snapshot it in memory and :mod:`rtxnet.checkpoint` can save it with ``weights_only`` loading.
    """

    def __init__(self, pg, args: argparse.Namespace, n_train: int, device: torch.device):
        torch.manual_seed(args.seed)            # same init everywhere (DDP broadcasts rank 0's anyway)
        self.pg = pg
        # init_sync=False: replicas start equal (same seed) and FaultTolerance syncs the state at
        # its first step, which is also where a replacement rank joining mid-run meets the others.
        self.sharded = args.strategy == "fsdp"
        wrapper = FullyShardedDataParallel if self.sharded else DistributedDataParallel
        self.model = wrapper(make_model(args.hidden).to(device), pg,
                             reduce_op=rtxnet.ReduceOp.SUM, init_sync=False)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=args.lr)
        # FSDP: the shards and the optimizer's sharded moments, resharded on load at any world size
        self.fsdp = FSDPState(self.model, self.optimizer) if self.sharded else None
        self.sampler = ElasticDistributedSampler(n_train, args.global_batch, rank=pg.rank,
                                                 world_size=pg.world_size, seed=args.seed)
        self.step = 0                            # steps completed
        self.history: list[list[float]] = []     # [step, loss, world_size]
        torch.manual_seed(args.seed + 1000 * pg.rank)   # per-rank stream for anything random later
        # FSDP: what built_state_dicts() gives with the shards as built (see there)
        self._sampler_built, self._rng_built = self.sampler.state_dict(), checkpoint.capture_rng()

    def state_dict(self) -> dict[str, Any]:
        if self.fsdp is not None:    # {"model": shards, "optimizer": ..., "step"}
            state = self.fsdp.state_dict()
        else:
            state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        return {**state, "sampler": self.sampler.state_dict(), "step": self.step,
                "rng": checkpoint.capture_rng(), "history": [list(h) for h in self.history]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.fsdp is not None:    # this rank's own shards, at the world size they were taken in
            self.fsdp.load_state_dict(state)
        else:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        self._load_replicated(state)

    def sharded_layout(self) -> tuple[int, int]:
        """FSDP: ``(rank, world_size)`` the shards are laid out for (FaultTolerance compares them
        before the first commit: a rank that joined late built its shards for another world)."""
        return self.fsdp.sharded_layout()

    def hold_built(self, hold: bool = True) -> None:
        """FSDP: keep the shards as built until the first commit (FaultTolerance asks): a rank
        lost in the first sync, before its shards reached its ring successor, then costs one
        step, not the job (a tester's find: a third rank SIGKILLed in the first sync ended the
        job, "the states as built of ranks [2] of the world of 3 are gone")."""
        self.fsdp.hold_built(hold)

    def holds_built(self) -> bool:
        return self.fsdp.holds_built()

    def built_state_dicts(self) -> list[dict[str, Any]] | None:
        """FSDP: every rank's :meth:`state_dict` before any step, in rank order, for
        :meth:`load_state_dicts`: the shards as built (a fresh optimizer), the sampler, step,
        history and this process's RNG as they were made; None once released."""
        built = self.fsdp.built_state_dicts()
        if built is None:
            return None
        rest = {"sampler": self._sampler_built, "step": 0, "rng": self._rng_built, "history": []}
        return [{**b, **rest} for b in built]

    def load_state_dicts(self, states: list[dict[str, Any]]) -> None:
        """FSDP: every rank's state of one committed step or checkpoint, in rank order, resharded
        for this world (FaultTolerance(sharded_state=True) and the checkpoint loaders call it)."""
        self.fsdp.load_state_dicts(states)
        # sampler, step and history are the same on every rank; the RNG streams are per rank
        # (a rank number the saved world did not have keeps its own)
        rest = {k: v for k, v in states[0].items() if k != "rng"}
        if self.pg.rank < len(states) and "rng" in states[self.pg.rank]:
            rest["rng"] = states[self.pg.rank]["rng"]
        self._load_replicated(rest)

    def _load_replicated(self, state: dict[str, Any]) -> None:
        self.optimizer.zero_grad(set_to_none=True)      # drop gradients of a half-done step
        self.sampler.load_state_dict(state["sampler"])
        self.sampler.set_world(self.pg.rank, self.pg.world_size)
        self.step = int(state["step"])
        self.history = [list(h) for h in state["history"]]
        if "rng" in state:
            checkpoint.restore_rng(state["rng"])

    def on_world(self, rank: int, world_size: int) -> None:
        """Called by FaultTolerance after the group (re-)formed: re-split the remaining samples."""
        self.sampler.set_world(rank, world_size)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Launched as rank 0 is only a first guess at who reports: see RankZeroOutput.
    _configure_logs(info=os.environ.get("RANK", "0") == "0")
    torch.set_num_threads(1)                     # ranks share the cores
    out: Path = args.out
    ckpt_dir = out / "checkpoints"
    # Before joining, each rank for itself: a rank that cannot run says so and nobody waits for it.
    # The refusals that need no folder come before --out is created, so they leave none behind.
    device = pick_device(args.device)
    xtr, ytr, xte, yte = load_data()
    if args.global_batch > len(xtr):
        print(f"train_digits: --global-batch must be at most the {len(xtr)} training samples, "
              f"got {args.global_batch}", file=sys.stderr)
        return 2
    if (why := check_out_folder(out)) is not None:
        print(f"train_digits: {why}", file=sys.stderr)
        return 2
    # held until this process exits
    _out_lock, why = claim_out_folder(out, this_run())
    if why is not None:
        print(f"train_digits: {why}", file=sys.stderr)
        return 2
    xtr, ytr, xte, yte = (t.to(device) for t in (xtr, ytr, xte, yte))
    resume_step = checkpoint.latest(ckpt_dir) if args.resume else None
    if args.resume and resume_step is None and any(ckpt_dir.glob("step-*")):
        # step folders, none intact: starting afresh would overwrite them; say so instead
        print(f"train_digits: --resume: no intact checkpoint in {ckpt_dir} (its step folders lack "
              f"a manifest or fail their checksums); without --resume training starts afresh and "
              f"replaces them", file=sys.stderr)
        return 2
    resume_what = f"--resume: checkpoint step-{resume_step} in {ckpt_dir}"
    if resume_step is not None and (saved := saved_setup(ckpt_dir, resume_step)) is not None:
        if (why := setup_mismatch(saved, args)) is not None:
            print(f"train_digits: {resume_what} {why}", file=sys.stderr)
            return 2
    setup = run_setup(args)
    pg = rtxnet.init()
    structlog.contextvars.bind_contextvars(rank=pg.rank)   # kept current by RankZeroOutput.is_me

    if device.type == "cuda":
        log.info("device", device=str(device), name=torch.cuda.get_device_name(device))
    state = TrainState(pg, args, len(xtr), device)

    def save_checkpoint(step: int) -> None:
        """Commit ``state`` as checkpoint ``step`` (the last 3 kept), with this run's setup."""
        checkpoint.save(ckpt_dir, step, state.state_dict(), pg=pg, keep=3,
                        metadata={"world_size": pg.world_size, "setup": setup})

    def load_checkpoint(step: int, root: str | Path) -> None:
        # --resume, and FaultTolerance when no live rank holds the last committed state
        if state.sharded:    # every saved rank's shards, resharded for this world
            state.load_state_dicts(checkpoint.load_all(root, step))
            return
        loaded = checkpoint.load(root, step, rank=pg.rank)
        if loaded["_checkpoint"]["resharded"]:
            loaded.pop("rng")                 # rank 0's RNG streams: keep this rank's own
        state.load_state_dict(loaded)

    resumed_from = None
    if args.resume:
        if resume_step is None:    # no step folder at all: nothing to resume, a fresh start
            log.warning("resume_no_checkpoint", folder=str(ckpt_dir))
        else:
            try:
                load_checkpoint(resume_step, ckpt_dir)
            except LOAD_MISMATCH_ERRORS as exc:
                # Saved before checkpoints recorded their setup (the check above): the state has
                # another shape. One line, naming this run's options, instead of a traceback.
                err = " ".join(str(exc).split())
                print(f"train_digits: {resume_what} does not fit this run's "
                      f"{_options(setup)} (it does not record the options it was saved "
                      f"with; resume with those): {type(exc).__name__}: {err[:300]}"
                      f"{'...' if len(err) > 300 else ''}", file=sys.stderr)
                try:
                    pg.close()
                except rtxnet.RtxError:
                    pass
                return 2
            resumed_from = state.step
            # the job's store names the checkpoint to restore from if every rank dies before
            # this run's first save
            checkpoint.record(ckpt_dir, resume_step, pg=pg)
            log.info("resumed", step=state.step, checkpoint=resume_step)
            if state.step >= args.steps and pg.rank == 0:
                log.warning("nothing_to_train", step=state.step, steps=args.steps,
                            hint="the checkpoint is at or past --steps: raise --steps to train on")

    ft = rtxnet.FaultTolerance(pg, state, start_step=state.step,   # continue the step count
                               load_checkpoint=load_checkpoint, rejoin_window_s=args.rejoin_window,
                               sharded_state=state.sharded)
    loss_fn = torch.nn.functional.cross_entropy
    loss_sum = torch.zeros(1, device=device)

    def train_step(step: int) -> tuple[float, int]:
        """One synchronous data-parallel step; returns the global mean loss and the global
        number of samples."""
        b = state.sampler.next_batch()
        idx = torch.tensor(b.indices, device=device)   # (a copy: the indices are read-only)
        state.optimizer.zero_grad(set_to_none=True)
        # Sum over this rank's samples / the step's global count: summed over ranks, this is the
        # mean loss of the global batch. A rank with no samples (the last, short batch of an
        # epoch) still runs forward and backward, so it takes part in every gradient bucket.
        loss = loss_fn(state.model(xtr[idx]), ytr[idx], reduction="sum") / b.global_n
        loss.backward()
        state.optimizer.step()
        loss_sum.copy_(loss.detach().reshape(1))
        pg.all_reduce(loss_sum, op=rtxnet.ReduceOp.SUM)
        state.step = step + 1
        value = float(loss_sum[0])
        # Every rank keeps the history, and it is part of the state that is snapshotted, sent to
        # a replacement and checkpointed: whichever process is rank 0 at the end has all of it.
        state.history.append([step, value, pg.world_size])
        return value, b.global_n

    if not args.resume and pg.membership.committed_step < 0 and pg.rank == 0:
        # held first: another run saving there (not through this script's --out lock) kept its
        # steps only until this line (a re-verifier's find)
        checkpoint.hold(ckpt_dir, pg=pg)
        remove_earlier_checkpoints(ckpt_dir)
    rank0 = RankZeroOutput(pg, args.steps)
    rank0.progress(min(state.step, args.steps))   # the bar at its start (the launched rank 0)
    t0 = time.perf_counter()
    samples = 0
    loss_value = float("nan")
    try:
        try:
            while ft.step < args.steps:
                if _interrupted:
                    raise KeyboardInterrupt
                with ft.guard() as step:
                    if step >= args.steps:
                        # the guard's sync restored a checkpoint at or past --steps (a relaunch
                        # of a crashed job asking for fewer steps): nothing is left to train, and
                        # its step must not run (a tester saw step 400 trained under --steps 200)
                        raise _PastTheEnd(step)
                    if step > 0 and step % args.checkpoint_every == 0 and step != resumed_from:
                        save_checkpoint(step)
                    loss_value, global_n = train_step(step)
                if ft.step == step + 1:                   # committed
                    samples += global_n
                    rank0.progress(ft.step, loss=f"{loss_value:.4f}",
                                   samples_s=f"{samples / (time.perf_counter() - t0):.0f}", world=pg.world_size)
                    if step % 50 == 0 and rank0.is_me():
                        log.info("train_step", step=step, loss=round(loss_value, 5), world_size=pg.world_size)
        except _PastTheEnd as end:
            rank0.close()
            log.warning("nothing_to_train", step=end.args[0], steps=args.steps,
                        hint="the checkpoint restored holds --steps steps or more")
        # Training is over: the job admits no rank from now on, so the final checkpoint and
        # evaluation (collectives; with FSDP the forward gathers shards) run in a world that no
        # replacement arriving now can grow.
        ft.finish()
    except rtxnet.JobFinishedError as exc:
        # This rank was frozen or cut off until the others finished: their result stands.
        rank0.close()
        log.warning("job_finished_without_this_rank", error=str(exc))
        pg.close()
        return 0
    except rtxnet.RtxError:
        rank0.close()   # the bar's last line before the error line (see __main__), not after it
        raise
    duration_s = time.perf_counter() - t0
    rank0.close()
    try:
        final_world, acc = after_training(pg, ft, state, save_checkpoint, resumed_from, xte, yte)
    except rtxnet.JobFinishedError as exc:
        # Frozen or cut off after the last step (the final checkpoint, the evaluation) until the
        # others went on without it: they write the result, not this rank (before, it wrote its
        # own over theirs and exited 1 at the end).
        log.warning("job_finished_without_this_rank", error=str(exc))
        pg.close()
        return 0
    if rank0.is_me():   # asked once, now: rank 0 of the epoch the run ended in writes everything
        out.mkdir(parents=True, exist_ok=True)   # the process that made it may be gone
        events = _events(ft.events)
        if resumed_from is not None and (out / "metrics.json").exists():
            # Keep the failure history of the run this one resumes (events up to the checkpoint).
            try:
                before = json.loads((out / "metrics.json").read_text()).get("events", [])
            except (OSError, ValueError):
                before = []
            events = [e for e in before if e.get("step", e.get("failed_step", 0)) < resumed_from] + events
        metrics = {
            "test_accuracy": acc, "steps": state.step, "world_size_end": pg.world_size,
            "global_batch": args.global_batch, "duration_s": round(duration_s, 3),
            "samples_per_s": round(samples / duration_s, 1) if duration_s > 0 else None,
            "final_loss": state.history[-1][1] if state.history else None,
            "resumed_from_step": resumed_from, "events": events,
            "loss_history": state.history,
        }
        (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
        _plot(out / "loss_curve.png", state.history, events, resumed_from, args.strategy)
        log.info("done", test_accuracy=round(acc, 4), duration_s=round(duration_s, 2), out=str(out),
                 launch_rank=ft.launch_rank)
        for line in ft.report():
            print(f"recovery: {line}", flush=True)
        print(f"test_accuracy={acc:.4f}", flush=True)
    leave_together(pg, final_world)
    pg.close()
    return 0


AFTER_TRAINING_TRIES = 3


def after_training(pg, ft, state, save_checkpoint, resumed_from, xte,
                   yte) -> tuple[tuple[int, int, int], float]:
    """The final checkpoint and the test accuracy, after ``ft.finish()``. A rank lost meanwhile
    (a collective raises, or FSDP's forward finds the world changed) makes every rank call
    ``ft.finish()`` again, which syncs (reshards) the state for the smaller world, and redo
    both, up to ``AFTER_TRAINING_TRIES`` times. Returns ``((epoch, rank, world size), accuracy)``:
    the world both ran in, the same on every rank that ran them."""
    for attempt in range(1, AFTER_TRAINING_TRIES + 1):
        if attempt > 1:
            ft.finish()
        world = (pg.epoch, pg.rank, pg.world_size)
        try:
            if state.step != resumed_from:               # the final state, whatever the period
                try:
                    save_checkpoint(state.step)
                except (rtxnet.RtxError, OSError) as exc:
                    if pg.epoch != world[0] or isinstance(exc, rtxnet.PeerLostError):
                        raise   # a rank lost (maybe this one): finish() again, below
                    log.warning("final_checkpoint_failed", error=str(exc))
            with torch.no_grad():   # FSDP: a forward gathers the shards (every rank runs it)
                model = state.model if state.sharded else state.model.module
                return world, float((model(xte).argmax(1) == yte).float().mean())
        except rtxnet.RtxError as exc:
            # a rank lost: the epoch changed, or not yet here (a peer's abort came first, or this
            # rank was the one declared lost: finish() raises JobFinishedError then)
            lost = pg.epoch != world[0] or isinstance(exc, rtxnet.PeerLostError)
            if not lost or attempt == AFTER_TRAINING_TRIES:
                raise
            log.warning("world_changed_after_training", error=f"{type(exc).__name__}: {exc}",
                        world_size=pg.world_size, attempt=attempt)
    raise AssertionError("unreachable")


def leave_together(pg, world: tuple[int, int, int]) -> None:
    """Leave together, so nobody's last collective sees a peer's orderly leave as a failure: the
    ranks of ``world`` (``after_training``'s; ``pg.epoch`` may differ between ranks by now, when
    one is fenced) each say they are done and wait for the others, up to 30 s. A peer that leaves
    in order says so first; once the membership changed (a peer lost), a missing one is not
    waited for any more. The result is written already: a peer that never comes costs a
    warning, not the job."""
    epoch, me, n = world
    keys = [f"train_digits/done/{epoch}/{r}" for r in range(n)]
    deadline = time.monotonic() + 30
    try:
        pg.store.set(keys[me], b"1")
        while True:
            try:
                pg.store.wait(keys, timeout=1.0)
                return
            except rtxnet.RtxTimeoutError as exc:
                if pg.epoch != epoch or time.monotonic() >= deadline:
                    log.warning("leave_without_peers", error=str(exc))
                    return
    except rtxnet.RtxError as exc:
        # this rank declared lost while it wrote the result (starved or frozen over the heartbeat
        # timeout), and the others gone with the job: the result stands (before: exit 1, a
        # re-verifier's find, "RendezvousError: unknown job")
        log.warning("leave_without_peers", error=f"{type(exc).__name__}: {exc}")


def _configure_logs(*, info: bool) -> None:
    """Log at info on the reporting rank, at warning on the others (``RTXNET_LOG_LEVEL`` wins)."""
    global log
    from transport.logconfig import configure_logging

    configure_logging(level=os.environ.get("RTXNET_LOG_LEVEL") or ("info" if info else "warning"))
    # structlog caches a logger's level at its first use: a fresh one sees the new level.
    log = structlog.get_logger("train_digits")


class RankZeroOutput:
    """What only rank 0 shows: the progress bar and this script's info-level log lines.

    Which process that is can change during a run: after a loss the coordinator renumbers the
    survivors densely (so a survivor becomes rank 0 when rank 0 dies), and a replacement or a
    fenced rank that rejoins takes a free rank (0 when every rank was restarted). So every call
    asks ``pg.rank`` (the current epoch's membership, which the agent replaces at every new
    epoch) rather than a rank stored at start. A process that becomes rank 0 turns its log level
    up to info and opens a bar at the current step; one that stops being rank 0 closes its bar.
    """

    def __init__(self, pg, total_steps: int):
        self.pg = pg
        self.total_steps = total_steps
        self.bar = None
        self._info = os.environ.get("RANK", "0") == "0"
        self._bound_rank = pg.rank
        try:
            from tqdm import tqdm
        except ImportError:   # no progress bar then; the log lines still come
            tqdm = None
        self._tqdm = tqdm

    def is_me(self) -> bool:
        """Whether this process is rank 0 now. Also rebinds ``rank`` in the log context when it
        changed: the agent rebinds it only in the event loop's thread."""
        rank = self.pg.rank
        if rank != self._bound_rank:
            structlog.contextvars.bind_contextvars(rank=rank)
            self._bound_rank = rank
        if rank != 0:
            self.close()
            return False
        if not self._info:
            _configure_logs(info=True)
            self._info = True
        return True

    def progress(self, steps_done: int, **postfix: Any) -> None:
        """Show ``steps_done`` of ``total_steps`` (and ``postfix``) when this process is rank 0."""
        if not self.is_me() or self._tqdm is None:
            return
        if self.bar is None:
            self.bar = self._tqdm(total=self.total_steps, initial=steps_done, desc="train", unit="step",
                                  file=_LineStream(sys.stderr), mininterval=1.0, ascii=True,
                                  dynamic_ncols=False, ncols=100)
        if postfix:
            self.bar.set_postfix(**postfix, refresh=False)
        self.bar.update(steps_done - self.bar.n)    # tqdm redraws at most once per mininterval

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class _LineStream:
    """tqdm's carriage-return updates as separate lines: rtxnet-run forwards output line by line."""

    def __init__(self, stream):
        self._s = stream

    def write(self, text: str) -> None:
        text = text.replace("\r", "\n")
        for line in text.split("\n"):
            if line.strip():
                self._s.write(line.rstrip() + "\n")

    def flush(self) -> None:
        self._s.flush()


def _events(raw: list[dict[str, Any]]) -> list[dict[str, Any]]:
    keep = ("event", "step", "failed_step", "resumed_step", "steps_lost", "error", "lost",
            "lost_launch", "added", "added_launch", "epoch", "world_size", "time_to_recover_s",
            "detection_latency_s", "seconds")   # (seconds: how long a commit_stall's vote waited)
    return [{k: e[k] for k in keep if k in e} for e in raw]


class _PastTheEnd(Exception):
    """The step FaultTolerance's sync restored is at or past ``--steps``: nothing to train."""


def _plot(path: Path, history: list[list[float]], events: list[dict[str, Any]], resumed_from: int | None,
          strategy: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print(f"train_digits: matplotlib is not installed, {path.name} skipped", file=sys.stderr)
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    h = np.asarray(history, dtype=float).reshape(-1, 3)
    if len(h):
        ax.plot(h[:, 0], h[:, 1], lw=1.2, label="training loss (global batch)")
        ws = ax.twinx()
        ws.step(h[:, 0], h[:, 2], where="post", color="tab:gray", lw=1, alpha=0.6)
        ws.set_ylabel("world size", color="tab:gray")
        ws.set_ylim(0, h[:, 2].max() + 1)
        ws.yaxis.get_major_locator().set_params(integer=True)
    labelled: set[str] = set()
    for e in events:
        if e["event"] == "failure":
            x, style, label = e["step"], dict(color="tab:red", ls="-", lw=2, alpha=0.5), "failure"
            text = f"lost rank(s) {e['lost']}" if e.get("lost") else f"step failed ({e.get('error')})"
        elif e["event"] == "recovered":
            x, style, label = e["resumed_step"], dict(color="tab:green", ls="--", lw=1.2), "recovery"
            text = f"world {e.get('world_size')}, {e.get('time_to_recover_s')} s"
        elif e["event"] == "restored":
            x, style, label = e["resumed_step"], dict(color="tab:purple", ls="--", lw=1.2), "restored"
            text = f"from checkpoint, failed at {e.get('failed_step')}"
        elif e["event"] == "joined":
            x, style, label = e["step"], dict(color="tab:blue", ls=":", lw=1.2), "rank joined"
            text = f"+{len(e['added'])} rank{'s' if len(e['added']) > 1 else ''}, world {e['world_size']}"
        else:
            continue
        ax.axvline(x, label=None if label in labelled else label, **style)
        ax.annotate(text, (x, 1.0), xycoords=("data", "axes fraction"), xytext=(3, {"failure": -12, "rank joined": -36}.get(label, -24)),
                    textcoords="offset points", fontsize=8, color=style["color"])
        labelled.add(label)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss")
    ax.set_yscale("log")
    if labelled and len(h):
        # room above the curve for the events' labels (they overlapped its start)
        lo, hi = ax.get_ylim()
        ax.set_ylim(lo, hi * 6)
    ax.set_title(f"digits MLP, rtxnet {strategy.upper()}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:   # Ctrl-C of rtxnet-run reaches every rank: one line, not a traceback
        sys.stderr.write("interrupted\n")   # one write: never glued into another thread's line
        sys.stderr.flush()
        sys.stdout.flush()
        # No interpreter teardown: rtxnet's loop thread and torch's threads may be mid-call, and
        # C++ destructors racing them aborted a rank once in 9 Ctrl-Cs ("terminate called
        # without an active exception", exit 134). The coordinator sees the rank go at once and
        # rtxnet-run removes its shared memory.
        os._exit(130)
    except rtxnet.JobFinishedError as exc:
        # A replacement that arrived after the others finished (rtxnet.init refused it): the
        # job's result stands and this rank has nothing to add.
        print(f"this rank came back after the job finished; its result stands ({exc})",
              file=sys.stderr)
        sys.exit(0)
    except rtxnet.RtxError as exc:
        # The job stopped for a reason the message explains (and says what to do about, like a
        # RendezvousError after the rejoin window): one line per rank, not a traceback each.
        # Anything else is a bug and keeps its traceback. Recorded for rtxnet-run, which names
        # the first failure's exception (an uncaught one is recorded by itself).
        rtxnet.errorfile.record(exc)
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(1)
