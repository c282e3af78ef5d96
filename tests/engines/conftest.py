"""Fixtures shared by the vLLM judge files: one tiny model, one set of prompts and one plain
engine's greedy tokens for the whole session (every engine start costs tens of seconds)."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import pytest

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:  # vllm_cases.py, whatever pytest's import mode is
    sys.path.insert(0, _HERE)

from vllm_cases import LENGTHS, MAX_TOKENS, SWAP_LENGTH  # noqa: E402


@pytest.fixture(scope="session")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from kvfsm.testing.tiny_llama import make_tiny_llama

    return str(make_tiny_llama(Path(tmp_path_factory.mktemp("tiny_llama")), seed=0))


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    from kvfsm.testing.tiny_llama import VOCAB

    rng = random.Random(7)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in [*LENGTHS, SWAP_LENGTH, SWAP_LENGTH]]


@pytest.fixture(scope="session")
def reference(model: str, prompts: list[list[int]]) -> list[list[int]]:
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed")
    from kvfsm.testing.vllm_pd import single

    return single(model, prompts, MAX_TOKENS)
