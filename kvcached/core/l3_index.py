"""What each L3 slot holds, as the daemon's state records it for a persistent L3 file. Pure logic.

The daemon's state reports every change of L3 residency as an ``IndexChange`` to a sink that
the I/O layer provides (it writes them to an index file beside the L3 file, in order, off the
socket thread); at start the I/O layer loads what the file holds and ``plan_rebuild`` turns it
back into tree insertions. Nothing here touches a file.

Keys. Namespace ids are per process, so a namespace is named by a digest of its geometry
(``namespace_key``). A page is named by its page key (``proto/page_keys.py``): a row holds its
page's key, its parent's key and its own token ids, so the prefix of every page can be rebuilt
from the rows alone, and a row that was torn (its key does not match its parent and tokens) or
whose parent row is missing only loses itself and what lies below it.
"""

from __future__ import annotations

import hashlib
import json
from typing import NamedTuple, Sequence, Union

from proto.messages import KVGeometry
from proto.page_keys import KEY_BYTES, ROOT_KEY, page_key
from proto.tokens import TOKEN_BYTES


def namespace_key(geometry: KVGeometry) -> str:
    """A stable name of a geometry, the same in every process."""
    canonical = json.dumps(geometry.to_wire(), sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(canonical.encode(), digest_size=16).hexdigest()


class NamespaceLayout(NamedTuple):
    """A namespace of the index. Slot s of it holds bytes [s * bytes_per_page, (s + 1) *
    bytes_per_page) of the file: slot ids are absolute, as page ids are in the pool (chunks.py),
    so which chunks of the file it owned follows from its rows and needs no record of its own."""

    namespace_key: str
    geometry: KVGeometry
    bytes_per_page: int


class SlotRow(NamedTuple):
    """One slot's content: the page named page_key, below parent_key, with these token ids."""

    slot: int
    page_key: bytes
    parent_key: bytes
    token_bytes: bytes
    checksum: int             # zlib.crc32 of the page's bytes as written


class SavedNamespace(NamedTuple):
    layout: NamespaceLayout
    rows: list[SlotRow]


class PutNamespace(NamedTuple):
    layout: NamespaceLayout


class DropNamespace(NamedTuple):
    """The namespace and every row of it are gone (reclaimed for another geometry)."""

    namespace_key: str


class PutSlots(NamedTuple):
    namespace_key: str
    rows: list[SlotRow]


class DeleteSlots(NamedTuple):
    namespace_key: str
    slot_ids: list[int]


IndexChange = Union[PutNamespace, DropNamespace, PutSlots, DeleteSlots]


class RebuildRun(NamedTuple):
    """A chain of pages below the page keyed parent_key (ROOT_KEY: the root), held by these slots:
    its own token bytes only, never the path above it, so a plan is as large as its rows."""

    parent_key: bytes
    token_bytes: bytes
    start_page: int
    slot_ids: list[int]
    checksums: list[int]
    end_key: bytes                    # the key of the chain's last page


class RebuildPlan(NamedTuple):
    runs: list[RebuildRun]            # in insertion order: every run's parent run comes earlier
    dropped_slot_ids: list[int]       # the slots of rows that cannot be trusted, used or reached
    num_beyond: int                   # of those: rows of slots past the region's end now
    num_torn: int                     # rows that are not what they claim to be
    num_orphans: int                  # rows whose parent row is missing (or was dropped)
    branch_keys: frozenset[bytes]     # the end keys of runs that other runs continue


def plan_rebuild(rows: Sequence[SlotRow], page_size: int, num_slots: int) -> RebuildPlan:
    """Turn a namespace's rows into tree insertions, dropping what cannot be trusted or used.

    A row is torn when its slot is repeated, its tokens are not one page, its checksum is not 32
    bits or its key is not the digest of its parent key and tokens; a row of a slot at or past
    num_slots no longer fits; a row whose parent is not reachable from the root is an orphan.
    These are dropped; every other row comes back, whatever happened to its siblings.

    Time and memory are O(rows): each run holds its own chain's tokens, and is inserted below the
    node its parent run made (``PrefixTree.insert_child``), not by a walk from the root."""
    page_bytes = page_size * TOKEN_BYTES
    dropped: list[int] = []
    seen_slots: set[int] = set()
    by_key: dict[bytes, SlotRow] = {}
    num_torn = num_beyond = 0
    for row in sorted(rows, key=lambda r: r.slot):
        if row.slot in seen_slots:
            num_torn += 1         # the slot's first row decides; deleting the slot would delete that one
            continue
        seen_slots.add(row.slot)
        if not 0 <= row.slot < num_slots:
            num_beyond += 1
            dropped.append(row.slot)
            continue
        sound = (len(row.token_bytes) == page_bytes and 0 <= row.checksum < 1 << 32
                 and len(row.parent_key) == KEY_BYTES
                 and page_key(row.parent_key, row.token_bytes) == row.page_key
                 and row.page_key not in by_key)          # one slot per page: the lowest keeps it
        if not sound:
            num_torn += 1
            dropped.append(row.slot)
            continue
        by_key[row.page_key] = row
    del seen_slots
    children: dict[bytes, list[SlotRow]] = {}
    for row in by_key.values():
        children.setdefault(row.parent_key, []).append(row)

    runs: list[RebuildRun] = []
    branch_keys: set[bytes] = set()
    reached_slots: set[int] = set()
    # Depth first; a chain of only children is one run, inserted as one tree node.
    stack: list[tuple[SlotRow, int]] = [(row, 0) for row in children.get(ROOT_KEY, ())]
    while stack:
        row, start_page = stack.pop()
        chain = [row]
        while len(children.get(chain[-1].page_key, ())) == 1:
            chain.append(children[chain[-1].page_key][0])
        end_key = chain[-1].page_key
        runs.append(RebuildRun(row.parent_key, b"".join(r.token_bytes for r in chain), start_page,
                               [r.slot for r in chain], [r.checksum for r in chain], end_key))
        reached_slots.update(r.slot for r in chain)
        below = children.get(end_key, ())
        if below:
            branch_keys.add(end_key)
        for child in below:
            stack.append((child, start_page + len(chain)))
    orphans = [row.slot for row in by_key.values() if row.slot not in reached_slots]
    return RebuildPlan(runs, dropped + orphans, num_beyond, num_torn, len(orphans), frozenset(branch_keys))
