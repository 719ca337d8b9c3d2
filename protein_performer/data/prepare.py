"""One streaming pass from a FASTA / UniProt ``.dat`` file (gzipped or not) to token shards.

    source -> blocks (cut at record starts) -> workers: tokenize, hash, split
           -> main, in block order: refuse repeated ids, drop exact duplicates, append to shards, count

Records are checked as every other command checks them (:mod:`protein_performer.sequences`):
an id seen before with the same sequence is a duplicate (dropped, counted); with another
sequence it is an error naming file, line and record, or with ``on_invalid='skip'`` counted
invalid. Ids are remembered as 64-bit hashes (two :class:`HashSet` s: ids, id + sequence).

Work is committed in *parts* (a fixed number of input blocks): a part's shards are
written, then ``parts/NNNNN.json`` (cumulative counts and where the next part starts).
A killed run restarts after the last committed part, rebuilding the de-dup set from the
committed shards' hashes (and the id sets from ``parts/NNNNN.ids.npy``), and produces
byte-identical shards. Results are cached in
``<data_dir>/prepared/<name>-<source sha256>-<params>``; ``manifest.json`` marks them done.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import multiprocessing as mp
import os
import shutil
import time
from collections import deque
from pathlib import Path

from dataclasses import dataclass, field

import numpy as np
import xxhash

from ..errors import UserError
from ..files import exclusive_lock, file_sha256, write_json
from ..output_guard import OutputGuard
from ..formats import SHARD_FORMATS, ParseError, TokenizedBlock, accession, check_source, detect_format, format_name
from ..formats import iter_ranges, iter_text_blocks, tokenize_block
from ..formats.text import BlockParseError, is_gzip, read_range
from ..tokenizer import VERSION, Tokenizer
from .dedup import HashSet
from .shards import MANIFEST, ShardWriter
from .split import SPLITS, split_codes

log = logging.getLogger(__name__)
FORMAT_VERSION = 2  # 2: a repeated id with another sequence is refused or counted invalid
HIST_BINS = 18  # log2 length bins: [1,2), [2,4), ... [2^17, inf)


def default_data_dir() -> Path:
    """``$PROTEIN_PERFORMER_DATA`` or ``~/.cache/protein-performer``."""
    return Path(os.environ.get("PROTEIN_PERFORMER_DATA", Path.home() / ".cache" / "protein-performer"))


def _params(format, valid_fraction, test_fraction, unknown, dedup, block_size, blocks_per_part) -> dict:
    return {"format": format, "valid_fraction": valid_fraction, "test_fraction": test_fraction, "unknown": unknown,
            "dedup": dedup, "block_size": block_size, "blocks_per_part": blocks_per_part,
            "tokenizer_version": VERSION, "format_version": FORMAT_VERSION}


def prepared_dir_for(source: Path, sha: str, params: dict, data_dir: Path) -> Path:
    name = source.name.split(".")[0] or "data"
    ph = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:8]
    return data_dir / "prepared" / f"{name}-{sha[:16]}-{ph}"


@dataclass
class BlockResult:
    """What one block turned into. Records are grouped by split (train, valid, test in
    that order, file order within a split); ``tokens`` holds each record's residues
    followed by ``<eos>``."""
    tokens: np.ndarray            # uint8
    lengths: np.ndarray           # int64, residues per record (eos not counted)
    hashes: np.ndarray            # uint64, xxh3 of the record's token ids (for de-duplication)
    splits: np.ndarray            # uint8 index into SPLITS
    records: np.ndarray           # int64, index of each record in the block (file order)
    read: np.ndarray              # int64[3], records read per split
    invalid: np.ndarray           # int64[3], invalid records per split
    id_hashes: np.ndarray         # uint64, xxh3 of each record's id (a repeated id is refused or skipped)
    lines: np.ndarray             # int64, 0-based line of each record's header in the block
    ids: list                     # bytes, each record's id (for messages)
    newlines: int                 # newline count of the block
    nbytes: int                   # size of the block's text
    reasons: list = field(default_factory=list)  # up to MAX_REASONS (relative line, id, why)


def by_split(block: TokenizedBlock, valid_fraction: float, test_fraction: float, eos_id: int) -> BlockResult:
    """A tokenized block's valid records grouped by split (from their accessions), each
    followed by ``<eos>``, with the hashes de-duplication and the id check need."""
    codes = split_codes([accession(i) for i in block.ids], valid_fraction, test_fraction)
    read = np.bincount(codes, minlength=3).astype(np.int64)
    inv = np.bincount(codes[block.invalid], minlength=3).astype(np.int64)
    good = np.flatnonzero(~block.invalid)
    order = good[np.argsort(codes[good], kind="stable")]  # grouped by split, file order within
    kept = [block.sequences[i] for i in order.tolist()]
    eos = bytes([eos_id])
    tokens = np.frombuffer(eos.join(kept) + eos if kept else b"", dtype=np.uint8)
    hashes = np.fromiter(map(xxhash.xxh3_64_intdigest, kept), dtype=np.uint64, count=len(kept))
    kept_ids = [block.ids[i] for i in order.tolist()]
    id_hashes = np.fromiter(map(xxhash.xxh3_64_intdigest, kept_ids), dtype=np.uint64, count=len(kept_ids))
    lengths = np.fromiter(map(len, kept), dtype=np.int64, count=len(kept))
    return BlockResult(tokens=tokens, lengths=lengths, hashes=hashes, splits=codes[order], records=order, read=read,
                       invalid=inv, id_hashes=id_hashes, lines=block.lines[order], ids=kept_ids,
                       newlines=block.newlines, nbytes=block.nbytes, reasons=block.reasons)


def _work(task) -> BlockResult:
    kind, payload, format, tokenizer, vf, tf, first, source = task
    buf = read_range(*payload) if kind == "range" else payload
    block = tokenize_block(buf, format, tokenizer=tokenizer, first_block=first, source=source)
    return by_split(block, vf, tf, tokenizer.eos_id)


#: how the worker pool starts. Not "fork": the caller may already run threads (torch's, a logger's),
#: and a child forked while one of them holds a lock can hang the pool (CI hung so once).
#: benchmarks/speed/data.py sets "spawn": its workers must be its own children for their CPU time to count.
POOL_START = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"


class _Ordered:
    """Runs tasks on a pool (or inline with 0 workers), yielding results in submission
    order with a bounded number in flight, so a gzip reader never runs far ahead."""

    def __init__(self, workers: int):
        self.pool = None
        if workers > 0:
            ctx = mp.get_context(POOL_START)
            self.pool = ctx.Pool(workers)
        self.depth = max(2, 2 * workers)

    def map(self, tasks):
        if self.pool is None:
            for t in tasks:
                yield t[0], _work(t[1])
            return
        queue = deque()
        for tag, t in tasks:
            queue.append((tag, self.pool.apply_async(_work, (t,))))
            if len(queue) >= self.depth:
                tag0, r = queue.popleft()
                yield tag0, r.get()
        while queue:
            tag0, r = queue.popleft()
            yield tag0, r.get()

    def close(self):
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()


class _State:
    """Cumulative counts; saved with every committed part."""

    def __init__(self, d: dict | None = None):
        d = d or {}
        self.next_offset = d.get("next_offset", 0)
        self.newlines = d.get("newlines", 0)
        self.blocks = d.get("blocks", 0)
        z = lambda: {s: 0 for s in SPLITS}  # noqa: E731
        self.counts = d.get("counts", {k: z() for k in ("records_read", "kept", "duplicates", "invalid", "tokens")})
        self.hist = d.get("hist", {s: [0] * HIST_BINS for s in SPLITS})
        self.train_token_counts = d.get("train_token_counts", [0] * Tokenizer().vocab_size)
        self.invalid_examples = d.get("invalid_examples", [])
        self.shards = d.get("shards", {s: [] for s in SPLITS})

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _part_path(out: Path, part: int) -> Path:
    return out / "parts" / f"{part:05d}.json"


def prepare(source: str | Path, *, data_dir: str | Path | None = None, out_dir: str | Path | None = None,
            format: str | None = None, valid_fraction: float = 0.01, test_fraction: float = 0.01,
            unknown: str = "error", on_invalid: str = "skip", dedup: bool = True, workers: int | None = None,
            block_size: int = 16 << 20, blocks_per_part: int = 64, max_parts: int | None = None,
            progress: bool = True, need: tuple[str, ...] = ()) -> Path:
    """Prepare ``source`` once; return the prepared folder (reused if already done).

    ``on_invalid='skip'`` counts and reports records with invalid residues or no
    sequence; ``'error'`` stops at the first with its file, line and record.
    ``max_parts`` stops after that many parts (a later call continues).
    ``need``: splits that must receive records (training needs ``("train", "valid")``).
    A file with no usable record, or none for a needed split, is an error and leaves no
    prepared folder; so does any failure before the first part is committed.
    """
    source = Path(source)
    check_source(source)
    if on_invalid not in ("skip", "error"):
        raise UserError(f"on_invalid must be 'skip' or 'error', got {on_invalid!r}")
    if not (valid_fraction >= 0 and test_fraction >= 0 and valid_fraction + test_fraction < 1):
        raise UserError(f"need 0 <= valid_fraction, test_fraction and a sum < 1, got {valid_fraction}, {test_fraction}")
    format = format_name(format, shards=True) if format else detect_format(source)
    if format not in SHARD_FORMATS:  # a table, told by its name
        raise UserError(f"{source}: a {format.upper()} table; preparation reads FASTA or UniProt flat files")
    data_dir = Path(data_dir) if data_dir is not None else default_data_dir()
    guard = OutputGuard("prepare", {"data.path": source})  # the output guard: the cache may hold the source,
    guard.folder_path("data.data_dir", data_dir)          # not be it or lie inside it
    sha = file_sha256(source, data_dir)
    params = _params(format, valid_fraction, test_fraction, unknown, dedup, block_size, blocks_per_part)
    out = Path(out_dir) if out_dir is not None else prepared_dir_for(source, sha, params, data_dir)
    guard.folder_path("prepared folder", out, holds=False)
    if (out / MANIFEST).is_file():
        log.info("%s: already prepared in %s", source, out)
        check_splits(source, json.loads((out / MANIFEST).read_text()), need, valid_fraction)
        return out
    lock = out.with_name(out.name + ".lock")
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        with exclusive_lock(lock, wait=True):  # DDP ranks / parallel jobs: one prepares
            if (out / MANIFEST).is_file():
                return out
            return _prepare(source, out, sha, params, on_invalid=on_invalid, workers=workers, max_parts=max_parts,
                            progress=progress, need=need)
    except BaseException:
        if created and not _part_path(out, 0).is_file():  # nothing committed to resume from
            _discard(out)
        raise


def source_file(path: str | None, url: str | None, data_dir: str | Path, *, download: bool = False,
                md5: str | None = None, metalink: str | None = None, progress: bool = True,
                retries: int | None = None, backoff: float | None = None) -> Path:
    """The local file to prepare: ``path``, or ``url`` downloaded into ``data_dir/downloads``
    (only with ``download``; resumable, checked against ``md5`` / ``metalink``)."""
    from .download import download as fetch
    if path is not None:
        p = Path(path).expanduser()
        if p.is_dir():
            raise UserError(f"data.path={path}: is a directory, not a FASTA or UniProt file")
        if not p.is_file():
            raise FileNotFoundError(f"data.path={path}: no such file")
        return p
    dest = Path(data_dir) / "downloads" / url.rsplit("/", 1)[-1]
    if dest.is_file():
        return dest
    if not download:
        raise FileNotFoundError(f"{dest} is not downloaded yet: set data.download=true to fetch {url}, "
                                f"or put the file there yourself")
    lock = dest.with_name(dest.name + ".lock")
    extra = {k: v for k, v in (("retries", retries), ("backoff", backoff)) if v is not None}
    try:
        with exclusive_lock(lock, wait=True):
            return fetch(url, dest, md5=md5, metalink=metalink, progress=progress, **extra)
    except BaseException:
        if not dest.with_name(dest.name + ".part").exists():  # nothing to resume: leave nothing behind
            lock.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                dest.parent.rmdir()
        raise


def prepare_data_config(data: dict) -> Path:
    """``protein-performer prepare``: what ShardDataModule.prepare_data does, from the data
    config alone, without importing torch or Lightning (so an already prepared file answers
    at once)."""
    if (data.get("path") is None) == (data.get("url") is None):
        raise UserError("give exactly one of data.path (a local FASTA/.dat file) and data.url")
    data_dir = Path(data["data_dir"]).expanduser() if data.get("data_dir") else default_data_dir()
    given = lambda keys: {arg: data[key] for key, arg in keys.items() if data.get(key) is not None}  # noqa: E731
    src = source_file(data.get("path"), data.get("url"), data_dir, **given(
        {"download": "download", "md5": "md5", "metalink": "metalink", "progress": "progress",
         "download_retries": "retries", "download_backoff": "backoff"}))
    # keys the config leaves out (or null) take prepare's defaults: one home for each
    return prepare(src, data_dir=data_dir, need=("train", "valid"), **given(
        {"format": "format", "valid_fraction": "valid_fraction", "test_fraction": "test_fraction",
         "unknown": "unknown", "on_invalid": "on_invalid", "dedup": "dedup", "prepare_workers": "workers",
         "progress": "progress"}))


def check_splits(source: Path, counts: dict, need: tuple[str, ...], valid_fraction: float) -> None:
    """One-line error when ``counts`` (a manifest, or the same shape) hold no usable record,
    or none in a split of ``need``."""
    if counts["kept"] == 0:
        first = f"; first invalid: {counts['invalid_examples'][0]}" if counts.get("invalid_examples") else ""
        raise UserError(f"{source}: no usable protein records ({counts['records_read']:,} read, "
                        f"{counts['invalid']:,} invalid, {counts['duplicates']:,} duplicates){first}")
    kept = {s: counts["splits"][s]["kept"] for s in SPLITS}
    if any(kept[s] == 0 for s in need):
        raise UserError(f"{source}: {kept['train']:,} records went to train and {kept['valid']:,} to valid; "
                        f"training needs both: change data.valid_fraction (now {valid_fraction}) or use a "
                        f"larger file")


def _discard(out: Path) -> None:
    """Remove a preparation's own files (and then its folder and lock, if nothing else is left)."""
    for name in ("parts", *SPLITS):
        shutil.rmtree(out / name, ignore_errors=True)
    for name in ("params.json", MANIFEST):
        (out / name).unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        out.rmdir()
        out.with_name(out.name + ".lock").unlink(missing_ok=True)
        out.parent.rmdir()  # the cache's prepared/ folder, when this was its only entry


