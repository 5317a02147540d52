"""`bench control-plane`'s placement part, small: real embedded Redis, simulated workers, no model."""

import json

from benchmarks import control_plane_bench


def test_placement_bench_places_everything_releases_everything_and_writes_the_keys(tmp_path, capsys):
    config = control_plane_bench.ControlPlaneBenchConfig(
        worker_counts=(4, 32), num_placements=400, warmup=50, concurrency=4, offered_per_s=500.0,
        step_s=0.0005, blocks_per_worker=256, run_service=False)
    result = control_plane_bench.run(config, json_path=tmp_path / "out.json", progress=lambda _msg: None)

    written = json.loads((tmp_path / "out.json").read_text())
    assert set(written["placement"]) == {"4", "32"}
    for num_workers, run in written["placement"].items():
        assert run["num_workers"] == int(num_workers)
        assert run["failed"] == {}
        assert run["ledger_left_after_finish"] == 0  # every placement was released again
        assert run["placements_per_s"] > 0 and run["offered_per_s"] <= 500.0
        assert 0 < run["place_p50_ms"] <= run["place_p99_ms"] <= run["place_max_ms"]
    assert "overhead" not in written and result["placement"] == written["placement"]
    table = capsys.readouterr().out
    assert "placements/s (capacity)" in table and "place_p99_ms" in table
