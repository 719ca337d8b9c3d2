"""Pass 2 of an embed run, shared by one process and by the processes of a multi-device run:
the batches (planned over the whole input, so they never depend on a resume or on how many
processes run them), each process's share, the records read back for it, and what a
finished batch adds to the outputs."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import numpy as np

from ..errors import UserError
from .embedder import Embedder, check_finite
from .h5 import H5Output
from .pt_dir import PtOutput


@dataclass
class Job:
    """One batch to run: ``batch`` (positions among the valid records, as planned), ``new``
    (those still missing from an output), their tokens and where each record is."""
    number: int
    batch: list[int]
    new: list[int]
    tokens: list[np.ndarray]
    where: list[str]


def _windows(it: Iterable, size: int) -> Iterator[list]:
    buf = []
    for x in it:
        buf.append(x)
        if len(buf) >= size:
            yield buf
            buf = []
    if buf:
        yield buf


@dataclass
class Plan:
    """Token-budget batches in windows of ``sort_records`` records over the whole input (done
    records included), and ``todo``, the records still missing. The k-th batch with work goes
    to process ``k % world``: batches are sorted longest first, so the shares are alike."""
    ids: list[str]
    lengths: list[int]
    sort_records: int
    windows: list[list[list[int]]]
    todo: set[int]

    @classmethod
    def make(cls, emb: Embedder, ids: list[str], lengths: list[int], max_tokens: int, sort_records: int,
             done: Callable[[int], bool]) -> "Plan":
        windows = []
        for start in range(0, len(ids), sort_records):
            window = lengths[start:start + sort_records]
            windows.append([[start + k for k in b] for b in emb.batches(window, max_tokens)])
        return cls(ids, lengths, sort_records, windows, {i for i in range(len(ids)) if not done(i)})

    def _numbered(self) -> Iterator[tuple[int, int, list[int]]]:
        """(window, job number, batch) for each batch with a record still missing."""
        k = 0
        for w, batches in enumerate(self.windows):
            for batch in batches:
                if any(i in self.todo for i in batch):
                    yield w, k, batch
                    k += 1

    def residues(self, rank: int = 0, world: int = 1) -> int:
        """The residues still missing in process ``rank``'s share."""
        return sum(self.lengths[i] - 2 for _, k, b in self._numbered() if k % world == rank
                   for i in b if i in self.todo)

    def jobs(self, source: str, read: Callable[[], Iterable], rank: int = 0, world: int = 1) -> Iterator[Job]:
        """Process ``rank``'s batches, their records streamed from ``read()`` (``source`` read
        again) one window at a time; a record that is not the one pass 1 saw is an error."""
        mine: dict[int, list[tuple[int, list[int]]]] = {}
        for w, k, batch in self._numbered():
            if k % world == rank:
                mine.setdefault(w, []).append((k, batch))
        if not mine:
            return
        for w, window in enumerate(_windows(read(), self.sort_records)):
            start = w * self.sort_records
            for k, batch in mine.get(w, []):
                entries = [window[i - start] if i - start < len(window) else None for i in batch]
                if any(e is None or e.id != self.ids[i] for e, i in zip(entries, batch)):
                    raise UserError(f"{source}: the file changed while it was being embedded")
                yield Job(k, batch, [i for i in batch if i in self.todo], [e.tokens for e in entries],
                          [e.where for e in entries])
            if w >= max(mine):
                break


@dataclass
class Outputs:
    """The open outputs of a run (either may be None) and what each finished batch adds to
    them; counts what it saved. ``progress``: called with the residues of each batch."""
    h5: H5Output | None
    pt: PtOutput | None
    ids: list[str]
    precision: str
    progress: Callable[[int], None] | None = None
    embedded: int = 0
    residues: int = 0

    def __getstate__(self):  # handed to the other processes without the progress bar
        return {**self.__dict__, "progress": None}

    def put(self, job: Job, results: list[dict]) -> None:
        """Save the new proteins of a finished batch (every one checked finite before any is saved)."""
        got = dict(zip(job.batch, results))
        where = dict(zip(job.batch, job.where))
        for i in job.new:
            check_finite(got[i], self.ids[i], where[i], self.precision)
        if self.h5 is not None and not self.h5.complete:
            index = [i for i in job.new if i not in self.h5.done]
            self.h5.write_batch(index, [got[i] for i in index])
        if self.pt is not None:
            self.pt.write([(self.ids[i], got[i]) for i in job.new if not self.pt.has(self.ids[i])])
        n_res = sum(len(t) - 2 for i, t in zip(job.batch, job.tokens) if i in job.new)
        self.embedded += len(job.new)
        self.residues += n_res
        if self.progress is not None:
            self.progress(n_res)


@dataclass
class Work:
    """What a process needs for its share: the plan, how to read the input again, the outputs."""
    plan: Plan
    source: str
    read: Callable[[], Iterable]
    outputs: Outputs

    def jobs(self, rank: int = 0, world: int = 1) -> Iterator[Job]:
        return self.plan.jobs(self.source, self.read, rank, world)
