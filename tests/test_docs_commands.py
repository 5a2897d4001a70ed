"""Every `olmo-ctl ...` command shown in README.md and docs/*.md names a real command and real options.

Commands are taken from code blocks (lines that start with `olmo-ctl` or `$ olmo-ctl`, continued by a
trailing backslash) and from inline code spans in prose, and checked against the Typer application's
click command tree. Placeholders are tolerated: `...`, `…`, upper-case words (RUN, FILE), `[optional]`
brackets and `a|b` alternatives; an unknown command, subcommand or option fails the test.
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
