"""Which worker a request goes to when several have room: by predicted work, by room, or by request count.

Room alone (`placement.roomiest_fit`) sends a request to the emptiest KV cache; but a worker
with two requests that will each run 500 more tokens has more work ahead than one with four
that finish in 10, and its cache can look as empty. With every worker decoding one token per
running sequence per step, and a step costing a fixed part plus a part per sequence in it,
the steps a new request of L tokens spends on a worker cost

    a * L  +  b * (L + sum over the worker's live requests of min(remaining_i, L))

since each request ahead shares the new one's steps until it ends, or until the new one
does. `a` and `b` are the same on like workers, so comparing `completion_cost` compares
predicted completion times. Requests waiting on a worker count as live: they take their
steps once admitted. A request the controller placed there that the worker has not yet
reported counts with its whole predicted length.

Pure: no Ray, Redis or torch (`ControlPlane.place` and the cluster simulator ask it).
"""

import bisect
import functools
import itertools
from collections.abc import Callable, Iterable, Mapping

from cluster.control.messages import RequestRecord
from cluster.control.placement import PendingRequest, RoomIndex, roomiest_fit
from workers.scheduling.length_distribution import LengthDistribution
from workers.values.work_types import WorkerStats

ROUTINGS = ("predicted_work", "room", "least_requests")
DEFAULT_ROUTING = "predicted_work"
LENGTHS = LengthDistribution()  # a request's expected length from its prediction, as the workers report theirs


def expected_tokens(record: RequestRecord) -> float:
    """A placed request's expected output tokens, from the bound it is planned with (0: none, then max_tokens)."""
    return _expected_length(record.predicted_output_tokens or None, record.max_tokens)


@functools.lru_cache(maxsize=65536)
def _expected_length(predicted_tokens: int | None, max_tokens: int) -> float:
    # Pure in two small integers, asked of every live request at every placement: computed once per pair.
    return LENGTHS.remaining_of(predicted_tokens, 0, max_tokens)


def completion_cost(own_tokens: float, others_remaining: Iterable[float]) -> float:
    """Steps' sequence-slots a request of `own_tokens` output tokens shares with the live requests it joins."""
    return own_tokens + sum(min(remaining, own_tokens) for remaining in others_remaining)


class LiveWork:
    """One worker's live requests' expected remaining tokens, sorted with prefix sums: `cost` is `completion_cost`
    in O(log n), so a controller can ask it of every worker for every request."""

    def __init__(self, remaining: Iterable[float] = ()) -> None:
        self._sorted = sorted(remaining)
        self._prefix = [0.0, *itertools.accumulate(self._sorted)]

    def __len__(self) -> int:
        return len(self._sorted)

    def cost(self, own_tokens: float) -> float:
        shorter = bisect.bisect_left(self._sorted, own_tokens)  # these end first; the rest share all its steps
        return own_tokens + self._prefix[shorter] + own_tokens * (len(self._sorted) - shorter)

    def added(self, tokens: float) -> "LiveWork":
        """This work with one more live request of `tokens` (O(n))."""
        return LiveWork([*self._sorted, tokens])


NO_WORK = LiveWork()


def least_work_fit(num_blocks: int, own_tokens: float, free_blocks: Mapping[str, int],
                   live: Mapping[str, LiveWork]) -> str | None:
    """The worker with room for `num_blocks` where the request is predicted to finish soonest (`completion_cost`),
    ties by most free blocks, then worker id; None if none has room.

    Args:
        num_blocks: the request's reservation.
        own_tokens: its predicted output tokens (expected length).
        free_blocks: ready worker id -> free blocks.
        live: worker id -> its live requests' work (missing: none).
    """
    best, best_key = None, None
    for worker_id, free in free_blocks.items():
        if free < num_blocks:
            continue
        key = (live.get(worker_id, NO_WORK).cost(own_tokens), -free, worker_id)
        if best_key is None or key < best_key:
            best, best_key = worker_id, key
    return best