def _prepare(source: Path, out: Path, sha: str, params: dict, *, on_invalid: str, workers: int | None,
             max_parts: int | None, progress: bool, need: tuple[str, ...]) -> Path:
    """Claim ``out``, resume after its last committed part, run the remaining parts, write the
    manifest. ``params`` (:func:`_params`) holds the settings the shards depend on."""
    _claim(out, sha, params)
    p = params
    part, state, seen, ids = _resume(out, p["dedup"])
    gz = is_gzip(source)
    workers = (os.cpu_count() or 1) if workers is None else workers
    tasks = _tasks(source, p["format"], Tokenizer(unknown=p["unknown"]), p["valid_fraction"], p["test_fraction"],
                   p["block_size"], state.next_offset, by_range=not gz and workers > 0)
    bar = _progress_bar(source, gz, state.next_offset) if progress else None
    t0 = time.perf_counter()
    try:
        part, done = _run_parts(tasks, workers, out, part, state, seen if p["dedup"] else None, ids, str(source),
                                on_invalid, p["blocks_per_part"], max_parts, bar)
    finally:
        if bar is not None:
            bar.close()
    if not done:
        log.info("%s: stopped after %d parts (max_parts); call again to continue", out, part)
        return out
    manifest = _manifest(state, source, sha, gz, params, time.perf_counter() - t0)
    try:
        check_splits(source, manifest, need, p["valid_fraction"])
    except UserError:
        _discard(out)  # complete but unusable for these settings: no folder to mistake for data
        raise
    write_json(out / MANIFEST, manifest, fixed_temp=True)  # fixed_temp: under the preparation's lock
    print(_summary(source, out, manifest))
    return out


