"""Every layout dimension with every feature (issue 64, item 3): docs/layouts.md's table of
combinations is what the rules say (tests/combinations.py), and each pair passes
meshrun-verify or is refused by a rule the table lists, with its reason. Every pair with -m
slow; in CI the table and a few pairs of what the last issues made run together."""

from __future__ import annotations

import pytest

from meshrun.tools import verify
from meshrun.validate import experts, layout
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


# The table's refusals whose cause is torch's: each pair run with its rule lifted still fails
# with the error the rule cites, so that the rule goes once torch lifts the limitation.
TORCH_LIMITS = {
    ("pp interleaved_zb", "checkpointing selective"): (
        layout,
        "_check_split_backward",
        "Trying to backward an extra time",
    ),
    ("pp interleaved_zb", "compile"): (
        layout,
        "_check_split_backward",
        "compiled with non-empty donated buffers which requires",
    ),
    ("ep", "checkpointing selective"): (
        experts,
        "_check_split_experts_checkpointing",
        "encountered during backward but not found in storage",
    ),
}
AXES = {axis.name: axis for axis in (*DIMENSIONS, *FEATURES)}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("pair", TORCH_LIMITS, ids=" x ".join)
def test_a_refusal_for_torchs_limitation_still_meets_it_with_the_rule_lifted(
    tmp_path, monkeypatch, capsys, rank_pool, pair
):
    module, rule, error = TORCH_LIMITS[pair]
    dim, feature = (AXES[name] for name in pair)
    assert rules_verdict(dim, feature) is not None, "the rule is gone: drop it here too"
    monkeypatch.setattr(module, rule, lambda *args: None)
    monkeypatch.setattr(verify, "launch", rank_pool.launch)
    _, overrides = configured(dim, feature)
    assert verify_run(tmp_path, *overrides) != 0
    # the ranks' records hold torch's whole traceback (its error chained below the schedule's)
    records = [path.read_text() for path in tmp_path.glob("**/failures/rank*.json")]
    assert any(error in said for said in (capsys.readouterr().out, *records))
