"""Notification batching: the writes folded into one NIXL transfer share its one notification.

``pack_notifications`` joins the writes' own notifications (``BATCH_MAGIC``, a u32 count, then
each as a u32 length and its bytes); the receiving data plane's ``unpack_notifications`` splits
them again, so every write still notifies on its own, after its data. A protocol notification
starts with "{" (JSON) or 0xB1, never NUL, so a batch cannot be mistaken for one; anything that
is not a well-formed batch is handed on whole (the runtime counts a malformed one).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

BATCH_MAGIC = b"\x00KVB"
MAX_BATCH = 64  # writes folded into one transfer at most, so notifications in one batch at most
_COUNT = struct.Struct("<I")


def pack_notifications(notes: Sequence[bytes]) -> bytes:
    """Several writes' notifications as one NIXL notification (they ride one transfer)."""
    pack = _COUNT.pack
    parts = [BATCH_MAGIC, pack(len(notes))]
    for n in notes:
        parts += [pack(len(n)), n]
    return b"".join(parts)


def unpack_notifications(data: bytes) -> list[bytes]:
    """The notifications in ``data``: a batch is split, anything else is one notification (a
    malformed batch too: the runtime counts it as malformed)."""
    if not data.startswith(BATCH_MAGIC):
        return [data]
    unpack = _COUNT.unpack_from
    try:
        (count,) = unpack(data, len(BATCH_MAGIC))
        pos, out = len(BATCH_MAGIC) + 4, []
        for _ in range(count):
            (n,) = unpack(data, pos)
            pos += 4
            if pos + n > len(data):
                return [data]
            out.append(data[pos : pos + n])
            pos += n
    except struct.error:
        return [data]
    return out if pos == len(data) and count <= MAX_BATCH else [data]
