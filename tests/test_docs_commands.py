"""Every `olmo-ctl ...` command shown in README.md and docs/*.md names a real command and real options.

Commands are taken from code blocks (lines that start with `olmo-ctl` or `$ olmo-ctl`, continued by a
trailing backslash) and from inline code spans in prose, and checked against the Typer application's
click command tree. Placeholders are tolerated: `...`, `…`, upper-case words (RUN, FILE), `[optional]`
brackets and `a|b` alternatives; an unknown command, subcommand or option fails the test.

Then the examples run: the code blocks' command lines of README.md and the pages a user reads next
(`EXAMPLE_PAGES`), and the commands `make demo` prints, in a directory as `make demo` leaves it (the
session's smoke run adopted as `runs/smoke-demo` and supervised to its final step by the Makefile's
own command line), in this process (helpers.cli.invoke): exit 0 and no traceback, or the `error:` line
a block shows. What cannot run here is skipped by the patterns of `SKIPPED`, each with its reason.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer.main

from olmo_ctl.cli import load_commands

APP = load_commands()  # every command registered
ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE = re.compile(r"(?<!`)`(olmo-ctl(?:\s[^`]*)?)`(?!`)")
PROMPT = re.compile(r"^\s*(?:\$\s+)?(olmo-ctl(?:\s.*)?)$")


def commands_in(path: Path) -> list[tuple[int, str]]:
    """(line number, command text) of every olmo-ctl command shown in a markdown file."""
    out: list[tuple[int, str]] = []
    in_code = False
    pending: tuple[int, str] | None = None
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line):
            in_code = not in_code
            pending = None
            continue
        if in_code:
            if pending is not None:
                text = pending[1] + " " + line.strip()
                if text.endswith("\\"):
                    pending = (pending[0], text[:-1].rstrip())
                else:
                    out.append((pending[0], text))
                    pending = None
                continue
            m = PROMPT.match(line)
            if m:
                text = m.group(1).strip()
                if text.endswith("\\"):
                    pending = (n, text[:-1].rstrip())
                else:
                    out.append((n, text))
        else:
            out.extend((n, m.group(1)) for m in INLINE.finditer(line))
    return out


def _tokens(text: str) -> list[str]:
    text = re.sub(r"\s#.*$", "", text)  # a shell comment
    try:
        toks = shlex.split(text)
    except ValueError:
        toks = text.split()
    out = []
    for t in toks:
        for part in t.split("|"):  # a|b alternatives, `--stage 1|2 | --recipe NAME|FILE`
            part = part.strip("[]{}(),;")
            if part:
                out.append(part)
    return out


def _is_placeholder(tok: str) -> bool:
    return tok in ("...", "…") or "..." in tok or "…" in tok or bool(re.fullmatch(r"[A-Z][A-Z0-9_./-]*", tok))


def _options(cmd) -> set[str]:
    opts = {"--help"}
    for p in cmd.params:
        opts.update(o for o in (*p.opts, *p.secondary_opts) if o.startswith("-"))
    return opts


def check(text: str) -> list[str]:
    """What is wrong with one shown command line (empty when it is fine)."""
    toks = _tokens(text)
    assert toks and toks[0] == "olmo-ctl", text
    cmd = typer.main.get_command(APP)
    path = ["olmo-ctl"]
    problems = []
    i = 1
    while hasattr(cmd, "commands") and i < len(toks):
        tok = toks[i]
        if tok.startswith("-"):
            break
        if _is_placeholder(tok):
            return problems  # `olmo-ctl COMMAND ...`, `olmo-ctl ...`: nothing more to check
        sub = cmd.commands.get(tok)
        if sub is None:
            return [f"`{' '.join(path)}` has no command `{tok}` (it has {', '.join(sorted(cmd.commands))})"]
        cmd, path, i = sub, [*path, tok], i + 1
    known = _options(cmd)
    for tok in toks[i:]:
        if not tok.startswith("-") or tok in ("-", "--") or re.fullmatch(r"-\d[\d.e-]*", tok):
            continue
        name = tok.split("=", 1)[0]
        if name not in known:
            problems.append(f"`{' '.join(path)}` has no option `{name}`")
    return problems


def shown() -> list[tuple[str, int, str]]:
    return [(p.relative_to(ROOT).as_posix(), n, text) for p in DOCS for n, text in commands_in(p)]


def test_readme_and_docs_show_commands():
    found = shown()
    files = {f for f, _, _ in found}
    assert "README.md" in files and len(files) > 3, files
    top = {_tokens(t)[1] for _, _, t in found if len(_tokens(t)) > 1}
    app_cmds = set(typer.main.get_command(APP).commands)
    assert app_cmds <= top, f"commands never shown in README.md or docs/: {sorted(app_cmds - top)}"


def test_every_shown_command_and_option_exists():
    bad = [f"{f}:{n}: {text}\n    {p}" for f, n, text in shown() for p in check(text)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    "text,ok",
    [
        ("olmo-ctl plan --stage 1 --device tpu7x-128", True),
        (
            "olmo-ctl plan --stage 1|2 | --recipe NAME|FILE --device D [--set k=v ...] [--mfu 0.4] [-o json]",
            True,
        ),
        ("olmo-ctl monitor RUN_DIR [--watch] [--interval 10] [-o json]", True),
        ("olmo-ctl convert hf-to-orbax ./hf gs://b/x --vocab-size=100278", True),
        ("olmo-ctl submit ... --dry-run", True),
        ("olmo-ctl ...", True),
        ("olmo-ctl submit --attempt -1 --dry-run", True),
        ("olmo-ctl launch --stage 1", False),  # no such command
        ("olmo-ctl convert hf-to-jax a b", False),  # no such subcommand
        ("olmo-ctl monitor runs/x --follow", False),  # no such option
        ("olmo-ctl plan --stage 1 --device v5p-8 --fast", False),
    ],
)
def test_the_checker_itself(text, ok):
    assert (check(text) == []) is ok, check(text)


def test_extraction(tmp_path):
    md = tmp_path / "x.md"
    md.write_text(
        "Run `olmo-ctl devices -o json` or `make demo`.\n"
        "```console\n$ olmo-ctl plan --stage 1 \\\n    --device v5p-8\noutput olmo-ctl not a command\n```\n"
        "```bash\nolmo-ctl data info --recipe smoke   # a comment\n```\n"
    )
    assert commands_in(md) == [
        (1, "olmo-ctl devices -o json"),
        (3, "olmo-ctl plan --stage 1 --device v5p-8"),
        (8, "olmo-ctl data info --recipe smoke   # a comment"),
    ]


# Docs pages that other changes add; linked from README.md already. Remove a name once its page exists.
PAGES_TO_COME: set[str] = set()
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    out, in_code = set(), False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            out.add(_slug(line.lstrip("#")))
    return out


def test_links_between_docs_resolve():
    bad = []
    for doc in DOCS:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            for target in LINK.findall(line):
                if re.match(r"[a-z]+:", target):
                    continue  # https:, mailto:
                file, _, anchor = target.partition("#")
                dest = (doc.parent / file).resolve() if file else doc
                rel = dest.relative_to(ROOT).as_posix() if dest.is_relative_to(ROOT) else str(dest)
                if not dest.exists():
                    if rel not in PAGES_TO_COME:
                        bad.append(f"{doc.name}:{n}: {target}: no such file")
                elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                    bad.append(f"{doc.name}:{n}: {target}: no such heading in {rel}")
    assert not bad, "\n".join(bad)


# ---------------------------------------------------------------- the examples run, after `make demo`

# The pages a new user reads after `make demo`. Their code blocks' command lines (not the fragments
# quoted in prose) run as written, one after another, in a directory as `make demo` leaves it, each
# with an empty user config: exit 0 and no traceback; a line the block shows as `error: ...` right
# below its command is that command's one line, exit 2.
EXAMPLE_PAGES = [
    "README.md",
    "docs/install.md",
    "docs/evaluation.md",
    "docs/verifying.md",
    "docs/ingredients.md",
    "docs/runs-logs-stop.md",
    "docs/monitoring-and-compare.md",
    "docs/data.md",
]
# What is not run, and why: a regular expression searched in the command line, and the reason.
SKIPPED = {
    r"gs://": "a bucket of the example's (gs://my-bucket, gs://b)",
    r"\bhf:|Olmo-3-1025-7B|\bhf/": "AI2's checkpoints, downloaded from Hugging Face first",
    r"--backend gke|^olmo-ctl (doctor|resize)\b": "a GKE cluster",
    r"^olmo-ctl sandbox\b": "a cluster on localhost (minutes)",
    r"^olmo-ctl preflight\b": "compiles the step for a TPU slice with libtpu (minutes)",
    r"\bolmo3-7b-s1\b|\bolmo2-32b-s\d": "a run of the GKE walk-through",
    r"\s-f\b|--watch\b": "follows until Ctrl-C",
    r"^olmo-ctl smoke\b|^olmo-ctl resume-until-done\b.*--(recipe|stage|model)\b": (
        "trains a new run (tens of seconds or more): the demo is the run trained here"
    ),
    r"^olmo-ctl \S+ (demo|twin|halt)(?![-\w])|runs/(soup-demo|smoke-straight|smoke-resumed|smoke-desync|"
    r"smoke-cpu1|smoke-resized-to-cpu2|t|mine|bugged)(?![-\w])": (
        "a run a page's walk-through trains with its own (skipped) commands, not `make demo`'s"
    ),
    r"\bbooks/|\bpapers/|\bdolma2/": "your own text files and tokenizer",
    r"\bRUN\b|\bA B\b|\[|\.\.\.": "a usage line or elided arguments, not an example",
}


def examples_in(path: Path) -> list[tuple[int, str, str | None]]:
    """(line number, command, the `error: ...` line the block shows below it or None) of every command
    line in a markdown file's code blocks (continued by a trailing backslash)."""
    lines = path.read_text().splitlines()
    out: list[tuple[int, str, str | None]] = []
    in_code, start, text = False, 0, ""
    for n, line in enumerate(lines, 1):
        if FENCE.match(line):
            in_code, text = not in_code, ""
            continue
        if not in_code:
            continue
        if text:
            text += " " + line.strip()
        else:
            m = PROMPT.match(line)
            if not m:
                continue
            start, text = n, m.group(1).strip()
        if text.endswith("\\"):
            text = text[:-1].rstrip()
            continue
        below = lines[n].strip() if n < len(lines) else ""
        out.append((start, text, below if below.startswith("error: ") else None))
        text = ""
    return out


