"""The epoch file of a peer registration: the one piece of shared memory between an engine whose
GPU cache others copy from (the owner) and those engines (readers).

The daemon creates it (``O_EXCL|O_NOFOLLOW``, mode 0600, in the shared-memory directory, named
after its socket) at ``PEER_REGISTER``, marks it closed when the registration's session ends, and
removes it. Layout, little-endian:

    [0, 8)      MAGIC
    [8, 16)     num_blocks (u64)
    [16, 24)    closed (u64): 0 while the registration lives; 1 once the daemon ended it or the
                owner closed it (readers then copy nothing more from it and close their mappings)
    [64, ...)   one u64 epoch per block: even while the block holds what it was published with,
                odd from before the owner writes it until after that write is done

Every access is an aligned 8-byte load or store (single-copy atomic on x86-64). The protocol
that makes a reader's copy safe is in docs/architecture.md, "Peer restores".
"""

from __future__ import annotations

MAGIC = b"KVPEERE1"
NUM_BLOCKS_OFFSET = 8
CLOSED_OFFSET = 16
EPOCHS_OFFSET = 64


def file_bytes(num_blocks: int) -> int:
    return EPOCHS_OFFSET + 8 * num_blocks
