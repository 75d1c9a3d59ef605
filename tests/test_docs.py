"""The docs are true to the code: the site builds strictly and offline, every code block of the README and
the docs runs (or says why it cannot here), every ``leank ...`` command shown parses with the real
parser, the README's mask table is the generator's output, and no file cites a document outside the repo.

A code block is run, or checked, by its fence language: ``python`` blocks run in order, one namespace per
page, from the repository root; ``bash`` blocks hold ``leank`` commands (parsed, not run: training takes
minutes) and ``make`` targets (which must exist). A block that needs what a test machine lacks is marked
on the line above it with ``<!-- test: skip needs a GPU | network | vLLM (...) -->`` and skipped with that
reason; any other command in a bash block fails the test.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted([ROOT / "README.md", *(p for p in DOCS.rglob("*.md") if "hooks" not in p.parts)])
CARDS = sorted((ROOT / "hub").glob("*/README.md"))  # the mask pages of the site are these cards
FENCE = re.compile(r"(?:^<!-- test: skip (?P<skip>[^\n]*?) -->\n)?^```(?P<lang>\w*)[^\n]*\n(?P<body>.*?)^```",
                   re.M | re.S)
SKIP_REASONS = ("needs a GPU", "needs GPUs", "needs network", "needs vLLM")
SHELL = ("bash", "sh", "shell", "console")
OPERATORS = {">", ">>", "|", "&&", "||", ";", "2>&1", "&"}


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def hooks() -> ModuleType:
    """docs/hooks/leank_docs.py, the build's generator of pages and tables."""
    if "leank_docs_hooks" not in sys.modules:
        spec = importlib.util.spec_from_file_location("leank_docs_hooks", DOCS / "hooks" / "leank_docs.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["leank_docs_hooks"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["leank_docs_hooks"]


def blocks(path: Path) -> list[dict[str, str]]:
    """The fenced code blocks of a Markdown file: language, body, skip reason (or None), line number."""
    text = path.read_text()
    return [{"lang": m["lang"], "body": m["body"], "skip": m["skip"], "line": text.count("\n", 0, m.start()) + 1}
            for m in FENCE.finditer(text)]


def code_texts(path: Path) -> list[tuple[int, str]]:
    """Every piece of code a reader may copy from a page: each line of a shell block (continuations joined),
    and each inline code span outside the blocks; with its line number."""
    text = path.read_text()
    out: list[tuple[int, str]] = []
    for b in blocks(path):
        if b["lang"] in SHELL:
            for i, line in enumerate(b["body"].replace("\\\n", " ").splitlines()):
                out.append((b["line"] + i + 1, line))
    prose = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    for m in re.finditer(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", prose, re.S):  # a span may wrap a line
        out.append((prose.count("\n", 0, m.start()) + 1, " ".join(m.group(2).split())))
    return out


def leank_invocations(code: str) -> list[list[str]]:
    """The ``leank`` command lines in a piece of shell code: the words after ``leank`` (also after
    ``$(which leank)``, inside ``--wrap "srun leank ..."``) up to a shell operator or comment."""
    try:
        words = shlex.split(code, comments=True)
    except ValueError:  # not shell (an unbalanced quote in prose code): nothing to parse
        return []
    found: list[list[str]] = []
    i = 0
    while i < len(words):
        word, i = words[i], i + 1
        if " " in word:  # a quoted command line (sbatch --wrap "...")
            found += leank_invocations(word)
        elif word in ("leank", "leank)") or word.endswith("/bin/leank"):
            args = []
            while i < len(words) and not (words[i] in OPERATORS or words[i].startswith((">", "2>"))):
                args.append(words[i])
                i += 1
            if args and re.fullmatch(r"[a-z]+", args[0]):
                found.append(args)  # its arguments are not searched again (`--methods full leank`)
    return found


def all_invocations() -> list[tuple[str, list[str]]]:
    out = []
    for path in [*PAGES, *CARDS]:
        for line, code in code_texts(path):
            for args in leank_invocations(code):
                out.append((f"{rel(path)}:{line}", args))
    return out


def parse_only(args: list[str]) -> None:
    """Parse a ``leank`` command line with the parser ``leank`` itself uses, without running it."""
    from leank_infer import cli

    name, argv = args[0], args[1:]
    assert name in cli.COMMANDS, f"unknown command {name!r}"
    if not argv:  # a command named in prose (`leank run`), not a command line
        return
    func = cli._load(name)
    if "--help" in argv or "-h" in argv:  # the parser prints its help and exits 0
        with contextlib.redirect_stdout(io.StringIO()), pytest.raises(SystemExit) as done:
            func(["--help"]) if name in cli.RAW_ARGV else cli.command_parser(func, f"leank {name}").parse_args(["--help"])
        assert done.value.code in (0, None)
        return
    if name in cli.RAW_ARGV:  # fit: LightningCLI's own parser; --print_config parses and stops
        from leank_train.cli import run_cli

        with contextlib.redirect_stdout(io.StringIO()), pytest.raises(SystemExit) as done:
            run_cli(["fit", *argv, "--print_config"])
        assert done.value.code in (0, None)
        return
    cli.parse(func, argv, f"leank {name}")


# ---- the site ------------------------------------------------------------------------------------------------
def test_docs_build_strictly_and_offline(tmp_path):
    """`mkdocs build --strict`: a broken link or anchor, a page missing from the nav, a docstring mkdocstrings
    cannot read, any warning fails it. Proxies that refuse every connection make a build that fetches fail."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "HF_HUB_OFFLINE": "1",
           "HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9", "NO_PROXY": ""}
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                           "-d", str(site)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    html = {p: p.read_text(errors="replace") for p in site.rglob("*.html")}
    remote = re.compile(r"<(?:script|link)[^>]+(?:src|href)=\"https?://")  # fonts, CDNs: the site works offline too
    assert not [page for page, t in html.items() if remote.search(t)]
    for folder in hooks().mask_folders():  # a page per published mask, its figures beside it
        assert (site / "masks" / folder.name / "index.html").is_file()
        assert (site / "masks" / folder.name / "pattern.png").is_file()
    cli_page = html[site / "reference" / "cli" / "index.html"]
    assert "usage: leank run" in cli_page and "usage: leank eval" in cli_page
    api_page = html[site / "reference" / "api" / "index.html"]
    assert "from_pretrained" in api_page and "LeanKCache" in api_page and ":class:" not in api_page


# ---- code blocks ---------------------------------------------------------------------------------------------
PYTHON_PAGES = [p for p in PAGES if any(b["lang"] == "python" for b in blocks(p))]


@pytest.mark.parametrize(
    "page",
    [pytest.param(p, marks=[pytest.mark.slow] if "LeanKModel" in p.read_text() else []) for p in PYTHON_PAGES],
    ids=rel,
)
def test_python_blocks_run(page, monkeypatch):
    """Every Python block of the page, in order, in one namespace (a later block uses an earlier one's names)."""
    monkeypatch.chdir(ROOT)
    namespace: dict = {"__name__": "docs_example"}
    ran = 0
    for b in blocks(page):
        if b["lang"] != "python":
            continue
        if b["skip"]:
            assert b["skip"].startswith(SKIP_REASONS), f"{rel(page)}:{b['line']}: skip reason {b['skip']!r}"
            continue
        code = compile(b["body"], f"{rel(page)}:{b['line']}", "exec")
        with contextlib.redirect_stdout(io.StringIO()):
            exec(code, namespace)
        ran += 1
    if not ran:
        pytest.skip("every Python block of this page is marked as needing what this machine lacks")


SHELL_BLOCKS = [(p, b) for p in PAGES for b in blocks(p) if b["lang"] in SHELL]


@pytest.mark.parametrize("page, block", SHELL_BLOCKS, ids=[f"{rel(p)}:{b['line']}" for p, b in SHELL_BLOCKS])
def test_shell_blocks_are_leank_commands_or_make_targets(page, block):
    """A shell block a reader copies either checks here (its `leank` commands parse, in the test below; its
    `make` targets exist) or says why it cannot."""
    if block["skip"]:
        assert block["skip"].startswith(SKIP_REASONS), f"skip reason {block['skip']!r}"
        pytest.skip(block["skip"])
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    for line in block["body"].replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if not words:
            continue
        if words[0] == "make":
            assert all(w in targets or "=" in w for w in words[1:]), f"{line!r}: no such make target"
        elif words[0] == "leank":
            assert leank_invocations(line), f"{line!r}: not a leank command line"
        else:
            pytest.fail(f"{line!r} is neither a leank command nor a make target: mark its block "
                        "<!-- test: skip needs ... --> with the reason it cannot run here")


# ---- leank commands ------------------------------------------------------------------------------------------
def test_every_leank_command_shown_parses(tmp_path, monkeypatch):
    """Each `leank ...` in the README, the docs and the mask cards (code blocks and inline code) parses with the
    real parser. Paths are read from a folder holding the repo's recipes/ and hub/, and the stage config that
    `leank run recipes/smollm2-135m.yaml --stage 1 --dump > stage1.yaml` writes (docs/training.md)."""
    import yaml

    from leank_train.pipeline import load_recipe
    from leank_train.recipe import stage_config

    for name in ("recipes", "hub"):
        (tmp_path / name).symlink_to(ROOT / name)
    stage1 = stage_config(load_recipe(ROOT / "recipes" / "smollm2-135m.yaml"), 1)
    (tmp_path / "stage1.yaml").write_text(yaml.safe_dump(stage1, sort_keys=False))
    monkeypatch.chdir(tmp_path)
    found = all_invocations()
    assert len({a[0] for _, a in found}) >= 6, "the docs show most commands"
    failures = []
    for where, args in found:
        try:
            parse_only(args)
        except BaseException as e:  # noqa: B036 - SystemExit and usage errors alike are failures to report
            failures.append(f"{where}: leank {shlex.join(args)}: {type(e).__name__}: {e}")
    assert not failures, "\n".join(failures)


def test_a_wrong_leank_command_is_caught():
    """The checks above can fail: an unknown option, a wrong type and an unknown command are each refused."""
    from leank_infer.cli_types import UsageError

    with pytest.raises(UsageError):
        parse_only(["eval", "hub/smollm2-135m-instruct", "--samplez", "3"])
    with pytest.raises(UsageError):
        parse_only(["bench", "--contexts", "many"])
    with pytest.raises(AssertionError, match="unknown command"):
        parse_only(["train", "recipes/smollm2-135m.yaml"])
    assert leank_invocations("torchrun --nproc_per_node 8 $(which leank) run r.yaml --x 1 > log") == [
        ["run", "r.yaml", "--x", "1"]]
    assert leank_invocations('sbatch --wrap "srun leank run r.yaml --trainer.devices 8"') == [
        ["run", "r.yaml", "--trainer.devices", "8"]]
    assert leank_invocations("leank eval m --methods full leank random") == [["eval", "m", "--methods", "full", "leank", "random"]]


# ---- README ---------------------------------------------------------------------------------------------------
def test_readme_is_short_and_its_links_resolve():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    missing = [link for link in links if "://" not in link and not (ROOT / link).exists()]
    assert not missing, missing


def test_readme_mask_table_is_the_generators_output():
    """The README's table of published masks is `python docs/hooks/leank_docs.py masks-table` as it prints now:
    a mask added, rebinarised or re-evaluated without refreshing the README fails here."""
    table = hooks().masks_table(lambda name: f"hub/{name}/")
    assert table in (ROOT / "README.md").read_text(), "refresh README.md with: python docs/hooks/leank_docs.py masks-table"


def test_the_table_headline_is_the_run_with_the_most_probes_at_the_shortest_length(tmp_path):
    """A card may hold a report run and a ratio sweep's rows at the same length: the table takes the run with
    more probes there (whichever was written last)."""
    def row(method, value, command, lost, length=1024, task="headline", n=None, both=0):
        return {"dataset_args": {"task": task, "length": length}, "metric_config": method, "value": value,
                "command": command,
                "metric_args": {"n": n, "paired_vs_full": {"both": both, "only_full": lost, "only_method": 0}}}

    for order in (1, -1):
        # the report run's probes are mostly ones neither answers: counted by n, not by the paired answers
        results = [row("full", 0.933, "report", 0), row("leank", 0.920, "report", 1),
                   row("leank", 0.3, "report", 1, task="niah_multivalue", n=75, both=22),
                   row("full", 1.0, "sweep", 0), row("leank", 1.0, "sweep", 0),
                   row("leank", 1.0, "sweep", 0, task="passkey", n=36, both=36),
                   row("leank", 0.5, "long", 9, length=4096), row("leank", 0.5, "long", 9, length=4096, task="passkey", n=500)]
        (tmp_path / "eval.json").write_text(json.dumps({"results": results[::order]}))
        h = hooks().headline(tmp_path)
        assert (h["command"], h["full"], h["leank"], h["lost"], h["length"]) == ("report", 0.933, 0.920, 1, 1024)


# ---- standing alone --------------------------------------------------------------------------------------------
def test_no_file_cites_a_document_outside_the_repository():
    """The design notes the project started from are not in the repository; nothing may cite them."""
    names = ["LEANK" + ".md", "DESIGN" + ".md"]
    try:
        files = subprocess.run(["git", "-C", str(ROOT), "ls-files"], capture_output=True, text=True,
                               check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    hits = []
    for name in files:
        path = ROOT / name
        if path.is_file() and path.suffix not in (".png", ".safetensors"):
            text = path.read_text(errors="replace")
            hits += [f"{name}: {n}" for n in names if n in text]
    assert not hits, hits


def test_the_recipes_table_shows_each_recipes_prompt_lengths_and_measured_cpu_time(tmp_path):
    """Issue #34: the recipes table says at which prompt lengths a recipe trains and, from its ``# CPU time:``
    header comment (where the measurement sits with its command), what its run cost; a paragraph over two
    comment lines is one cell, cut at its first sentence; a recipe without one gets an empty cell."""
    h = hooks()
    recipe = tmp_path / "r.yaml"
    recipe.write_text("# LeanK recipe: x\n# CPU time: stage 2 (40 steps), 15 s a step of one core\n"
                      "# (1 thread), peak 3.4 GB. Command: docs/training.md.\n# Other text.\n\nratio: 0.7\n")
    assert h.cpu_time(recipe) == "stage 2 (40 steps), 15 s a step of one core (1 thread), peak 3.4 GB"
    recipe.write_text("# LeanK recipe: x\n\nratio: 0.7\n")
    assert h.cpu_time(recipe) == ""
    table = h.recipes_table(lambda name: name)
    row = next(line for line in table.splitlines() if "`recipes/smollm2-135m-s3-8k.yaml`" in line)
    assert "| 1,000-8,000 |" in row and "15 s of one core a step" in row
    assert "| 500-2,000 |" in next(line for line in table.splitlines() if "`recipes/smollm2-135m.yaml`" in line)


# ---- the first hour ----------------------------------------------------------------------------------------------
ISSUE_REF = re.compile(r"\b[Ii]ssues? #?\d+|(?<![\w/.-])#\d+\b")


def issue_references(text: str) -> list[str]:
    """``#22``, ``issue 34``: references to a tracker a reader of the docs cannot follow (an upstream
    ``owner/repo#123`` names its repository and is fine)."""
    return [m.group(0) for m in ISSUE_REF.finditer(text)]


def test_no_page_cites_an_issue_number():
    """The docs say what the code does; an issue number belongs to git history, not to a page."""
    assert issue_references("fixed in #22, see issue 34 and Issue #31's item") == ["#22", "issue 34", "Issue #31"]
    assert issue_references("upstream triton-lang/triton#11584; [link](#lengths-of-use)") == []
    hits = [f"{rel(p)}: {ref}" for p in [*PAGES, *CARDS] for ref in issue_references(p.read_text())]
    assert not hits, hits


def quick_start_output(page: Path) -> str:
    """What the page's first Python block (the quick start) prints, run from the repository root."""
    code = next(b for b in blocks(page) if b["lang"] == "python")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code["body"], f"{rel(page)}:{code['line']}", "exec"), {"__name__": "docs_example"})
    return out.getvalue()


@pytest.mark.slow
def test_the_quick_start_prunes_and_says_so(monkeypatch):
    """The README's and the quick start page's first example is one block; its prompt is longer than the tokens
    kept whole, so the cache of that generate call holds less than a dense one, and the page quotes what it
    prints."""
    monkeypatch.chdir(ROOT)
    readme, page = ROOT / "README.md", DOCS / "quickstart.md"
    first = [next(b["body"] for b in blocks(p) if b["lang"] == "python") for p in (readme, page)]
    assert first[0] == first[1], "README.md and docs/quickstart.md show different quick starts"
    printed = quick_start_output(page)
    share = re.search(r"(\d+) tokens: KV ([\d,]+) bytes, (\d+)% of dense ([\d,]+)", printed)
    kept = re.search(r"kept whole: (\d+), pruned: (\d+)", printed)
    assert share and kept, printed
    assert int(share[3]) < 100 and int(kept[2]) > 0, printed
    assert int(kept[2]) < int(share[1])  # the pruned tokens are the cache's, and fewer than all of it
    for p in (readme, page):  # the quoted output is what it prints now
        assert f"`{share[0]}`" in p.read_text().replace("\n", " "), f"{rel(p)} quotes another output than {share[0]!r}"


def test_stats_byte_ratio_is_not_named_like_the_masks_ratio():
    """``mask.ratio`` is the fraction of K channels pruned; the bytes' quotient has a name of its own."""
    import torch

    from leank_infer import ChannelMask

    mask = ChannelMask.from_pretrained(ROOT / "hub" / "smollm2-135m-instruct-s3")
    b = mask.stats(dtype=torch.bfloat16)["bytes_per_token"]
    assert "ratio" not in b
    assert b["leank_over_dense"] == b["leank"] / b["dense"] != mask.ratio


def test_which_mask_reads_each_length_from_the_eval_record(tmp_path):
    """The recommendation's reasons come from eval.json: per length the run with the most probes, the positional
    rule's rows only for the positional row; and the pages that mention a choice of mask link to the one table."""
    def rows(command, length, full, leank, lost, n, rule=None, tasks=("a", "b")):
        head = {"task": "headline", "length": length, "tasks": list(tasks)}
        out = [{"dataset_args": head, "metric_config": "full", "value": full, "command": command, "metric_args": {}},
               {"dataset_args": head, "metric_config": "leank", "value": leank, "command": command,
                "metric_args": {"rule": rule, "paired_vs_full": {"only_full": lost, "only_method": 0}}}]
        return out + [{"dataset_args": {"task": t, "length": length}, "metric_config": "full", "value": 1.0,
                       "command": command, "metric_args": {"n": n}} for t in tasks]

    record = [*rows("small", 1024, 1.0, 0.9, 2, 10), *rows("big", 1024, 0.95, 0.93, 1, 25),
              *rows("pos", 1024, 0.95, 0.8, 6, 25, rule="positional"), *rows("long", 4096, 1.0, 0.98, 2, 34, tasks="abc")]
    (tmp_path / "eval.json").write_text(json.dumps({"results": record}))
    h = hooks()
    plain, positional = h.headlines_by_length(tmp_path), h.headlines_by_length(tmp_path, positional=True)
    assert (plain[1024]["command"], plain[1024]["leank"], plain[1024]["lost"], plain[1024]["probes"]) == ("big", 0.93, 1, 50)
    assert (plain[4096]["probes"], plain[4096]["tasks"]) == (102, 3)
    assert (positional[1024]["command"], positional[1024]["leank"]) == ("pos", 0.8) and 4096 not in positional
    table = h.which_mask_table(lambda name: name)
    for rec in h.RECOMMENDED:
        assert f"[{rec['mask']}]" in table
    for page in (ROOT / "README.md", DOCS / "index.md", DOCS / "quickstart.md", DOCS / "evaluation.md", DOCS / "vllm.md"):
        assert "masks.md#which-mask" in page.read_text(), f"{rel(page)} does not link to the Which mask table"
