"""The training data pipeline: OLMo-core's fixed-sequence-length ("FSL") numpy dataset semantics.

- `TokenDataset`: each token file is cut on its own into non-overlapping `seq_len` instances; each
  file's remainder is dropped. Instance `i` counts through the files in order. Labels are the
  inputs shifted left by one with the last position ignored (-100).
- `epoch_order`: the global order of epoch `e` (epochs start at 1) is
  `numpy.random.Generator(numpy.random.PCG64(seed + e)).permutation(n_instances)`, trimmed to whole
  global batches (the same permutation as OLMo-core's `shuffle(arange(n))` with that generator).
- `BatchLoader`: THE one place that shards data. Global batch `b` of epoch `e` is
  `order[b*G:(b+1)*G]`; process `p` of `P` reads only `order[b*G + p*G/P : b*G + (p+1)*G/P]`.
  Nothing downstream re-shards (re-striding an already sharded stream is the double-sharding bug).
  Its state is "the next batch to be read": `{epoch, batch_in_epoch, batches_seen, tokens_seen,
  fingerprint}`, global (the same on every process, independent of the process count), so a
  checkpoint written after step N resumes at global batch N+1 on any slice.
- Stored orders: with `order_dir` (the trainer passes `<run-dir>/data_order`), each epoch's order is
  computed once, stored with chunk checksums, and read back by rows (`epoch_order.py`), so a
  restart or another host reads only the rows it needs instead of recomputing the permutation.
- Background prefetch: worker threads build the next batches ahead of time; the state is the
  consumer's (what `next()` handed out), never the prefetcher's, so restore is exact.
- Optional n-gram repetition filter (`repetition.py`, shared with the packed dataset): an instance holding a period-1..13 pattern repeated >= 32
  times back to back gets every label set to -100 (its tokens still count in the loss denominator
  as OLMo-core does: the trainer sees them as ignored positions).

numpy only: no jax import here.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from olmo_ctl import storage
from olmo_ctl.core.errors import BadInput
from olmo_ctl.data.files import (
    TOKEN_BYTES,
    TokenFile,
    check_fingerprint,
    dataset_fingerprint,
    resolve_files,
)
from olmo_ctl.trainer.epoch_order import stored_order
from olmo_ctl.trainer.repetition import has_repetition
from olmo_ctl.trainer.token_files import TokenFiles

IGNORE_INDEX = -100
STATE_KEYS = ("epoch", "batch_in_epoch", "batches_seen", "tokens_seen", "fingerprint")


# ---------------------------------------------------------------- order


def epoch_order(n_instances: int, seed: int, epoch: int, global_batch: int) -> np.ndarray:
    """Instance indices of epoch `epoch` (>= 1) in order, trimmed to whole global batches.

    Exactly `numpy.random.Generator(numpy.random.PCG64(seed + epoch)).permutation(n_instances)`
    with the tail beyond the last whole global batch cut off. (`Generator.permutation(n)` is
    `shuffle(arange(n))`; the shuffle is done on a uint32 arange when it fits, which draws the same
    random numbers and gives the same permutation with half the memory.)
    """
    if epoch < 1:
        raise ValueError(f"epochs start at 1, got {epoch}")
    if global_batch < 1:
        raise ValueError(f"global_batch must be positive, got {global_batch}")
    rng = np.random.Generator(np.random.PCG64(seed + epoch))
    order: np.ndarray
    if n_instances < 2**32:
        order = np.arange(n_instances, dtype=np.uint32)
        rng.shuffle(order)
    else:
        order = rng.permutation(n_instances)
    return order[: n_instances // global_batch * global_batch]


# ---------------------------------------------------------------- dataset


class TokenDataset:
    """Fixed-length instances over raw uint32 token files (local: memory-mapped; gs://: ranged reads)."""

    def __init__(
        self,
        files: Sequence[TokenFile | str],
        seq_len: int,
        ngram_filter: bool = False,
        vocab_size: int | None = None,
    ):
        if seq_len < 2:
            raise ValueError(f"seq_len must be >= 2, got {seq_len}")
        self.files = [f if isinstance(f, TokenFile) else _stat_file(f) for f in files]
        self.seq_len = int(seq_len)
        self.ngram_filter = bool(ngram_filter)
        self.vocab_size = vocab_size
        self.instances_per_file = np.array([f.tokens // self.seq_len for f in self.files], dtype=np.int64)
        self._ends = np.cumsum(self.instances_per_file)
        self.token_files = TokenFiles(self.files)  # local maps and gs:// reads, a bounded number kept open

    def __len__(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    def __repr__(self) -> str:
        return f"TokenDataset({len(self.files)} files, seq_len={self.seq_len}, instances={len(self)})"

    @property
    def tokens_per_epoch(self) -> int:
        return len(self) * self.seq_len

    def fingerprint(self, seed: int) -> str:
        return dataset_fingerprint(self.files, self.seq_len, seed)

    def locate(self, i: int) -> tuple[int, int]:
        """(file index, token offset) of instance `i`."""
        if not 0 <= i < len(self):
            raise IndexError(f"instance {i} out of range [0, {len(self)})")
        fi = int(np.searchsorted(self._ends, i, side="right"))
        first = int(self._ends[fi - 1]) if fi else 0
        return fi, (i - first) * self.seq_len

    def tokens(self, i: int) -> np.ndarray:
        """The `seq_len` raw tokens of instance `i` (uint32)."""
        fi, off = self.locate(int(i))
        out = self.token_files.read(fi, off, off + self.seq_len)
        return out if storage.is_gcs(self.files[fi].path) else np.array(out)

    def instance(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids int32[seq_len], labels int32[seq_len]): labels shifted left by one, last -100.

        With the n-gram filter on, a repetitive instance has every label -100 (see `instance_kept`).
        """
        input_ids, labels, _ = self._instance(i)
        return input_ids, labels

    def _instance(self, i: int) -> tuple[np.ndarray, np.ndarray, bool]:
        toks = self.tokens(i)
        if self.vocab_size is not None and len(toks) and int(toks.max()) >= self.vocab_size:
            raise BadInput(
                f"instance {i} holds token id {int(toks.max())}, outside the model's vocab "
                f"({self.vocab_size})",
                "the data was made with another tokenizer than the recipe's model",
            )
        input_ids = toks.astype(np.int32)
        labels = np.empty_like(input_ids)
        labels[:-1] = input_ids[1:]
        labels[-1] = IGNORE_INDEX
        kept = not (self.ngram_filter and has_repetition(toks))
        if not kept:
            labels[:] = IGNORE_INDEX
        return input_ids, labels, kept

    def batch(self, indices) -> dict[str, np.ndarray]:
        """Rows for `indices`: input_ids, labels, instance_ids, and instance_mask (False: filtered out).

        A filtered instance's labels are all -100, but its `seq_len - 1` label positions still
        belong in the loss denominator (OLMo-core's instance filter): the trainer divides by
        `(labels != -100).sum() + (seq_len - 1) * (~instance_mask).sum()`.
        """
        idx = np.asarray(indices, dtype=np.int64)
        inputs = np.empty((len(idx), self.seq_len), dtype=np.int32)
        labels = np.empty((len(idx), self.seq_len), dtype=np.int32)
        kept = np.ones(len(idx), dtype=bool)
        for r, i in enumerate(idx):
            inputs[r], labels[r], kept[r] = self._instance(int(i))
        return {"input_ids": inputs, "labels": labels, "instance_ids": idx, "instance_mask": kept}


def _stat_file(path: str) -> TokenFile:
    info = storage.store_for(path).stat(path)
    if info is None:
        raise BadInput(f"token file `{path}` does not exist")
    if info.size % TOKEN_BYTES:
        raise BadInput(f"`{path}` is {info.size} bytes, not a whole number of uint32 tokens")
    return TokenFile(path, path, info.size)


# ---------------------------------------------------------------- loader


class BatchLoader:
    """This process's disjoint slice of each global batch, in the documented global order.

    `next()` returns `{"input_ids": int32[local_B, T], "labels": int32[local_B, T],
    "instance_ids": int64[local_B], "instance_mask": bool[local_B]}` with `local_B = global_batch / process_count`; process `p`
    gets rows `p*local_B ... (p+1)*local_B - 1` of the global batch. After the last whole global
    batch of an epoch the next epoch starts (the remainder of the shuffled order is not used).
    """

    def __init__(
        self,
        dataset: TokenDataset,
        global_batch: int,
        seed: int,
        process_index: int = 0,
        process_count: int = 1,
        *,
        prefetch_workers: int = 0,
        prefetch_buffer: int = 2,
        fingerprint: str | None = None,
        order_dir: str | None = None,
        progress: Callable[[], None] | None = None,
    ):
        if process_count < 1 or not 0 <= process_index < process_count:
            raise ValueError(f"bad process {process_index} of {process_count}")
        if global_batch < 1 or global_batch % process_count:
            raise BadInput(
                f"global batch {global_batch} is not a multiple of the {process_count} data-loading processes"
            )
        self.dataset = dataset
        self.global_batch = int(global_batch)
        self.seed = int(seed)
        self.process_index = int(process_index)
        self.process_count = int(process_count)
        self.local_batch = self.global_batch // self.process_count
        self.batches_per_epoch = len(dataset) // self.global_batch
        if self.batches_per_epoch == 0:
            raise BadInput(
                f"the training data holds {len(dataset)} instances of {dataset.seq_len} tokens, "
                f"fewer than one global batch ({global_batch})",
                "add data or lower train.global_batch",
            )
        self.fingerprint = fingerprint or dataset.fingerprint(self.seed)
        self.prefetch_workers = int(prefetch_workers)
        self.prefetch_buffer = max(1, int(prefetch_buffer))
        self._epoch = 1
        self._batch = 0  # next batch to hand out, within the epoch
        self._seen = 0
        self._tokens = 0
        self.order_dir = order_dir
        self.progress = progress  # called while waiting for host 0's epoch order (the watchdog's beat)
        self._orders: dict = {}
        self._pool = (
            ThreadPoolExecutor(self.prefetch_workers, thread_name_prefix="data")
            if self.prefetch_workers
            else None
        )
        self._pending: deque[tuple[tuple[int, int], Future]] = deque()

    # -- order and positions (main thread only)

    def order(self, epoch: int):
        """The epoch's order: computed here (an array), or with `order_dir` the stored one (an
        `epoch_order.OrderFile`, computed and stored by the first process that needs it)."""
        o = self._orders.get(epoch)
        if o is None:
            if self.order_dir:
                # One host computes and stores it; the others wait for it and read their rows.
                o = stored_order(
                    self.order_dir,
                    self.fingerprint,
                    len(self.dataset),
                    self.seed,
                    epoch,
                    build=self.process_index == 0,
                    progress=self.progress,
                )
            else:
                o = epoch_order(len(self.dataset), self.seed, epoch, self.global_batch)
            self._orders = {e: v for e, v in self._orders.items() if e >= epoch - 1}
            self._orders[epoch] = o
        return o

    def _rows(self, epoch: int, start: int, stop: int) -> np.ndarray:
        return np.asarray(self.order(epoch)[start:stop]).astype(np.int64)

    def local_indices(self, epoch: int, batch_in_epoch: int) -> np.ndarray:
        """This process's rows of the global batch (only these are read from a stored order)."""
        start = batch_in_epoch * self.global_batch + self.process_index * self.local_batch
        return self._rows(epoch, start, start + self.local_batch)

    def _after(self, pos: tuple[int, int]) -> tuple[int, int]:
        e, b = pos
        return (e, b + 1) if b + 1 < self.batches_per_epoch else (e + 1, 0)

    # -- iteration

    def next(self) -> dict[str, np.ndarray]:
        pos = (self._epoch, self._batch)
        if self._pool is None:
            out = self.dataset.batch(self.local_indices(*pos))
        else:
            nxt = self._pending[-1][0] if self._pending else pos
            if self._pending:
                nxt = self._after(nxt)
            while len(self._pending) < self.prefetch_buffer + 1:
                self._pending.append((nxt, self._pool.submit(self.dataset.batch, self.local_indices(*nxt))))
                nxt = self._after(nxt)
            got, fut = self._pending.popleft()
            assert got == pos, (got, pos)
            try:
                out = fut.result()
            except BaseException:
                self._drop_pending()  # a retry rebuilds from the consumer's position
                raise
        self._epoch, self._batch = self._after(pos)
        self._seen += 1
        self._tokens += self.global_batch * self.dataset.seq_len
        return out

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return self.next()

    # -- state

    def state(self) -> dict:
        """The next batch to be read (JSON-serialisable; identical on every process).

        `global_batch` is kept so that a resume with another global batch continues at the same
        place of the epoch's order instead of reading `batch_in_epoch` in other units.
        """
        return {
            "epoch": self._epoch,
            "batch_in_epoch": self._batch,
            "batches_seen": self._seen,
            "tokens_seen": self._tokens,
            "fingerprint": self.fingerprint,
            "global_batch": self.global_batch,
        }

    def restore(self, state: dict, allow_data_change: bool = False) -> str | None:
        """Continue from `state` (from `state()`). Returns a message when a data change was allowed."""
        missing = [k for k in STATE_KEYS if k not in state]
        if missing:
            raise BadInput(
                f"data loader state lacks {', '.join(missing)}",
                "the checkpoint was not written by this trainer",
            )
        msg = check_fingerprint(state["fingerprint"], self.fingerprint, allow_data_change)
        epoch, batch = int(state["epoch"]), int(state["batch_in_epoch"])
        if epoch < 1 or batch < 0:
            raise BadInput(f"data loader state has epoch {epoch}, batch {batch}")
        saved_gb = int(state.get("global_batch") or self.global_batch)
        if saved_gb != self.global_batch:
            # Same order, same place in it: instance offset batch * saved_gb of this epoch.
            offset = batch * saved_gb
            if offset % self.global_batch and not allow_data_change:
                raise BadInput(
                    f"the global batch changed from {saved_gb} to {self.global_batch} at instance "
                    f"{offset} of epoch {epoch}, which is not a whole number of new global batches",
                    "keep train.global_batch, or pass --allow-data-change to skip to the next whole batch",
                )
            batch = -(-offset // self.global_batch)
        if batch >= self.batches_per_epoch:  # the epoch got shorter (other data or global batch)
            epoch, batch = epoch + 1, 0
        self._drop_pending()
        self._epoch, self._batch = epoch, batch
        self._seen = int(state["batches_seen"])
        self._tokens = int(state["tokens_seen"])
        return msg

    def _drop_pending(self) -> None:
        while self._pending:
            self._pending.popleft()[1].cancel()

    def close(self) -> None:
        self._drop_pending()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---------------------------------------------------------------- recipe helpers


def make_train_loader(
    recipe,
    process_index: int = 0,
    process_count: int = 1,
    order_dir: str | None = None,
    progress: Callable[[], None] | None = None,
) -> BatchLoader:
    """The recipe's training loader: its files, seq_len, data seed, n-gram switch and prefetch settings;
    with `order_dir`, epoch orders (and a packed dataset's packing) are stored there by process 0 and
    read back by later attempts and the other processes. `progress` is called as the set-up advances
    (a group packed or read, a wait for process 0 answered): the watchdog's beat."""
    files = resolve_files(recipe, "train")
    ds = make_train_dataset(
        recipe,
        files,
        cache_dir=f"{order_dir.rstrip('/')}/packing" if order_dir else None,
        build=process_index == 0,
        progress=progress,
    )
    return BatchLoader(
        ds,
        recipe.train.global_batch,
        recipe.data.seed,
        process_index,
        process_count,
        prefetch_workers=recipe.data.prefetch_workers,
        prefetch_buffer=recipe.data.prefetch_buffer,
        order_dir=order_dir,
    )


def make_train_dataset(
    recipe,
    files,
    cache_dir: str | None = None,
    build: bool = True,
    progress: Callable[[], None] | None = None,
):
    """The recipe's training dataset: fixed-length instances cut from each file, or with `data.packed`
    OLMo-core's packed instances (`packed.PackedDataset`, documents masked from each other; with
    `cache_dir` and `build=False`, the packing process 0 stores is waited for and read)."""
    if recipe.data.packed:
        from olmo_ctl.trainer.packed import PackedDataset

        return PackedDataset(
            files,
            recipe.train.seq_len,
            eos_token_id=recipe.model.eos_token_id,
            pad_token_id=recipe.model.pad_token_id,
            source_group_size=recipe.data.source_group_size,
            ngram_filter=recipe.data.ngram_filter,
            vocab_size=recipe.model.vocab_size,
            cache_dir=cache_dir,
            source_permutation_seed=recipe.data.source_permutation_seed,
            build=build,
            progress=progress,
        )
    return TokenDataset(
        files, recipe.train.seq_len, ngram_filter=recipe.data.ngram_filter, vocab_size=recipe.model.vocab_size
    )


def eval_indices(n_instances: int, n_batches: int, batch_size: int) -> np.ndarray:
    """`n_batches * batch_size` distinct held-out instances spread evenly over the files (no randomness)."""
    total = n_batches * batch_size
    if n_instances < total:
        raise BadInput(
            f"the held-out data holds {n_instances} instances, fewer than eval.batches x batch size "
            f"({n_batches} x {batch_size})",
            "lower eval.batches or eval.batch_size, or add held-out data",
        )
    return np.arange(total, dtype=np.int64) * n_instances // total


def eval_batches(
    recipe,
    n: int,
    batch_size: int = 0,
    process_index: int = 0,
    process_count: int = 1,
    dataset: TokenDataset | None = None,
) -> list[dict[str, np.ndarray]]:
    """The same `n` held-out batches every time: this process's slice of each (batch_size 0 = global batch)."""
    bs = batch_size or recipe.train.global_batch
    if bs % process_count:
        raise BadInput(
            f"eval batch size {bs} is not a multiple of the {process_count} data-loading processes"
        )
    ds = dataset or TokenDataset(
        resolve_files(recipe, "eval"), recipe.train.seq_len, vocab_size=recipe.model.vocab_size
    )
    idx = eval_indices(len(ds), n, bs).reshape(n, bs)
    local = bs // process_count
    lo = process_index * local
    return [ds.batch(row[lo : lo + local]) for row in idx]
