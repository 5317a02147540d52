"""The predictor's hidden-state probe, wired into the worker's engine.

`workers` never imports `predictor_service` and the reverse: the engine asks for a
`workers.scheduling.length_probe.LengthProbe`, the predictor ships a `HiddenStateProbe`, and this
module, on the cluster side that knows both, wraps one in the other. The controller hands
`load_length_probe` to each worker actor it starts; the actor calls it once its model is
loaded, in its own process (the probe needs torch, which the controller never loads).
"""

from workers.scheduling.length_probe import LengthProbe, ProbeQuery, RemainingEstimate


class PredictorLengthProbe(LengthProbe):
    """A `predictor_service.hidden_probe.HiddenStateProbe` as the engine's `LengthProbe`.

    Args:
        predictor: the trained probe (anything with `interval_tokens`, `reads_at` and `predict_rows`).
    """

    def __init__(self, predictor) -> None:
        self.predictor = predictor
        self.interval_tokens = predictor.interval_tokens

    def is_due(self, num_output_tokens: int) -> bool:
        return self.predictor.reads_at(num_output_tokens)

    def estimate_remaining(self, hidden, queries: list[ProbeQuery]) -> list[RemainingEstimate | None]:
        out = self.predictor.predict_rows(hidden, [q.num_prompt_tokens for q in queries],
                                          [q.num_output_tokens for q in queries], [q.max_tokens for q in queries])
        return [RemainingEstimate(int(point), int(upper))
                for point, upper in zip(out.point_remaining, out.upper_remaining, strict=True)]


def load_length_probe(spec: str, hidden_size: int) -> PredictorLengthProbe:
    """The probe named by `spec` ("default": the shipped one, else a folder), for a model of `hidden_size`."""
    # Here, not at the top: this module is imported where torch is never loaded (the controller).
    from predictor_service.hidden_probe import load_probe_for

    return PredictorLengthProbe(load_probe_for(spec, hidden_size))
