"""Page allocator over ids 0..num_pages-1 (L2 pages and L3 slots) that prefers contiguous runs.

Contiguity matters on both tiers: one DMA covers a run of L2 pages, and one pwrite/preadv
covers a run of L3 slots. So free space is kept as maximal runs of consecutive ids:
  - `_run_starts`: sorted starts, to find the runs next to a freed id by bisection;
  - `_start_to_length`: the run at each start;
  - `_runs_by_length`: sorted (length, start) pairs, to find the best-fitting run by bisection.
Every operation costs O(log runs) searches plus list inserts/pops (memmove of at most a few
thousand pointers), never O(num_pages).

An id that is neither free nor allocated is simply not in the allocator's hands: a namespace's
allocator starts with no free page (``all_free=False``) and is given the pages of each chunk of
the pool it gains (``free_range``), and gives them back when the chunk goes (``take_range``).
"""

from __future__ import annotations

import bisect
import operator
from typing import Iterable

import numpy as np

from kvcached.core.tiers import IntegrityError


class PageAllocator:
    def __init__(self, num_pages: int, all_free: bool = True):
        num_pages = operator.index(num_pages)
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        self._num_pages = num_pages
        self._num_free = 0
        self._run_starts: list[int] = []
        self._start_to_length: dict[int, int] = {}
        self._runs_by_length: list[tuple[int, int]] = []
        if num_pages and all_free:
            self._add_run(0, num_pages)

    # ---- queries -------------------------------------------------------------------------

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def num_free(self) -> int:
        return self._num_free

    def can_allocate(self, n: int) -> bool:
        return 1 <= n <= self._num_free

    def free_page_ids(self) -> set[int]:
        free: set[int] = set()
        for start, length in self._start_to_length.items():
            free.update(range(start, start + length))
        return free

    # ---- allocate / free -----------------------------------------------------------------

    def allocate(self, n: int) -> list[int] | None:
        """n page ids, or None when fewer than n are free.

        The smallest free run that holds all n wins (lowest start on ties), so large runs stay
        whole for large requests. Failing that, whole runs are taken largest-first; the last,
        partial piece is again taken best-fit, which leaves the larger runs intact.
        """
        n = operator.index(n)
        if n < 1:
            raise ValueError(f"allocate needs n >= 1, got {n}")
        if n > self._num_free:
            return None
        page_ids: list[int] = []
        remaining = n
        while remaining:
            # (remaining, -1) sorts before every run of length `remaining`: the lowest start wins.
            index = bisect.bisect_left(self._runs_by_length, (remaining, -1))
            if index < len(self._runs_by_length):
                length, start = self._runs_by_length[index]
                self._remove_run(start)
                if length > remaining:
                    self._add_run(start + remaining, length - remaining)
                page_ids.extend(range(start, start + remaining))
                break
            longest = self._runs_by_length[-1][0]
            index = bisect.bisect_left(self._runs_by_length, (longest, -1))
            length, start = self._runs_by_length[index]
            self._remove_run(start)
            page_ids.extend(range(start, start + length))
            remaining -= length
        return page_ids

    def free(self, page_ids: Iterable[int]) -> None:
        """Return pages; ValueError (and nothing changed) on out-of-range, repeated or already-free ids."""
        ids = sorted(map(operator.index, page_ids))
        num_ids = len(ids)
        if not num_ids:
            return
        if ids[0] < 0 or ids[-1] >= self._num_pages:
            bad = ids[0] if ids[0] < 0 else ids[-1]
            raise ValueError(f"page id {bad} out of range [0, {self._num_pages})")
        # Runs of consecutive ids, each checked against the free runs with one search (evicted
        # pages come in a few runs: no per-page search).
        runs: list[tuple[int, int]] = []
        run_start = 0
        for i in range(1, num_ids + 1):
            if i < num_ids and ids[i] == ids[i - 1]:
                raise ValueError("page ids repeated in one free() call")
            if i == num_ids or ids[i] != ids[i - 1] + 1:
                start, end = ids[run_start], ids[i - 1] + 1
                free_page = self._first_free_in(start, end)
                if free_page is not None:
                    raise ValueError(f"page id {free_page} is already free")
                runs.append((start, end - start))
                run_start = i
        for start, length in runs:
            self._free_run(start, length)

    def take(self, page_ids: Iterable[int]) -> None:
        """Allocate exactly these ids (a rebuild that knows which pages hold data); ValueError,
        and nothing changed, on an out-of-range, repeated or not-free id. Costs O(num_pages)."""
        ids = [operator.index(page_id) for page_id in page_ids]
        if len(set(ids)) != len(ids):
            raise ValueError("page ids repeated in one take() call")
        for page_id in ids:
            if not 0 <= page_id < self._num_pages:
                raise ValueError(f"page id {page_id} out of range [0, {self._num_pages})")
            if not self._is_free(page_id):
                raise ValueError(f"page id {page_id} is not free")
        if not ids:
            return
        free = np.zeros(self._num_pages, dtype=bool)
        for start, length in self._start_to_length.items():
            free[start:start + length] = True
        free[ids] = False
        edges = np.flatnonzero(np.diff(np.concatenate(([False], free, [False])).astype(np.int8)))
        starts, ends = edges[0::2].tolist(), edges[1::2].tolist()
        self._run_starts = starts
        self._start_to_length = {start: end - start for start, end in zip(starts, ends)}
        self._runs_by_length = sorted((end - start, start) for start, end in zip(starts, ends))
        self._num_free = int(free.sum())

    def free_range(self, start: int, stop: int) -> None:
        """Return ids [start, stop), none of them free; ValueError (and nothing changed) otherwise.
        O(log runs), whatever the length."""
        if not 0 <= start <= stop <= self._num_pages:
            raise ValueError(f"range [{start}, {stop}) out of range [0, {self._num_pages})")
        if start == stop:
            return
        # A free run that overlaps [start, stop) starts before stop and ends after start.
        index = bisect.bisect_left(self._run_starts, stop) - 1
        if index >= 0:
            run_start = self._run_starts[index]
            if run_start + self._start_to_length[run_start] > start:
                raise ValueError(f"ids of [{start}, {stop}) are free already (the run at {run_start})")
        self._free_run(start, stop - start)

    def take_range(self, start: int, stop: int) -> None:
        """Allocate exactly ids [start, stop), all of them free; ValueError (and nothing changed)
        otherwise. O(log runs): free ids that are consecutive lie in one run."""
        if not 0 <= start <= stop <= self._num_pages:
            raise ValueError(f"range [{start}, {stop}) out of range [0, {self._num_pages})")
        if start == stop:
            return
        index = bisect.bisect_right(self._run_starts, start) - 1
        run_start = self._run_starts[index] if index >= 0 else -1
        run_end = run_start + self._start_to_length[run_start] if index >= 0 else -1
        if not (index >= 0 and run_end >= stop):
            raise ValueError(f"ids of [{start}, {stop}) are not all free")
        self._remove_run(run_start)
        if run_start < start:
            self._add_run(run_start, start - run_start)
        if stop < run_end:
            self._add_run(stop, run_end - stop)

    # ---- integrity -----------------------------------------------------------------------

    def check_integrity(self) -> None:
        starts = self._run_starts
        if any(starts[i] >= starts[i + 1] for i in range(len(starts) - 1)):
            raise IntegrityError("run starts not strictly sorted")
        if set(starts) != set(self._start_to_length) or len(starts) != len(self._start_to_length):
            raise IntegrityError("run starts and run lengths disagree")
        total = 0
        previous_end = -1
        for start in starts:
            length = self._start_to_length[start]
            if length < 1 or start < 0 or start + length > self._num_pages:
                raise IntegrityError(f"run [{start}, {start + length}) out of range")
            # Equal would mean two touching runs that should have been merged.
            if start <= previous_end:
                raise IntegrityError(f"run at {start} overlaps or touches the previous run")
            previous_end = start + length
            total += length
        if total != self._num_free:
            raise IntegrityError(f"free count {self._num_free} != sum of runs {total}")
        expected = sorted((length, start) for start, length in self._start_to_length.items())
        if expected != self._runs_by_length:
            raise IntegrityError("length index disagrees with the runs")

    # ---- internals -----------------------------------------------------------------------

    def _first_free_in(self, start: int, end: int) -> int | None:
        """The lowest free page id in [start, end), or None."""
        index = bisect.bisect_right(self._run_starts, end - 1) - 1
        if index < 0:
            return None
        # The last free run starting before end: if it does not reach start, no earlier one does.
        run_start = self._run_starts[index]
        if run_start + self._start_to_length[run_start] <= start:
            return None
        while index > 0:        # an earlier run may reach into [start, end) too: the lowest wins
            previous = self._run_starts[index - 1]
            if previous + self._start_to_length[previous] <= start:
                break
            index -= 1
        return max(start, self._run_starts[index])

    def _is_free(self, page_id: int) -> bool:
        index = bisect.bisect_right(self._run_starts, page_id) - 1
        if index < 0:
            return False
        start = self._run_starts[index]
        return page_id < start + self._start_to_length[start]

    def _free_run(self, start: int, length: int) -> None:
        # The caller checked that no id in [start, start+length) is free, so the only runs that
        # can touch this one end exactly at `start` or begin exactly at `start + length`.
        index = bisect.bisect_left(self._run_starts, start)
        end = start + length
        if index < len(self._run_starts) and self._run_starts[index] == end:
            end += self._start_to_length[end]
            self._remove_run(start + length)
        if index > 0:
            previous = self._run_starts[index - 1]
            if previous + self._start_to_length[previous] == start:
                self._remove_run(previous)
                start = previous
        self._add_run(start, end - start)

    def _add_run(self, start: int, length: int) -> None:
        bisect.insort(self._run_starts, start)
        self._start_to_length[start] = length
        bisect.insort(self._runs_by_length, (length, start))
        self._num_free += length

    def _remove_run(self, start: int) -> None:
        length = self._start_to_length.pop(start)
        del self._run_starts[bisect.bisect_left(self._run_starts, start)]
        del self._runs_by_length[bisect.bisect_left(self._runs_by_length, (length, start))]
        self._num_free -= length
