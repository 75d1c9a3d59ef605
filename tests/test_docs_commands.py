"""Every command on the site can be rerun from a fresh clone: each path a command shown in the README, the docs
pages or a mask card reads is either in the repository (committed) or written by an earlier command on the same
page (its ``--out_dir``, ``--mask_dir``, ``--json``, ``--save``, ``--plot``..., a ``leank run`` recipe's
``out_dir``, a ``make`` target's outputs, a ``> file`` redirect).

A command is a shell line of a code block or an inline code span whose first word (after ``VAR=value``,
``time`` or ``/usr/bin/time -v``) is ``leank``, ``python``/``python3`` (or a virtual environment's), ``make``
or ``torchrun``; a path is a word whose first component is a top-level entry of the repository or ``runs/``
(where runs write). Hub repo ids (``me/leank-smollm2``) and paths outside the repository are not checked.
"""

from __future__ import annotations

import html
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "hub").glob("*/README.md")])
FENCE = re.compile(r"^```(?P<lang>\w*)[^\n]*\n(?P<body>.*?)^```", re.M | re.S)
SHELL = ("bash", "sh", "shell", "console")
HTML_CODE = re.compile(r"<code>(.*?)</code>", re.S)
SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)
HEADS = ("leank", "python", "python3", "make", "torchrun")
#: the options whose value is a path the command writes
OUTPUT_FLAGS = {"--out_dir", "--out-dir", "--mask_dir", "--mask-dir", "--json", "--save", "--plot", "--sweep-plot",
                "--out", "--output", "-o"}
OPERATORS = {"&&", "||", ";", "|", "&"}


def tracked() -> set[str]:
    """The repository's files and folders: git's tracked files and every folder above them (the files of a
    fresh clone); without git, what is on disk except ``runs/``."""
    try:
        files = subprocess.run(["git", "-C", str(ROOT), "ls-files"], capture_output=True, text=True,
                               check=True).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):
        files = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.parts[len(ROOT.parts)] != "runs"]
    out = set()
    for f in filter(None, files):
        parts = Path(f).parts
        out.update("/".join(parts[:i]) for i in range(1, len(parts) + 1))
    return out


TRACKED = tracked()
TOP = {p for p in TRACKED if "/" not in p} | {"runs"}


def page_commands(text: str) -> list[tuple[int, str]]:
    """The code a reader may copy, in page order: each line of a shell block (continuations joined) and each
    inline code span outside the blocks; with its line number."""
    found: list[tuple[int, str]] = []
    for m in FENCE.finditer(text):
        if m["lang"] in SHELL:
            start = text.count("\n", 0, m.start()) + 1
            for i, line in enumerate(m["body"].replace("\\\n", " ").splitlines()):
                found.append((start + i + 1, line))
    prose = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    for m in SPAN.finditer(prose):
        found.append((prose.count("\n", 0, m.start()) + 1, " ".join(m.group(2).split())))
    for m in HTML_CODE.finditer(prose):  # the cards' folded commands: escaped HTML code elements
        found.append((prose.count("\n", 0, m.start()) + 1, " ".join(html.unescape(m.group(1)).split())))
    return sorted(found, key=lambda t: t[0])


def segments(code: str) -> list[list[str]]:
    """The commands of a piece of shell code (split at ``&&``, ``;``, ``|``...), each without its leading
    ``VAR=value``, ``time`` and ``/usr/bin/time -v``; only those that start with a known command."""
    try:
        words = shlex.split(code, comments=True)
    except ValueError:  # not shell code (prose in backticks)
        return []
    out, cur = [], []
    for w in [*words, ";"]:
        if w in OPERATORS:
            while cur and (re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", cur[0]) or cur[0] in ("time", "/usr/bin/time")
                           or (cur[0].startswith("-") and len(cur) > 1)):
                cur = cur[1:]
            if cur and (cur[0] in HEADS or cur[0].endswith(("/python", "/leank"))):
                out.append(cur)
            cur = []
        else:
            cur.append(w)
    return out


def is_path(word: str) -> bool:
    """A word naming a path in the repository's tree (not a Hub id, an option, a URL or a placeholder)."""
    if any(c in word for c in " <>{}*$") or "://" in word or word.startswith("-"):
        return False
    first = word.split("/", 1)[0]
    return "/" in word and first in TOP


def recipe_out_dir(recipe: str) -> str | None:
    """The ``out_dir`` a recipe (or the recipe it includes with ``config:``) names."""
    path = ROOT / recipe
    while path.is_file():
        data = yaml.safe_load(path.read_text()) or {}
        if "out_dir" in data:
            return str(data["out_dir"])
        if "config" not in data:
            return None
        path = path.parent / data["config"]
    return None


