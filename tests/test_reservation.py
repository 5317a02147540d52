"""Cluster-level reservations per policy (pure)."""

import pytest

from cluster.reservation import reservation_tokens


def test_max_reserve_holds_the_worst_case():
    assert reservation_tokens("max_reserve", 30, 200, predicted_output_tokens=40) == 230


def test_s3_holds_the_predicted_bound_capped_by_max_tokens():
    assert reservation_tokens("s3", 30, 200, predicted_output_tokens=40) == 70
    assert reservation_tokens("s3", 30, 200, predicted_output_tokens=500) == 230
    assert reservation_tokens("s3_peak", 30, 200, predicted_output_tokens=None) == 230


def test_resumed_request_reserves_past_what_it_already_produced():
    assert reservation_tokens("s3", 30, 200, predicted_output_tokens=40, num_resumed_tokens=90) == 30 + 91
    assert reservation_tokens("paged_greedy", 30, 200, predicted_output_tokens=40, num_resumed_tokens=10) == 41


def test_paged_greedy_reserves_only_the_prompt_and_next_token():
    assert reservation_tokens("paged_greedy", 30, 200, predicted_output_tokens=40) == 31


@pytest.mark.parametrize("args, match", [
    (("nope", 3, 4, None), "unknown policy"),
    (("s3", 0, 4, None), "num_prompt_tokens"),
    (("s3", 3, 0, None), "max_tokens"),
])
def test_bad_input_is_a_clear_error(args, match):
    with pytest.raises(ValueError, match=match):
        reservation_tokens(*args)


def test_resumed_past_max_tokens_is_an_error():
    with pytest.raises(ValueError, match="num_resumed_tokens"):
        reservation_tokens("s3", 3, 10, 5, num_resumed_tokens=10)
