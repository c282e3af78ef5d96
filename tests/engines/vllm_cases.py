"""The prompts every connector is judged on (shared by the judge files and conftest.py)."""

from __future__ import annotations

MAX_TOKENS = 12
# several blocks with a partial last one, whole blocks, one block and a token, shorter than a block
LENGTHS = [200, 100, 96, 64, 33, 10]
# two prompts of one length whose params the negative control swaps
SWAP_LENGTH = 80
