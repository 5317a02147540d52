"""What a labels file says about output lengths, per sampling setting.

Pure numpy over `LabelRow`s: how many answers reach the length limit, and, where a prompt
was sampled several times, how much its length varies from draw to draw. The share of
length variance that the prompt explains (`explained_by_prompt`, on log lengths) is the
ceiling for any predictor that sees only the prompt: the rest is the draw.
"""

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from predictor_service.training import LabelRow


@dataclass(frozen=True, slots=True)
class SettingStats:
    """Lengths under one sampling setting.

    Attributes:
        temperature, top_p: the setting.
        num_prompts: distinct prompts.
        num_answers: label rows (prompt x sample).
        at_limit_share: answers that ran to max_tokens (the model did not stop by itself).
        prompts_sometimes_at_limit: among prompts with several samples, the share where some but not
            all samples ran to the limit (None without such prompts).
        mean_output_tokens, median_output_tokens: over every answer.
        median_prompt_range_tokens: median over multi-sample prompts of (longest - shortest sample).
        explained_by_prompt: 1 - within-prompt / total variance of log(1 + length), over
            multi-sample prompts; 1.0 means each prompt always gives the same length.
    """

    temperature: float
    top_p: float
    num_prompts: int
    num_answers: int
    at_limit_share: float
    prompts_sometimes_at_limit: float | None
    mean_output_tokens: float
    median_output_tokens: float
    median_prompt_range_tokens: float | None
    explained_by_prompt: float | None

    def as_json(self) -> dict:
        return asdict(self)


def _by_prompt(rows: Sequence[LabelRow]) -> dict[str, list[LabelRow]]:
    grouped: dict[str, list[LabelRow]] = defaultdict(list)
    for row in rows:
        grouped[row.prompt_id].append(row)
    return grouped


def explained_by_prompt(groups: Sequence[Sequence[float]]) -> float | None:
    """1 - pooled within-group variance / total variance (eta squared), over groups of two or more values;
    None with fewer than two such groups or no variance at all."""
    groups = [np.asarray(group, dtype=np.float64) for group in groups if len(group) > 1]
    if len(groups) < 2:
        return None
    values = np.concatenate(groups)
    total = float(np.var(values))
    if total == 0.0:
        return None
    within = float(np.sum([np.sum((group - group.mean()) ** 2) for group in groups]) / len(values))
    return 1.0 - within / total


def setting_stats(rows: Sequence[LabelRow]) -> list[SettingStats]:
    """One `SettingStats` per (temperature, top_p) in the rows, greedy first."""
    if not rows:
        raise ValueError("no label rows to describe")
    settings: dict[tuple[float, float], list[LabelRow]] = defaultdict(list)
    for row in rows:
        settings[(row.temperature, row.top_p)].append(row)
    stats = []
    for (temperature, top_p), setting_rows in sorted(settings.items()):
        lengths = np.asarray([row.num_output_tokens for row in setting_rows], dtype=np.float64)
        at_limit = [row.num_output_tokens >= row.max_tokens for row in setting_rows]
        multi = [group for group in _by_prompt(setting_rows).values() if len(group) > 1]
        sometimes = [0 < sum(r.num_output_tokens >= r.max_tokens for r in group) < len(group) for group in multi]
        ranges = [max(r.num_output_tokens for r in group) - min(r.num_output_tokens for r in group) for group in multi]
        stats.append(SettingStats(
            temperature=temperature, top_p=top_p, num_prompts=len({row.prompt_id for row in setting_rows}),
            num_answers=len(setting_rows), at_limit_share=float(np.mean(at_limit)),
            prompts_sometimes_at_limit=float(np.mean(sometimes)) if multi else None,
            mean_output_tokens=float(lengths.mean()), median_output_tokens=float(np.median(lengths)),
            median_prompt_range_tokens=float(np.median(ranges)) if multi else None,
            explained_by_prompt=explained_by_prompt(
                [[np.log1p(r.num_output_tokens) for r in group] for group in multi]),
        ))
    return stats
