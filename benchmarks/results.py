"""A benchmark's measured table for the docs: ``docs/results/NAME.json`` holds the table, the command that
printed it and the date. The docs build puts it where a page says ``<!-- leank:NAME -->``
(``docs/hooks/leank_docs.py``), so a table in the docs is always a command's output, shown with the command."""

from __future__ import annotations

import datetime
import json
import os
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"


def command() -> str:
    """This process's command line, as run from the repository root."""
    script = Path(sys.argv[0]).resolve()
    parts = [str(script.relative_to(ROOT)) if script.is_relative_to(ROOT) else str(script), *sys.argv[1:]]
    env = Path(sys.prefix).name  # .venv or .venv-vllm (make install / make install-vllm)
    python = f"{env}/bin/python" if env.startswith(".venv") else "python"
    return python + " " + shlex.join(p.replace(str(ROOT) + os.sep, "") for p in parts)


def save(name: str, markdown: str) -> Path:
    """Write ``docs/results/<name>.json`` (replacing it whole)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    record = {
        "command": command(),
        "date": datetime.date.today().isoformat(),
        "cpus": os.cpu_count(),
        "load_1min": round(os.getloadavg()[0], 2),
        "markdown": markdown,
    }
    path = RESULTS / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    tmp.replace(path)
    return path


def best_of(tries: list[dict], key: Callable[[dict], tuple], figure: Callable[[dict], float], higher: bool) -> list[dict]:
    """One row per ``key``, in first-seen order: its try with the best ``figure`` (the highest if ``higher``, else the
    lowest; the first on a tie), with every try's figure (rounded to 2 places) in ``tries``. Fresh engines of one
    side on a small shared machine run up to ~1.4x apart, so a benchmark compares each side's best of several."""
    out: dict[tuple, dict] = {}
    for r in tries:
        k = key(r)
        best = out.get(k)
        seen = best["tries"] if best else []
        if best is None or (figure(r) > figure(best) if higher else figure(r) < figure(best)):
            out[k] = {**r, "tries": seen}
        out[k]["tries"] = [*seen, round(figure(r), 2)]
    return list(out.values())
