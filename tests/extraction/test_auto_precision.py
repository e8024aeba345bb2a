"""``--precision auto``'s rule (embedpipe/extraction/auto_precision.py ``pick``), on planted timings:
a near-tie goes to fp32, then to the fixed order; a clear win (at least the margin faster
than every passing policy before it) chooses the fast policy; a failing cosine is refused; the
median of the rounds is robust to one slow round; the reason says the rule. No wall clocks."""

from __future__ import annotations

import random

import pytest

from embedpipe.extraction import auto_precision
from embedpipe.extraction.auto_precision import MARGIN, describe, pick
from embedpipe.runtime.auto_cache import Timing

OK, BAD = 0.99999, 0.99  # a passing and a failing pooled cosine to fp32


def timings(**ms: float) -> dict[str, Timing]:
    return {name.replace("_", "-"): Timing(value, 1.0 if name == "fp32" else OK) for name, value in ms.items()}


def test_the_margin_is_ten_percent_and_the_order_starts_with_fp32() -> None:
    assert MARGIN == 0.10
    assert auto_precision.ORDER[0] == "fp32"
    assert set(auto_precision.CPU_CANDIDATES) <= set(auto_precision.ORDER)


@pytest.mark.parametrize(("ms", "want"), [
    (dict(fp32=100.0, bf16_mixed=95.0, int8_mixed=96.0), "fp32"),  # both within 10%: fp32
    (dict(fp32=100.0, int8_mixed=90.5), "fp32"),  # 9.5% faster: not enough
    (dict(fp32=100.0, int8_mixed=90.0), "int8-mixed"),  # exactly 10% faster: enough
    (dict(fp32=100.0, bf16_mixed=80.0, int8_mixed=78.0), "bf16-mixed"),  # int8 within 10% of bf16: bf16 first
    (dict(fp32=100.0, bf16_mixed=80.0, int8_mixed=70.0), "int8-mixed"),  # 12.5% faster than bf16 too
    (dict(fp32=100.0, bf16_mixed=95.0, int8_mixed=89.0), "fp32"),  # int8 within 10% of bf16, bf16 of fp32
    (dict(fp32=100.0, bf16_mixed=120.0, int8_mixed=85.0), "int8-mixed"),  # 15% faster than fp32, faster than bf16
    (dict(fp32=100.0, bf16_mixed=60.0, fp16_mixed=58.0), "bf16-mixed"),  # CUDA: bf16 before fp16 on a near-tie
    (dict(fp32=100.0, bf16_mixed=100.0, int8_mixed=100.0), "fp32"),  # an exact tie
])
def test_a_policy_other_than_fp32_is_chosen_only_with_a_clear_win(ms, want) -> None:
    assert pick(timings(**ms)) == want


def test_the_choice_does_not_depend_on_the_order_the_timings_are_given_in() -> None:
    given = timings(fp32=100.0, bf16_mixed=80.0, int8_mixed=78.0)
    assert pick(dict(reversed(list(given.items())))) == pick(given) == "bf16-mixed"


def test_a_policy_below_the_pass_cosine_is_refused_and_not_compared_against() -> None:
    planted = timings(fp32=100.0, bf16_mixed=50.0, int8_mixed=85.0)
    planted["bf16-mixed"] = Timing(50.0, BAD)
    assert pick(planted) == "int8-mixed"  # bf16 fails; int8 compared with fp32 only (15% faster)
    planted["int8-mixed"] = Timing(85.0, BAD)
    assert pick(planted) == "fp32"
    reason = describe(planted)
    assert "bf16-mixed 50.0 ms" in reason and "below the pass cosine 0.999: refused" in reason


def test_the_median_of_the_rounds_is_robust_to_one_slow_round() -> None:
    fp32 = Timing.from_rounds([100.0, 400.0, 101.0], 1.0)  # one round slowed by other work on the node
    int8 = Timing.from_rounds([97.0, 96.0, 98.0], OK)
    assert fp32.ms_per_1k_residues == 101.0 and int8.ms_per_1k_residues == 97.0
    assert pick({"fp32": fp32, "int8-mixed": int8}) == "fp32"  # a mean (200) would have chosen int8-mixed
    fast = Timing.from_rounds([60.0, 61.0, 300.0], OK)  # a clear win survives its own slow round
    assert pick({"fp32": fp32, "int8-mixed": fast}) == "int8-mixed"
    with pytest.raises(ValueError):
        Timing.from_rounds([], 1.0)


def test_three_measurements_with_jitter_agree_under_the_margin_rule() -> None:
    """Near-tied candidates (int8-mixed 3% faster than fp32) whose rounds jitter by up to 8%,
    three measurements: the smallest median flips between int8-mixed and fp32 (the old rule's
    choice), the margin rule keeps fp32 every time."""
    base = {"fp32": 100.0, "bf16-mixed": 104.0, "int8-mixed": 97.0}
    picks, smallest = [], []
    for seed in (3, 4, 5):
        rng = random.Random(seed)
        measured = {name: Timing.from_rounds([ms * rng.uniform(0.92, 1.08) for _ in range(auto_precision.ROUNDS)],
                                             1.0 if name == "fp32" else OK) for name, ms in base.items()}
        picks.append(pick(measured))
        smallest.append(min(measured, key=lambda n: measured[n].ms_per_1k_residues))
    assert len(set(smallest)) == 2  # the smallest time disagreed across the three
    assert picks == ["fp32"] * 3


def test_the_reason_states_the_rule() -> None:
    reason = describe(timings(fp32=100.0, bf16_mixed=98.0, int8_mixed=95.0))
    assert reason.endswith("fp32 chosen: int8-mixed was 5% faster, short of that margin (the median of 3 interleaved "
                           "rounds; a policy other than fp32 is chosen only when at least 10% faster than every "
                           "passing policy before it in the order fp32, bf16-mixed, int8-mixed)")
    assert describe(timings(fp32=100.0, int8_mixed=50.0)).endswith("int8-mixed chosen (the median of 3 interleaved "
                                                                   "rounds; a policy other than fp32 is chosen only "
                                                                   "when at least 10% faster than every passing policy "
                                                                   "before it in the order fp32, int8-mixed)")


def test_the_reason_names_the_policy_the_fastest_did_not_beat_by_the_margin() -> None:
    reason = describe(timings(fp32=100.0, bf16_mixed=95.0, int8_mixed=89.0))
    assert "fp32 chosen: int8-mixed was 11% faster than fp32 but 6% faster than bf16-mixed, short of that margin" \
        in reason


def test_a_named_policy_s_warning_follows_the_margin_rule() -> None:
    near = timings(fp32=100.0, int8_mixed=95.0)
    assert auto_precision.measured_note("fp32", near, "then") == ""  # auto would choose fp32 too
    note = auto_precision.measured_note("int8-mixed", near, "then")
    assert "fp32 ran 100.0 and int8-mixed was not at least 10% faster than it: --precision auto would choose it" in note
