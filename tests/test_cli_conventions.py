"""What every command has without asking: `olmo-ctl` alone prints its help, `--version`, `-h` as well
as `--help`, shell completion, one example at the end of each `--help` (one of README.md's), argument
names written one way, each command's whole first sentence in the top-level `--help`, `-o yaml`
beside `-o json`, and usage errors in one line. Then the commands that list and set up:
`olmo-ctl recipes` and `olmo-ctl config init`.

Every case runs the real entry point in this process (helpers.cli.invoke)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib

import pytest
import typer.main
import yaml
from helpers.cli import ROOT, clean_env, invoke
from test_docs_commands import check, commands_in

import olmo_ctl
from olmo_ctl.cli import COMMAND_MODULES, load_commands
from olmo_ctl.core.config import Settings, setting_names
from olmo_ctl.core.recipe import STAGE_RECIPES, shipped_recipes

APP = load_commands()  # every command registered


@pytest.fixture
def env(tmp_path):
    return clean_env(tmp_path / "xdg")


def all_commands() -> list[tuple[list[str], object]]:
    """(path, click command) of the application, its groups and every command in them."""
    out: list[tuple[list[str], object]] = []

    def walk(cmd, path):
        out.append((path, cmd))
        for name, sub in (getattr(cmd, "commands", None) or {}).items():
            walk(sub, [*path, name])

    walk(typer.main.get_command(APP), [])
    return out


LEAVES = [path for path, cmd in all_commands() if not getattr(cmd, "commands", None)]
GROUPS = [path for path, cmd in all_commands() if getattr(cmd, "commands", None)]


def test_olmo_ctl_alone_prints_its_help(env):
    p = invoke(env=env)
    assert p.returncode == 0 and p.stderr == ""
    assert p.stdout == invoke("--help", env=env).stdout
    assert p.stdout.startswith("Usage: olmo-ctl [OPTIONS] COMMAND [ARGS]...")
    for group in GROUPS[1:]:  # `olmo-ctl config` alone: the group's help, its commands listed
        g = invoke(*group, env=env)
        assert g.returncode == 0 and g.stdout == invoke(*group, "--help", env=env).stdout
        assert all(name in g.stdout for name in typer.main.get_command(APP).commands[group[0]].commands)


def test_version_is_the_packages(env):
    p = invoke("--version", env=env)
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert (p.returncode, p.stdout, p.stderr) == (0, f"olmo-ctl {version}\n", "")
    assert olmo_ctl.__version__ == version


@pytest.mark.parametrize("path", GROUPS + LEAVES, ids=lambda p: " ".join(p) or "olmo-ctl")
def test_h_is_help_and_help_ends_with_one_example_from_the_readme(path, env):
    long, short = invoke(*path, "--help", env=env), invoke(*path, "-h", env=env)
    assert long.returncode == 0 and short.returncode == 0, (long.stderr, short.stderr)
    assert short.stdout == long.stdout
    text = long.stdout
    assert "-h, --help" in text
    head, sep, example = text.partition("\nExample:\n")
    assert sep and "Example:" not in example, text
    assert text.count("Example:") == 1, text  # the example once: not again in the description
    (line,) = [ln.strip() for ln in example.splitlines() if ln.strip()]
    assert line.startswith(" ".join(["olmo-ctl", *path])), line
    assert check(line) == [], (line, check(line))
    readme = {cmd for _, cmd in commands_in(ROOT / "README.md")}
    assert line in readme, f"{line!r} is not among README.md's examples"


@pytest.mark.parametrize("columns", ["80", "200"])
def test_the_top_level_help_gives_each_commands_whole_first_sentence(columns, env):
    text = invoke("--help", env={**env, "COLUMNS": columns}).stdout
    listed = " ".join(text.partition("\nCommands:\n")[2].split())
    assert "..." not in listed and "stage 1/2" not in text
    top = typer.main.get_command(APP)
    for name in top.commands:
        summary = top.commands[name].get_short_help_str(limit=10_000)
        assert summary.endswith(".") and f"{name} {summary}" in listed, (name, summary)


def test_the_top_level_help_names_every_model_and_where_it_runs(env):
    text = " ".join(invoke("--help", env=env).stdout.split())
    for said in ("OLMo 3 7B", "OLMo 3 32B", "OLMo 2 32B", "TPU slices", "GPU nodes", "on this machine"):
        assert said in text.partition("Options:")[0], (said, text)


def test_argument_names_are_written_one_way(env):
    usage = {" ".join(path): invoke(*path, "--help", env=env).stdout.splitlines()[0] for path in LEAVES}
    for cmd, line in usage.items():
        rest = line.removeprefix(f"Usage: olmo-ctl {cmd} [OPTIONS]").split()
        assert all(re.fullmatch(r"\[?[A-Z][A-Z0-9_]*(\.\.\.)?\]?", a) for a in rest), line
    assert usage["compare"] == "Usage: olmo-ctl compare [OPTIONS] A B"
    assert usage["resume-until-done"] == "Usage: olmo-ctl resume-until-done [OPTIONS] [RUN]"
    assert usage["resize"] == "Usage: olmo-ctl resize [OPTIONS] RUN"
    assert usage["monitor"] == "Usage: olmo-ctl monitor [OPTIONS] RUN"  # a name or a directory, as logs
    assert usage["data prepare"] == "Usage: olmo-ctl data prepare [OPTIONS] FILES..."
    text = invoke("surgery", "soup", "--help", env=env).stdout
    args = text.partition("Arguments:\n")[2].partition("\n\n")[0]
    assert args.split()[0] == "CHECKPOINTS..." and "<" not in args and "{" not in text


def test_a_mistyped_command_is_one_line(env):
    p = invoke("version", env=env)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr == "error: No such command 'version'; did you mean '--version'? see `olmo-ctl --help`\n"
    p = invoke("resiz", "x", env=env)
    assert p.returncode == 2
    assert p.stderr == "error: No such command 'resiz'; did you mean 'resize'? see `olmo-ctl --help`\n"
    p = invoke("frobnicate", env=env)
    assert p.stderr == "error: No such command 'frobnicate'; see `olmo-ctl --help`\n"


@pytest.mark.parametrize("name", sorted(COMMAND_MODULES))
def test_a_command_loads_its_own_module_alone(name):
    """`olmo-ctl NAME` imports NAME's module (COMMAND_MODULES), not every command's: a fresh process that
    loads only that has NAME registered, and the table names every command the application has."""
    assert set(COMMAND_MODULES) == set(typer.main.get_command(APP).commands)
    code = (
        "import sys, typer.main\n"
        "from olmo_ctl.cli import COMMAND_MODULES, app, load_commands\n"
        f"load_commands([{name!r}])\n"
        "print(' '.join(sorted(typer.main.get_command(app).commands)))\n"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('olmo_ctl.cli.'))))\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    registered, modules = (line.split() for line in p.stdout.splitlines())
    assert name in registered and f"olmo_ctl.cli.{COMMAND_MODULES[name]}" in modules


def test_a_dry_run_imports_no_other_command(tmp_path):
    """What a `submit --dry-run` costs is its own command: no other command module is imported."""
    code = (
        "import sys\n"
        "from olmo_ctl.cli import main\n"
        f"rc = main(['submit', '--stage', '1', '--device', 'tpu7x-128', '--dry-run', '--output-manifest', "
        f"{str(tmp_path / 'j.yaml')!r}])\n"
        "print(rc, ' '.join(sorted(m for m in sys.modules if m.startswith('olmo_ctl.cli.'))))\n"
    )
    env = clean_env(tmp_path / "xdg")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    rc, *modules = p.stdout.split()
    assert rc == "0" and "olmo_ctl.cli.submit" in modules
    assert not {f"olmo_ctl.cli.{m}" for n, m in COMMAND_MODULES.items() if n != "submit"} & set(modules), (
        modules
    )


def test_shell_completion(env, monkeypatch):
    # --show-completion is for the shell it runs in (Typer asks the process tree); under `make` that is
    # sh, which Typer has no script for: the test asks as bash would.
    import typer.completion

    monkeypatch.setattr(typer.completion, "_get_shell_name", lambda: "bash")
    p = invoke("--show-completion", env=env)
    assert p.returncode == 0 and "_OLMO_CTL_COMPLETE=complete_bash" in p.stdout, p.stdout + p.stderr
    asked = {**env, "_OLMO_CTL_COMPLETE": "complete_bash", "COMP_WORDS": "olmo-ctl res", "COMP_CWORD": "1"}
    p = invoke(env=asked)
    assert p.returncode == 0 and p.stdout.split() == ["resume-until-done", "resize"], p.stdout
    asked.update(COMP_WORDS="olmo-ctl plan --st", COMP_CWORD="2")
    assert invoke(env=asked).stdout.split() == ["--stage"]


@pytest.mark.parametrize(
    "argv",
    [
        ["devices", "--generation", "v5p"],
        ["recipes"],
        ["plan", "--stage", "1", "--device", "tpu7x-128"],
        ["config", "show"],
    ],
    ids=lambda a: a[0],
)
def test_yaml_says_what_json_says(argv, env):
    j, y = invoke(*argv, "-o", "json", env=env), invoke(*argv, "-o", "yaml", env=env)
    assert j.returncode == 0 and y.returncode == 0, (j.stderr, y.stderr)
    assert yaml.safe_load(y.stdout) == json.loads(j.stdout)


def test_smoke_takes_o_json_and_keeps_json_as_a_hidden_alias(env):
    text = invoke("smoke", "-h", env=env).stdout
    assert "-o, --output" in text and "--json" not in text
    p = invoke("smoke", "--device", "cpu-1", "--backend", "local", "-o", "xml", env=env)
    assert p.returncode == 2 and "'xml' is not one of 'table', 'json', 'yaml'" in p.stderr
    # --json still parses (refused here only for its --junit, before anything runs)
    p = invoke(
        "smoke", "--device", "cpu-1", "--backend", "local", "--json", "--junit", "/no/such/dir/x.xml", env=env
    )
    assert p.returncode == 2 and p.stderr.startswith("error: --junit `/no/such/dir/x.xml`"), p.stderr


def test_counts_agree_with_their_noun(env):
    p = invoke("plan", "--recipe", "smoke", "--device", "cpu-1", env=env)
    first = p.stdout.splitlines()[0]
    assert first.endswith(", 1 VM, 1 device"), first
    p = invoke("plan", "--stage", "1", "--device", "tpu7x-128", env=env)
    assert "64 chips, 16 VMs, 128 devices" in p.stdout.splitlines()[0]


def test_data_info_shows_a_ratio_to_three_digits(env):
    j = json.loads(invoke("data", "info", "--recipe", "smoke", "-o", "json", env=env).stdout)
    t = invoke("data", "info", "--recipe", "smoke", env=env).stdout
    (line,) = [ln for ln in t.splitlines() if ln.startswith("epochs_for_max_steps: ")]
    assert line == f"epochs_for_max_steps: {j['epochs_for_max_steps']:.3g}"
    assert j["epochs_for_max_steps"] == j["max_steps"] / j["batches_per_epoch"]


# ---------------------------------------------------------------- olmo-ctl recipes


def test_recipes_lists_every_shipped_recipe_on_one_line(env):
    p = invoke("recipes", env=env)
    assert p.returncode == 0, p.stderr
    header, *rows = p.stdout.splitlines()
    assert header.split()[:3] == ["NAME", "STAGE", "PARAMS"]
    assert [r.split()[0] for r in rows] == shipped_recipes()
    raw = yaml.safe_load((ROOT / "recipes" / "smoke.yaml").read_text())
    (smoke,) = [r for r in rows if r.startswith("smoke ")]
    assert smoke.endswith(raw["description"]) and f" {raw['train']['max_steps']:,} " in smoke
    data = json.loads(invoke("recipes", "-o", "json", env=env).stdout)
    by = {r["name"]: r for r in data}
    t = raw["train"]
    assert by["smoke"]["tokens"] == t["max_steps"] * t["global_batch"] * t["seq_len"]
    model = yaml.safe_load((ROOT / "recipes" / "models" / f"{raw['model']}.yaml").read_text())
    assert by["smoke"]["stage_option"] is None and by["smoke"]["model"] == model["name"]
    for stage, name in STAGE_RECIPES.items():
        assert by[name]["stage"] == stage and by[name]["stage_option"] == f"--stage {stage}"
    # The 32B stages: `--model NAME --stage N`, each listed with its own model and batch.
    for name, option, model, batch in (
        ("olmo2-32b-stage1", "--model olmo2-32b --stage 1", "olmo2-32b", 2048),
        ("olmo2-32b-stage2", "--model olmo2-32b --stage 2", "olmo2-32b", 2048),
        ("olmo3-32b-stage1", "--model olmo3-32b --stage 1", "olmo3-32b", 1024),
        ("olmo3-32b-stage2", "--model olmo3-32b --stage 2", "olmo3-32b", 512),
        ("olmo3-32b-stage3", "--model olmo3-32b --stage 3", "olmo3-32b", 128),
    ):
        assert (by[name]["stage_option"], by[name]["model"], by[name]["global_batch"]) == (
            option,
            model,
            batch,
        )
        assert by[name]["stage"] == int(option[-1])
    # A stage of ingredients: each ingredient's steps, and the tokens all of them read.
    soup = by["olmo2-32b-stage2"]
    assert [(i["name"], i["max_steps"]) for i in soup["ingredients"]] == [
        ("seed1110-100b", 11921),
        ("seed2662-100b", 11921),
        ("seed2662-300b", 35763),
    ]
    assert soup["total_tokens"] == (11921 + 11921 + 35763) * 2048 * 4096
    assert by["smoke"]["ingredients"] == [] and by["smoke"]["total_tokens"] == by["smoke"]["tokens"]
    (line,) = [r for r in rows if r.startswith("olmo2-32b-stage2 ")]
    assert " 11,921+11,921+35,763 " in line


# ---------------------------------------------------------------- olmo-ctl config init


def _uncommented(text: str) -> str:
    """The site file with every setting line uncommented (descriptions stay comments)."""
    text = re.sub(r"^# (\w+):", r"\1:", text, flags=re.M)
    return re.sub(r"^#   (\w+): \{", r"  \1: {", text, flags=re.M)


def test_config_init_writes_a_commented_file_every_command_reads(env, tmp_path):
    path = tmp_path / "xdg" / "olmo-ctl" / "config.yaml"
    p = invoke("config", "init", env=env)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[0] == f"wrote {path}"
    text = path.read_text()
    assert yaml.safe_load(text) is None  # sets nothing as written
    shown = json.loads(invoke("config", "show", "-o", "json", env=env).stdout)
    assert set(shown["sources"].values()) == {"default"} and shown["config_file_exists"] is True
    for name in setting_names():
        assert re.search(rf"^# {name}:", text, re.M), name
    # Each commented line is the setting at its default: uncommented, the file resolves to the defaults.
    path.write_text(_uncommented(text))
    shown = json.loads(invoke("config", "show", "-o", "json", env=env).stdout)
    defaults = Settings().to_dict()
    assert {k: v for k, v in shown["settings"].items() if k != "prices"} == {
        k: v for k, v in defaults.items() if k != "prices"
    }
    assert shown["settings"]["prices"] == {
        "tpu7x": {"on_demand": 0.0, "spot": 0.0},
        "v5p": {"on_demand": 0.0, "spot": 0.0},
    }
    # A setting whose default is none has an empty line: set by nothing, still the default.
    assert shown["sources"] == {k: "default" if v is None else f"file {path}" for k, v in defaults.items()}


def test_config_init_never_replaces_a_file_without_force(env, tmp_path):
    path = tmp_path / "xdg" / "olmo-ctl" / "config.yaml"
    path.parent.mkdir(parents=True)
    path.write_text("namespace: research\n")
    before = path.stat().st_mtime_ns
    p = invoke("config", "init", env=env)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr == (
        f"error: config file `{path}` exists; edit it, or pass --force to replace it with a commented one\n"
    )
    assert path.read_text() == "namespace: research\n" and path.stat().st_mtime_ns == before
    assert invoke("config", "init", "--force", env=env).returncode == 0
    assert yaml.safe_load(path.read_text()) is None and "# namespace: default" in path.read_text()
    assert [f.name for f in path.parent.iterdir()] == ["config.yaml"]  # no temporary file left


def test_config_init_where_a_directory_is_in_the_way(env, tmp_path):
    (tmp_path / "xdg" / "olmo-ctl" / "config.yaml").mkdir(parents=True)
    p = invoke("config", "init", "--force", env=env)
    assert p.returncode == 2 and len(p.stderr.splitlines()) == 1 and "is a directory" in p.stderr


def test_a_local_mistake_is_named_before_the_site_settings_placeholders(env, tmp_path):
    """No site settings (the GKE backend's run root and image are placeholders): a mistake that setting
    them would not fix is the line said, in the directory where `make demo` trains. A local device
    without --backend local; a run to continue that is not under ./runs, with the run meant; and the
    same with --run-root runs. A new GKE run still needs the placeholders set. Nothing is written."""
    (tmp_path / "runs" / "sub1").mkdir(parents=True)
    (tmp_path / "runs" / "sub1" / "run.yaml").write_text("run: sub1\n")  # a run's name is all that is read
    for args, says in [
        (
            ("submit", "--recipe", "smoke", "--device", "cpu-1", "--run", "foo"),
            "error: `cpu-1` is a local device; the GKE backend runs on TPU slices and GPU nodes; "
            "for a local run add --backend local",
        ),
        (
            ("resume-until-done", "--recipe", "smoke", "--device", "cpu-1", "--run", "foo"),
            "error: `cpu-1` is a local device; ",
        ),
        (
            ("resume-until-done", "sbu1"),
            "error: no run `sbu1` under ./runs, where this machine's runs are while no run root is set; "
            "did you mean `sub1`? ",
        ),
        (
            ("resume-until-done", "sbu1", "--run-root", "runs"),
            "error: no run `sbu1` under ./runs; did you mean `sub1`? ",
        ),
        (("submit", "--run", "sbu1"), "error: no run `sbu1` under ./runs, "),
        (
            ("submit", "--stage", "1", "--device", "tpu7x-128"),
            "error: site settings still hold placeholders (run_root, image)",
        ),
    ]:
        p = invoke(*args, env=env, cwd=tmp_path)
        assert p.returncode == 2 and len(p.stderr.splitlines()) == 1, (args, p.stderr)
        assert p.stderr.startswith(says), (args, p.stderr)
    assert sorted(x.name for x in (tmp_path / "runs").iterdir()) == ["sub1"]


# ---------------------------------------------------------------- make demo


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_demo_ends_with_what_to_run_next():
    out = subprocess.run(["make", "-n", "demo"], cwd=ROOT, capture_output=True, text=True, timeout=60).stdout
    run = re.search(r"resume-until-done .*--run (\S+) --run-root (\S+)", out.replace("\\\n", " "))
    assert run, out
    nexts = re.findall(r'^echo "\s*(olmo-ctl [^"]*)"', out, re.M)
    assert nexts and nexts[0] == f"olmo-ctl monitor {run.group(2)}/{run.group(1)}", out
    assert all(check(c) == [] for c in nexts)
    assert "source .venv/bin/activate" in out


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_demo_never_deletes_its_run_directory():
    """`make demo` again (after a Ctrl-C that left the trainer running, or after a finished demo) goes on
    with the same run: nothing under the run root is removed (tests/test_demo_bare.py runs it)."""
    out = subprocess.run(
        ["make", "-n", "-o", ".venv/.installed", "demo", "DEMO_ROOT=/tmp/somewhere"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert "resume-until-done" in out, out
    removing = [ln for ln in out.splitlines() if re.match(r"\s*(rm|find|mv)\s", ln)]
    assert not removing, out
