"""`make mutants`: mutmut over the core modules, one pass per module, each with its own narrow tests.

mutmut reads one ``[tool.mutmut]`` (pyproject.toml, current folder) and keeps its state in
``./mutants``, so each pass runs in a folder of its own, ``mutants/<pass>/``: links to the sources,
the tests and the data they read, and a pyproject.toml whose ``[tool.mutmut]`` is the shared one
with the pass's ``only_mutate`` and ``pytest_add_cli_args_test_selection`` (``[tool.leank-mutants.<pass>]``).
``names`` there narrows the pass to mutant-name globs (the functions of one concern, e.g. the loss
of module.py). Every pass starts from scratch, so a rerun after a test change measures the new tests.

mutmut's own output goes to ``mutants/<pass>/mutmut.log``. Prints one line per pass (killed / timeout / survived / no tests / other) and writes
``mutants/<pass>/summary.json`` with the surviving mutants' names (``mutmut show NAME`` in that folder).
Run: ``python tests/mutation_passes.py [PASS ...]`` (default: every pass), or ``make mutants [MODULE=rule]``;
``--report`` only reads the folders again (a pass stopped part way counts its unrun mutants as not run);
``--survivors`` reruns, on the tests as they are now, only the survivors of each pass's last run (the
"after" of a test change: the mutants killed before stay killed, the survivors are tried again);
``PASS --only GLOB[,GLOB]`` runs only the mutants of one pass whose names match (a quick try of a pass).
Not a test module (not collected by pytest).
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: mutmut depends on toml there
    import toml as tomllib

ROOT = Path(__file__).resolve().parent.parent
LINKED = ("leank_infer", "leank_train", "tests", "hub", "recipes")
# the console script, not `python -m mutmut`: -m puts the current folder (the unmutated links) first on sys.path
MUTMUT = str(Path(sys.executable).parent / "mutmut")


def _toml_value(value: object) -> str:
    # strings, numbers, booleans and lists of them: JSON writes them as valid TOML
    return json.dumps(value)


def pass_config(pyproject: dict, name: str) -> tuple[dict, list[str]]:
    """The ``[tool.mutmut]`` of pass ``name`` and its mutant-name globs."""
    base = dict(pyproject["tool"]["mutmut"])
    spec = dict(pyproject["tool"]["leank-mutants"][name])
    names = spec.pop("names", [])
    base.update(spec)
    return base, names


def _pyproject_text(pyproject_path: Path, mutmut: dict) -> str:
    """The repo's pyproject.toml with its ``[tool.mutmut]`` and pass tables replaced by ``mutmut``."""
    out, skipping = [], False
    for line in pyproject_path.read_text().splitlines():
        if line.startswith("[") and line[1:2].isalpha():
            skipping = line.startswith(("[tool.mutmut]", "[tool.leank-mutants"))
        if not skipping:
            out.append(line)
    out.append("[tool.mutmut]")
    out += [f"{k} = {_toml_value(v)}" for k, v in mutmut.items()]
    return "\n".join(out) + "\n"


def _statuses(folder: Path, env: dict) -> dict[str, str]:
    done = subprocess.run([MUTMUT, "results", "--all", "true"], cwd=folder, env=env,
                          capture_output=True, text=True, check=True)
    out = {}
    for line in done.stdout.splitlines():
        if ": " in line:
            key, status = line.strip().rsplit(": ", 1)
            out[key] = status
    return out


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return env


def run_pass(name: str, pyproject: dict, max_children: int = 1, only: list[str] | None = None) -> dict:
    mutmut, names = pass_config(pyproject, name)
    names = only or names  # --only: a part of the pass (e.g. one function's mutants), to try a pass quickly
    folder = ROOT / "mutants" / name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for item in LINKED:
        if (ROOT / item).exists():
            (folder / item).symlink_to(ROOT / item)
    (folder / "pyproject.toml").write_text(_pyproject_text(ROOT / "pyproject.toml", mutmut))
    # one thread per test process: the CPU-time limit of a mutant then means wall time, and the pass
    # leaves the other cores alone. No PYTHONPATH: mutmut puts its copy first on sys.path itself, and
    # naming that folder before it exists makes Python cache it as absent (the imports then fall through
    # to an editable install of leank elsewhere).
    env = _env()
    start = time.monotonic()
    with open(folder / "mutmut.log", "w") as log:
        run = subprocess.run([MUTMUT, "run", "--max-children", str(max_children), *names],
                             cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT)
    return summarize(name, pyproject, env, run.returncode, round((time.monotonic() - start) / 60, 1), only)


