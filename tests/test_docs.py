"""The generated docs (docs/prefill_room.md, docs/decode_room.md, docs/messages.md) match spec/."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvfsm import docsgen
from kvfsm.protocol.spec import load_spec, spec_dir

REPO_ROOT = spec_dir().parent


def _mermaid_block(page: str) -> str:
    match = re.search(r"```mermaid\n(.*?)```", page, re.DOTALL)
    assert match is not None, "no mermaid block in the generated page"
    return match.group(1)


def test_committed_docs_are_fresh() -> None:
    stale = docsgen.stale(REPO_ROOT)
    assert stale == [], f"generated docs are stale: {stale}; run `kvfsm docs` (or `python -m kvfsm.docsgen`)"


def test_check_reports_an_edited_page_and_a_missing_one(tmp_path: Path) -> None:
    written = docsgen.write_all(tmp_path)
    assert sorted(written) == sorted(docsgen.render_all())
    assert docsgen.stale(tmp_path) == []
    assert docsgen.main(["--check", "--root", str(tmp_path)]) == 0

    edited = tmp_path / "docs/decode_room.md"
    edited.write_text(edited.read_text() + "hand edit\n")
    (tmp_path / "docs/messages.md").unlink()
    assert docsgen.stale(tmp_path) == ["docs/decode_room.md", "docs/messages.md"]
    assert docsgen.main(["--check", "--root", str(tmp_path)]) == 1

    assert docsgen.main(["--root", str(tmp_path)]) == 0
    assert docsgen.stale(tmp_path) == []


def test_rendering_is_deterministic() -> None:
    assert docsgen.render_all() == docsgen.render_all()


@pytest.mark.parametrize("machine", ["prefill_room", "decode_room"])
def test_every_row_id_appears_in_its_page(machine: str) -> None:
    page = docsgen.render_all()[f"docs/{machine}.md"]
    for row in load_spec().machines[machine].rows:
        assert re.search(rf"^\| {re.escape(row.id)} \|", page, re.MULTILINE), f"row {row.id} missing from the table"


@pytest.mark.parametrize("machine", ["prefill_room", "decode_room"])
def test_diagram_mentions_every_leaf_state(machine: str) -> None:
    block = _mermaid_block(docsgen.render_all()[f"docs/{machine}.md"])
    assert block.startswith("stateDiagram-v2\n")
    spec = load_spec().machines[machine]
    for name in spec.states:
        assert re.search(rf"\b{re.escape(docsgen.mermaid_id(name))}\b", block), f"state {name} missing from diagram"
    for parent, leaves in spec.groups.items():
        if leaves != (parent,):
            assert f"state {docsgen.mermaid_id(parent)} {{" in block
    for row in spec.rows:
        if row.dest is not None:
            assert re.search(rf"[(, ]{re.escape(row.id)}[,)]", block), f"row {row.id} changes state but is not drawn"


def test_table_cells_escape_pipes() -> None:
    assert docsgen._cell("a | b\n  c") == "a \\| b c"
