"""Every benchmark the README documents runs end to end at a tiny size and writes its JSON.

Timings are not checked (tests check behaviour); a benchmark that crashes or stops writing its
rows is (tools/bench/control.py crashed for a fresh user after the coordinator began refusing
joins with other bounds, and no test noticed). multihost.py needs root and network namespaces
(skipped, with the reason, elsewhere).
"""

from __future__ import annotations

import json
import subprocess
import sys

import procs
import pytest

ROOT = procs.ROOT
pytestmark = pytest.mark.timeout(120)

BENCHES = {
    "control": (["--trials", "1", "--worlds", "2", "--journal-records", "200"],
                lambda d: {r["bench"] for r in d} == {"form", "detect", "journal"}),
    "collectives": (["--ranks", "2", "--sizes", "1KiB", "1MiB", "--ops", "all_reduce", "all_gather",
                     "reduce_scatter", "broadcast", "--compare", "gloo"],
                    lambda d: {(r["impl"], r["op"]) for r in d} == {
                        (i, o) for i in ("rtxnet", "gloo")
                        for o in ("all_reduce", "all_gather", "reduce_scatter", "broadcast")}),
    "ddp": (["--worlds", "2", "--steps", "5", "--width", "64", "--depth", "2", "--repeat", "1"],
            lambda d: {r["impl"] for r in d} == {"rtxnet", "torch"}),
    "journal_bench": (["--records", "500"], lambda d: len(d) == 2 and all(r["records"] == 500 for r in d)),
    "recovery": (["--trials", "1", "--kinds", "SIGKILL"],
                 lambda d: d["rows"] and d["summary"] and "not measured" in d["anchor"]["source"]),
    "fsdp": (["--worlds", "2", "--width", "64", "--depth", "2"], lambda d: d["rows"]),
    "startup": (["--trials", "1", "--nproc", "3", "--steps", "20"],
                lambda d: [r["preload"] for r in d] == ["none", "auto"] and all(r["resumed_s"] > 0 for r in d)),
    "snapshot": (["--mb", "8", "--repeat", "1"],
                 lambda d: {(r["mb"], r["op"]) for r in d} == {(8, o) for o in ("pack", "unpack", "memcpy", "tobytes", "pack_into", "memcpy_into")}),
}


@pytest.mark.parametrize("name", sorted(BENCHES))
def test_benchmark_runs_and_writes_its_json(name, tmp_path):
    args, check = BENCHES[name]
    out = tmp_path / "new" / f"{name}.json"   # a folder that does not exist yet: made at the end
    proc = subprocess.run([sys.executable, f"tools/bench/{name}.py", *args, "--json", str(out)],
                          capture_output=True, text=True, timeout=110, cwd=ROOT, env=procs.env())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert check(json.loads(out.read_text())), out.read_text()[:2000]


@pytest.mark.timeout(60)
def test_collectives_table_keeps_wide_values_apart(capsys):
    # Before: fixed widths ran a 4-digit algbw into its neighbour ("41.3us1626.211").
    import importlib.util

    spec = importlib.util.spec_from_file_location("collectives", ROOT / "tools" / "bench" / "collectives.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.print_table([{"impl": "rtxnet", "op": "all_reduce", "ranks": 1, "nbytes": 64 << 20, "time_s": 41.3e-6,
                      "algbw_gbps": 1626.211, "busbw_gbps": 123456.0}])
    head, rule, row = capsys.readouterr().out.splitlines()
    assert row.split() == ["all_reduce", "1", "64MiB", "|", "41.3us", "1626.211", "123456.000"], row
    assert len(head) == len(rule) == len(row) and row.endswith(" 123456.000")


