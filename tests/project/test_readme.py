"""The README tells the truth about the repository's layout and links only inside it."""

import contextlib
import io
import re
import shlex
from pathlib import Path

from s3serve_cli.bench_peers import peers_systems
from s3serve_cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _layout_rows() -> list[str]:
    section = README.split("## Layout", 1)[1]
    return re.findall(r"^\| `([^`]+)/` \|", section, flags=re.MULTILINE)


def test_layout_table_lists_every_package_and_folder_that_exists():
    listed = _layout_rows()
    assert listed, "no layout table found"
    missing = [folder for folder in listed if not (ROOT / folder).is_dir()]
    assert not missing, f"the layout table names folders that do not exist: {missing}"
    packages = {path.parent.relative_to(ROOT).as_posix() for path in ROOT.glob("*/__init__.py")}
    packages |= {path.parent.relative_to(ROOT).as_posix() for path in ROOT.glob("*/*/__init__.py")}
    unlisted = sorted(packages - set(listed))
    assert not unlisted, f"packages missing from the README's layout table: {unlisted}"


DOCS = sorted((ROOT / "docs").glob("*.md"))


def test_readme_links_the_architecture_document_inside_the_repository():
    assert "(docs/architecture.md)" in README and (ROOT / "docs" / "architecture.md").is_file()
    assert "../shared/docs/DESIGN.md" not in README
    for text in [README, *(doc.read_text() for doc in DOCS)]:
        for path in re.findall(r"`((?:cluster|workers|kv_kernels|benchmarks|predictor_service|s3serve_cli|deploy|tests)"
                               r"/[\w/]+\.(?:py|yaml|json))`", text):
            assert (ROOT / path).is_file(), f"a named file does not exist: {path}"


def test_the_readme_is_short_and_every_link_in_it_and_the_docs_resolves():
    assert len(README.splitlines()) < 200, "the README should read in five minutes: move detail to docs/"
    for source, text in [(ROOT / "README.md", README), *((doc, doc.read_text()) for doc in DOCS)]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if "://" in target:
                continue
            assert (source.parent / target).exists(), f"{source.name} links to {target}, which does not exist"


def test_user_docs_name_no_path_outside_the_repository():
    """A user of the project has no ../shared; only the benchmarks default to the data it is developed with."""
    for source, text in [(ROOT / "README.md", README), *((doc, doc.read_text()) for doc in DOCS)]:
        if source.name == "benchmarks.md":
            assert "the data this repository is developed with" in text
            continue
        assert "../shared" not in text, f"{source.name} names a path outside the repository"


def test_the_default_policy_and_routing_are_the_ones_the_readme_names():
    from cluster.config import ServiceConfig
    from workers.actors.worker_settings import WorkerSettings

    policy = re.search(r"The default policy is `(\w+)`", README)
    routing = re.search(r"the default routing is `(\w+)`", README)
    probe = re.search(r"the\s+length\s+probe\s+is\s+`(\w+)`\s+by\s+default", README)
    assert policy and routing and probe, "the README no longer names the defaults"
    config = ServiceConfig()
    assert config.policy == WorkerSettings.of().policy == policy.group(1)
    assert config.routing == routing.group(1)
    assert config.length_probe == probe.group(1)


def test_the_architecture_documents_path_names_a_file_that_exists_at_every_hop():
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"One line per hop.*?```\n(.*?)```", text, re.S)
    assert block, "docs/architecture.md lost its hop-by-hop path"
    hops = [line.split() for line in block.group(1).splitlines() if line.strip()]
    assert len(hops) >= 10
    for hop in hops:
        path = next((word for word in hop if word.endswith(".py") and "/" in word), None)
        assert path and (ROOT / path).is_file(), f"hop {' '.join(hop[:3])!r} names no file that exists"


def _documented_commands() -> list[str]:
    """The arguments of every `s3serve` invocation shown: the README's inline ones that pass a flag (its tables'
    commands), and every code block line in it and the docs (joined across trailing backslashes)."""
    commands = [command for command in re.findall(r"`s3serve ([^`]+)`", README) if "--" in command]
    for path in (ROOT / "README.md", *DOCS):
        joined = re.sub(r"\\\n\s*", " ", path.read_text())
        commands += re.findall(r"^\s*(?:\.venv/bin/)?s3serve (.+)$", joined, flags=re.MULTILINE)
    return sorted(set(commands))


def test_every_documented_command_parses_and_uses_only_flags_that_apply():
    commands = _documented_commands()
    assert len(commands) > 20 and "bench peers --workload natural --quick" in commands, commands
    failures = []
    for command in commands:
        stderr = io.StringIO()
        try:
            with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
                args = build_parser().parse_args(shlex.split(command, comments=True))
            if args.command == "bench" and args.bench == "peers":
                peers_systems(args)  # the flags its --workload uses (checked before the bench runs)
        except SystemExit as exit_:
            if exit_.code != 0:  # 0: --help
                failures.append(f"s3serve {command}: {stderr.getvalue().strip()}")
        except ValueError as error:
            failures.append(f"s3serve {command}: {error}")
    assert not failures, "\n".join(failures)