def _claim(out: Path, sha: str, params: dict) -> None:
    """Mark ``out`` as this source's preparation under these settings (refusing another's)."""
    (out / "parts").mkdir(parents=True, exist_ok=True)
    info_path = out / "params.json"
    info = {"source_sha256": sha, "params": params}
    if info_path.is_file() and json.loads(info_path.read_text()) != info:
        raise UserError(f"{out}: holds a preparation of other data or settings ({info_path}); use another out_dir")
    write_json(info_path, info, fixed_temp=True)


def _resume(out: Path, dedup: bool) -> tuple[int, _State, HashSet, IdCheck]:
    """(next part, counts, de-dup set, id check) after the last committed part (all empty at the start)."""
    part = 0
    while _part_path(out, part).is_file():
        part += 1
    state = _State(json.loads(_part_path(out, part - 1).read_text()) if part else None)
    seen = HashSet(1 << 20)
    ids = IdCheck()
    if part:
        if dedup:
            for s in SPLITS:
                for shard in state.shards[s]:
                    seen.add(np.load(out / shard["hashes_file"], allow_pickle=False))
        for p in range(part):
            ids.load(_ids_path(out, p))
        log.info("%s: resuming after %d finished parts (%d sequences)", out, part, len(ids))
    return part, state, seen, ids


