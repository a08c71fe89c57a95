"""Every layout dimension with every feature (issue 64, item 3): docs/layouts.md's table of
combinations is what the rules say (tests/combinations.py), and each pair passes
meshrun-verify or is refused by a rule the table lists, with its reason. Every pair with -m
slow; in CI the table and a few pairs of what the last issues made run together."""

from __future__ import annotations

import pytest

from meshrun.tools import verify
from tests.combinations import DIMENSIONS, DOC, FEATURES, configured, in_doc, reason, table
from tests.combinations import verdict as rules_verdict
from tests.test_verify import report, verify_run

FAST = {("cp ring", "custom module")}  # MoE x TP x SP: test_expert_parallel.py's, in CI too
PAIRS = [
    pytest.param(
        dim,
        feature,
        id=f"{dim.name} x {feature.name}",
        marks=() if (dim.name, feature.name) in FAST else pytest.mark.slow,
    )
    for dim in DIMENSIONS
    for feature in FEATURES
]


def test_the_docs_table_of_combinations_is_what_the_rules_say():
    assert in_doc(DOC.read_text()) == table(), "the rules changed: python -m tests.combinations"


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("dim", "feature"), PAIRS)
def test_each_pair_verifies_or_is_refused_for_a_reason_the_table_lists(
    tmp_path, monkeypatch, rank_pool, launch_host, dim, feature
):
    refused = rules_verdict(dim, feature)
    if refused is not None:
        assert reason(refused) in in_doc(DOC.read_text())
        return
    _, overrides = configured(dim, feature)
    # torchft's replica groups run on the real launcher; the rest on the session's pool
    replicas = "parallel.fault_tolerance=torchft" in overrides
    monkeypatch.setattr(verify, "launch", (launch_host if replicas else rank_pool).launch)
    code = verify_run(tmp_path, *overrides)
    assert code == 0, report(tmp_path)
