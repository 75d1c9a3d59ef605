"""The code layout docs/architecture.md ("The layers") describes holds: folders import only the folders below them,
no import cycle, and leank_infer never imports leank_train (read from the source with ``ast``, nothing run)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("leank_infer", "leank_train")
# leank_infer's folders, lowest first: a module imports only from its own folder or one listed before it.
# Top level (the CLIs, bench, reference_import, the package facade) and vllm/ sit above them all.
INFER_ORDER = ("folders", "mask", "hub", "decode", "model")
# The only imports that reach up (deferred, inside a function): the Hub conveniences on the mask object
# (docs/architecture.md, "The layers"), ChannelMask.from_pretrained (download a revision to a folder) and push_to_hub
# (which writes a card for a bare mask, and the card reads the mask: publish sits above both), and the mask's bytes
# after a prefill, which end where the rule says the next query's recent part begins (decode.rule, torch only).
UPWARD = {
    ("leank_infer.mask.channel_mask", "leank_infer.hub.transfer"),
    ("leank_infer.mask.channel_mask", "leank_infer.hub.publish"),
    ("leank_infer.mask.channel_mask", "leank_infer.decode.rule"),
}
# The console script: one `leank` command for inference and training, so it may load leank_train's commands
# (and catch their errors) when they run, inside a function; never at import.
ENTRY_POINT = "leank_infer.cli"
# A deferred cycle in the evaluation CLI (evaluate borrows cli.one_line_errors), left to the CLI rework of #20.
PENDING = {("leank_train.evaluate", "leank_train.cli")}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _imports(name: str, path: Path, known: set[str]) -> tuple[set[str], set[str]]:
    """(module-level, deferred) imports of repo modules by module ``name``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    top_level = {id(n) for n in tree.body} | {
        id(s) for n in tree.body if isinstance(n, ast.If) for s in n.body + n.orelse  # if TYPE_CHECKING:
    }
    eager, deferred = set(), set()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for target in targets:
            while target and target not in known:  # `import a.b.c`: the deepest repo module named
                target = target.rpartition(".")[0]
            if target and target != name:
                (eager if id(node) in top_level else deferred).add(target)
    return eager, deferred


def _graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    mods = _modules()
    eager, deferred = {}, {}
    for name, path in mods.items():
        eager[name], deferred[name] = _imports(name, path, set(mods))
    return eager, deferred


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as a list of modules, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _folder(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "leank_infer" and len(parts) > 1 and parts[1] in INFER_ORDER else None


def test_no_import_cycle_and_the_only_upward_imports_are_listed():
    eager, deferred = _graph()
    assert _cycle(eager) is None, f"import cycle at module level: {' -> '.join(_cycle(eager))}"
    both = {m: (eager[m] | deferred[m]) - {t for s, t in UPWARD | PENDING if s == m} for m in eager}
    assert _cycle(both) is None, f"import cycle through a deferred import: {' -> '.join(_cycle(both))}"
    for src, dst in UPWARD:  # the exceptions exist (else drop them from the list)
        assert dst in deferred[src], f"{src} no longer imports {dst}: remove it from UPWARD"


def test_leank_infer_never_imports_leank_train():
    """Only the ``leank`` entry point reaches leank_train, deferred (its training commands, its error types)."""
    eager, deferred = _graph()
    bad = sorted(f"{m} -> {t}" for m in eager if m.startswith("leank_infer")
                 for t in eager[m] | (deferred[m] if m != ENTRY_POINT else set()) if t.startswith("leank_train"))
    assert not bad, bad


def test_leank_infer_folders_import_only_the_folders_below():
    eager, deferred = _graph()
    rank = {f: i for i, f in enumerate(INFER_ORDER)}
    bad = []
    for module in eager:
        here = _folder(module)
        if here is None:
            continue
        for target in eager[module] | deferred[module]:
            there = _folder(target)
            above = target.startswith("leank_infer") and there is None
            if (there is not None and rank[there] > rank[here] or above) and (module, target) not in UPWARD:
                bad.append(f"{module} ({here}) -> {target} ({there or 'top level'})")
    assert not bad, "imports that reach up the layout: " + "; ".join(sorted(bad))
