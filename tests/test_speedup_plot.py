"""The speed-up plot's points and predicted curves from bench figures."""
import pytest

from saguaro.benchmarks.speedup_plot import Costs, committed_per_round, measured_points, pair_costs, predicted_speedup


def contexts(decode: float, verify: float) -> list[dict]:
    return [{"context": 128, "decode_ms": decode, "verify_ms": verify, "tree_step_ms": {}}]


def bench_figures() -> dict:
    return {"engine_costs": {"k": 4, "engines": [{"role": "target", "contexts": contexts(10.0, 12.0)},
                                                 {"role": "draft", "contexts": contexts(1.0, 1.5)}]},
            "modes": {"autoregressive": {"decode_tokens_per_s": 50.0, "accepted": 0.0, "drafted_tokens": 0},
                      "speculative K=4": {"decode_tokens_per_s": 75.0, "accepted": 30.0, "drafted_tokens": 40}}}


def test_points_are_acceptance_per_drafted_token_and_speed_over_autoregressive():
    (point,) = measured_points(bench_figures(), "pair")  # autoregressive verified no drafts: no point
    assert point.label == "pair: speculative K=4"
    assert point.acceptance == pytest.approx(0.75) and point.speedup == pytest.approx(1.5)


def test_the_curves_follow_the_round_cost_model():
    costs = pair_costs(bench_figures())
    assert costs == Costs(4, 10.0, 12.0, 1.0)
    assert committed_per_round(0.0, 4) == 1.0 and committed_per_round(1.0, 4) == 5.0
    assert committed_per_round(0.5, 2) == pytest.approx(1.75)
    # nothing accepted: a round costs a verify and K draft steps for one token
    assert predicted_speedup(0.0, costs, False) == pytest.approx(10.0 / (12.0 + 4.0))
    assert predicted_speedup(1.0, costs, True) == pytest.approx(5 * 10.0 / 12.0)
    assert predicted_speedup(0.6, costs, True) > predicted_speedup(0.6, costs, False)
