"""A tiny randomly initialised Llama saved to disk, for running real engines (vLLM) on a CPU.

The model has no tokenizer: engines load it with ``skip_tokenizer_init=True`` and take token-id
prompts. Its weights depend only on the seed, so two engines loading the same directory (or two
directories made with one seed) compute the same logits. ``transformers`` and ``torch`` are
imported only when a model is made, so importing this module needs neither.
"""

from __future__ import annotations

import json
from pathlib import Path

HIDDEN = 128
LAYERS = 2
ATTENTION_HEADS = 4
KV_HEADS = 2
VOCAB = 1024
INTERMEDIATE = 256
MAX_POSITIONS = 2048


def make_tiny_llama(path: str | Path, seed: int = 0) -> Path:
    """Write a seeded random ``LlamaForCausalLM`` (float32 weights, no tokenizer) to ``path``.

    Returns the directory. Writing the same seed twice gives identical weight files.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM  # type: ignore[import-not-found, unused-ignore]

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=ATTENTION_HEADS,
        num_key_value_heads=KV_HEADS,
        intermediate_size=INTERMEDIATE,
        vocab_size=VOCAB,
        max_position_embeddings=MAX_POSITIONS,
        # ids inside the vocabulary; no token is ever a stop token in greedy tests because
        # engines run with ignore_eos
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # The default init (std 0.02) gives near-uniform logits, where greedy ties would make the
    # comparison between engines depend on float summation order: widen the weights so the
    # argmax has a clear margin.
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 / p.shape[-1] ** 0.5))
    model.to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    (out / "kvfsm_tiny_llama.json").write_text(json.dumps({"seed": seed}))
    return out
