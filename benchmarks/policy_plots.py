"""PNG plots of a policy benchmark: throughput per policy, KV utilisation and concurrency over time."""

from pathlib import Path


def plot_runs(runs: list, summaries: dict[str, dict], plot_dir: Path) -> list[Path]:
    """Throughput per policy, KV utilisation over time, concurrency over time.

    Args:
        runs: `PolicyRun`s; their `steps` rows are (end_s, duration_s, sequences, used blocks, reserved blocks).
        summaries: policy name -> summary dict with "tokens_per_s".
        plot_dir: created if missing.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plot_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    figure, axis = plt.subplots(figsize=(6, 4))
    names = [run.policy for run in runs]
    axis.bar(names, [summaries[n]["tokens_per_s"] for n in names], color="#4c72b0")
    axis.set_ylabel("output tokens / s")
    axis.set_title("Throughput per policy")
    paths.append(plot_dir / "throughput.png")
    figure.tight_layout()
    figure.savefig(paths[-1], dpi=120)
    plt.close(figure)
    for filename, title, column, ylabel in (
        ("kv_utilisation.png", "KV blocks used (solid) and reserved (dashed)", None, "fraction of KV budget"),
        ("concurrency.png", "Running sequences over time", 2, "running sequences"),
    ):
        figure, axis = plt.subplots(figsize=(7, 4))
        for run in runs:
            times = [s[0] for s in run.steps]
            if column is None:
                line, = axis.plot(times, [s[3] / run.num_blocks for s in run.steps], label=run.policy)
                axis.plot(times, [s[4] / run.num_blocks for s in run.steps], linestyle="--", color=line.get_color())
            else:
                axis.plot(times, [s[column] for s in run.steps], label=run.policy)
        axis.set_xlabel("seconds")
        axis.set_ylabel(ylabel)
        axis.set_title(title)
        axis.legend()
        paths.append(plot_dir / filename)
        figure.tight_layout()
        figure.savefig(paths[-1], dpi=120)
        plt.close(figure)
    return paths
