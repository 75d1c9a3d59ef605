"""benchmarks/vllm_throughput.py's bookkeeping (no engine): equal-batch rows are the fastest of each side's fresh
engines, every try stays in the table, and the ratio is LeanK's best over plain's best."""

from __future__ import annotations

from conftest import load_benchmark


def row(engine: str, batch, tok_s: float, running: int = 4) -> dict:  # noqa: ANN001
    return dict(engine=engine, threads=2, context=2048, batch=batch, tok_s=tok_s, tok_cpu_s=tok_s / 2, running=running)


def test_each_side_keeps_its_fastest_engine_and_every_try():
    bench = load_benchmark("vllm_throughput")
    tries = [row("plain", 4, 50.0), row("leank", 4, 40.0), row("plain", 4, 45.0), row("leank", 4, 60.0),
             row("plain", 16, 90.0), row("leank", 16, 99.0)]  # fmt: skip
    best = {(r["engine"], r["batch"]): r for r in bench.best_of(tries)}
    assert len(best) == 4
    assert best["plain", 4]["tok_s"] == 50.0 and best["plain", 4]["tries"] == [50.0, 45.0]
    assert best["leank", 4]["tok_s"] == 60.0 and best["leank", 4]["tok_cpu_s"] == 30.0
    assert best["leank", 4]["tries"] == [40.0, 60.0]
    rows = list(best.values()) + [row("plain", "max", 45.0, 11), row("leank", "max", 60.0, 24)]
    text = bench.table(rows, "hub/smollm2-135m-instruct-s3", 2, repeats=2)
    assert "the fastest of 2 fresh engines per side" in text
    assert "| 2 | 2048 | 4 | 50.0 (25.0) | 60.0 (30.0) | 1.20x | 50.0, 45.0 / 40.0, 60.0 |" in text
    assert "| 2 | 2048 | max (11 vs 24) | 45.0 (22.5) | 60.0 (30.0) | 1.33x |  |" in text
    one = bench.table(rows, "hub/smollm2-135m-instruct-s3", 2)
    assert "fastest" not in one and "every try" not in one


def test_a_partial_run_saves_beside_the_fuller_tables():
    name = load_benchmark("vllm_throughput").result_name
    assert name(2) == name(2, ["max", "equal"], [8192, 2048]) == "vllm-throughput-2-threads"
    assert name(1) == "vllm-throughput-1-thread"
    assert name(2, ["equal"]) == "vllm-throughput-2-threads-equal"
    assert name(1, ["equal"], [2048]) == "vllm-throughput-1-thread-equal-2k"
    assert name(1, ["max"], [8192]) == "vllm-throughput-1-thread-max-8k"
    assert name(2, ["equal"], [3000]) == "vllm-throughput-2-threads-equal-3000"
    assert len({name(1, ["equal"], c) for c in ([2048], [8192], [2048, 8192])}) == 3


def test_a_one_context_run_saves_under_its_own_name(monkeypatch, capsys):
    """main() with --save, the engines replaced by their rows: each thread count's table is saved once, under the
    name of the contexts and phases it ran, and alternates fresh engines per side --repeats times."""
    bench = load_benchmark("vllm_throughput")
    calls, saved = [], {}

    def engine(args, mask, context, threads, phase, batches, kv):  # noqa: ANN001, ANN202
        calls.append((mask != "", context, threads))
        return [row("leank" if mask else "plain", b, 50.0 + len(calls)) | dict(context=context, threads=threads)
                for b in batches]  # fmt: skip

    monkeypatch.setattr(bench, "run", engine)
    monkeypatch.setattr(bench.results, "save", lambda name, text: saved.setdefault(name, text) and name)
    monkeypatch.setattr("sys.argv", ["vllm_throughput.py", "--contexts", "8192", "--batches", "1", "4", "--threads",
                                     "1", "--phases", "equal", "--repeats", "2", "--save"])  # fmt: skip
    bench.main()
    assert calls == [(False, 8192, 1), (True, 8192, 1)] * 2
    assert list(saved) == ["vllm-throughput-1-thread-equal-8k"]
    assert "| 1 | 8192 | 4 | 53.0 (26.5) | 54.0 (27.0) | 1.02x | 51.0, 53.0 / 52.0, 54.0 |" in saved[
        "vllm-throughput-1-thread-equal-8k"]
    capsys.readouterr()
