"""`leank bench`: the side-by-side table and the --estimate mode, on a tiny model."""

from __future__ import annotations

import re

from conftest import tiny_model
from test_model import tiny_repo

from leank_infer.cli import main


def test_bench_prints_dense_and_leank_side_by_side(tmp_path, capsys):
    mask_dir, _ = tiny_repo(tmp_path)
    plot = tmp_path / "decode.png"
    assert main(["bench", str(mask_dir), "--contexts", "96", "--batches", "1", "2", "--new_tokens", "4",
                 "--plot", str(plot), "--card"]) == 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (mask_dir / "decode.png").is_file() and "![decode.png](decode.png)" in (mask_dir / "README.md").read_text()
    out = capsys.readouterr().out
    assert out.startswith("command: leank bench ")
    rows = [line for line in out.splitlines() if re.match(r"\s+96\s+[12] \|", line)]
    assert len(rows) == 2
    for row in rows:
        ratio = float(row.split()[-1])
        assert 0 < ratio < 1  # the LeanK cache really holds fewer bytes than the dense one


def test_bench_estimate_needs_no_weights(tmp_path, capsys):
    tiny_model("qwen2").config.save_pretrained(tmp_path)  # a config alone
    assert main(["bench", "--estimate", str(tmp_path), "--ratio", "0.5"]) == 0
    out = capsys.readouterr().out
    # 2 layers x 2 KV heads x 16 channels x (K + V) x 4 bytes (float32 on CPU)
    assert "dense 512, LeanK 384 (0.750 of dense)" in out