def make_commands(target: str) -> list[list[str]]:
    """The commands a Makefile target runs, its variables substituted and ``for v in a b; do ...; done``
    loops unrolled (enough for this repository's Makefile)."""
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    variables = {m[1]: m[2].strip() for m in re.finditer(r"^([A-Z_]+)\s*[:?]?=(.*)$", text, re.M)}
    body = re.search(rf"^{re.escape(target)}:[^\n]*\n((?:\t[^\n]*\n?)*)", text, re.M)
    if body is None:
        return []
    out = []
    for line in body.group(1).splitlines():
        line = line.strip()
        for _ in range(5):  # nested variables
            line = re.sub(r"\$\(([A-Z_]+)\)", lambda m: variables.get(m[1], m[0]), line)
        loop = re.fullmatch(r"for (\w+) in ([^;]+); do (.*); done", line)
        lines = ([loop[3].replace(f"$${loop[1]}", v) for v in loop[2].split()] if loop else [line])
        for one in lines:
            out += segments(one.replace("|| exit 1", ""))
    return out


def outputs(words: list[str]) -> set[str]:
    """The paths a command writes."""
    out = set()
    for i, w in enumerate(words):
        flag, eq, value = w.partition("=")
        if eq and flag in OUTPUT_FLAGS:
            out.add(value)
        elif w in OUTPUT_FLAGS and i + 1 < len(words):
            out.add(words[i + 1])
    head = words[0].rsplit("/", 1)[-1]
    if head == "leank" and words[1:2] == ["run"] and len(words) > 2 and not any(
            w.startswith("--out_dir") for w in words):
        out.add(recipe_out_dir(words[2]) or "")
    if head == "leank" and words[1:2] == ["import"] and len(words) > 3:
        out.add(words[3])
    if head == "make":
        for target in words[1:]:
            for cmd in make_commands(target):
                out |= outputs(cmd)
    return {p.rstrip("/") for p in out if p}


def redirects(code: str) -> set[str]:
    return set(re.findall(r"(?<![0-9&])>{1,2}\s*([\w./-]+)", code))


def unrunnable(text: str) -> list[str]:
    """Each ``line: path (in command)`` whose path is neither committed nor written earlier on the page."""
    produced: set[str] = set()
    bad = []
    for line, code in page_commands(text):
        for words in segments(code):
            made = outputs(words)
            for w in words[1:]:
                value = w.partition("=")[2] if w.startswith("--") and "=" in w else w
                if not is_path(value) or value.rstrip("/") in made:
                    continue
                path = value.rstrip("/")
                if path in TRACKED or any(path == p or path.startswith(p + "/") for p in produced):
                    continue
                bad.append(f"{line}: {value} (in `{' '.join(words)[:120]}`)")
            produced |= made
        produced |= redirects(code)
    return bad


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_a_command_reads_is_committed_or_made_earlier_on_the_page(page):
    bad = unrunnable(page.read_text())
    assert not bad, (f"{page.relative_to(ROOT)}: commands read paths a fresh clone does not have and no earlier "
                     "command on the page writes (name a committed hub/ folder, or show the command that makes it):\n"
                     + "\n".join(bad))


def test_the_check_catches_a_path_nobody_makes():
    """A run's folder read before any command writes it fails; after a command writes it (or a make target, or a
    recipe's out_dir), it passes; committed folders and Hub ids pass."""
    assert unrunnable("`python benchmarks/eval_masks.py runs/cand/b8/mask --lengths 1024 --json runs/x.json`") == [
        "1: runs/cand/b8/mask (in `python benchmarks/eval_masks.py runs/cand/b8/mask --lengths 1024 --json runs/x.json`)"]
    assert unrunnable("`leank eval runs/a/mask`\n\n`leank run recipes/smollm2-135m.yaml --out_dir runs/a`") != []
    assert unrunnable("`leank run recipes/smollm2-135m.yaml --out_dir runs/a`\n\n`leank eval runs/a/mask`") == []
    assert unrunnable("```bash\nleank run recipes/smollm2-135m.yaml --quick\nleank eval runs/smollm2-135m/mask\n"
                      "leank push runs/smollm2-135m/mask me/leank-smollm2\n```\n") == []
    assert unrunnable("`make sweep` then `python benchmarks/eval_masks.py runs/sweep/r50 --lengths 1024`") == []
    assert unrunnable("`python benchmarks/eval_masks.py runs/sweep/r50 --lengths 1024`") != []
    assert unrunnable("`leank eval hub/smollm2-135m-instruct-s3 --json runs/e.json`") == []
    assert unrunnable("`leank eval hub/no-such-mask`") != []
