"""The code examples in docs/index.md run as written."""

from __future__ import annotations

from pathlib import Path

import pytest

INDEX = Path(__file__).resolve().parent.parent / "docs" / "index.md"


def _blocks() -> list[str]:
    text = INDEX.read_text()
    return [part.split("```")[0] for part in text.split("```python")[1:]]


@pytest.mark.parametrize("block", _blocks())
def test_index_example_runs(block: str) -> None:
    exec(compile(block, str(INDEX), "exec"), {})