def makefile_next_commands() -> list[str]:
    """The commands `make demo` prints to run next (its `echo`ed `olmo-ctl ...` lines)."""
    text = (ROOT / "Makefile").read_text()
    return [c.replace("$(DEMO_ROOT)", "runs") for c in re.findall(r'@echo "\s*(olmo-ctl [^"]*)"', text)]


def makefile_demo_command() -> list[str]:
    """`make demo`'s resume-until-done command line (its arguments), with DEMO_ROOT=runs."""
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    m = re.search(r"\$\(BIN\)/olmo-ctl (resume-until-done [^\n]*)", text)
    assert m, "the Makefile's demo target runs no resume-until-done"
    return shlex.split(m.group(1).replace("$(DEMO_ROOT)", "runs"))


def skipped(text: str) -> str | None:
    return next((why for pattern, why in SKIPPED.items() if re.search(pattern, text)), None)


def runnable_examples() -> list[tuple[str, str, str | None]]:
    """(where, command, shown error) of every example that runs after `make demo`."""
    out = [(f"{page}:{n}", text, err) for page in EXAMPLE_PAGES for n, text, err in examples_in(ROOT / page)]
    out += [("Makefile (demo's next commands)", c, None) for c in makefile_next_commands()]
    return [(where, text, err) for where, text, err in out if skipped(text) is None]


