"""The package as pip installs it: build the wheel, find the files the code reads at run time, install the wheel
into a scratch folder and run code from there (tests/test_wheel.py, tests/vllm_plugin/test_vllm_wheel.py).

Offline: the wheel is built with the running environment's setuptools (``--no-build-isolation``, the ``dev``
extra has it) from a copy of the sources (an in-tree build would leave ``build/`` in the repo, and a stale
``build/lib`` can put a file the package data no longer lists back into the wheel). The installed copy runs in
a fresh interpreter whose working directory is outside the repo and whose ``PYTHONPATH`` is the scratch folder
only, so ``import leank_infer`` cannot find the repo's copy (its dependencies come from the environment).
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("leank_infer", "leank_train")
_STRING = r"""\s*["']([^"']+)["']"""
# the forms in which a module names a file next to it: Path(__file__).with_name("x"), Path(__file__).parent / "x",
# importlib.resources.files(<package>).joinpath("x") or / "x"
_NEXT_TO_MODULE = re.compile(r"__file__\)(?:\.resolve\(\))?(?:\.with_name\(|\.parent\s*/)" + _STRING)
_LOADER_WORDS = re.compile(r"__file__|\bfiles\(|\bresources\.")
_FOREIGN = re.compile(r"""\bfiles\(\s*["'](?!leank_)""")
_RESOURCE = re.compile(r"files\(\s*(__package__|__name__|[\"']leank_[\w.]+[\"'])\s*\)\s*(?:\.joinpath\(|/)" + _STRING)


def runtime_files(root: Path = ROOT) -> set[str]:
    """Every file the packages' code reads from the package folder at run time, found by scanning the sources for
    the loaders (wheel paths, e.g. ``leank_infer/decode/quant_cpu.cpp``).

    A line that uses ``__file__``, ``files(...)`` or ``resources.`` in a form this scan does not read raises, so a
    new way of loading a file cannot slip past it."""
    found = set()
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            module_dir = path.parent.relative_to(root)
            text = path.read_text()
            for lineno, line in enumerate(text.splitlines(), 1):
                code = line.split("#")[0]
                if not _LOADER_WORDS.search(code) or _FOREIGN.search(code):
                    continue  # no loader, or another package's files (e.g. wonderwords' word lists)
                hits = [(module_dir, m.group(1)) for m in _NEXT_TO_MODULE.finditer(code)]
                for m in _RESOURCE.finditer(code):
                    owner = m.group(1).strip("\"'")
                    where = module_dir if owner in ("__package__", "__name__") else Path(*owner.split("."))
                    hits.append((where, m.group(2)))
                if not hits:
                    raise ValueError(f"{path.relative_to(root)}:{lineno}: a file loader the scan cannot read: {line.strip()}")
                found |= {(where / name).as_posix() for where, name in hits}
    return found


def package_data_files(root: Path = ROOT) -> set[str]:
    """Every file in the package folders that is not Python source or a build product (all of it ships)."""
    out = set()
    for package in PACKAGES:
        for path in (root / package).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix not in (".py", ".pyc", ".so"):
                out.add(path.relative_to(root).as_posix())
    return out


def build_wheel(out: Path, root: Path = ROOT, python: str = sys.executable) -> Path:
    """Build the wheel of a copy of the sources into ``out``, offline, with ``python``'s setuptools."""
    src = out / "src"
    src.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (root / name).exists():
            shutil.copy2(root / name, src / name)
    for package in PACKAGES:
        shutil.copytree(root / package, src / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so"))
    dist = out / "dist"
    cmd = [python, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", str(dist), str(src)]
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=out)
    if run.returncode:
        raise RuntimeError(f"building the wheel failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    (wheel,) = dist.glob("leank-*.whl")
    return wheel


def wheel_files(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as z:
        return set(z.namelist())


def install(wheel: Path, target: Path, python: str = sys.executable) -> Path:
    """``pip install --no-deps --target``: the wheel's files only (the dependencies are the environment's)."""
    cmd = [python, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(target), str(wheel)]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"installing the wheel failed:\n{run.stderr[-3000:]}")
    return target


# Appended to every script run from the installed copy: each leank module it imported is the installed one.
_FROM_TARGET = """
import sys as _sys
_bad = sorted(n for n, m in list(_sys.modules.items()) if n.split(".")[0] in {packages!r}
              and not str(getattr(m, "__file__", None) or "").startswith({target!r}))
assert not _bad, f"imported from outside the installed copy: {{_bad}}"
"""


def run_installed(code: str, target: Path, cwd: Path, python: str = sys.executable, timeout: float = 600,
                  env: dict[str, str] | None = None) -> dict:
    """Run ``code`` from the installed copy (``PYTHONPATH`` = ``target`` only, working directory ``cwd``, outside
    the repo) and return the JSON object its last line of stdout prints."""
    if cwd.resolve().is_relative_to(ROOT):
        raise ValueError(f"{cwd} is inside the repo: its leank_infer would be importable")
    script = cwd / "installed_check.py"
    script.write_text(code + _FROM_TARGET.format(packages=set(PACKAGES), target=str(target.resolve())))
    environment = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    environment.update(env or {})
    environment["PYTHONPATH"] = str(target.resolve())
    run = subprocess.run([python, str(script)], capture_output=True, text=True, cwd=cwd, env=environment,
                         timeout=timeout)  # fmt: skip
    lines = run.stdout.strip().splitlines()
    if run.returncode or not lines:
        raise AssertionError(f"the installed copy failed (exit {run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-5000:]}")
    return json.loads(lines[-1])


def readme_quick_start(root: Path = ROOT) -> str:
    """The Python block of README.md's "Quick start", the repository files it names (a mask folder of hub/, the
    text it reads) made absolute: the run's working directory is outside the repo."""
    text = (root / "README.md").read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    ast.parse(code)
    folders = set(re.findall(r"""from_pretrained\(["'](hub/[^"']+)["']""", code))
    if not folders:
        raise ValueError("README's quick start loads no mask folder of hub/")
    files = {m for m in re.findall(r"""open\(["']([^"']+)["']""", code) if (root / m).is_file()}
    for name in folders | files:
        code = code.replace(f'"{name}"', repr(str(root / name))).replace(f"'{name}'", repr(str(root / name)))
    return code
