"""bench/layout.py runs end to end and writes the JSON it promises (figures are not judged here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def test_layout_bench_quick_run_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "layout.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "layout.py"), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())
    assert res["quick"] is True and res["baseline"] in res["rooms"]
    rooms = res["rooms"]
    assert rooms[res["baseline"]]["kind"] == "direct" and rooms[res["baseline"]]["descriptors_ratio"] == 1.0
    assert {"tp2_tp4_p16", "tp4_tp2_p16", "tp2_tp4_p64", "tp4_tp2_p64", "tp2_tp4_p16_p64", "tp4_tp2_p64_p16"} <= set(
        rooms
    )
    for name, row in rooms.items():
        keys = ("descriptors", "descriptors_chunked", "descriptors_contiguous", "plan_us", "verify_us", "prepare_us")
        assert all(row[k] > 0 for k in keys), name
        assert row["descriptors_contiguous"] <= row["descriptors"] <= row["descriptors_chunked"], name
        assert row["kind"] == (
            "direct"
            if row["prefill_tp"] == row["decode_tp"] and row["prefill_page"] == row["decode_page"]
            else "sliced"
        )
        assert row["descriptors_ratio"] > 0 and row["plan_us_ratio"] > 0
    # a sliced room moves the same bytes as the direct one in more descriptors
    assert rooms["tp2_tp4_p16"]["bytes"] == rooms[res["baseline"]]["bytes"]
    assert rooms["tp2_tp4_p16"]["descriptors"] > rooms[res["baseline"]]["descriptors"]