def test_the_examples_that_run_after_make_demo_are_found():
    ran = [text for _, text, _ in runnable_examples()]
    assert "olmo-ctl eval runs/smoke-demo/checkpoints/100" in ran
    assert "olmo-ctl monitor runs/smoke-demo" in ran  # the Makefile's next command
    assert any(t.startswith("olmo-ctl surgery soup runs/smoke-demo/") for t in ran)
    for text, why in [
        ("olmo-ctl monitor gs://my-bucket/runs/olmo3-7b-s1 --watch", "a bucket"),
        ("olmo-ctl logs twin --run-root runs --host 1 --tail 2", "a page's walk-through"),
        ("olmo-ctl monitor runs/soup-demo", "a page's walk-through"),
        ("olmo-ctl resume-until-done --recipe smoke --device cpu-1 --backend local --run demo", "trains"),
        ("olmo-ctl runs [--run-root ROOT] [-o json]", "a usage line"),
    ]:
        assert why in (skipped(text) or ""), text
    assert skipped("olmo-ctl data audit smoke-demo -o json") is None


@pytest.fixture(scope="module")
def demo(smoke_run, tmp_path_factory) -> Path:
    """A directory as `make demo` leaves it: `runs/smoke-demo`, the smoke recipe to its final step 100
    under resume-until-done (the Makefile's command line). Its first 40 steps are the session's smoke
    run (`smoke_run`, trained once for every test), adopted as the run's; the supervisor trains the rest."""
    from helpers.cli import clean_env, invoke
    from helpers.runs import copy_run

    from olmo_ctl.core.recipe import load_recipe
    from olmo_ctl.rundir import RunDir
    from olmo_ctl.supervise.attempts import data_fingerprint

    here = tmp_path_factory.mktemp("demo")
    run = copy_run(smoke_run, here / "runs" / "smoke-demo")
    r = load_recipe("smoke")
    RunDir(str(run)).create_run(r.to_dict(), r.fingerprint(), data_fingerprint(r), "cpu-1", adopt=True)
    p = invoke(*makefile_demo_command(), env=clean_env(here / "xdg"), cwd=here)
    assert p.returncode == 0 and "final step 100/100 committed" in p.stdout, (
        p.stdout[-3000:],
        p.stderr[-3000:],
    )
    return here


def _shell_words(text: str) -> list[str]:
    """The command's words, up to a pipe or a redirection (what the shell hands the command)."""
    words = shlex.split(re.sub(r"\s#.*$", "", text))
    cut = next((i for i, w in enumerate(words) if w in ("|", ">", ">>", "2>&1")), len(words))
    return words[1:cut]


def test_the_examples_run_as_written_after_make_demo(demo, tmp_path):
    from helpers.cli import clean_env, invoke

    bad = []
    for k, (where, text, shown) in enumerate(runnable_examples()):
        p = invoke(*_shell_words(text), env=clean_env(tmp_path / f"xdg{k}"), cwd=demo)
        both = p.stdout + p.stderr
        if "Traceback" in both:
            bad.append(f"{where}: {text}\n    a traceback: {both[-1500:]}")
        elif shown is None and p.returncode != 0:
            bad.append(f"{where}: {text}\n    exit {p.returncode}: {p.stderr.strip()[-500:]}")
        elif shown is not None and (p.returncode != 2 or not p.stderr.startswith(shown.split("/")[0])):
            bad.append(
                f"{where}: {text}\n    shown: {shown}\n    got (exit {p.returncode}): {p.stderr.strip()}"
            )
    assert not bad, "\n".join(bad)
