"""The code examples in docs/index.md, docs/transports.md and docs/layouts.md run as written."""

from __future__ import annotations

from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
PAGES = ["index.md", "transports.md", "layouts.md"]


def _blocks() -> list[tuple[str, str]]:
    out = []
    for page in PAGES:
        text = (DOCS / page).read_text()
        out += [(page, part.split("```")[0]) for part in text.split("```python")[1:]]
    return out


@pytest.mark.parametrize(("page", "block"), _blocks())
def test_docs_example_runs(page: str, block: str) -> None:
    if page == "transports.md":
        from kvfsm.transport.nixl import nixl_available

        if (why := nixl_available()) is not None:
            pytest.skip(f"NIXL: {why}")
    exec(compile(block, str(DOCS / page), "exec"), {})
