"""One planning rule per policy: what the worker reserves is what the controller plans (pure, no Ray or torch)."""

import pytest

from workers.scheduling.policies import POLICIES, SERVING_POLICY_NAMES, make_policy
from workers.values.sampling_params import SamplingParams
from workers.values.sequence import Sequence


def plan(name: str, *args, **kwargs) -> int:
    return make_policy(name, max_model_len=1000).planned_tokens(*args, **kwargs)


def test_each_policy_plans_its_own_rule():
    # prompt 30, nothing generated, max_tokens 200, predicted bound 40
    assert plan("max_reserve", 30, 0, 200, 40) == 230
    assert plan("s3", 30, 0, 200, 40) == 70
    assert plan("s3_peak", 30, 0, 200, 40) == 70
    assert plan("paged_greedy", 30, 0, 200, 40) == 30  # plans nothing ahead
    assert plan("oracle", 30, 0, 200, 40, forced_output_tokens=55) == 85
    assert plan("sglang_ratio", 30, 0, 200, 40) == 30 + 140  # remaining max_tokens x the starting ratio 0.7


def test_s3_clamps_the_bound_and_moves_past_it_to_the_next_bucket():
    assert plan("s3", 30, 0, 200, 500) == 230  # capped by max_tokens
    assert plan("s3_peak", 30, 0, 200, None) == 230  # no prediction: the worst case
    # 90 generated past a bound of 40: next bucket edge (buckets of 100 for max_model_len 1000), at least double
    assert plan("s3", 30, 90, 200, 40) == 30 + 100
    assert plan("paged_greedy", 30, 10, 200, 40) == 40


@pytest.mark.parametrize("name", SERVING_POLICY_NAMES)
@pytest.mark.parametrize("num_output", [0, 7, 60, 150])
def test_the_worker_reserves_what_the_controller_plans(name, num_output):
    policy = make_policy(name, max_model_len=1000)
    seq = Sequence("r", list(range(1, 31)), SamplingParams(max_tokens=200), predicted_output_tokens=45,
                   output_token_ids=list(range(num_output)))
    controller_plan = policy.planned_tokens(30, num_output, 200, 45)
    if policy.holds_plan:
        assert policy.reservation_tokens(seq) == controller_plan
    else:
        assert policy.reservation_tokens(seq) == seq.num_tokens <= controller_plan  # blocks on demand
    assert policy.planned_tokens_of(seq) == controller_plan


def test_the_registry_is_the_only_list_of_names():
    assert set(POLICIES) == {"max_reserve", "paged_greedy", "s3", "s3_peak", "sglang_ratio", "oracle"}
    assert "oracle" in POLICIES and "oracle" not in SERVING_POLICY_NAMES  # needs the true length
    assert make_policy("s3", max_model_len=2048).bucket_tokens == 204
    assert make_policy("s3", max_model_len=2048, bucket_tokens=7).bucket_tokens == 7


@pytest.mark.parametrize("args, match", [
    (("nope", 3, 0, 4, None), "unknown policy 'nope'; choose one of max_reserve, paged_greedy"),
    (("s3", 0, 0, 4, None), "num_prompt_tokens and max_tokens must be >= 1, got 0 and 4"),
    (("s3", 3, 0, 0, None), "got 3 and 0"),
    (("s3", 3, 10, 10, 5), r"num_output_tokens must be in \[0, max_tokens=10\)"),
    (("oracle", 3, 0, 10, 5), "needs forced_output_tokens"),
])
def test_bad_input_is_a_clear_error(args, match):
    with pytest.raises(ValueError, match=match):
        plan(*args)