class LeastWorkChooser:
    """For `placement.first_fit_decreasing`'s `choose`: among the workers a waiting request fits, the one where it is
    predicted to finish soonest (`completion_cost`; ties as listed, roomiest first), counting the requests this call
    placed before it; a request without `work_tokens` takes the first that fits.

    Args:
        live: worker id -> its live requests' work (`live_work_by_worker`); missing: none.
    """

    def __init__(self, live: Mapping[str, LiveWork]) -> None:
        self._live = dict(live)

    def __call__(self, request: PendingRequest, fitting: list[str]) -> str:
        own = request.work_tokens
        if own is None:
            return fitting[0]
        best = min(fitting, key=lambda w: self._live.get(w, NO_WORK).cost(own))  # min keeps the first of equals
        self._live[best] = self._live.get(best, NO_WORK).added(own)
        return best


def least_requests_fit(num_blocks: int, free_blocks: Mapping[str, int], num_live: Mapping[str, int]) -> str | None:
    """The worker with room for `num_blocks` that holds the fewest live requests (vLLM's and Ray Serve's
    least-loaded choice), ties by most free blocks, then worker id; None if none has room."""
    fitting = [(num_live.get(w, 0), -free, w) for w, free in free_blocks.items() if free >= num_blocks]
    return min(fitting)[2] if fitting else None


def live_work(reported_ids: Iterable[str], reported_remaining: Iterable[float],
              placed: Iterable[tuple[str, float]]) -> LiveWork:
    """A worker's live requests' expected remaining tokens: for each request the ledger places there (`placed`:
    request id, its whole expected length), what the worker's latest stats reported for it, or its whole expected
    length while the stats do not list it yet. A request the stats list but the ledger no longer places there
    (finished, or moved since) does not count; stats without one value per request (a worker of an older
    version) count as not listing any."""
    ids, remaining = list(reported_ids), list(reported_remaining)
    reported = dict(zip(ids, remaining)) if len(ids) == len(remaining) else {}
    return LiveWork(reported.get(request_id, tokens) for request_id, tokens in placed)


def live_work_by_worker(worker_ids: Iterable[str], records: Iterable[RequestRecord],
                        latest: Mapping[str, WorkerStats]) -> dict[str, LiveWork]:
    """`live_work` of each of `worker_ids`, from the ledger's records and the workers' latest stats."""
    placed: dict[str, list[tuple[str, float]]] = {w: [] for w in worker_ids}
    for record in records:
        if record.worker_id in placed:
            placed[record.worker_id].append((record.request_id, expected_tokens(record)))
    live = {}
    for worker_id, requests in placed.items():
        stats = latest.get(worker_id)
        reported = (stats.request_ids, stats.remaining_tokens) if stats is not None else ((), ())
        live[worker_id] = live_work(*reported, requests)
    return live


def route(routing: str, num_blocks: int, own_tokens: float, free_blocks: Mapping[str, int],
          live: Mapping[str, LiveWork]) -> str | None:
    """The worker `routing` picks among those with room for `num_blocks` (None if none has room).

    Args:
        routing: one of `ROUTINGS`.
        num_blocks: the request's reservation.
        own_tokens: its expected output tokens.
        free_blocks: ready worker id -> free blocks.
        live: worker id -> its live requests' expected remaining tokens (`live_work`).
    """
    check_routing(routing)
    if routing == "predicted_work":
        return least_work_fit(num_blocks, own_tokens, free_blocks, live)
    if routing == "least_requests":
        return least_requests_fit(num_blocks, free_blocks, {w: len(work) for w, work in live.items()})
    return roomiest_fit(num_blocks, free_blocks)


def route_among(routing: str, num_blocks: int, own_tokens: float, exclude: str | None, rooms: RoomIndex,
                records: Callable[[], Iterable[RequestRecord]], latest: Mapping[str, WorkerStats]) -> str | None:
    """`route` over the controller's view: ready workers' room (`rooms`, without `exclude`), the ledger's records
    and the workers' latest stats. Room alone asks the index, O(log workers), and reads no records."""
    if routing == "room":
        return rooms.roomiest(num_blocks, exclude=exclude)
    free = {w: f for w, f in rooms.free().items() if w != exclude}
    return route(routing, num_blocks, own_tokens, free, live_work_by_worker(free, records(), latest))


def check_routing(routing: str) -> None:
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, got {routing!r}")
