"""The suite kills every planted bug of `mutation_check.py` (slow: `pytest -m mutation`);
that every bug still applies to the code is checked in the default run."""
import mutation_check
import pytest


@pytest.mark.parametrize("mutation", mutation_check.MUTATIONS, ids=lambda m: m.name)
def test_every_planted_bug_still_applies_to_the_code_it_names(mutation):
    """Code moved or reworded under a mutation would leave the mutation check planting
    nothing: each one's original text is found exactly once in its file."""
    assert (mutation_check.REPO / mutation.file).read_text().count(mutation.old) == 1, mutation.name


@pytest.mark.mutation
@pytest.mark.parametrize("mutation", mutation_check.MUTATIONS, ids=lambda m: m.name)
def test_the_suite_fails_on_a_planted_bug(mutation):
    (_, killer, _), = mutation_check.check([mutation])
    assert killer, f"no test fails when {mutation.what}"
