"""The policy contract (docs/policies.md), checked for every registered policy and for the documentation's example.

- `can_admit` and `shorter_work_victim` are questions: they change neither the policy nor a sequence;
- the planning rule reads no admission state: its answers are the same after any hooks were called;
- no hook changes a sequence: the scheduler writes `bound_after_overrun`'s answer;
- the example policy, executed from docs/policies.md, runs through the real scheduler to the end.
"""

import copy
import dataclasses
import re
from pathlib import Path

import pytest

from policy_driver import BLOCK_SIZE, make_requests, simulate
from workers.scheduling.policies import POLICY_NAMES, make_policy, make_rule
from workers.scheduling.scheduling_policy import SchedulingPolicy
from workers.values.sequence import Sequence, SequenceStatus

DOCS = Path(__file__).resolve().parents[2] / "docs" / "policies.md"


def _example_policy_class() -> type[SchedulingPolicy]:
    """The ShortestFirstPolicy of docs/policies.md, executed from its one python block."""
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.S)
    assert len(blocks) == 1, "docs/policies.md should hold exactly one python block: the example policy"
    namespace: dict = {}
    exec(compile(blocks[0], str(DOCS), "exec"), namespace)
    return namespace["ShortestFirstPolicy"]


def _policies() -> list[tuple[str, object]]:
    return [*[(name, lambda name=name: make_policy(name, max_model_len=256)) for name in POLICY_NAMES],
            ("docs example", lambda: _example_policy_class()())]


POLICIES = _policies()
IDS = [name for name, _ in POLICIES]


def _with_progress(seqs: list[Sequence], decoded: list[int]) -> list[Sequence]:
    """Running sequences with `decoded` outputs each, all their tokens computed."""
    for seq, num in zip(seqs, decoded):
        seq.output_token_ids = [7] * num
        seq.num_computed_tokens = seq.num_tokens
        seq.status = SequenceStatus.RUNNING
    return seqs


def _state(seq: Sequence) -> dict:
    return {f.name: copy.deepcopy(getattr(seq, f.name)) for f in dataclasses.fields(seq)}


def _planning_answers(rule, seqs: list[Sequence]) -> list:
    answers = [rule.prediction_from(40, 300), rule.holds_plan, rule.admits_at_worker, rule.reads_prediction]
    for seq in seqs:
        args = (seq.num_prompt_tokens, seq.num_output_tokens, seq.params.max_tokens, seq.predicted_output_tokens,
                seq.params.forced_output_tokens)
        answers += [rule.planned_tokens(*args), rule.placement_tokens(*args), rule.planned_tokens_of(seq),
                    rule.reservation_tokens(seq), rule.growth_tokens(seq), rule.bound_after_overrun(seq)]
    return answers


def _drive_admission_hooks(policy: SchedulingPolicy, running: list[Sequence], waiting: list[Sequence]) -> None:
    """Every hook through which a worker's scheduler teaches its policy, many times over."""
    for step in range(40):
        policy.on_step(running if step % 7 else [])
        policy.on_refused(waiting[step % len(waiting)], running)
        if step % 3 == 0:
            policy.on_preempted(running[-1], running[:-1])


@pytest.mark.parametrize("make", [make for _, make in POLICIES], ids=IDS)
def test_can_admit_and_shorter_work_victim_change_neither_the_policy_nor_a_sequence(make):
    policy = make()
    running = _with_progress(make_requests(6, seed=1)[:4], decoded=[0, 5, 30, 90])
    waiting = make_requests(6, seed=2)
    _drive_admission_hooks(policy, running, waiting)  # in some learned state, not only a fresh one
    before = copy.deepcopy(vars(policy))
    sequences_before = [_state(s) for s in [*running, *waiting]]
    answers = set()
    for seq in waiting:
        for num_blocks in (1, 8, 64, 10_000):  # refusals and admissions alike
            answers.add(policy.can_admit(seq, running, num_blocks, BLOCK_SIZE, 64))
            policy.can_admit(seq, running[:1], num_blocks, BLOCK_SIZE, 64)  # a speculative question
        victim = policy.shorter_work_victim(seq, running)
        assert victim is None or victim in running
    assert answers <= {True, False}
    assert vars(policy) == before
    assert [_state(s) for s in [*running, *waiting]] == sequences_before


