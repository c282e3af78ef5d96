"""The generated docs (docs/prefill_room.md, docs/decode_room.md, docs/messages.md) match spec/,
and docs/configuration.md matches the configuration classes."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvfsm import docsgen
from kvfsm.config import one_of, positive, setting, validate
from kvfsm.protocol.errors import SpecError
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
    config = tmp_path / docsgen.CONFIG_PAGE
    config.write_text(config.read_text() + "hand edit\n")
    assert docsgen.stale(tmp_path) == [docsgen.CONFIG_PAGE]
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


@dataclass(frozen=True)
class PollerConfig:
    """Knobs of a poller, for the reference page's tests.

    This second paragraph stays out of the page."""

    poll_s: float = setting(0.5, doc="how long | between polls", when="lower it for latency", check=positive,
                            must="a number > 0")  # fmt: skip
    mode: str = setting("auto", doc="who polls", check=one_of("auto", "never"), must='"auto" or "never"')
    peers: dict[str, int] = setting(doc="known peers", default_factory=dict)

    def __post_init__(self) -> None:
        validate(self)


@dataclass(frozen=True)
class OtherPollerConfig:
    poll_s: float = setting(0.25, doc="how long between polls", check=positive, must="a number > 0")

    def __post_init__(self) -> None:
        validate(self)


def _rows(page: str) -> list[list[str]]:
    """The body rows of the page's tables, cells split on unescaped pipes."""
    rows = []
    for line in page.splitlines():
        if line.startswith("| ") and not line.startswith(("| field |", "| --- |")):
            rows.append([c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line)[1:-1]])
    return rows


def test_configuration_page_lists_every_field_of_every_class_in_order() -> None:
    page = docsgen.render_configuration([PollerConfig, OtherPollerConfig])
    assert page.index("## `PollerConfig`") < page.index("## `OtherPollerConfig`")
    assert f"`from {__name__} import PollerConfig`" in page
    assert "Knobs of a poller, for the reference page's tests." in page and "second paragraph" not in page
    assert "OtherPollerConfig(" not in page  # a class without a docstring gets no dataclass signature
    assert _rows(page) == [
        ["`poll_s`", "`float`", "`0.5`", "how long | between polls", "lower it for latency", "a number > 0"],
        ["`mode`", "`str`", "`'auto'`", "who polls", "-", '"auto" or "never"'],
        ["`peers`", "`dict[str, int]`", "`{}`", "known peers", "-", "any value of its type"],
        ["`poll_s`", "`float`", "`0.25`", "how long between polls", "-", "a number > 0"],
    ]


def test_configuration_page_refuses_an_undocumented_field() -> None:
    @dataclass(frozen=True)
    class Bare:
        poll_s: float = 0.5

    with pytest.raises(TypeError, match="Bare.poll_s is not declared with setting"):
        docsgen.render_configuration([Bare])


def test_configuration_page_goes_stale_when_a_declaration_changes(tmp_path: Path) -> None:
    docsgen.write_all(tmp_path, configs=[PollerConfig])
    assert docsgen.stale(tmp_path, configs=[PollerConfig]) == []
    assert docsgen.stale(tmp_path, configs=[PollerConfig, OtherPollerConfig]) == [docsgen.CONFIG_PAGE]
    assert docsgen.stale(tmp_path, configs=[]) == [docsgen.CONFIG_PAGE]


def test_listed_configuration_classes_load_in_order_and_one_that_does_not_import_is_an_error() -> None:
    assert docsgen.load_config_classes([f"{__name__}:PollerConfig", f"{__name__}:OtherPollerConfig"]) == [
        PollerConfig,
        OtherPollerConfig,
    ]
    for path in ("kvfsm.no_such_module:Config", "kvfsm.config:NoSuchConfig"):
        with pytest.raises(SpecError, match=path):
            docsgen.load_config_classes([f"{__name__}:PollerConfig", path])


def test_every_listed_configuration_class_is_on_the_committed_page() -> None:
    page = (REPO_ROOT / docsgen.CONFIG_PAGE).read_text()
    for cls in docsgen.load_config_classes():
        assert f"## `{cls.__name__}`" in page