def _tasks(source: Path, format: str, tokenizer: Tokenizer, valid_fraction: float, test_fraction: float,
           block_size: int, start: int, by_range: bool):
    """(offset, worker task) per block from ``start``: the block's text, or (uncompressed, with
    workers) only its byte range, which the worker reads itself."""
    src = str(source)
    if by_range:
        it = ((off, ("range", (src, off, n))) for off, n in iter_ranges(source, format, block_size, start))
    else:
        it = ((off, ("bytes", buf)) for off, buf in iter_text_blocks(source, format, block_size, start))
    for off, (kind, payload) in it:
        yield off, (kind, payload, format, tokenizer, valid_fraction, test_fraction, off == 0, src)


def _progress_bar(source: Path, gz: bool, start: int):
    from tqdm import tqdm
    return tqdm(total=None if gz else source.stat().st_size, initial=0 if gz else start,
                unit="B", unit_scale=True, desc=f"prepare {source.name}")


def _run_parts(tasks, workers: int, out: Path, part: int, state: _State, seen: HashSet | None, ids: IdCheck,
               src: str, on_invalid: str, blocks_per_part: int, max_parts: int | None, bar) -> tuple[int, bool]:
    """Absorb the blocks' results in block order, committing a part every ``blocks_per_part``
    blocks and at the end; (parts committed, whether the source is finished)."""
    runner = _Ordered(workers)
    writers = None
    try:
        for off, res in _in_file_lines(runner.map(tasks), state):
            if writers is None:
                writers = {s: ShardWriter(out, s, part) for s in SPLITS}
            _absorb(res, off, state, seen, ids, writers, src, on_invalid)
            state.blocks += 1
            if bar is not None:
                bar.update(res.nbytes)
            if state.blocks % blocks_per_part == 0:
                _commit(out, part, writers, state, ids)
                writers, part = None, part + 1
                if max_parts is not None and part >= max_parts:
                    return part, False
        if writers is not None:
            _commit(out, part, writers, state, ids)
            part += 1
    finally:
        runner.close()
    return part, True


