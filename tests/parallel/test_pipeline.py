"""rtxnet pipeline parallelism (GPipe, 1F1B) against one process, with real rank processes.

The 4-rank launch shared with ``test_tensor_parallel.py`` (``mp_launch.py``, ``mp_worker.py``)
runs every schedule with 4 stages on the world and 2 stages on two 2-rank subgroups, then the
failure cases; it ends with rank 3 dying while rank 2 waits for it.
"""

from __future__ import annotations

import re

import mp_launch
import pytest

pytestmark = pytest.mark.timeout(120)

TOL = 1e-5   # relative, float32
CASES = [(4, M) for M in (1, 3, 4, 8)] + [(2, M) for M in (1, 3, 4)]


@pytest.fixture(scope="module")
def pp(tmp_path_factory) -> list[dict]:
    return [r["pp"] for r in mp_launch.results(tmp_path_factory)]


def stage_of(rank: int, S: int) -> int:
    return rank if S == 4 else rank % 2


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("S,M", CASES)
def test_schedule_matches_one_process(pp, schedule, S, M):
    for rank, r in enumerate(pp):
        c = r[f"S{S}/{schedule}/M{M}"]
        s = stage_of(rank, S)
        assert c["n_grads"] == 2 * (4 // S) + (s == S - 1) * 2   # every parameter compared
        assert c["grad"] < TOL, c
        assert c["loss"] < TOL, c          # 0.0 on stages that hold no loss (and return None)
        assert c["out"] < TOL, c


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("S", [4, 2])
def test_a_second_step_after_an_optimizer_update_matches_one_process(pp, schedule, S):
    for r in pp:
        c = r[f"S{S}/{schedule}/train"]
        assert c["param"] < TOL and c["grad"] < TOL and c["loss"] < TOL, c


@pytest.mark.parametrize("S,M", CASES)
def test_gpipe_holds_every_micro_batch_and_1f1b_at_most_the_stages_ahead(pp, S, M):
    for rank, r in enumerate(pp):
        s = stage_of(rank, S)
        g, o = r[f"S{S}/gpipe/M{M}"], r[f"S{S}/1f1b/M{M}"]
        assert g["peak"] == M
        assert o["peak"] == min(S - s, M)
        assert g["trace"] == " ".join([f"F{m}" for m in range(M)] + [f"B{m}" for m in range(M)])


def test_1f1b_order_on_each_stage(pp):
    traces = [r["S4/1f1b/M8"]["trace"] for r in pp]
    assert traces[3] == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7"
    assert traces[1] == "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7"
    assert traces[0] == "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7"


def test_bad_arguments_are_refused_naming_the_values(pp):
    for r in pp:
        e = r["errors"]
        assert e["num_stages"].startswith("ConfigError: num_stages(3) != pipeline group size(4)")
        assert e["micro_zero"].startswith("ConfigError: n_microbatches(0) must be an int in 1..")
        assert e["micro_float"].startswith("ConfigError: n_microbatches(2.0) must be an int")
    assert pp[0]["errors"]["batch"] == "ConfigError: input batch(10) is not divisible by n_microbatches(4)"
    assert pp[0]["errors"]["no_input"] == "ConfigError: stage 0 needs the input tensor, got NoneType"
    assert pp[3]["errors"]["target"] == "ConfigError: target batch(10) is not divisible by n_microbatches(4)"


def test_a_target_of_another_batch_size_than_the_input_is_refused_on_every_stage(pp):
    # before: the loss broadcast [3, C] outputs against [1, C] targets, the step "succeeded"
    # with a wrong loss and gradients (a breaker's find)
    assert pp[3]["abort_target_rows"]["error"] == (
        "ConfigError: target has 4 rows, the input 12: the last stage's target must be [B, ...] "
        "with the first stage's batch size B, or have as many rows as its output's leading "
        "dimensions flattened"), pp[3]["abort_target_rows"]
    for r in pp[:3]:
        assert r["abort_target_rows"]["error"].startswith("ConfigError: "), r["abort_target_rows"]
    assert all(r["abort_target_rows"]["seconds"] < 10 for r in pp), [r["abort_target_rows"] for r in pp]


def test_a_silent_peer_times_out_within_the_deadline(pp):
    for rank, r in enumerate(pp):
        t = r["timeout"]
        assert t["error"] == "CollectiveTimeout", t
        assert t["ranks"] == [rank ^ 1], t        # the other rank of the pair
        assert 0.4 < t["seconds"] < 5, t


def test_a_lost_stage_raises_peer_lost_instead_of_hanging(pp):
    lost = pp[2]["peer_lost"]
    assert lost["error"] == "PeerLostError", lost
    assert lost["ranks"] == [3], lost
    assert lost["seconds"] < 10, lost


def test_stage_0_refusing_its_input_fails_every_stage_at_once_naming_it(pp):
    # Before: stages 1..3 waited out their 20 s deadline and said "recv ... timed out".
    assert pp[0]["abort"]["error"] == "ConfigError: input batch(10) is not divisible by n_microbatches(4)"
    for s, r in enumerate(pp[1:], start=1):
        assert r["abort"]["error"] == ("ConfigError: stage 0 refused the input of this step (its "
                                       f"ConfigError names the value); stage {s} did not run it"), r["abort"]
    assert all(r["abort"]["seconds"] < 10 for r in pp), [r["abort"] for r in pp]


def test_the_last_stage_refusing_its_target_fails_every_stage_at_once(pp):
    # Before: stages 0..2 waited out their 20 s deadline for a gradient.
    assert pp[3]["abort_target"]["error"] == "ConfigError: target batch(10) is not divisible by n_microbatches(4)"
    for s, r in enumerate(pp[:3]):
        assert r["abort_target"]["error"] == (
            f"ConfigError: a later stage (after stage {s}) failed this step (its own error says why); "
            f"stage {s} did not finish it"), r["abort_target"]
    assert all(r["abort_target"]["seconds"] < 10 for r in pp), [r["abort_target"] for r in pp]


def test_a_step_under_no_grad_or_with_a_per_element_loss_is_refused_naming_why(pp):
    for r in pp:
        assert r["abort_no_grad"].startswith("ConfigError: ScheduleGPipe.step() trains (each "
                                             "micro-batch's forward and backward): it cannot run "
                                             "under torch.no_grad()"), r["abort_no_grad"]
    assert pp[3]["abort_loss_shape"] == ("ConfigError: loss_fn returned (3, 4); it must return one "
                                         "number per micro-batch (a scalar tensor: reduction='mean' "
                                         "or 'sum')"), pp[3]["abort_loss_shape"]
    assert pp[0]["abort_loss_shape"].startswith("ConfigError: a later stage"), pp[0]["abort_loss_shape"]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_stage_whose_module_raises_fails_every_stage_at_once_and_the_next_step_runs(pp, schedule):
    res = [r[f"abort_module/{schedule}"] for r in pp]
    assert res[1]["error"] == "RuntimeError: user bug on call 2", res
    assert res[0]["error"] == ("ConfigError: a later stage (after stage 0) failed this step (its own "
                               "error says why); stage 0 did not finish it"), res
    for s in (2, 3):
        assert res[s]["error"] == (f"ConfigError: stage 1 failed this step (its own error says why); "
                                   f"stage {s} did not finish it"), res
    assert all(r["seconds"] < 10 for r in res), res
    # the failed step's leftover messages are never taken for the next step's
    assert abs(res[3]["next_loss"] - res[3]["ref_loss"]) <= 1e-5 * abs(res[3]["ref_loss"]), res


def test_a_stage_interrupted_by_keyboard_interrupt_fails_every_stage_at_once_and_the_next_step_runs(pp):
    res = [r["abort_module_interrupt"] for r in pp]
    assert res[1]["error"] == "KeyboardInterrupt: ", res
    assert res[0]["error"].startswith("ConfigError: a later stage (after stage 0) failed this step"), res
    for s in (2, 3):
        assert res[s]["error"].startswith("ConfigError: stage 1 failed this step"), res
    assert all(r["seconds"] < 10 for r in res), res
    assert abs(res[3]["next_loss"] - res[3]["ref_loss"]) <= 1e-5 * abs(res[3]["ref_loss"]), res


def test_a_pipeline_on_the_same_group_works_again_after_a_replacement_joins(tmp_path):
    # the tags' step numbers count per group object and epoch: the survivors' count went on
    # after the failure while the replacement started at 0, so every step after it timed out
    import subprocess
    import sys

    import procs

    proc = subprocess.run([sys.executable, "-m", "rtxnet.launcher", "--nproc", "3", "--max-restarts", "1",
                           str(mp_launch.ROOT / "tests/parallel/pp_rejoin_worker.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=100, env=procs.env(), cwd=mp_launch.ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    import json

    res = json.loads((tmp_path / "loss.json").read_text())
    assert abs(res["pipeline"] - res["one_process"]) <= 1e-5 * abs(res["one_process"]), res


def test_a_stage_built_before_the_ranks_were_renumbered_fails_the_step_at_once_on_every_rank(tmp_path):
    # After a loss and a replacement the world has 3 ranks again, but the survivors' stages 1
    # and 2 run on ranks 0 and 1. Before, only the size was checked: stage 1 on rank 0 sent to
    # itself ("pipeline_abort_not_sent ... send to self"), and 20 s later every rank raised
    # ValueError("recv from self") or a timeout, which FaultTolerance does not retry.
    import json
    import subprocess
    import sys

    import procs

    proc = subprocess.run([sys.executable, "-m", "rtxnet.launcher", "--nproc", "3", "--max-restarts", "1",
                           str(mp_launch.ROOT / "tests/parallel/pp_stale_worker.py"), str(tmp_path), "1f1b"],
                          capture_output=True, text=True, timeout=100, env=procs.env(), cwd=mp_launch.ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = {json.loads(p.read_text())["rank"]: json.loads(p.read_text())
           for p in tmp_path.glob("stale.*.json")}
    assert sorted(got) == [0, 1, 2], got
    # (the replacement joins once the survivors were renumbered 0, 1 (pp_stale_worker.py); the
    # world of 3 it joins may number them 0, 1 or 0, 2: either way a survivor's stage is stale)
    stale = {(g["stage"], r) for r, g in got.items() if g["stage"] != r}
    assert stale, got
    # a stale stage names itself; a stage fine itself names a stale one
    for r, g in got.items():
        m = re.match(r"pipeline stage (\d+) runs on rank (\d+) ", g.get("message") or "")
        assert m, g
        stage, rank = int(m[1]), int(m[2])
        assert (stage, rank) == (g["stage"], r) if g["stage"] != r else (stage, rank) in stale, (g, stale)
        assert g["error"] == "ConfigError", g
        assert g["message"].startswith(f"pipeline stage {stage} runs on rank {rank} of its group: it "
                                       f"was built before a membership change renumbered the ranks"), g
        assert "rebuild every PipelineStage" in g["message"], g
        assert g["attrs"] == [stage, rank], g
        assert g["seconds"] < 10, g            # at once, not at the 20 s deadline
    assert "send to self" not in proc.stderr
    # rebuilt as stage pg.rank, the same group goes on
    res = json.loads((tmp_path / "loss.json").read_text())
    assert abs(res["pipeline"] - res["one_process"]) <= 1e-5 * abs(res["one_process"]), res


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_stage_failing_in_its_backward_fails_the_step_on_every_stage_the_last_included(pp, schedule):
    # GPipe's last stage had returned its loss as if the step went well while stage 2 raised
    res = [r[f"abort_backward/{schedule}"] for r in pp]
    assert res[2]["error"] == "RuntimeError: user bug in backward", res
    assert res[3]["error"].startswith("ConfigError: stage 2 failed this step (its own error says why); stage 3 "), res
    for s in (0, 1):
        assert res[s]["error"].startswith(f"ConfigError: a later stage (after stage {s}) failed this step"), res
    assert all(r["seconds"] < 10 for r in res), res


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_an_empty_batch_is_refused_naming_it_and_the_next_step_runs(pp, schedule):
    # Before: stage 0 raised a bare "IndexError: list index out of range" (B = 0 is divisible by
    # any M, and split into no micro-batches), the others "stage 0 failed this step".
    res = [r[f"empty/{schedule}"] for r in pp]
    empty = "ConfigError: {} batch(0) is empty: a step needs at least one sample per micro-batch, " \
            "a multiple of n_microbatches(4)"
    assert res[0]["error"] == empty.format("input"), res
    assert res[3]["error"] == empty.format("target"), res
    for s in (1, 2):
        assert res[s]["error"] == ("ConfigError: stage 0 refused the input of this step (its "
                                   f"ConfigError names the value); stage {s} did not run it"), res
    assert all(r["seconds"] < 10 for r in res), res
    assert abs(res[3]["next_loss"] - res[3]["ref_loss"]) <= 1e-5 * abs(res[3]["ref_loss"]), res


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_stages_before_one_that_detaches_its_input_keep_no_gradient_as_in_one_process(pp, schedule):
    # Before: stage 2 sent back a gradient of zeros, so stages 0 and 1 got .grad == 0 where one
    # process leaves None (and momentum, Adam or weight decay moved those parameters).
    for s, r in enumerate(pp):
        c = r[f"detach/{schedule}"]
        assert c["ref_none"] == [s < 2] * len(c["ref_none"]), c
        assert c["none"] == c["ref_none"], (s, c)
        assert c["grad"] < TOL, (s, c)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_replicated_stage_some_of_whose_replicas_get_no_gradient_still_reduces_on_all(pp, schedule):
    # stage 1 of replica 0 detaches its input, replica 1's does not: every replica of stage 0
    # takes part in DDP's reduction (skipping the backward there, replica 1 would wait for
    # replica 0 until its deadline, while replica 0 returned), the gradient as in one process
    for r in pp:
        c = r[f"detach_dp/{schedule}"]
        assert c["error"] == "no error", c
        assert c["grad"] < TOL and c["seconds"] < 10, c


@pytest.mark.parametrize("case", ["kinds", "counts"])
def test_stages_running_different_schedules_fail_the_step_at_once_naming_them(pp, case):
    # Before: GPipe next to 1F1B deadlocked until every stage raised "CollectiveTimeout: recv from
    # rank 1 tag 8388610 timed out"; different micro-batch counts failed in the last stage's loss.
    res = [r[f"mixed/{case}"] for r in pp]
    which = ("stages 0, 2 ScheduleGPipe with n_microbatches(4); stages 1, 3 Schedule1F1B with "
             "n_microbatches(4)" if case == "kinds" else
             "stages 0, 1, 2 Schedule1F1B with n_microbatches(2); stage 3 Schedule1F1B with "
             "n_microbatches(4)")
    for r in res:
        assert r["error"] == (f"ConfigError: pipeline stages run different schedules: {which}; "
                              "every stage must run the same schedule with the same "
                              "n_microbatches (this step failed on every stage)"), res
    assert all(r["seconds"] < 10 for r in res), res
    assert abs(res[3]["next_loss"] - res[3]["ref_loss"]) <= 1e-5 * abs(res[3]["ref_loss"]), res


def _pp_ft_run(out, plan: str) -> list[dict]:
    import json
    import subprocess
    import sys

    import procs

    out.mkdir()
    proc = subprocess.run([sys.executable, "-m", "rtxnet.launcher", "--nproc", "3", "--faults", plan,
                           str(mp_launch.ROOT / "tests/parallel/pp_ft_worker.py"), str(out), "16"],
                          capture_output=True, text=True, timeout=100, env=procs.env(), cwd=mp_launch.ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((out / f"stage{r}.json").read_text()) for r in range(3)]


def test_a_message_lost_between_stages_redoes_the_step_on_every_stage(tmp_path):
    # A re-verifier's find: the stage whose activation was lost raised LinkBrokenError (which
    # FaultTolerance answers by redoing the step), but told its neighbours it had failed the
    # step, and they raised ConfigError, which ended the job (5 of 5). Such a failure is passed
    # on as one the step's retry answers (CollectiveError); the result is the fault-free one.
    ref = _pp_ft_run(tmp_path / "ref", "")
    got = _pp_ft_run(tmp_path / "lost", "lose-message:rank=1:step=6")
    assert [r["sha"] for r in got] == [r["sha"] for r in ref] and all(r["steps"] == 16 for r in got), got
    rec = [e for r in got for e in r["events"] if e["event"] == "recovered"]
    assert len(rec) == 3 and all(e["failed_step"] == 6 and e["steps_lost"] == 1 for e in rec), rec
    assert "LinkBrokenError" in {e["error"] for e in rec}, rec
