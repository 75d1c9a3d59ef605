"""benchmarks/vllm_serving.py's bookkeeping (no engine): each engine's row is its best fresh try (shortest wall time
for the prefix workload, shortest median time to first token for the mixed load), every try kept beside it."""

from __future__ import annotations

from conftest import load_benchmark


def prefix(engine: str, wall: float) -> dict:
    return dict(workload="prefix", engine=engine, wall_s=wall, output_tok_s=512 / wall, hit_rate=0.9)


def ttft(engine: str, median: float) -> dict:
    return dict(workload="ttft", engine=engine, ttft_s=[median / 2, median, median, median], ttft_median_s=median,
                decode_tok_s_during=2.0, step_ms=[40.0, 90.0, 300.0])  # fmt: skip


def test_each_engine_keeps_its_best_try_and_every_try():
    bench = load_benchmark("vllm_serving")
    tries = [prefix("plain", 8.0), prefix("leank, dense-prompt", 9.0), ttft("plain", 10.0), ttft("leank, dense-prompt", 9.5),
             prefix("plain", 7.5), prefix("leank, dense-prompt", 9.5), ttft("plain", 11.0), ttft("leank, dense-prompt", 8.0)]  # fmt: skip
    best = {(r["workload"], r["engine"]): r for r in bench.best_of(tries)}
    assert list(best) == [("prefix", "plain"), ("prefix", "leank, dense-prompt"), ("ttft", "plain"),
                          ("ttft", "leank, dense-prompt")]  # fmt: skip
    assert best["prefix", "plain"]["wall_s"] == 7.5 and best["prefix", "plain"]["tries"] == [8.0, 7.5]
    assert best["prefix", "leank, dense-prompt"]["wall_s"] == 9.0
    assert best["prefix", "leank, dense-prompt"]["tries"] == [9.0, 9.5]
    assert best["ttft", "plain"]["ttft_median_s"] == 10.0 and best["ttft", "plain"]["tries"] == [10.0, 11.0]
    assert best["ttft", "leank, dense-prompt"]["ttft_median_s"] == 8.0
    assert best["ttft", "leank, dense-prompt"]["tries"] == [9.5, 8.0]
    one = bench.best_of([prefix("plain", 8.0)])
    assert one[0]["tries"] == [8.0] and one[0]["wall_s"] == 8.0
