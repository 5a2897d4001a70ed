"""OLMo-core's LM evaluator: per-label CE loss and perplexity over padded documents (`eval.lm`).

What AI2's OLMo 3 runs log every 10,000 steps (`LMEvaluatorCallbackConfig` over the validation mix
`v3-small-ppl-validation`), with OLMo-core's semantics (snapshot fa6c5014):

- Instances (`NumpyPaddedFSLDataset`, `segment_documents_into_instances` in
  src/olmo_core/data/utils.py): one per document. A file's documents end at each EOS token (the EOS
  belongs to the document it ends); tokens after a file's last EOS are no document. A document longer
  than the sequence length is truncated to its first `seq_len` tokens; a shorter one is padded with
  the pad token, its `label_mask` false on the padding (`NumpyPaddedFSLDataset.__getitem__`).
- Labels (`get_labels`, src/olmo_core/data/utils.py): the inputs shifted left by one, -100 where the
  next position is padding, and at the last position.
- Loss (src/olmo_core/eval/lm_evaluator.py, `LMEvaluator.update_metrics` with `MeanMetric`): the
  per-token CE (0 at ignored labels) of the `label_mask` positions, averaged over every label's
  instances: sum of CE / sum of document lengths. A document of n tokens has n - 1 targets but counts
  n in the denominator (its last position's label is ignored, its CE 0): that is OLMo-core's number,
  and ours. PPL = exp(CE) (`compute_metrics`).
- Tags (src/olmo_core/train/callbacks/evaluator_callback.py): `eval/lm/<label>/CE loss` and
  `eval/lm/<label>/PPL`; a mix's label is its manifest's first column (`c4_en-validation`).
- Every evaluation covers the whole set (OLMo-core's `eval_duration` of one epoch). OLMo-core's eval
  loader itself reads its shuffle (seed 0, epoch 1) cut to whole global eval batches, so it leaves out
  fewer than one batch of instances, which depend on its data-parallel size: `eval.lm.whole_batches_of`
  selects exactly those (`evaluated_instances`); 0, the default, evaluates every instance.

Hosts: the instances are numbered file by file, document by document (OLMo-core's dataset order); of
the n evaluated (ascending), process `p` of `P` evaluates the contiguous share `host_share(n, p, P)`
and reads only those instances' tokens.
Each host finds the document boundaries itself, from the EOS positions (as each node of an OLMo-core
job writes its own instance index). Every host runs the same number of eval steps (`steps_per_eval`),
padding its last rows with weightless ones; the step sums CE and weights per label over the whole
slice, and the host adds the per-step sums in float64 in a fixed order: deterministic on a layout.

numpy at import; jax only in `evaluate`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from olmo_ctl.core.contracts import lm_eval_tags
from olmo_ctl.core.errors import BadInput
from olmo_ctl.data.files import TokenFile, resolve_mix, resolve_paths
from olmo_ctl.trainer.evaluator import Evaluation, Evaluator
from olmo_ctl.trainer.token_files import TokenFiles

IGNORE_INDEX = -100


def document_spans(tokens: np.ndarray, eos_token_id: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends) of the padded-FSL instances of one token file: each document ends just after an
    EOS, truncated to `seq_len` tokens; what follows the last EOS is dropped."""
    ends = np.flatnonzero(np.asarray(tokens) == eos_token_id).astype(np.int64) + 1
    starts = np.concatenate(([0], ends))[: len(ends)].astype(np.int64)
    return starts, np.minimum(ends, starts + seq_len)