def _in_file_lines(results, state: _State):
    """``results`` in block order, a block's format error naming the file's line (the lines of the
    blocks absorbed before it are counted in ``state``)."""
    try:
        yield from results
    except BlockParseError as e:
        raise e.in_file(state.newlines) from None


def _summary(source: Path, out: Path, c: dict) -> str:
    msg = (f"prepared {source}: read {c['records_read']:,} records, kept {c['kept']:,}, "
           f"duplicates {c['duplicates']:,}, invalid {c['invalid']:,}; "
           + ", ".join(f"{s} {c['splits'][s]['kept']:,}" for s in SPLITS) + f"\nprepared data: {out}")
    if c["invalid"]:
        msg += "\ninvalid records (first few): " + "; ".join(c["invalid_examples"])
    return msg


class IdCheck:
    """Which records repeat an earlier id, with the same sequence or another (64-bit hashes:
    ids, and id + sequence), in file order; what a part added is saved with the part."""

    def __init__(self):
        self.ids, self.pairs, self.added = HashSet(1 << 20), HashSet(1 << 20), []

    def __len__(self) -> int:
        return len(self.ids)

    def check(self, res: BlockResult) -> tuple[np.ndarray, np.ndarray]:
        """(same, other) per record of ``res``: repeats an earlier id with the same sequence / another."""
        order = np.argsort(res.records, kind="stable")  # file order
        idh = res.id_hashes[order]
        pair = idh ^ (res.hashes[order] * np.uint64(0x9E3779B97F4A7C15))
        first = self.ids.add(idh)
        self.pairs.add(pair[first])
        again = np.flatnonzero(~first)
        other = np.zeros(len(order), dtype=bool)
        other[again[self.pairs.add(pair[again])]] = True
        same, diff = np.empty_like(other), np.empty_like(other)
        same[order], diff[order] = ~first & ~other, other
        self.added.append(np.stack([idh, pair], axis=1))
        return same, diff

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")  # a fixed name: under the preparation's lock, a rerun replaces a kill's
        with open(tmp, "wb") as fh:
            np.save(fh, np.concatenate(self.added) if self.added else np.zeros((0, 2), np.uint64))
        os.replace(tmp, path)
        self.added = []

    def load(self, path: Path) -> None:
        a = np.load(path, allow_pickle=False)
        self.ids.add(a[:, 0])
        self.pairs.add(a[:, 1])


