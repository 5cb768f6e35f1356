"""The hidden branch budget: measured at build time, stored in the manifest, read back on
the engine info, turned into decoding options; old manifests without it still load."""
import json
import shutil
from dataclasses import replace

import pytest
import torch
from checkpoints import build_small_engines

from saguaro.runtime.control.calibration import Calibration, machine_name
from saguaro.runtime.control.costs import CostCurve, hidden_branches
from saguaro.runtime.core.contracts import causal_mask
from saguaro.runtime.core.options import DEFAULT_FANOUT, DecodeOptions, hidden_branch_options
from saguaro.runtime.engines import load_engine_pair
from saguaro.runtime.engines.manifest import MANIFEST_FILE


def calibration(verify_ms, tree_step_ms, glue_ms=1.0):
    """Figures in ms, as a calibration: the verify by K (K + 1 tokens), the draft by rows."""
    return Calibration.from_milliseconds(64, verify_ms, glue_ms, tree_step_ms)


def test_hidden_budget_is_the_largest_b_whose_prespeculation_fits_under_the_verify():
    # K=2: glue 1 + 2 * tree(B) against verify 10 -> tree(B) <= 4.5 fits
    record = calibration({1: 4.0, 2: 10.0}, {2: 3.0, 3: 4.5, 4: 4.6})
    assert record.hidden_branches(2, most=4) == 3
    assert record.hidden_branches(1, most=4) == 2          # K=1: 1 + 3.0 <= 4.0 < 1 + 4.5
    assert record.hidden_by_k(2, most=4) == (0, 2, 3)
    assert calibration({1: 100.0}, {2: 3.0, 3: 4.5, 4: 4.6}).hidden_branches(1, most=4) == 4  # at most `most`


def test_a_budget_that_does_not_fit_stops_the_count_even_if_a_larger_one_timed_faster():
    record = calibration({1: 5.0}, {1: 1.0, 2: 9.0, 3: 1.0})
    assert record.hidden_branches(1, most=3) == 1
    assert calibration({1: 1.0}, {1: 1.0}).hidden_branches(1) == 0  # not even one branch hides


def test_the_policy_and_the_build_apply_one_rule():
    """The load policy's branch cap at batch 1 and the build's hidden budget come from the
    same function on the same curves (the policy's tree curve folds the glue into a step)."""
    step = CostCurve({1: 0.001, 4: 0.0012, 16: 0.003})
    assert hidden_branches(0.010, step, steps=5) == max(b for b in range(1, 64) if 5 * step(b) <= 0.010)
    assert hidden_branches(0.010, step, steps=5, requests=2) == max(b for b in range(1, 64) if 5 * step(2 * b) <= 0.010)
    assert hidden_branches(0.0001, step, steps=1) == 0


def test_calibration_round_trips_through_the_manifest_form():
    record = replace(calibration({1: 4.0, 2: 10.0}, {1: 2.0, 2: 3.0}), alone={2: 0.003}, machine="m")
    stored = json.loads(json.dumps(record.to_manifest(max_k=2, most=2)))
    assert Calibration.from_manifest(stored) == record
    assert stored["hidden_branches"] == [0, 2, 2]  # K=1: 1 + 3.0 <= 4.0; K=2: 1 + 2 x 3.0 <= 10


def test_a_calibration_stored_by_older_builds_reads_as_the_points_it_measured():
    old = {"context": 64, "verify_ms": {"1": 4.0, "2": 10.0}, "glue_ms": 1.0, "tree_step_ms": {"1": 2.0, "2": 3.0},
           "machine": "m", "date": "2026-11-01", "hidden_branches": [0, 2, 2]}
    read = Calibration.from_manifest(old)
    assert read.verify == {2: 0.004, 3: 0.010} and read.draft == {1: 0.001, 2: 0.003}
    assert not read.measured_here  # no alone curve: a policy measures its own


@pytest.mark.parametrize("hidden, k, expected", [
    (None, 4, {"fanout": DEFAULT_FANOUT, "budget": None}),
    (15, 4, {"fanout": (3,), "budget": None}),
    (16, 4, {"fanout": (3,), "budget": None}),
    (3, 4, {"fanout": DEFAULT_FANOUT, "budget": 3}),
    (0, 4, {"fanout": (0,), "budget": None}),
])
def test_hidden_branches_become_decoding_options_that_never_exceed_them(hidden, k, expected):
    fields = hidden_branch_options(hidden, k)
    assert fields == expected
    options = DecodeOptions(num_draft_tokens=k, **fields)
    if hidden is not None:
        assert options.fanout_policy().max_branches <= hidden or not options.prespeculating


def test_causal_mask_lets_each_new_token_see_the_past_and_the_new_tokens_before_it():
    for past, count in [(0, 1), (0, 5), (3, 4), (128, 2)]:
        expected = torch.ones(count, past + count, dtype=torch.bool).tril(diagonal=past)
        assert torch.equal(causal_mask(past, count), expected)


@pytest.fixture(scope="module")
def built(tiny_pair, tmp_path_factory):
    return build_small_engines(tiny_pair, tmp_path_factory.mktemp("calibrated") / "engines", "calibration-test",
                               max_draft_tokens=3, max_branches=4)


def test_the_build_stores_a_calibration_and_the_engine_info_carries_it(built):
    record = json.loads((built / MANIFEST_FILE).read_text())["calibration"]
    calibration = Calibration.from_manifest(record)
    for curve in (calibration.verify, calibration.alone, calibration.draft):
        assert {1, 2, 4, 8} <= set(curve) and all(seconds > 0 for seconds in curve.values())
    assert calibration.measured_here and calibration.machine == machine_name()
    assert record["hidden_branches"] == list(calibration.hidden_by_k(3, most=4))
    target, draft = load_engine_pair(built)
    for engine in (target, draft):
        assert engine.info.calibration == calibration
        assert engine.info.hidden_budget(3) == record["hidden_branches"][3] <= 4
        assert engine.info.hidden_budget(4) is None  # beyond the engines' K


def test_engines_built_before_calibration_existed_still_load(built, tmp_path):
    old = shutil.copytree(built, tmp_path / "old")
    manifest = json.loads((old / MANIFEST_FILE).read_text())
    del manifest["calibration"]
    (old / MANIFEST_FILE).write_text(json.dumps(manifest))
    target, _ = load_engine_pair(old)
    assert target.info.calibration is None and target.info.hidden_budget(2) is None
