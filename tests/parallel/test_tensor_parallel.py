"""rtxnet tensor parallelism against one process, with real rank processes under ``rtxnet-run``.

The 4-rank launch shared with ``test_pipeline.py`` (``mp_launch.py``, ``mp_worker.py``) runs every
scenario on the world (4-way tensor parallel) and on two 2-rank subgroups (2-way).
"""

from __future__ import annotations

import mp_launch
import pytest

pytestmark = pytest.mark.timeout(120)

TOL = 1e-5   # relative, float32
SIZES = ("w4", "w2")


@pytest.fixture(scope="module")
def tp(tmp_path_factory) -> list[dict]:
    return [r["tp"] for r in mp_launch.results(tmp_path_factory)]


def close(d: dict, *skip: str) -> None:
    for k, v in d.items():
        if k not in skip:
            assert v < TOL, (k, d)


@pytest.mark.parametrize("size", SIZES)
def test_column_then_row_mlp_matches_one_process(tp, size):
    W = 4 if size == "w4" else 2
    for r in tp:
        m = r[f"{size}/mlp"]
        assert m["types"] == ["ColumnParallelLinear", "RowParallelLinear"]
        assert m["shapes"] == [[8 // W, 6], [5, 8 // W]]       # really sharded
        close(m, "types", "shapes")                            # output, loss, every gradient


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("gather", [True, False])
def test_column_parallel_output_gathered_or_split(tp, size, gather):
    W = 4 if size == "w4" else 2
    for r in tp:
        c = r[f"{size}/column_gather_{gather}"]
        assert c["shape"] == [3, 4, 8 if gather else 8 // W]
        close(c, "shape")


@pytest.mark.parametrize("size", SIZES)
def test_row_parallel_taking_the_full_input(tp, size):
    for r in tp:
        close(r[f"{size}/row_full_input"])


@pytest.mark.parametrize("size", SIZES)
def test_layers_built_from_sizes_hold_slices_of_the_seeded_single_process_layer(tp, size):
    assert all(r[f"{size}/init_from_seed_equal"] for r in tp)


def test_bad_sizes_and_inputs_are_refused_naming_the_values(tp):
    for r in tp:
        e = r["w4/errors"]
        assert e["column_out_features"] == (
            "ConfigError: out_features(17) is not divisible by the tensor-parallel group size(4)")
        assert e["row_in_features"] == (
            "ConfigError: in_features(17) is not divisible by the tensor-parallel group size(4)")
        assert e["from_linear_not_linear"] == "ConfigError: from_linear takes a torch.nn.Linear, got ReLU"
        assert e["column_input_dim"] == (
            "ValueError: ColumnParallelLinear: input last dimension(7) != in_features(6)")
        assert e["row_input_dim"] == (
            "ValueError: RowParallelLinear: input last dimension(8) != in_features/W(2)")
        assert e["shard_mlp_name"].startswith("ConfigError: shard_mlp: down('nope') is not a submodule")
        assert r["w2/errors"]["column_out_features"].endswith("out_features(9) is not divisible "
                                                              "by the tensor-parallel group size(2)")