def _ids_path(out: Path, part: int) -> Path:
    return out / "parts" / f"{part:05d}.ids.npy"


def _absorb(res: BlockResult, off: int, state: _State, seen: HashSet | None, ids: IdCheck, writers: dict, src: str,
            on_invalid: str) -> None:
    """Fold one block's result into the shards and counts (main process, block order)."""
    for line, rid, why in res.reasons:
        text = f"{src}:{state.newlines + line + 1}: record {rid!r}: {why}"
        if on_invalid == "error":
            raise ParseError(text + " (set data.on_invalid=skip to count and skip such records)")
        if len(state.invalid_examples) < 20:
            state.invalid_examples.append(text)
    if on_invalid == "error" and res.invalid.sum():
        raise ParseError(f"{src}: invalid record after line {state.newlines}")
    same, other = ids.check(res)
    for i in np.flatnonzero(other)[np.argsort(res.records[other], kind="stable")].tolist():
        text = (f"{src}:{state.newlines + int(res.lines[i]) + 1}: record {res.ids[i].decode('utf-8', 'replace')!r}: "
                f"repeats an earlier record's id with a different sequence")
        if on_invalid == "error":
            raise ParseError(text + " (rename one, or set data.on_invalid=skip to count and skip such records)")
        if len(state.invalid_examples) < 20:
            state.invalid_examples.append(text)
    is_new = ~(same | other)
    if seen is not None:  # the first occurrence in file order is kept, whatever its split
        in_file_order = np.argsort(res.records, kind="stable")
        in_file_order = in_file_order[is_new[in_file_order]]
        is_new[in_file_order] = seen.add(res.hashes[in_file_order])
    bounds = np.searchsorted(res.splits, np.arange(len(SPLITS) + 1))
    tok_off = np.concatenate(([0], np.cumsum(res.lengths + 1)))
    for si, s in enumerate(SPLITS):
        a, b = int(bounds[si]), int(bounds[si + 1])
        new = is_new[a:b]
        lens = res.lengths[a:b] + 1
        toks = res.tokens[tok_off[a]:tok_off[b]]
        if not new.all():
            toks = toks[np.repeat(new, lens)]
            lens = lens[new]
        writers[s].append(toks, lens, res.hashes[a:b][new])
        c = state.counts
        c["records_read"][s] += int(res.read[si])
        c["invalid"][s] += int(res.invalid[si]) + int(other[a:b].sum())
        c["duplicates"][s] += int((~new & ~other[a:b]).sum())
        c["kept"][s] += int(new.sum())
        c["tokens"][s] += int(lens.sum())
        if len(lens):
            bins = np.minimum(np.frexp(lens - 1)[1] - 1, HIST_BINS - 1)  # floor(log2(residues))
            h = np.bincount(bins, minlength=HIST_BINS)
            state.hist[s] = [x + int(y) for x, y in zip(state.hist[s], h)]
            if s == "train":
                tc = np.bincount(toks, minlength=len(state.train_token_counts))
                tc[: Tokenizer().aa_offset] = 0
                state.train_token_counts = [x + int(y) for x, y in zip(state.train_token_counts, tc)]
    state.newlines += res.newlines
    state.next_offset = off + int(res.nbytes)