@pytest.mark.timeout(60)
def test_multihost_table_names_sizes_under_a_mib_and_between_units(capsys):
    # Before: the size column was nbytes >> 20 MiB, so 1 KiB read "0MiB" and 1.5 MiB "1MiB".
    import importlib.util

    spec = importlib.util.spec_from_file_location("multihost", ROOT / "tools" / "bench" / "multihost.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    row = {"algorithm": "ring", "ran": "ring", "time_s": 1e-3, "algbw_gbps": 1.0, "busbw_gbps": 1.5,
           "bound_s": 1e-3, "frac_of_bound": 1.0, "ok": True}
    mod.print_table([{**row, "nbytes": n} for n in (1 << 10, 3 << 19, 64 << 20, 1000)])
    sizes = [line.split()[2] for line in capsys.readouterr().out.splitlines()[1:]]
    assert sizes == ["1KiB", "1536KiB", "64MiB", "1000B"], sizes


def test_collectives_bench_refuses_an_algorithm_an_op_does_not_have(tmp_path):
    proc = subprocess.run([sys.executable, "tools/bench/collectives.py", "--algorithm", "recursive_doubling",
                           "--ops", "all_gather"], capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env=procs.env())
    assert proc.returncode == 2
    assert "--algorithm 'recursive_doubling' does not apply to all_gather (all_gather: direct, ring, shm)" \
        in proc.stderr, proc.stderr


@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "reduce_scatter"])
def test_multihost_bench_runs_on_two_namespace_hosts(op, tmp_path):
    out = tmp_path / "mh.json"
    proc = subprocess.run([sys.executable, "tools/bench/multihost.py", "--op", op, "--sizes", "1MiB",
                           "--iters", "1", "--timeout", "80", "--json", str(out)],
                          capture_output=True, text=True, timeout=110, cwd=ROOT, env=procs.env())
    if proc.returncode == 2 and proc.stderr.startswith("multihost: "):
        pytest.skip(proc.stderr.strip())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["op"] == op and all(r["ok"] for r in res["rows"]), res
    algorithms = ["ring", "hierarchical"] if op == "all_reduce" else ["direct", "ring", "hierarchical"]
    assert [r["algorithm"] for r in res["rows"]] == algorithms + ["default"], res
    assert res["rows"][-1]["ran"] == "hierarchical", res   # 1 MiB on 2 x 2 ranks


@pytest.mark.parametrize(("args", "says"), [
    # a tester's finds: each was a traceback (or, --repeat, a run without end)
    (["checkpoint_io.py", "--dir", "/proc"], "argument --dir: '/proc': cannot write a file there"),
    (["journal_bench.py", "--dir", "/proc"], "argument --dir: '/proc': cannot write a file there"),
    (["snapshot.py", "--mb", "65536"], "--mb 65536 needs about 320.0 GiB of memory; this machine has "),
    (["checkpoint_io.py", "--mb", "65536"], "--mb 65536 needs about 128.0 GiB of memory; this machine has "),
    (["multihost.py", "--rate", "bogus"], "argument --rate: 'bogus' is not a rate tc takes"),
    (["multihost.py", "--rate", "0"], "argument --rate: '0' is not a rate tc takes"),
    (["multihost.py", "--sizes", "0B"], "argument --sizes: 0 B is not a positive multiple of 4 B"),
    (["multihost.py", "--op", "all_gather", "--sizes", "1000B"],
     "argument --sizes: 1000 B is not a positive multiple of 16 B (4 ranks' parts"),
    (["multihost.py", "--dtype", "float16", "--sizes", "3B"], "3 B is not a positive multiple of 2 B"),
    (["collectives.py", "--repeat", "99999999999"], "argument --repeat: must be in 1..1000, got 99999999999"),
    (["collectives.py", "--sizes", "-1KiB"], "bad value '-1KiB': sizes are positive"),
    (["collectives.py", "--ranks", "-2"], "argument --ranks: must be in 1..64, got -2"),
])
def test_benchmarks_refuse_what_they_cannot_run_in_one_line(args, says):
    proc = subprocess.run([sys.executable, f"tools/bench/{args[0]}", *args[1:]], capture_output=True, text=True,
                          timeout=60, cwd=ROOT, env=procs.env())
    assert proc.returncode == 2 and says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
