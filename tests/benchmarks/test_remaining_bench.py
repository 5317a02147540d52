"""`bench remaining`'s probe columns: the shipped probe is read at the checkpoints and changes no bound."""

from benchmarks.remaining_bench import CHECKPOINTS, _ProbeRecorder
from workers.scheduling.length_probe import LengthProbe, ProbeQuery, RemainingEstimate


class _Halves(LengthProbe):
    """Says half of what is still allowed is left."""

    def estimate_remaining(self, hidden, queries):
        return [RemainingEstimate(q.max_remaining_tokens // 2, q.max_remaining_tokens) for q in queries]


def test_the_recorder_reads_at_the_checkpoints_and_keeps_every_bound():
    recorder = _ProbeRecorder(_Halves())
    assert not recorder.refines_bounds  # the engine runs it whatever the policy, and it rewrites nothing
    assert [n for n in range(300) if recorder.is_due(n)] == list(CHECKPOINTS)
    queries = [ProbeQuery("a", 10, 0, 100), ProbeQuery("b", 20, 64, 200)]
    assert recorder.estimate_remaining(None, queries) == [None, None]
    assert recorder.points == {(0, "a"): 50, (64, "b"): 68}