def _commit(out: Path, part: int, writers: dict, state: _State, ids: IdCheck) -> None:
    for s, w in writers.items():
        state.shards[s].append(w.close())
    ids.save(_ids_path(out, part))
    # last: the part counts as done once this exists
    write_json(_part_path(out, part), state.to_dict(), fixed_temp=True)


def _manifest(state: _State, source: Path, sha: str, gz: bool, params: dict, seconds: float) -> dict:
    c = state.counts
    splits = {s: {k: c[k][s] for k in ("records_read", "kept", "duplicates", "invalid", "tokens")}
              | {"shards": [x for x in state.shards[s] if x["records"] > 0],
                 "length_histogram": state.hist[s]} for s in SPLITS}
    total = {k: sum(c[k].values()) for k in ("records_read", "kept", "duplicates", "invalid", "tokens")}
    hist = [sum(state.hist[s][i] for s in SPLITS) for i in range(HIST_BINS)]
    return {
        "format_version": FORMAT_VERSION,
        "tokenizer_version": VERSION,
        "source": {"path": str(source), "bytes": source.stat().st_size, "sha256": sha, "format": params["format"], "gzip": gz,
                   "uncompressed_bytes": state.next_offset},
        "params": params,
        **total,
        "splits": splits,
        "length_histogram": {"note": "residues per kept record; bin i counts lengths in [2^i, 2^(i+1)), "
                                     "the last bin everything longer", "counts": hist},
        "train_token_counts": state.train_token_counts,
        "invalid_examples": state.invalid_examples,
        "seconds_last_run": round(seconds, 3),
    }
