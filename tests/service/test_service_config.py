"""Service configuration from YAML and flags."""

import pytest
from pydantic import ValidationError

from cluster.config import ServiceConfig, load_config


def test_defaults_bind_only_this_machine():
    config = ServiceConfig()
    assert config.host == "127.0.0.1"
    assert config.min_workers_resolved == config.max_workers_resolved == config.num_workers == 1
    assert config.model_id == "smollm2-135m-instruct"


def test_yaml_then_flags(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("port: 9001\nnum_workers: 2\nmax_workers: 3\npolicy: max_reserve\n")
    config = load_config(path, {"port": 9002, "policy": None})
    assert (config.port, config.num_workers, config.max_workers_resolved, config.policy) == (9002, 2, 3, "max_reserve")


@pytest.mark.parametrize("fields, match", [
    ({"policy": "fastest"}, "policy"),
    ({"num_workers": 3, "max_workers": 2}, "min_workers <= num_workers <= max_workers"),
    ({"block_size": 12}, "power of two"),
    ({"port": 0}, "port"),
    ({"typo_field": 1}, "typo_field"),
    ({"length_probe": "/nonexistent/probe"}, "not a probe folder"),
    ({"max_overtaken_steps": -1}, "max_overtaken_steps"),
    ({"rebalance_min_gap": 1}, "rebalance_min_gap must be 0 .off. or at least 2"),
    ({"rebalance_min_gap": -1}, "rebalance_min_gap"),
])
def test_bad_settings_name_the_field(fields, match):
    with pytest.raises(ValidationError, match=match):
        ServiceConfig(**fields)


def test_missing_or_malformed_yaml_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(ValueError, match="mapping"):
        load_config(bad)


def test_prefix_caching_is_on_by_default_and_reaches_the_worker_settings():
    from cluster.control.controller import worker_settings

    assert ServiceConfig().prefix_caching is True
    assert worker_settings(ServiceConfig()).engine.cache.prefix_caching is True
    assert worker_settings(ServiceConfig(prefix_caching=False)).engine.cache.prefix_caching is False


def test_the_starvation_guard_setting_reaches_the_workers_scheduler():
    from dataclasses import replace

    from cluster.control.controller import worker_settings
    from workers.actors.worker_actor import build_engine

    settings = worker_settings(ServiceConfig(max_overtaken_steps=7, policy="s3_peak", max_model_len=512,
                                             length_probe="none"))
    assert settings.engine.scheduler.max_overtaken_steps == 7
    assert worker_settings(ServiceConfig()).engine.scheduler.max_overtaken_steps == 1024
    engine = build_engine(replace(settings, tiny_model_seed=0, dtype="float32", kv_cache_memory="1MiB",
                                  num_torch_threads=1))
    assert engine.scheduler.config.max_overtaken_steps == 7


def test_a_length_probe_folder_is_made_absolute_for_the_workers(monkeypatch):
    from cluster.control.controller import worker_settings
    from predictor_service.hidden_probe import DEFAULT_PROBE

    monkeypatch.chdir(DEFAULT_PROBE.parent)
    config = ServiceConfig(length_probe=DEFAULT_PROBE.name)  # relative to where `serve` runs
    assert config.length_probe == str(DEFAULT_PROBE.resolve())
    assert worker_settings(config).length_probe == config.length_probe
    # auto: the shipped probe for the model it was trained for, nothing for another model
    assert ServiceConfig().length_probe == "auto" and worker_settings(ServiceConfig()).probe == "default"
    assert worker_settings(ServiceConfig(model="tiny")).probe is None
    assert worker_settings(ServiceConfig(length_probe="none")).probe is None
    assert worker_settings(ServiceConfig(model="tiny", length_probe="default")).probe == "default"


def test_served_model_names_are_vllms(tmp_path):
    assert ServiceConfig(served_model_name="mine").served_model_name == ("mine",)  # YAML may give one name
    config = ServiceConfig(served_model_name=["first", "second"])
    assert config.model_id == "first" and config.accepted_model_ids == ("first", "second")
    local = ServiceConfig(model=str(tmp_path / "Qwen2.5-0.5B-Instruct"))
    # unnamed: the folder's name, and the path itself as a vLLM client started against it would send
    assert local.model_id == "Qwen2.5-0.5B-Instruct" and local.accepted_model_ids == ("Qwen2.5-0.5B-Instruct",
                                                                                     local.model)
    for bad in ([], [""], "  "):
        with pytest.raises(ValueError, match="served_model_name must be one or more non-empty names"):
            ServiceConfig(served_model_name=bad)


def test_a_chat_template_must_be_a_file_and_is_made_absolute(tmp_path, monkeypatch):
    (tmp_path / "chat.jinja").write_text("{{ messages[0]['content'] }}")
    monkeypatch.chdir(tmp_path)
    assert ServiceConfig(chat_template="chat.jinja").chat_template == str(tmp_path / "chat.jinja")
    with pytest.raises(ValueError, match="chat_template 'missing.jinja' is not a file"):
        ServiceConfig(chat_template="missing.jinja")


def test_the_start_up_line_says_how_much_fits_in_kv():
    from s3serve_cli.serve import kv_summary

    assert kv_summary([8192, 8192], 2048, "4GiB") == (
        "KV cache (4GiB): 8,192 tokens per worker, 4 sequence(s) of max_model_len 2,048 at once in the smallest")
    assert "4,096 to 8,192 tokens per worker, 2 sequence(s)" in kv_summary([8192, 4096], 2048)
    assert "fewer than one: raise --kv-cache-memory" in kv_summary([1024], 2048)
    assert kv_summary([], 2048) == "KV cache (auto): no worker reported yet"


def test_start_up_waits_past_serves_fixed_proxy_timeout_until_its_own_deadline(monkeypatch):
    """Serve gives its HTTP proxy 60 s; a busy machine needs longer: start-up says so and waits, up to its
    deadline, and a different failure is raised at once."""
    import time

    from ray import serve

    from cluster.service import start_serve

    outcomes = [TimeoutError("HTTP proxies not available after 60s."), None]
    calls, lines = [], []

    def fake_start(http_options):
        calls.append(http_options)
        outcome = outcomes.pop(0)
        if outcome is not None:
            raise outcome

    monkeypatch.setattr(serve, "start", fake_start)
    start_serve({"port": 1}, time.monotonic() + 60, lines.append)
    assert len(calls) == 2 and len(lines) == 1 and "still starting" in lines[0]
    outcomes[:] = [TimeoutError("HTTP proxies not available after 60s.")]
    with pytest.raises(TimeoutError):
        start_serve({"port": 1}, time.monotonic() - 1, lines.append)  # past the deadline: the error stands
    outcomes[:] = [TimeoutError("something else")]
    with pytest.raises(TimeoutError, match="something else"):
        start_serve({"port": 1}, time.monotonic() + 60, lines.append)


def test_the_controllers_copy_holds_no_secrets():
    config = ServiceConfig(api_keys=("sk-secret",), redis_url="rediss://admin:hunter2@redis.internal:6380/0")
    kept = config.without_secrets()
    assert kept.api_keys == () and kept.redis_url == "rediss://admin:***@redis.internal:6380/0"
    assert "sk-secret" not in kept.model_dump_json() and "hunter2" not in kept.model_dump_json()
    assert ServiceConfig(redis_url="redis://:pw@h:1").without_secrets().redis_url == "redis://:***@h:1"
    assert ServiceConfig(redis_url="redis://h:1").without_secrets().redis_url == "redis://h:1"
    assert config.api_keys == ("sk-secret",)  # the router's copy keeps them
