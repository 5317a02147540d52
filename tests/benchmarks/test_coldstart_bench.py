"""The cold-start bench's plan, its scoring of promoted versions on unseen requests, and its table."""

from benchmarks.coldstart_bench import ColdStartConfig, _print, load_plan, score_versions
from predictor_service.artifacts import save_predictor
from predictor_service.sample_stream import TrainingSample
from predictor_service.training import make_predictor

POOL = "../shared/data/prompts/pool.jsonl"


def test_the_plan_sends_distinct_pool_prompts_as_greedy_chats_in_a_seeded_order():
    config = ColdStartConfig(num_requests=50, max_tokens=300, prompts_path=POOL)
    plan = load_plan(config, "http://127.0.0.1:1", "m")
    ids = [r.request_id for r in plan.requests]
    assert len(set(ids)) == 50 and plan.endpoint == "chat" and plan.concurrency == config.concurrency
    assert all(r.max_tokens == 300 and r.forced_output_tokens is None and r.messages for r in plan.requests)
    assert [r.request_id for r in load_plan(config, "http://127.0.0.1:1", "m").requests] == ids
    assert [r.request_id for r in load_plan(ColdStartConfig(num_requests=50, prompts_path=POOL, seed=1),
                                            "http://127.0.0.1:1", "m").requests] != ids


def _samples(count: int) -> list[TrainingSample]:
    # answers grow with the prompt: a prompt-length model ranks them, the max_tokens prior cannot (one max_tokens)
    return [TrainingSample(f"p{i}", "word " * (i % 40 + 1), i % 40 + 1, 256, 0.0, 10 + 5 * (i % 40))
            for i in range(count)]


def test_each_promoted_version_is_scored_on_the_requests_it_never_saw(tmp_path, capsys):
    samples = _samples(200)
    predictor = make_predictor("linear", 0.9, 2048).fit([s.example() for s in samples[:120]],
                                                        [s.true_output_tokens for s in samples[:120]])
    version_dir = save_predictor(predictor, tmp_path, {}, {}, "m")
    attempts = [{"promoted": False, "reason": "only 50 samples; need 60", "version_dir": None, "num_samples": 50},
                {"promoted": True, "reason": "candidate beat the active version", "version_dir": str(version_dir),
                 "num_samples": 150}]
    rows = score_versions(attempts, samples, 2048)
    assert rows[0]["num_unseen"] == 0 and "version" not in rows[0]
    assert rows[1]["num_unseen"] == 50 and rows[1]["version"]["num_examples"] == 50
    assert rows[1]["version"]["kendall_tau"] > 0.8
    assert rows[1]["prior"]["kendall_tau"] == 0.0  # one max_tokens for all: nothing ranked
    _print({"num_samples": 200, "num_failed": 0, "elapsed_s": 10.0, "max_len": 2048, "attempts": rows})
    out = capsys.readouterr().out
    assert "first promotion after 150 finished requests" in out
    assert "attempt 1 at 50 samples: only 50 samples; need 60" in out
