"""The settings tree: each setting declared once, and the service's config, flags, YAML and reference made from it."""

import ast
import dataclasses
import sys
from pathlib import Path

import pytest

from cluster.config import WORKER_SETTING_NAMES, ServiceConfig, ServiceSettings, load_config, service_default
from s3serve_cli.main import build_parser
from s3serve_cli.settings_reference import example_yaml, markdown
from workers.actors.worker_settings import WorkerSettings
from workers.scheduling.engine_config import CacheConfig, EngineConfig, SchedulerConfig
from workers.values.setting import build, flat, leaves

REPO_ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("workers", "cluster")  # where the service's settings classes live


def _settings_classes() -> dict[str, list[str]]:
    """Every class named *Config or *Settings in the service's packages, with the fields it declares itself."""
    found = {}
    for folder in LAYERS:
        for path in sorted((REPO_ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef) and node.name.endswith(("Config", "Settings")):
                    found[f"{path.relative_to(REPO_ROOT)}:{node.name}"] = [
                        n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
                        and n.target.id != "model_config"]
    return found


def test_no_setting_is_declared_twice():
    declared: dict[str, list[str]] = {}
    for owner, names in _settings_classes().items():
        for name in names:
            declared.setdefault(name, []).append(owner)
    twice = {name: owners for name, owners in declared.items() if len(owners) > 1}
    assert not twice, f"declared in more than one settings class: {twice}"
    # the tree's classes are among those scanned, so the check sees them
    assert {"workers/scheduling/engine_config.py:SchedulerConfig", "workers/scheduling/engine_config.py:CacheConfig",
            "workers/scheduling/engine_config.py:EngineConfig", "workers/actors/worker_settings.py:WorkerSettings",
            "cluster/config.py:ServiceSettings"} <= set(_settings_classes())


def test_the_scan_finds_a_setting_declared_again(tmp_path, monkeypatch):
    copy = tmp_path / "workers"
    copy.mkdir()
    (copy / "other.py").write_text("class OtherConfig:\n    max_num_seqs: int = 64\n")
    (tmp_path / "cluster").mkdir()
    monkeypatch.setattr(sys.modules[__name__], "REPO_ROOT", tmp_path)
    assert _settings_classes() == {"workers/other.py:OtherConfig": ["max_num_seqs"]}


def _repeated_defaults() -> list[str]:
    """Fields of *Config / *Settings classes outside the service's own packages that are named like a service setting
    and write its default again as a literal (`LatencyBenchConfig.max_num_seqs = 32`)."""
    repeated = []
    for folder in sorted(p for p in REPO_ROOT.iterdir() if (p / "__init__.py").is_file() and p.name not in LAYERS):
        for path in sorted(folder.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not (isinstance(node, ast.ClassDef) and node.name.endswith(("Config", "Settings"))):
                    continue
                for item in node.body:
                    if (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                            and item.target.id in ServiceConfig.model_fields and isinstance(item.value, ast.Constant)
                            and item.value.value == service_default(item.target.id)):
                        repeated.append(f"{path.relative_to(REPO_ROOT)}:{item.lineno} {node.name}.{item.target.id}")
    return repeated


def test_no_other_package_writes_a_service_default_again():
    # Benches and tools may run the engine with values of their own (a bench's 128 slots), but where they run it as
    # the service does they take the value from its one declaration (cluster.config.service_default).
    assert not _repeated_defaults(), f"take these from service_default(name): {_repeated_defaults()}"


def test_the_default_scan_finds_a_literal_copy(tmp_path, monkeypatch):
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "__init__.py").write_text("")
    (tmp_path / "tools" / "bench.py").write_text("class BenchConfig:\n    max_num_seqs: int = 32\n"
                                                 "    max_num_batched_tokens: int = 1024\n")  # the second differs
    monkeypatch.setattr(sys.modules[__name__], "REPO_ROOT", tmp_path)
    assert _repeated_defaults() == ["tools/bench.py:2 BenchConfig.max_num_seqs"]


def test_the_service_config_is_its_own_settings_and_the_workers_leaves_as_declared():
    leaves_by_name = {leaf.name: leaf for leaf in leaves(WorkerSettings)}
    assert len(leaves_by_name) == len(list(leaves(WorkerSettings)))  # a leaf's name is unique in the tree
    assert set(ServiceConfig.model_fields) == set(ServiceSettings.model_fields) | set(WORKER_SETTING_NAMES)
    assert {"kv_cache_bytes", "cache_salt", "tiny_model_seed"}.isdisjoint(ServiceConfig.model_fields)  # internal
    for name in WORKER_SETTING_NAMES:
        info, leaf = ServiceConfig.model_fields[name], leaves_by_name[name]
        assert (info.default, info.description) == (leaf.default, leaf.description), name
        assert leaf.description, f"{name} has no description"
    # one default each: the service's workers get the engine's own values
    assert ServiceConfig().worker_settings().engine == EngineConfig()
    assert ServiceConfig().max_num_seqs == SchedulerConfig().max_num_seqs == EngineConfig().scheduler.max_num_seqs


def test_each_layer_gets_its_part_of_the_tree():
    settings = ServiceConfig(max_num_seqs=8, block_size=8, preemption_mode="swap", max_model_len=512,
                             prefix_caching=False).worker_settings()
    assert settings.engine.scheduler == SchedulerConfig(max_num_seqs=8)
    assert settings.engine.cache == CacheConfig(block_size=8, prefix_caching=False, preemption_mode="swap")
    assert settings.engine.max_model_len == 512
    assert build(WorkerSettings, flat(settings)) == settings  # flat names go back where they came from
    fewer = settings.updated(max_num_seqs=2)
    assert fewer.engine.scheduler.max_num_seqs == 2 and fewer.updated(max_num_seqs=8) == settings
    with pytest.raises(ValueError, match="has no setting max_num_seq$"):
        EngineConfig.of(max_num_seq=8)
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        ServiceConfig(block_size=12)


def test_flags_are_the_declared_settings():
    parser = build_parser()
    args = parser.parse_args(["serve", "--max-num-seqs", "8", "--no-prefix-caching", "--api-key", "a", "--api-key",
                              "b", "--preemption-mode", "swap", "--num-gpus-per-worker", "0.5"])
    assert (args.max_num_seqs, args.prefix_caching, args.api_keys, args.worker_num_gpus) == (8, False, ["a", "b"], 0.5)
    assert args.block_size is None  # not given: the file's value or the default stands
    serve = next(a for a in parser._subparsers._group_actions[0].choices.values() if a.prog.endswith(" serve"))
    flags = {option for action in serve._actions for option in action.option_strings}
    for name, info in ServiceConfig.model_fields.items():
        flag = (info.json_schema_extra or {}).get("flag") or "--" + name.replace("_", "-")
        assert flag in flags, name
    help_text = " ".join(serve.format_help().split())
    assert "most sequences a worker runs (holds KV blocks for) at once (sequences; default: 32)" in help_text
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--preemption-mode", "sometimes"])


def test_a_yaml_file_sets_any_leaf_and_the_printed_example_is_the_defaults(tmp_path):
    path = tmp_path / "service.yaml"
    path.write_text("max_num_seqs: 12\nswap_space_bytes: 1048576\nport: 9000\n")
    config = load_config(path, {"max_num_seqs": 16})
    assert (config.port, config.worker_settings().engine.scheduler.max_num_seqs) == (9000, 16)
    assert config.worker_settings().engine.cache.swap_space_bytes == 1048576
    example = tmp_path / "example.yaml"
    example.write_text(example_yaml())
    assert load_config(example) == ServiceConfig()
    assert all(f"\n{name}: " in example_yaml() for name in ServiceConfig.model_fields)


def test_the_configuration_reference_in_docs_is_current():
    assert (REPO_ROOT / "docs" / "configuration.md").read_text() == markdown(), (
        "docs/configuration.md is stale: run `s3serve settings > docs/configuration.md`")
    assert all(f"| `{name}` |" in markdown() for name in ServiceConfig.model_fields)


def test_settings_are_dataclass_fields_with_their_metadata():
    for tree in (WorkerSettings, EngineConfig, SchedulerConfig, CacheConfig):
        for field in dataclasses.fields(tree):
            assert "description" in field.metadata, f"{tree.__name__}.{field.name} is not declared with setting()"
