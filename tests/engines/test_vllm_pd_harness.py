"""The harness around real engines: the tiny model is deterministic, and an engine that cannot
start fails fast with its output and leaves no process behind."""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

import pytest

from kvfsm.testing.vllm_pd import Engine, EngineError, EngineSpec

needs_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None or importlib.util.find_spec("torch") is None,
    reason="making the tiny Llama needs transformers and torch",
)
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")


@needs_transformers
def test_tiny_llama_is_a_function_of_its_seed(tmp_path: Path) -> None:
    from kvfsm.testing.tiny_llama import make_tiny_llama

    a = make_tiny_llama(tmp_path / "a", seed=3) / "model.safetensors"
    b = make_tiny_llama(tmp_path / "b", seed=3) / "model.safetensors"
    c = make_tiny_llama(tmp_path / "c", seed=4) / "model.safetensors"
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()


@needs_vllm
@pytest.mark.timeout(200)
def test_engine_that_cannot_start_fails_with_its_output(tmp_path: Path) -> None:
    t0 = time.monotonic()
    with pytest.raises(EngineError) as err:
        Engine(EngineSpec(str(tmp_path / "no-such-model")), "broken", start_timeout=150)
    assert "broken: exited" in str(err.value)
    assert "no-such-model" in str(err.value)  # the tail of the child's own output
    assert time.monotonic() - t0 < 150


@needs_vllm
@pytest.mark.timeout(200)
def test_engine_past_its_start_bound_is_killed_with_its_group(tmp_path: Path) -> None:
    from kvfsm.testing.tiny_llama import make_tiny_llama

    model = str(make_tiny_llama(tmp_path / "m", seed=0))
    engine = None
    with pytest.raises(EngineError, match="no answer to start within"):
        engine = Engine(EngineSpec(model), "slow", wait=False)
        engine.wait_ready(timeout=3)  # vLLM needs far longer to start
    assert engine is not None
    assert engine.proc.poll() is not None
    with pytest.raises(ProcessLookupError):
        os.killpg(engine.proc.pid, 0)  # nothing of its process group is left
