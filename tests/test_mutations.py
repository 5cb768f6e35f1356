"""The suite kills every planted bug of `mutation_check.py` (slow: `pytest -m mutation`)."""
import mutation_check
import pytest

pytestmark = pytest.mark.mutation


@pytest.mark.parametrize("mutation", mutation_check.MUTATIONS, ids=lambda m: m.name)
def test_the_suite_fails_on_a_planted_bug(mutation):
    (_, killer, _), = mutation_check.check([mutation])
    assert killer, f"no test fails when {mutation.what}"