def rerun_survivors(name: str, pyproject: dict, max_children: int = 1) -> dict:
    """Run again, on the tests as they are now, only the mutants pass ``name`` left alive (its summary.json);
    its killed mutants stay killed. The stats (which test reaches which function) are collected afresh."""
    folder = ROOT / "mutants" / name
    earlier = json.loads((folder / "summary.json").read_text())
    # the pass's current settings (its test selection may have grown), the stats collected afresh
    text = _pyproject_text(ROOT / "pyproject.toml", pass_config(pyproject, name)[0])
    for where in (folder, folder / "mutants"):  # mutmut reads the first, its test runs the copy in the second
        (where / "pyproject.toml").write_text(text)
    (folder / "mutants" / "mutmut-stats.json").unlink(missing_ok=True)
    # mutmut copied the tests when the pass began and does not copy them again: the copy is refreshed here
    shutil.copytree(ROOT / "tests", folder / "mutants" / "tests", dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = _env()
    start = time.monotonic()
    code = 0
    if earlier["survived"]:
        with open(folder / "mutmut-rerun.log", "w") as log:
            code = subprocess.run([MUTMUT, "run", "--max-children", str(max_children), *earlier["survived"]],
                                  cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    minutes = round((time.monotonic() - start) / 60, 1)
    summary = summarize(name, pyproject, env, code, minutes)
    summary["rerun_of"] = {"survived": earlier["survived"], "minutes": earlier.get("minutes")}
    (folder / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def summarize(name: str, pyproject: dict, env: dict | None = None, exit_code: int | None = None,
              minutes: float | None = None, only: list[str] | None = None) -> dict:
    """Counts and survivors of pass ``name`` from its folder (also of a pass stopped part way:
    its unrun mutants count as "not checked"); ``only``: the mutant-name globs a partial run was given."""
    mutmut, names = pass_config(pyproject, name)
    names = only or names
    folder = ROOT / "mutants" / name
    if minutes is None and (folder / "summary.json").is_file():  # --report: keep the run's own time
        earlier = json.loads((folder / "summary.json").read_text())
        exit_code, minutes = earlier.get("mutmut_exit"), earlier.get("minutes")
    statuses = _statuses(folder, env if env is not None else _env())
    if names:
        statuses = {k: v for k, v in statuses.items() if any(fnmatch.fnmatch(k, g) for g in names)}
    counts: dict[str, int] = {}
    for status in statuses.values():
        counts[status] = counts.get(status, 0) + 1
    summary = {
        "pass": name, "mutmut_exit": exit_code, "minutes": minutes,
        "only_mutate": mutmut.get("only_mutate"), "names": names,
        "tests": mutmut.get("pytest_add_cli_args_test_selection"), "mutants": len(statuses), "counts": counts,
        "survived": sorted(k for k, v in statuses.items() if v == "survived"),
        "no_tests": sorted(k for k, v in statuses.items() if v == "no tests"),
    }
    (folder / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def main(argv: list[str]) -> int:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    passes = list(pyproject["tool"]["leank-mutants"])
    report = "--report" in argv  # only read what earlier (maybe stopped) passes left in mutants/<pass>/
    survivors = "--survivors" in argv  # rerun only what an earlier complete pass left alive
    only = None  # --only GLOB[,GLOB]: run these mutants of the pass only (a quick try of a pass)
    if "--only" in argv:
        i = argv.index("--only")
        only = argv[i + 1].split(",") if i + 1 < len(argv) else []
        argv = argv[:i] + argv[i + 2:]
    argv = [a for a in argv if a not in ("--report", "--survivors")]
    chosen = argv or passes
    unknown = [p for p in chosen if p not in passes]
    if unknown:
        print(f"unknown pass {unknown}; passes: {passes}", file=sys.stderr)
        return 2
    if report or survivors:
        chosen = [p for p in chosen if (ROOT / "mutants" / p / "summary.json" if survivors else
                                        ROOT / "mutants" / p / "mutants").exists()]
    if only is not None and (survivors or report or len(chosen) != 1 or not only):
        print("--only GLOB[,GLOB] takes one pass, and neither --report nor --survivors", file=sys.stderr)
        return 2
    run = rerun_survivors if survivors else run_pass
    rows = [summarize(p, pyproject) if report else run_pass(p, pyproject, only=only) if only else run(p, pyproject)
            for p in chosen]
    print("\n| pass | mutants | killed | timeout | survived | no tests | not run | other | minutes |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        c = dict(r["counts"])
        cols = [c.pop(k, 0) for k in ("killed", "timeout", "survived", "no tests", "not checked")]
        print(f"| {r['pass']} | {r['mutants']} | " + " | ".join(map(str, cols)) + f" | {sum(c.values())} | {r['minutes']} |")
        for s in r["survived"]:
            print(f"    survived: {s}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