def padded_instance(doc: np.ndarray, seq_len: int, pad_token_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, labels) int32[seq_len] of one document (at most `seq_len` tokens): padded inputs;
    labels shifted left by one, ignored where the next position is padding and at the end."""
    n = len(doc)
    ids = np.full(seq_len, pad_token_id, np.int32)
    ids[:n] = doc
    labels = np.full(seq_len, IGNORE_INDEX, np.int32)
    labels[: n - 1] = ids[1:n]
    return ids, labels


def host_share(n_instances: int, proc: int, n_proc: int) -> range:
    """The instances process `proc` of `n_proc` evaluates: a contiguous share, sizes differing by at
    most one; over the processes, every instance exactly once."""
    return range(n_instances * proc // n_proc, n_instances * (proc + 1) // n_proc)


def steps_per_eval(n_instances: int, n_proc: int, rows_per_proc: int) -> int:
    """Eval steps of one evaluation, the same on every process: the largest share over its rows."""
    largest_share = -(-n_instances // n_proc)
    return -(-largest_share // rows_per_proc)


@dataclass(frozen=True)
class LabelledFiles:
    label: str
    files: tuple[TokenFile, ...]


def resolve_sets(recipe) -> list[LabelledFiles]:
    """`eval.lm`'s token files with their labels, in order: a validation mix's files under `data.root`
    in its manifest's order, one entry per line (its label the line's), or the recipe's `sets`. A
    missing file is a BadInput naming it."""
    lm, root = recipe.eval.lm, recipe.data.root
    if lm.mix:
        from olmo_ctl.data.mixes import load_mix

        files = resolve_mix(lm.mix, root, what="eval.lm.mix")
        return [LabelledFiles(e.label, (f,)) for e, f in zip(load_mix(lm.mix), files, strict=True)]
    return [
        LabelledFiles(s.label, tuple(resolve_paths(s.files, root, what=f"eval.lm `{s.label}`")))
        for s in lm.sets
    ]


class LMEvalData:
    """The padded-document instances of labelled token files, numbered file by file (in `sets`'
    order, as OLMo-core numbers its dataset's files), document by document; a label may hold several
    files. `batch(indices)` builds rows, from this process's cached share once `cache_share` read it."""

    def __init__(
        self,
        sets: list[LabelledFiles],
        seq_len: int,
        eos_token_id: int,
        pad_token_id: int,
        vocab_size: int | None = None,
    ):
        self.labels = list(dict.fromkeys(s.label for s in sets))  # first-seen order
        self.seq_len, self.pad_token_id, self.vocab_size = seq_len, pad_token_id, vocab_size
        files = [f for s in sets for f in s.files]
        self.token_files = TokenFiles(files)
        fi_parts, start_parts, end_parts, label_parts = [], [], [], []
        fi = 0
        for s in sets:
            li = self.labels.index(s.label)
            for f in s.files:
                starts, ends = document_spans(self.token_files.tokens(fi), eos_token_id, seq_len)
                if not len(starts):
                    raise BadInput(
                        f"eval.lm `{s.label}`: `{f.path}` holds no document (no EOS token {eos_token_id})",
                        "documents in token files end with the model's EOS token (OLMo-core's layout)",
                    )
                fi_parts.append(np.full(len(starts), fi, np.int64))
                start_parts.append(starts)
                end_parts.append(ends)
                label_parts.append(np.full(len(starts), li, np.int32))
                fi += 1
        self.file_index = np.concatenate(fi_parts)
        self.starts, self.ends = np.concatenate(start_parts), np.concatenate(end_parts)
        self.label_index = np.concatenate(label_parts)
        self._cache: dict[int, tuple[int, np.ndarray]] = {}  # file -> (first token, this share's tokens)

    def __len__(self) -> int:
        return len(self.starts)

    def cache_share(self, indices) -> None:
        """Read the tokens of `indices` (ascending) once: one range per file, kept in memory."""
        idx = np.asarray(indices, np.int64)
        for fi in np.unique(self.file_index[idx]).tolist():
            rows = idx[self.file_index[idx] == fi]
            first, last = int(self.starts[rows[0]]), int(self.ends[rows[-1]])
            toks = np.array(self.token_files.read(fi, first, last))
            if self.vocab_size is not None and len(toks) and int(toks.max()) >= self.vocab_size:
                raise BadInput(
                    f"eval.lm `{self.labels[self.label_index[rows[0]]]}`: `{self.token_files.files[fi].path}`"
                    f" holds token id {int(toks.max())}, outside the model's vocab ({self.vocab_size})",
                    "the data was made with another tokenizer than the recipe's model",
                )
            self._cache[fi] = (first, toks)
        # A fresh cache drops the scan's maps and whole gs:// files: only the share stays in memory.
        self.token_files = TokenFiles(self.token_files.files)

    def document(self, i: int) -> np.ndarray:
        """Instance `i`'s tokens (at most `seq_len`): from the cached share, else read."""
        fi = int(self.file_index[i])
        if fi in self._cache:
            first, toks = self._cache[fi]
            doc = toks[int(self.starts[i]) - first : int(self.ends[i]) - first]
        else:
            doc = self.token_files.read(fi, int(self.starts[i]), int(self.ends[i]))
        return doc

    def batch(self, indices, rows: int) -> dict[str, np.ndarray]:
        """`rows` rows: the instances `indices`, then weightless padding rows (all labels ignored,
        label index -1). `weight` is OLMo-core's per-instance denominator: the document's length."""
        out = {
            "input_ids": np.full((rows, self.seq_len), self.pad_token_id, np.int32),
            "labels": np.full((rows, self.seq_len), IGNORE_INDEX, np.int32),
            "label_index": np.full(rows, -1, np.int32),
            "weight": np.zeros(rows, np.int32),
        }
        for r, i in enumerate(indices):
            doc = self.document(int(i))
            out["input_ids"][r], out["labels"][r] = padded_instance(doc, self.seq_len, self.pad_token_id)
            out["label_index"][r], out["weight"][r] = self.label_index[i], len(doc)
        return out


def evaluated_instances(n_instances: int, whole_batches_of: int = 0) -> np.ndarray:
    """The instances an evaluation covers, ascending: all of them, or with `whole_batches_of` B > 0
    those OLMo-core's eval loader reads: `NumpyFSLDataLoader` (src/olmo_core/data/data_loader.py)
    shuffles with `PCG64(seed 0 + epoch 1)` (`Evaluator.__iter__` pins epoch 1) and keeps only whole
    global batches of B instances."""
    if whole_batches_of <= 0:
        return np.arange(n_instances, dtype=np.int64)
    order = np.arange(n_instances, dtype=np.uint32)
    np.random.Generator(np.random.PCG64(0 + 1)).shuffle(order)
    return np.sort(order[: n_instances // whole_batches_of * whole_batches_of].astype(np.int64))


def first_per_label(instances: np.ndarray, label_index: np.ndarray, limit: int) -> np.ndarray:
    """Of `instances` (ascending), the first `limit` of each label, still ascending."""
    labels = label_index[instances]
    keep = np.zeros(len(instances), bool)
    for li in np.unique(labels):
        keep[np.flatnonzero(labels == li)[:limit]] = True
    return instances[keep]


def per_label_metrics(labels: list[str], ce_sums, weights) -> dict[str, float]:
    """OLMo-core's scalars from per-label CE sums and weights: `eval/lm/<label>/CE loss`, `.../PPL`."""
    import math

    out = {}
    for label, ce, w in zip(labels, ce_sums, weights, strict=True):
        loss = float(ce) / float(w) if w else math.nan
        ce_tag, ppl_tag = lm_eval_tags(label)
        out[ce_tag], out[ppl_tag] = loss, math.exp(min(loss, 80.0))
    return out


class LMEvaluator(Evaluator):
    """The whole `eval.lm` set on the run's mesh, in eval steps of `step.eval_layout`'s micro-batches;
    in the loop, every `eval.lm.interval` steps (trainer/evaluator.py)."""

    name = "lm"

    def __init__(self, data: LMEvalData, s, limit: int = 0):
        """`limit` > 0: only the first `limit` evaluated instances (documents) of each label."""
        from olmo_ctl.trainer.step import eval_layout, jit_lm_eval_step

        self.data, self.s = data, s
        self.interval = s.recipe.eval.lm.interval
        n_micro, micro = eval_layout(s.recipe, s.plan)
        self.rows_per_proc = n_micro * micro // s.n_proc
        self.instances = evaluated_instances(len(data), s.recipe.eval.lm.whole_batches_of)
        if limit > 0:
            self.instances = first_per_label(self.instances, data.label_index, limit)
        if not len(self.instances):
            raise BadInput(
                f"eval.lm: its {len(data)} instances make no whole batch of eval.lm.whole_batches_of "
                f"({s.recipe.eval.lm.whole_batches_of})",
                "lower eval.lm.whole_batches_of, or 0 to evaluate every instance",
            )
        n = len(self.instances)
        mine = host_share(n, s.proc, s.n_proc)
        self.share = self.instances[mine.start : mine.stop]  # this process's instances, ascending
        self.steps = steps_per_eval(n, s.n_proc, self.rows_per_proc)
        self.step_fn = jit_lm_eval_step(s.recipe, len(data.labels), s.mesh)
        data.cache_share(self.share)

    @classmethod
    def for_recipe(cls, s) -> LMEvaluator | None:
        r = s.recipe
        if not r.eval.lm.enabled:
            return None
        m = r.model
        data = LMEvalData(resolve_sets(r), r.train.seq_len, m.eos_token_id, m.pad_token_id, m.vocab_size)
        return cls(data, s)

    def host_batches(self):
        """This process's rows of each eval step, in order (the last ones padded)."""
        r = self.rows_per_proc
        for k in range(self.steps):
            yield self.data.batch(self.share[k * r : (k + 1) * r], r)

    def evaluate(self, params) -> dict[str, float]:
        """OLMo-core's scalars per label: `eval/lm/<label>/CE loss` and `.../PPL`."""
        return per_label_metrics(self.data.labels, *self.sums(params))

    def run(self, params) -> Evaluation:
        values = self.evaluate(params)
        losses = " ".join(f"{x} {values[lm_eval_tags(x)[0]]:.4f}" for x in self.data.labels)
        return Evaluation(values, f"lm {losses}")

    def sums(self, params) -> tuple[np.ndarray, np.ndarray]:
        """Per label (in `data.labels`' order): the sum of the CE of its targets and the sum of its
        weights (its documents' lengths: OLMo-core's denominator, the tokens evaluated), float64."""
        import jax

        from olmo_ctl.trainer.step import eval_device_batch

        s = self.s
        # Every step dispatched before any result is read: the next rows are built while one runs.
        sums = [
            self.step_fn(params, eval_device_batch(b, s.recipe, s.plan, s.mesh, s.local_devices, s.n_proc))
            for b in self.host_batches()
        ]
        n = len(self.data.labels)
        ce, w = np.zeros(n, np.float64), np.zeros(n, np.float64)
        for c, k in jax.device_get(sums):
            for m in range(len(c)):  # per micro-batch, in order
                ce += np.asarray(c[m], np.float64)
                w += np.asarray(k[m], np.float64)
        return ce, w
