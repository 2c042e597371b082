"""``rtxnet``: command-line tools.

    rtxnet status [--coordinator ADDR] [--json] [--timeout S]
    rtxnet topology [--json]

``status`` prints every job on the coordinator: state (``rendezvous``, ``running``, or ``crashed``:
every rank lost, kept for restarted ranks), epoch, world size, last committed step and, per member,
rank, host, pid, heartbeat age and, for a member that waits for the world to grow (a
fault-tolerant job below its ``min_world_size``, a rank rejoining below ``min_ranks``), the world
size it waits for; jobs whose launchers have claimed them and no rank has joined yet
(``launching``: each launcher's pid, host and node); then the newest finished job ids, which
cannot be used again (``--json``: entries ``{"job", "state": "launching", "committed_step": -1,
"launchers", "members": []}`` and ``{"job", "state": "finished", "committed_step", "members": []}`` after the
jobs). ADDR defaults to ``RTXNET_COORDINATOR`` or
``tcp://127.0.0.1:29600``. Exit code 1 when the coordinator does not answer in time (after about
2 s when nothing listens on a TCP address at all: two refused connects 1 s apart); 2 for a bad
argument (``S`` must be a finite number of seconds > 0) or address.

``topology`` prints this machine as rtxnet sees it (:func:`rtxnet.topology.local_topology`): the
host identity the agents publish (``RTXNET_HOST`` overrides the hostname), CPUs, and every GPU NVML
reports with its UUID, PCI bus id, name and memory; or why no GPU is listed. Exit code 0 either
way.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import uuid
from typing import Any

import structlog

from transport.channel import NOT_ZEROMQ, NOTHING_LISTENS, ControlClient, nobody_there
from transport.errors import ConnectError, RtxError, RtxTimeoutError
from transport.wire import last_committed

__all__ = ["main"]


async def _ask(address: str, mtype: str, timeout_s: float, job: str = "", **fields: Any) -> dict:
    """One request ``mtype`` to the coordinator at ``address``, on a connection of its own (a
    tool's, or a launcher's between its ranks' starts); the reply's body.

    Raises:
        RtxError: no answer within ``timeout_s``, or the coordinator's refusal.
    """
    client = ControlClient(address, f"rtxnet-{mtype}/{os.getpid()}/{uuid.uuid4().hex[:8]}")
    try:
        return await client.request(mtype, job=job, epoch=-1, deadline_s=timeout_s, **fields)
    finally:
        await client.aclose()


async def _status(address: str, timeout_s: float, job: str = "") -> dict:
    """The coordinator's status reply: ``{"jobs": [...], "finished": {job: last committed step},
    "finished_total": n}`` (``finished``: ``job`` only when given, else the newest ids)."""
    body = await _ask(address, "status", timeout_s, job)
    body.setdefault("finished", {})
    return body


class _NobodyListens(Exception):
    pass


async def _status_unless_refused(address: str, timeout_s: float) -> dict:
    """:func:`_status`, but given up early when a plain TCP connect to ``address`` is refused, or
    what listens there answers as no ZeroMQ peer does, at two checks 1 s apart (waiting out
    ``timeout_s`` would not help; a daemon that is starting binds its port well within that).

    Raises:
        _NobodyListens: with the reason, naming host and port.
        RtxError: as :func:`_status`.
    """
    loop = asyncio.get_running_loop()
    req = asyncio.ensure_future(_status(address, timeout_s))
    end, refused = loop.time() + timeout_s, 0
    while True:
        done, _ = await asyncio.wait({req}, timeout=max(0.0, min(1.0, end - loop.time())))
        if done or loop.time() >= end:
            return await req
        why = await asyncio.to_thread(nobody_there, address)
        refused = refused + 1 if why and (why.startswith(NOTHING_LISTENS) or NOT_ZEROMQ in why) else 0
        if refused >= 2:
            req.cancel()
            await asyncio.gather(req, return_exceptions=True)
            raise _NobodyListens(why)


def _shown(text: Any) -> str:
    """``text`` for a terminal: control characters (escape sequences, newlines) written as
    escapes, since job ids and host names come from any client of the coordinator."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _exited(proc: dict) -> str:
    """``" (exited)"`` for a fenced process of this host that is gone (or a zombie): the
    coordinator cannot tell a frozen rank from one its launcher killed and replaced."""
    from .topology import gone_from_this_host

    return " (exited)" if gone_from_this_host(proc) else ""