@pytest.mark.parametrize("make", [make for _, make in POLICIES], ids=IDS)
def test_the_planning_rule_answers_the_same_whatever_the_worker_learned(make):
    fresh, taught = make(), make()
    running = _with_progress(make_requests(6, seed=3)[:4], decoded=[0, 5, 30, 90])
    probes = [*running, *make_requests(6, seed=4)]
    expected = _planning_answers(fresh, probes)
    _drive_admission_hooks(taught, running, probes[4:])
    taught.admission_order(probes)
    taught.choose_victim(running[0], running)
    assert _planning_answers(taught, probes) == expected


@pytest.mark.parametrize("make", [make for _, make in POLICIES], ids=IDS)
def test_no_hook_changes_a_sequence(make):
    policy = make()
    # Running past their predictions: the overrun's new bound is an answer, not a write.
    running = _with_progress(make_requests(5, seed=5), decoded=[1, 60, 119, 150, 200])
    waiting = make_requests(4, seed=6)
    before = [_state(s) for s in [*running, *waiting]]
    _planning_answers(policy, [*running, *waiting])
    policy.admission_order(waiting)
    policy.choose_victim(running[1], running)
    _drive_admission_hooks(policy, running, waiting)
    assert [_state(s) for s in [*running, *waiting]] == before


def test_the_router_and_controller_get_the_rule_each_worker_plans_by():
    for name in POLICY_NAMES:
        rule, policy = make_rule(name, max_model_len=256), make_policy(name, max_model_len=256)
        probes = make_requests(6, seed=7)
        assert _planning_answers(rule, probes) == _planning_answers(policy, probes), name


def test_the_documented_example_runs_through_the_scheduler_and_learns_from_preemptions():
    policy = _example_policy_class()(relax_steps=10_000)  # keeps what it learned for the whole run
    # Predictions at half the true lengths: every sequence outruns its plan, doubles it, and some are preempted.
    seqs = make_requests(24, seed=8, prediction_error=-0.5)
    true_lengths = {s.seq_id: s.params.forced_output_tokens for s in seqs}
    scheduler, allocator, _, _ = simulate(policy, seqs, num_blocks=96)
    assert all(s.num_output_tokens == true_lengths[s.seq_id] for s in seqs)  # each ran to its own end
    assert allocator.num_free_blocks == allocator.num_blocks
    assert scheduler.stats.mispredictions  # the scheduler wrote the doubled bounds, and counted them
    assert scheduler.num_preemptions > 0 and policy.headroom_blocks == scheduler.num_preemptions
    assert [s.seq_id for s in policy.admission_order(seqs[:3])] == [
        s.seq_id for s in sorted(seqs[:3], key=policy.planned_tokens_of)]


def test_the_documented_example_keeps_free_blocks_after_preemptions_and_gives_them_back_when_calm():
    policy = _example_policy_class()(relax_steps=2)
    running = _with_progress(make_requests(2, seed=9), decoded=[3, 3])
    newcomer = make_requests(1, seed=10)[0]
    planned = sum(-(-policy.planned_tokens_of(s) // BLOCK_SIZE) for s in [*running, newcomer])
    assert policy.can_admit(newcomer, running, planned, BLOCK_SIZE, 64)
    policy.on_preempted(running[1], running[:1])
    assert not policy.can_admit(newcomer, running, planned, BLOCK_SIZE, 64)  # one block kept free now
    policy.on_step(running)
    policy.on_step(running)  # two calm steps: the block is given back
    assert policy.can_admit(newcomer, running, planned, BLOCK_SIZE, 64)