def _jsonable(obj: Any) -> Any:
    """``obj`` with what JSON cannot hold made text: bytes and map keys that are not strings (a
    coordinator refuses them in a member's info now; a journal from before may hold them)."""
    if isinstance(obj, dict):
        return {k if isinstance(k, str) else repr(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_jsonable(v) for v in obj]
    return repr(obj) if isinstance(obj, bytes) else obj


def _render(status: dict) -> str:
    jobs, finished = status["jobs"], status["finished"]
    launching = status.get("launching") or []   # (a coordinator before it: none)
    lines = [] if jobs or launching or status.get("jobs_omitted") else ["no jobs"]
    for j in jobs:
        # a running world below its minimum, its members waiting for it to grow, says so (a
        # fresh user read "running" there as training); the rendezvous count only where anyone
        # waits in one (it said "0 joined and waiting" of every running job)
        waiting = [m["waiting_for"] for m in j["members"] if m.get("waiting_for")]
        state = j["state"]
        if state == "running" and waiting:
            state = f"running, waiting for a world of {max(waiting)}"
        pending = ""
        if j["pending"] or j["state"] == "rendezvous" or j.get("missing_ranks"):
            # (a fresh user read "pending 2" as two ranks missing: they are the ones that came)
            pending = (f"{j['pending']} joined and waiting for the next epoch"
                       + (f" (missing ranks {', '.join(map(str, j['missing_ranks']))})"
                          if j.get("missing_ranks") else "") + ", ")
        lines.append(
            f"job {_shown(j['job'])}: {state}, epoch {j['epoch']}, world size {j['world_size']} "
            f"(min {j['min_ranks']}, max {j['max_ranks']}), {pending}"
            f"{last_committed(j['committed_step'])}, {j['kv_keys']} key(s)"
            + (f", {j['kv_waits']} store wait(s) open" if j.get("kv_waits") else "")
            + (", training finished (admits no ranks)" if j.get("finished_training") else "")
        )
        for m in j["members"]:
            # info is whatever the member published: any shape (a tester's "topology": "x" was a
            # traceback here)
            info = m.get("info")
            topo = info.get("topology") if isinstance(info, dict) else None
            found = topo.get("gpus") if isinstance(topo, dict) else None
            gpus = f"  {len(found)} GPU(s)" if isinstance(found, list) and found else ""
            waits = f"  waiting for a world of {m['waiting_for']}" if m.get("waiting_for") else ""
            # renumbered after a loss, a rank is told apart by the rank rtxnet-run started it as
            launch = info.get("launch_rank") if isinstance(info, dict) else None
            launched = (f" (launch rank {launch})" if type(launch) is int and launch != m["rank"] else "")
            age = m.get("heartbeat_age_s")
            beat = (f"heartbeat {age * 1000:7.0f} ms ago" if isinstance(age, int | float)
                    else "not heard from since the coordinator started")
            lines.append(f"  rank {m['rank']:>3}{launched}  {_shown(m['host'])}  pid {m['pid']:<8} {beat}{gpus}{waits}")
        if j.get("fenced"):
            # (a process, not a rank: its launch rank may be back as a replacement, a new pid; a
            # fresh user read "not back" as the rank's)
            lines.append("  processes declared lost, not readmitted (a replacement has a new pid): " + ", ".join(
                f"pid {f['pid']} on {_shown(f['host'])}{_exited(f)}" for f in j["fenced"]))
    for j in launching:
        lines.append(f"job {_shown(j['job'])}: launching, no rank has joined yet ("
                     + "; ".join(f"rtxnet-run pid {c['pid']} on {_shown(str(c['host']))}, node {c['node']}"
                                 for c in j["launchers"]) + ")")
    if status.get("jobs_omitted"):
        lines.append(f"... and {status['jobs_omitted']} more jobs not shown (the answer must fit one "
                     f"message)")
    if finished:   # after the running jobs, which are what one looks for (a fresh user's remark)
        more = status.get("finished_total", len(finished)) - len(finished)
        lines.append(f"finished (ids not reusable){f', newest {len(finished)} of {len(finished) + more}' if more else ''}: "
                     + ", ".join(f"{_shown(j)} ({last_committed(s)})" for j, s in finished.items()))
    return "\n".join(lines)


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < v <= 3600:   # NaN fails too
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds in (0, 3600]")
    return v


_DEFAULT_COORDINATOR = "tcp://127.0.0.1:29600"   # rtxnet-coordinator's default --bind


def main(argv: list[str] | None = None) -> int:
    from transport.logconfig import ensure_standard_fds

    ensure_standard_fds()
    try:
        return _main(argv)
    except KeyboardInterrupt:   # Ctrl-C while waiting for the coordinator: one line, no traceback
        print("rtxnet: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rtxnet", description="rtxnet command-line tools")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{status,topology}")
    st = sub.add_parser("status", help="show the coordinator's jobs, members, epochs and heartbeats")
    st.add_argument("--coordinator", default=None,
                    help="address of the coordinator to ask (default $RTXNET_COORDINATOR, else "
                         "tcp://127.0.0.1:29600); an rtxnet-run started without --coordinator picks a "
                         "free port and prints it in its line '[rtxnet-run] coordinator tcp://...'")
    st.add_argument("--json", action="store_true", help="print JSON instead of a table")
    st.add_argument("--timeout", type=_seconds, default=5.0,
                    help="seconds to wait for the answer, in (0, 3600] (default 5)")
    tp = sub.add_parser("topology", help="show this machine's host identity, CPUs and GPUs (NVML)")
    tp.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(argv)
    if not structlog.is_configured():
        # stdout is the answer (``--json`` is parsed by scripts): library logs go to stderr, and
        # only warnings (a reconnect notice is not news to someone asking for a status)
        from transport.logconfig import configure_logging

        try:
            configure_logging(level=os.environ.get("RTXNET_LOG_LEVEL") or "warning")
        except ValueError as exc:   # names RTXNET_LOG_LEVEL or RTXNET_LOG_JSON
            print(f"rtxnet: {exc}", file=sys.stderr)
            return 2
    if args.cmd == "topology":
        from .topology import local_topology, render_topology

        try:
            topo = local_topology()
        except RtxError as exc:   # e.g. an RTXNET_HOST too long to be an identity
            print(f"rtxnet topology: {exc}", file=sys.stderr)
            return 2
        return _print(json.dumps(topo, indent=2) if args.json else render_topology(topo))
    if args.cmd == "status":
        defaulted = args.coordinator is None and not os.environ.get("RTXNET_COORDINATOR")
        if args.coordinator is None:
            args.coordinator = os.environ.get("RTXNET_COORDINATOR") or _DEFAULT_COORDINATOR
        try:
            status = asyncio.run(_status_unless_refused(args.coordinator, args.timeout))
        except _NobodyListens as exc:
            hint = ("; the coordinator an rtxnet-run starts listens on a free port, which it prints "
                    "in its line '[rtxnet-run] coordinator tcp://...': pass that with --coordinator"
                    if defaulted else "")
            print(f"rtxnet status: no answer from {args.coordinator} ({exc}){hint}", file=sys.stderr)
            return 1
        except ConnectError as exc:
            print(f"rtxnet status: {exc}", file=sys.stderr)
            return 2
        except RtxError as exc:
            why = nobody_there(args.coordinator) if isinstance(exc, RtxTimeoutError) else None
            print(f"rtxnet status: {exc}{f' ({why})' if why else ''}", file=sys.stderr)
            return 1
        try:
            if args.json:
                fin = [{"job": j, "state": "finished", "committed_step": s, "members": []}
                       for j, s in status["finished"].items()]
                text = json.dumps(_jsonable(status["jobs"] + (status.get("launching") or []) + fin),
                                  indent=2)
            else:
                text = _render(status)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            # a reply of another shape (another version's coordinator, or not rtxnet's): one
            # line, not a traceback (a tester's find: KeyError: 'jobs')
            print(f"rtxnet status: the answer of {args.coordinator} is not a status this rtxnet "
                  f"can read ({type(exc).__name__}: {str(exc)[:200]}); is it an rtxnet "
                  f"coordinator of the same version?", file=sys.stderr)
            return 1
        return _print(text)
    return 2  # pragma: no cover


def _print(text: str) -> int:
    try:
        print(text, flush=True)
    except BrokenPipeError:  # `rtxnet status | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
