"""AI2's downstream evaluator (`eval.downstream`): OLMo-core's in-loop tasks, scored by our model.

What AI2's OLMo 3 runs log every 10,000 steps (`DownstreamEvaluatorCallbackConfig` in OLMo-core's
src/scripts/official/OLMo3/OLMo-3-1025-7B-pretrain-1.py), with the semantics of ai2-olmo-eval 0.9.0
(the version OLMo-core pins) and OLMo-core (snapshot fa6c5014):

- Instances: `olmo_eval.build_task(label, tokenizer, model_ctx_len=seq_len)` with the run's tokenizer
  (`data.tokenizer`), as `DownstreamEvaluator._build_data_loader` builds them when the train module
  gives its sequence length: each instance a query (context, then the continuation but its last
  token; truncated from the left to `seq_len`), `ctx_len` and the continuation. A fast multiple-choice
  instance (`fast_mc`) scores each of its `choices` (one token each) at the last context position.
- Scores: the continuation's log-likelihood (the sum of log-softmax over the padded vocabulary at its
  positions, `-F.cross_entropy(reduction="sum")` in `ICLMetric.update`; a converted model's padding
  rows left out: `ModelConfig.softmax_vocab_size`), computed by our model on the run's mesh; only
  those positions' values leave the device (one value per instance and choice).
- Metrics: `ICLMetric.compute()`'s, computed here from the same values (`icl_metrics`): per
  (doc, continuation) the first value, per document the argmax against its label; its metric keys
  (`acc_v1`, `len_norm_v1`, `bpb_v1`, ...) and OLMo-core's tags `eval/downstream/<task> (<label>)`.
  With each task's standard error as lm-eval-harness reports it (`mean_stderr`: the sample standard
  deviation over documents of the task's own metric, over the square root of their number).
- Batches (`batch_plan`): a task's instances sorted by query length, cut into eval steps; a step's
  rows are padded to the shortest of `row_lengths` that holds its longest query, as ai2-olmo-eval's
  `collate_fn` pads a batch to its longest query rounded up to 128 (not to the sequence length: over
  AI2's 26 tasks most queries are a small part of it). The lengths are 128 x 1, 2, 3, 4, 6, 8, 12, ...
  and the sequence length, a handful of shapes to compile (12 at 8192), and a step's rows at most 1.5x
  its longest from 256 tokens on. Padding sits after a row's tokens, where causal attention hides it:
  every scored position's logits are the full-length row's.
- Hosts: every host plans the same steps; process `p` of `P` scores the p-th share of each step's
  rows. Every step's scores come back replicated with each row's instance index, so every host
  computes the same metrics; process 0 logs them.

numpy at import; olmo_eval (the `eval` extra) when tasks are built; jax only on the mesh.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from olmo_ctl.core.contracts import DOWNSTREAM_PREFIX
from olmo_ctl.core.errors import BadInput
from olmo_ctl.core.recipe import tokenizer_spec
from olmo_ctl.core.text import closest
from olmo_ctl.data.tokenizer import BYTES_TOKENIZER as BYTES_TOKENIZER
from olmo_ctl.data.tokenizer import bytes_tokenizer_json as bytes_tokenizer_json
from olmo_ctl.data.tokenizer import tokenizer_path
from olmo_ctl.trainer.evaluator import Evaluation, Evaluator
from olmo_ctl.trainer.lm_eval import IGNORE_INDEX

ROW_MULTIPLE = 128  # ai2-olmo-eval's collate_fn pads a batch to its longest query rounded up to this
LOG_2_OF_E = 1.44269504089  # olmo_eval.metrics

# OLMo-core's DownstreamEvaluator.metric_type_to_label (src/olmo_core/train/callbacks/evaluator_callback.py)
METRIC_LABELS = {
    "f1_v1": "F1 score",
    "acc_v1": "accuracy",
    "len_norm_v1": "length-normalized accuracy",
    "pmi_dc_v1": "PMI-DC accuracy",
    "ce_loss_v1": "CE loss",
    "bpb_v1": "BPB",
    "soft_v1": "soft loss",
    "soft_log_v1": "log soft loss",
    "f1_v2": "F1 score v2",
    "acc_v2": "accuracy v2",
    "len_norm_v2": "length-normalized accuracy v2",
    "pmi_dc_v2": "PMI-DC accuracy v2",
    "ce_loss_v2": "CE loss v2",
    "bpb_v2": "BPB v2",
    "soft_v2": "soft loss v2",
    "soft_log_v2": "log soft loss v2",
}

# The 26 tasks of AI2's OLMo 3 pretraining script (OLMo-3-1025-7B-pretrain-1.py, "fast" task set).
OLMO3_PRETRAIN_TASKS = (
    "arc_challenge_test_bpb_5shot",
    "arc_challenge_test_mc_5shot_fast",
    "arc_easy_test_bpb_5shot",
    "arc_easy_test_mc_5shot_fast",
    "basic_skills_arithmetic_rc_5shot",
    "basic_skills_coding_rc_5shot",
    "basic_skills_common_knowledge_rc_5shot",
    "basic_skills_logical_reasoning_rc_5shot",
    "basic_skills_pattern_rc_5shot",
    "basic_skills_string_operations_rc_5shot",
    "codex_humaneval_gold_bpb_3shot",
    "codex_mbpp_gold_bpb_3shot",
    "copycolors_10way_fast",
    "hellaswag_bpb_5shot",
    "minerva_math_500_gold_bpb_0shot",
    "mmlu_humanities_test_bpb_5shot",
    "mmlu_humanities_test_mc_5shot_fast",
    "mmlu_other_test_bpb_5shot",
    "mmlu_other_test_mc_5shot_fast",
    "mmlu_social_sciences_test_bpb_5shot",
    "mmlu_social_sciences_test_mc_5shot_fast",
    "mmlu_stem_test_bpb_5shot",
    "mmlu_stem_test_mc_5shot_fast",
    "mt_mbpp_cpp_gold_bpb_3shot",
    "mt_mbpp_java_gold_bpb_3shot",
    "mt_mbpp_rust_gold_bpb_3shot",
)

# ---------------------------------------------------------------- named suites (`--suite`)

# The OLMo 3 case study's eight downstream tasks, scored offline on AI2's checkpoints and the run's:
# ARC-Challenge, ARC-Easy, BoolQ, HellaSwag, OpenBookQA, PIQA, WinoGrande and MMLU, each 5-shot in its
# multiple-choice form on its OLMES split (test where the task has one, else validation); not `_fast`,
# so any tokenizer builds them. MMLU is ai2-olmo-eval's four MMLU categories: eight tasks, 11 labels.
CASE_STUDY_TASKS = (
    "arc_challenge_test_mc_5shot",
    "arc_easy_test_mc_5shot",
    "boolq_val_mc_5shot",
    "hellaswag_val_mc_5shot",
    "openbookqa_test_mc_5shot",
    "piqa_val_mc_5shot",
    "winogrande_val_mc_5shot",
    "mmlu_humanities_test_mc_5shot",
    "mmlu_other_test_mc_5shot",
    "mmlu_social_sciences_test_mc_5shot",
    "mmlu_stem_test_mc_5shot",
)
# Task sets by name (`eval --suite`, `verify --suite`): the in-loop set of AI2's OLMo 3 pretraining and
# the case study's eight.
SUITES: dict[str, tuple[str, ...]] = {
    "olmo3-in-loop": OLMO3_PRETRAIN_TASKS,
    "case-study": CASE_STUDY_TASKS,
}


def downstream_tag(task: str, metric: str) -> str:
    """OLMo-core's tag of one metric of one task: `eval/downstream/<task> (<metric label>)`."""
    return f"{DOWNSTREAM_PREFIX}{task} ({METRIC_LABELS.get(metric, metric)})"


def _olmo_eval():
    try:
        import olmo_eval
    except ImportError as e:
        raise BadInput(
            f"eval.downstream needs ai2-olmo-eval, which is not installed ({e})",
            "install the eval extra (docs/install.md#the-eval-extra), or set eval.downstream=[]",
        ) from None
    return olmo_eval


def known_tasks() -> list[str]:
    """Every task label ai2-olmo-eval can build."""
    return sorted(_olmo_eval().list_tasks())


def check_tasks(labels) -> None:
    """A BadInput naming the first label ai2-olmo-eval does not know."""
    known = set(known_tasks())
    for label in labels:
        if label not in known:
            meant = closest(str(label), known, cutoff=0.8)
            close = [k for k in sorted(known) if k.startswith(str(label).split("_")[0])][:4]
            raise BadInput(
                f"unknown downstream task {label!r}",
                (
                    f"did you mean `{meant}`?"
                    if meant
                    else f"ai2-olmo-eval's labels, e.g. {', '.join(close or sorted(known)[:4])}"
                )
                + " (`olmo-ctl eval --list-tasks` prints them all)",
            )


# ---------------------------------------------------------------- the tokenizer
# Found by data/tokenizer.py's `tokenizer_path`, the rule `data prepare --tokenizer` follows too.


def load_tokenizer(spec: str, model_cfg, cache_dir: str | None = None):
    """olmo_eval's HFTokenizer over `data.tokenizer`, with the model's EOS and pad ids (OLMo-core
    builds it from its TokenizerConfig the same way)."""
    ev = _olmo_eval()
    path = tokenizer_path(spec, cache_dir)
    return ev.HFTokenizer(path, pad_token_id=model_cfg.pad_token_id, eos_token_id=model_cfg.eos_token_id)


# ---------------------------------------------------------------- task instances


@dataclass
class TaskSet:
    """One task's instances as arrays (n instances, choices C >= 1), in ai2-olmo-eval's order."""

    label: str
    metric_type: str
    query: list  # token lists: context + continuation[:-1], at most seq_len
    ctx_len: np.ndarray
    cont_len: np.ndarray
    continuation: list  # token lists
    choices: np.ndarray  # [n, C] int32: fast-MC choice tokens, -1 where none
    fast_mc: bool
    doc_id: np.ndarray
    cont_id: np.ndarray
    label_id: np.ndarray
    cont_str_len: np.ndarray
    cont_byte_len: np.ndarray
    cont_str_len_no_leading_space: np.ndarray
    cont_byte_len_no_leading_space: np.ndarray

    def __len__(self) -> int:
        return len(self.ctx_len)

    @classmethod
    def from_instances(cls, label: str, metric_type: str, instances: list[dict]) -> TaskSet:
        fast = bool(instances) and bool(instances[0].get("fast_mc"))
        width = max((len(x["choices"]) for x in instances), default=1) if fast else 1
        choices = np.full((len(instances), width), -1, np.int32)
        if fast:
            for i, x in enumerate(instances):
                choices[i, : len(x["choices"])] = x["choices"]

        def col(key):
            return np.array([int(x[key]) for x in instances], np.int64)

        return cls(
            label=label,
            metric_type=metric_type,
            query=[list(x["query"]) for x in instances],
            ctx_len=col("ctx_len"),
            cont_len=col("cont_len"),
            continuation=[list(x["continuation"]) for x in instances],
            choices=choices,
            fast_mc=fast,
            doc_id=col("doc_id"),
            cont_id=col("cont_id"),
            label_id=col("label_id"),
            cont_str_len=col("cont_str_len"),
            cont_byte_len=col("cont_byte_len"),
            cont_str_len_no_leading_space=col("cont_str_len_no_leading_space"),
            cont_byte_len_no_leading_space=col("cont_byte_len_no_leading_space"),
        )

    def first_documents(self, n: int) -> TaskSet:
        """The instances of the task's first `n` documents (in ai2-olmo-eval's order), every
        continuation of each: a smaller task with the same metrics' arithmetic."""
        first = list(dict.fromkeys(self.doc_id.tolist()))[:n]  # documents in order of appearance
        keep = np.flatnonzero(np.isin(self.doc_id, first))
        cut = dataclasses.replace(
            self,
            query=[self.query[i] for i in keep],
            continuation=[self.continuation[i] for i in keep],
        )
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, np.ndarray):
                setattr(cut, f.name, value[keep])
        return cut

    def query_lengths(self) -> np.ndarray:
        """Each instance's query length in tokens (int64 [n])."""
        return np.fromiter((len(q) for q in self.query), np.int64, len(self.query))

    def rows(
        self, indices, n_rows: int, seq_len: int, pad_token_id: int, width: int | None = None
    ) -> dict[str, np.ndarray]:
        """`n_rows` model rows of `width` tokens (default `seq_len`): the instances `indices`, then
        padding rows (index -1, nothing scored). `labels` holds the continuation at the positions whose
        logits predict it; `choice_pos` the last context position (where a fast-MC instance's choices
        are scored)."""
        width = width or seq_len
        out = {
            "input_ids": np.full((n_rows, width), pad_token_id, np.int32),
            "labels": np.full((n_rows, width), IGNORE_INDEX, np.int32),
            "choice_pos": np.zeros(n_rows, np.int32),
            "choice_ids": np.full((n_rows, self.choices.shape[1]), -1, np.int32),
            "index": np.full(n_rows, -1, np.int32),
        }
        for r, i in enumerate(indices):
            i = int(i)
            q, c = self.query[i], self.continuation[i]
            ctx, n = int(self.ctx_len[i]), int(self.cont_len[i])
            if len(q) > seq_len or ctx + n - 1 > seq_len:
                raise BadInput(
                    f"downstream task {self.label}: instance {i} is {len(q)} tokens, over seq_len {seq_len}",
                    "build the task with model_ctx_len equal to the sequence length",
                )
            if len(q) > width:
                raise ValueError(f"instance {i} is {len(q)} tokens, over its batch's rows ({width})")
            out["input_ids"][r, : len(q)] = q
            out["labels"][r, ctx - 1 : ctx - 1 + n] = c[:n]
            out["choice_pos"][r] = ctx - 1
            out["choice_ids"][r] = self.choices[i]
            out["index"][r] = i
        return out


def row_lengths(seq_len: int, multiple: int = ROW_MULTIPLE) -> list[int]:
    """The lengths a step's rows are padded to, ascending: `multiple` x 1, 2, 3, 4, 6, 8, 12, 16, ...
    (2^k and 3 x 2^k) below `seq_len`, then `seq_len`: about 2 log2(seq_len / multiple) shapes to
    compile, each at most 1.5x the one before from 2 x multiple on."""
    out, k = [], 1
    while k * multiple < seq_len:
        out.append(k * multiple)
        if k >= 2 and 3 * k // 2 * multiple < seq_len:
            out.append(3 * k // 2 * multiple)
        k *= 2
    return [*out, seq_len]


def batch_plan(
    query_lengths: np.ndarray,
    rows_per_step: int,
    seq_len: int,
    multiple: int = ROW_MULTIPLE,
    pad_to_seq_len: bool = False,
) -> list[tuple[np.ndarray, int]]:
    """The eval steps of one task, the same on every host: (its instances, the length its rows are
    padded to) per step. The instances in order of query length (ascending, ties in task order), cut
    into steps of `rows_per_step` (the rows of every host); a step's length the shortest of
    `row_lengths` that holds its longest query (`seq_len` for every step with `pad_to_seq_len`, the
    layout without buckets)."""
    order = np.argsort(query_lengths, kind="stable")
    lengths = row_lengths(seq_len, multiple)
    plan = []
    for k in range(0, len(order), rows_per_step):
        idx = order[k : k + rows_per_step]
        longest = int(query_lengths[idx].max())
        width = seq_len if pad_to_seq_len else next((n for n in lengths if n >= longest), seq_len)
        plan.append((idx, width))
    return plan


def build_task_set(label: str, tokenizer, seq_len: int) -> TaskSet:
    """`olmo_eval.build_task(label, tokenizer, model_ctx_len=seq_len)` as arrays."""
    ev = _olmo_eval()
    check_tasks([label])
    try:
        task = ev.build_task(label, tokenizer, model_ctx_len=seq_len)
    except AssertionError as e:
        if "continuation length 1" not in str(e):
            raise
        raise BadInput(
            f"downstream task {label}: a fast multiple-choice task needs each choice to be one token, and"
            f" the run's tokenizer makes some longer ({e})",
            "leave the `_fast` tasks out with this tokenizer, or use their `_mc_5shot` / `_rc_5shot` forms",
        ) from None
    ts = TaskSet.from_instances(label, task.metric_type, [task[i] for i in range(len(task))])
    too_long = int(np.sum(ts.ctx_len < 1))
    if too_long:
        raise BadInput(
            f"downstream task {label}: {too_long} of its {len(ts)} continuations are longer than the"
            f" sequence length {seq_len} (the longest {int(ts.cont_len.max())} tokens)",
            "leave the task out at this sequence length (AI2's runs use 8192)",
        )
    return ts


CACHE_DIR = "eval/downstream"  # in the run directory: the built tasks, one file per task and key
_INT_FIELDS = (
    "ctx_len",
    "cont_len",
    "doc_id",
    "cont_id",
    "label_id",
    "cont_str_len",
    "cont_byte_len",
    "cont_str_len_no_leading_space",
    "cont_byte_len_no_leading_space",
)


def task_set_bytes(ts: TaskSet) -> bytes:
    """A TaskSet as a compressed .npz (token lists flat, with their offsets)."""
    import io

    def flat(lists):
        lengths = np.array([len(x) for x in lists], np.int64)
        data = np.fromiter((t for x in lists for t in x), np.int64, int(lengths.sum()))
        return data.astype(np.uint32), np.concatenate(([0], np.cumsum(lengths)))

    q, q_off = flat(ts.query)
    c, c_off = flat(ts.continuation)
    buf = io.BytesIO()
    np.savez_compressed(
        buf,
        label=np.array(ts.label),
        metric_type=np.array(ts.metric_type),
        fast_mc=np.array(ts.fast_mc),
        query=q,
        query_offsets=q_off,
        continuation=c,
        continuation_offsets=c_off,
        choices=ts.choices,
        **{k: getattr(ts, k) for k in _INT_FIELDS},
    )
    return buf.getvalue()


def task_set_from_bytes(data: bytes) -> TaskSet:
    import io

    z = np.load(io.BytesIO(data), allow_pickle=False)

    def lists(key):
        v, off = z[key].astype(np.int64), z[f"{key}_offsets"]
        return [v[off[i] : off[i + 1]].tolist() for i in range(len(off) - 1)]

    return TaskSet(
        label=str(z["label"]),
        metric_type=str(z["metric_type"]),
        query=lists("query"),
        continuation=lists("continuation"),
        choices=z["choices"],
        fast_mc=bool(z["fast_mc"]),
        **{k: z[k] for k in _INT_FIELDS},
    )


class TaskCache:
    """Built tasks kept in the run directory (`eval/downstream/<task>-<key>.npz`), so that only a run's
    first attempt pays for ai2-olmo-eval's building (minutes for AI2's 26 tasks) and later attempts
    read them in seconds. The key is the task's label, the tokenizer file's content, the sequence
    length, the model's EOS and pad ids and the ai2-olmo-eval version: anything that changes the
    instances changes the file. Process 0 writes (create-only); a file that does not read back is
    built again, and a failed write costs the next attempt a build, never this one."""

    def __init__(self, run_dir: str, tokenizer_file: str, seq_len: int, model_cfg, write: bool):
        import hashlib
        from importlib.metadata import PackageNotFoundError, version

        from olmo_ctl import storage

        try:
            ev = version("ai2-olmo-eval")
        except PackageNotFoundError:
            ev = "none"
        with open(tokenizer_file, "rb") as f:
            tok = hashlib.sha256(f.read()).hexdigest()
        ids = (model_cfg.eos_token_id, model_cfg.pad_token_id)
        self.key = hashlib.sha256(f"{tok} {seq_len} {ids} {ev}".encode()).hexdigest()[:16]
        self.dir, self.write = storage.join(run_dir.rstrip("/"), CACHE_DIR), write
        self.store = storage.store_for(self.dir)

    def path(self, label: str) -> str:
        from olmo_ctl import storage

        return storage.join(self.dir, f"{label}-{self.key}.npz")

    def get(self, label: str) -> TaskSet | None:
        path = self.path(label)
        try:
            if not self.store.exists(path):
                return None
            ts = task_set_from_bytes(self.store.read_bytes(path))
        except Exception as e:  # noqa: BLE001 - a torn or foreign file: build the task again
            print(f"warning: {path} does not read back ({e}); building the task again", flush=True)
            return None
        return ts if ts.label == label else None

    def put(self, ts: TaskSet) -> None:
        if not self.write:
            return
        path = self.path(ts.label)
        try:
            self.store.create(path, task_set_bytes(ts))  # a local store makes the directories
        except Exception as e:  # noqa: BLE001 - storage errors come in many types; the next attempt builds
            print(f"warning: the built task {ts.label} was not kept in {self.dir} ({e})", flush=True)


# ---------------------------------------------------------------- ICLMetric's arithmetic


def _entries(ts: TaskSet, ll: np.ndarray, choice_ll: np.ndarray):
    """(doc, cont, log-likelihood sum, instance) in ICLMetric.update's order: per instance, its
    continuation, or each of its fast-MC choices (those padded with -1 skipped)."""
    for i in range(len(ts)):
        doc = int(ts.doc_id[i])
        if ts.fast_mc:
            for c in range(ts.choices.shape[1]):
                if ts.choices[i, c] == -1:
                    continue
                yield doc, c, float(choice_ll[i, c]), i
        else:
            yield doc, int(ts.cont_id[i]), float(ll[i]), i


def _normalized(metric_type: str, ts: TaskSet, s: float, i: int) -> tuple[float, ...]:
    """(log-likelihood, CE, BPB and their no-leading-space forms) of one scored continuation, as
    ICLMetric.update normalizes its log-probability sum `s`."""
    str_len, byte_len = float(ts.cont_str_len[i]), float(ts.cont_byte_len[i])
    str_nls, byte_nls = (
        float(ts.cont_str_len_no_leading_space[i]),
        float(ts.cont_byte_len_no_leading_space[i]),
    )
    ce, bpb = -s / str_len, -s / byte_len * LOG_2_OF_E
    ce_nls, bpb_nls = -s / str_nls, -s / byte_nls * LOG_2_OF_E
    if metric_type in ("acc", "f1"):
        return s, ce, bpb, s, ce_nls, bpb_nls
    if metric_type in ("len_norm", "ce_loss", "bpb"):
        return s / str_len, ce, bpb, s / str_nls, ce_nls, bpb_nls
    raise BadInput(
        f"downstream metric type {metric_type!r} is not supported", "acc, f1, len_norm, ce_loss or bpb"
    )


def _f1(labels, preds, pos_label=0) -> float:
    tp = sum(y == pos_label and p == pos_label for y, p in zip(labels, preds, strict=True))
    fp = sum(y != pos_label and p == pos_label for y, p in zip(labels, preds, strict=True))
    fn = sum(y == pos_label and p != pos_label for y, p in zip(labels, preds, strict=True))
    if tp + fp == 0 or tp + fn == 0:
        return 0.0
    precision, recall = tp / (tp + fp), tp / (tp + fn)
    return 0.0 if precision + recall == 0 else 2 * precision * recall / (precision + recall)


def mean_stderr(values) -> float:
    """lm-eval-harness's `mean_stderr`: sample standard deviation / sqrt(n); nan under two values."""
    x = np.asarray(values, np.float64)
    if len(x) < 2:
        return math.nan
    return float(np.std(x, ddof=1) / math.sqrt(len(x)))


def icl_metrics(ts: TaskSet, ll: np.ndarray, choice_ll: np.ndarray) -> dict[str, float]:
    """`ICLMetric(ts.metric_type).compute()` from the log-likelihood sums of every instance (`ll`[n])
    and fast-MC choice (`choice_ll`[n, C]), with `stderr`: the standard error of the task's own metric
    (its `_v1`) over documents. The same arithmetic: per (doc, continuation) the first entry, a
    document skipped when its continuation ids leave a gap, argmax (first of ties) in float32."""
    mt = ts.metric_type
    labels: dict[int, int] = {}
    per_doc: dict[int, dict[int, tuple[float, ...]]] = {}
    for doc, cont, s, i in _entries(ts, ll, choice_ll):
        labels.setdefault(doc, int(ts.label_id[i]))
        per_doc.setdefault(doc, {}).setdefault(cont, _normalized(mt, ts, s, i))
    correct, ce_nls, ce, bpb_nls, bpb = [], [], [], [], []
    preds, preds_nls, golds = [], [], []
    soft: list[float] = []
    soft_log: list[float] = []
    soft_nls: list[float] = []
    soft_log_nls: list[float] = []
    for doc, conts in per_doc.items():
        n = len(conts)
        if any(c >= n for c in conts):  # ICLMetric's IndexError: the document is skipped
            continue
        vals = np.full((n, 6), np.nan)
        for c, v in conts.items():
            vals[c] = v
        lls = vals[:, 0].astype(np.float32)
        lls_nls = vals[:, 3].astype(np.float32)
        gold = labels[doc]
        if mt == "ce_loss":
            ce.append(vals[0, 1])
            ce_nls.append(vals[0, 4])
        elif mt == "bpb":
            bpb.append(vals[0, 2])
            bpb_nls.append(vals[0, 5])
        elif mt == "f1":
            preds.append(int(np.argmax(lls)))
            preds_nls.append(int(np.argmax(lls_nls)))
            golds.append(gold)
        else:
            correct.append(1.0 if int(np.argmax(lls)) == gold else 0.0)
            ce.append(vals[gold, 1])
            ce_nls.append(vals[gold, 4])
            bpb.append(vals[gold, 2])
            bpb_nls.append(vals[gold, 5])
            for x, sm, slm in ((lls, soft, soft_log), (lls_nls, soft_nls, soft_log_nls)):
                x64 = x.astype(np.float64)
                lse = float(np.max(x64) + np.log(np.sum(np.exp(x64 - np.max(x64)))))
                slm.append(float(x64[gold]) - lse)
                sm.append(math.exp(float(x64[gold]) - lse))

    def mean(x):
        return float(np.mean(np.asarray(x, np.float64))) if len(x) else math.nan

    if mt == "f1":
        return {"f1_v1": _f1(golds, preds), "f1_v2": _f1(golds, preds_nls), "stderr": math.nan}
    if mt == "ce_loss":
        return {"ce_loss_v1": mean(ce_nls), "ce_loss_v2": mean(ce), "stderr": mean_stderr(ce_nls)}
    if mt == "bpb":
        return {"bpb_v1": mean(bpb_nls), "bpb_v2": mean(bpb), "stderr": mean_stderr(bpb_nls)}
    return {
        f"{mt}_v1": mean(correct),
        f"{mt}_v2": mean(correct),
        "ce_loss_v1": mean(ce_nls),
        "ce_loss_v2": mean(ce),
        "bpb_v1": mean(bpb_nls),
        "bpb_v2": mean(bpb),
        "soft_v1": mean(soft_nls),
        "soft_v2": mean(soft),
        "soft_log_v1": mean(soft_log_nls),
        "soft_log_v2": mean(soft_log),
        "stderr": mean_stderr(correct),
    }


def primary(metrics: dict[str, float]) -> float:
    """A task's own metric (its metric type's `_v1`: the first `icl_metrics` gives)."""
    return next(iter(metrics.values()))


def tagged(results: dict[str, dict[str, float]]) -> dict[str, float]:
    """Every task's metrics under OLMo-core's tags (the standard errors are ours: not logged)."""
    return {
        downstream_tag(task, k): v
        for task, metrics in results.items()
        for k, v in metrics.items()
        if k != "stderr"
    }


# ---------------------------------------------------------------- on the mesh


def make_downstream_step(recipe):
    """params, batch {input_ids, labels: [n_micro, micro, T], choice_pos, index: [n_micro, micro],
    choice_ids: [n_micro, micro, C]} -> (index, log-likelihood sums [n_micro, micro], choice
    log-likelihoods [n_micro, micro, C]), fp32: per row, the sum of the log-softmax (over the padded
    vocabulary) at its continuation's labels, and at `choice_pos` that of each choice token."""
    import jax
    import jax.numpy as jnp

    from olmo_ctl.trainer.model import forward

    cfg = recipe.model

    def step(params, batch):
        def body(carry, mb):
            logits = forward(params, mb["input_ids"], cfg)  # [micro, T, V] fp32
            lse = jax.nn.logsumexp(logits, axis=-1)  # [micro, T]
            mask = mb["labels"] != IGNORE_INDEX
            target = jnp.take_along_axis(logits, jnp.where(mask, mb["labels"], 0)[..., None], axis=-1)[..., 0]
            ll = jnp.sum(jnp.where(mask, target - lse, 0.0), axis=-1)
            at = jnp.take_along_axis(logits, mb["choice_pos"][:, None, None], axis=1)[:, 0]  # [micro, V]
            lse_at = jnp.take_along_axis(lse, mb["choice_pos"][:, None], axis=1)  # [micro, 1]
            ids = mb["choice_ids"]
            choice = jnp.take_along_axis(at, jnp.maximum(ids, 0), axis=-1) - lse_at
            return carry, (mb["index"], ll, jnp.where(ids >= 0, choice, 0.0))

        _, out = jax.lax.scan(body, None, batch)
        return out

    return step


def jit_downstream_step(recipe, mesh):
    import jax

    from olmo_ctl.trainer import sharding

    return jax.jit(make_downstream_step(recipe), out_shardings=sharding.replicated(mesh))


def device_rows(rows: dict, n_micro: int, micro: int, mesh, rows_per_proc: int) -> dict:
    """This process's rows as global arrays `[n_micro, micro, ...]` laid out as the eval step's
    micro-batches (`step.micro_layout`): token rows as the train batch, per-row values over the rows."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from olmo_ctl.trainer import sharding
    from olmo_ctl.trainer.step import micro_batch_sharding, micro_layout

    row_spec = sharding.row_sharding(mesh).spec
    out = {}
    for k, x in rows.items():
        if k in ("input_ids", "labels"):
            shard = micro_batch_sharding(mesh)
        else:
            shard = NamedSharding(mesh, PartitionSpec(None, *row_spec, *([None] * (x.ndim - 1))))
        out[k] = jax.make_array_from_process_local_data(
            shard, micro_layout(x, rows_per_proc, n_micro), (n_micro, micro, *x.shape[1:])
        )
    return out


class DownstreamEvaluator(Evaluator):
    """`eval.downstream`'s tasks on the run's mesh, in the eval step's micro-batches; in the loop, every
    `eval.downstream.interval` steps (trainer/evaluator.py). The tasks are built when the attempt
    starts, so a task the tokenizer or the sequence length cannot take stops it then (exit 2), not at
    its first evaluation days later."""

    name = "downstream"

    def __init__(self, tasks: list[TaskSet], s, pad_to_seq_len: bool = False):
        """`pad_to_seq_len`: every row `train.seq_len` tokens, one shape (the layout without length
        buckets; `benchmarks/eval_padding.py` measures both)."""
        from olmo_ctl.trainer.step import eval_layout

        self.tasks, self.s, self.pad_to_seq_len = tasks, s, pad_to_seq_len
        self.interval = s.recipe.eval.downstream.interval
        self.n_micro, self.micro = eval_layout(s.recipe, s.plan)
        self.rows_per_proc = self.n_micro * self.micro // s.n_proc
        # A row length every sequence shard divides (a step's rows are split over them).
        self.row_multiple = math.lcm(ROW_MULTIPLE, s.plan.seq_shards)
        self.step_fn = jit_downstream_step(s.recipe, s.mesh)

    @classmethod
    def for_recipe(
        cls, s, tokenizer_cache: str | None = None, run_dir: str | None = None
    ) -> DownstreamEvaluator | None:
        """The recipe's tasks, each read from the run directory's task cache when an earlier attempt
        built it (`TaskCache`), else built (and, by process 0, kept there)."""
        r = s.recipe
        if not r.eval.downstream.tasks:
            return None
        path = tokenizer_path(tokenizer_spec(r), tokenizer_cache)
        cache = TaskCache(run_dir, path, r.train.seq_len, r.model, write=s.proc == 0) if run_dir else None
        tasks, tok, read = [], None, 0
        for label in r.eval.downstream.tasks:
            ts = cache.get(label) if cache else None
            if ts is None:
                if tok is None:
                    tok = load_tokenizer(path, r.model)
                ts = build_task_set(label, tok, r.train.seq_len)
                if cache:
                    cache.put(ts)
            else:
                read += 1
            tasks.append(ts)
        n = sum(len(t) for t in tasks)
        where = f" ({read} read from {CACHE_DIR}/)" if read else ""
        print(f"downstream: {len(tasks)} tasks, {n:,} instances{where}", flush=True)
        return cls(tasks, s)

    def plan(self, ts: TaskSet) -> list[tuple[np.ndarray, int]]:
        """`batch_plan` of `ts` on this layout: (instances of every host, row length) per eval step."""
        s = self.s
        return batch_plan(
            ts.query_lengths(),
            self.rows_per_proc * s.n_proc,
            s.recipe.train.seq_len,
            self.row_multiple,
            self.pad_to_seq_len,
        )

    def scores(self, params, ts: TaskSet) -> tuple[np.ndarray, np.ndarray]:
        """(log-likelihood sums [n], choice log-likelihoods [n, C]) of every instance of `ts`."""
        import jax

        s, r = self.s, self.rows_per_proc
        local_rows = s.local_devices // s.plan.seq_shards
        seq_len, pad = s.recipe.train.seq_len, s.recipe.model.pad_token_id
        outs = []
        # Every step dispatched before any result is read: the next rows are built while one runs.
        for idx, width in self.plan(ts):
            rows = ts.rows(idx[s.proc * r : (s.proc + 1) * r], r, seq_len, pad, width)
            outs.append(self.step_fn(params, device_rows(rows, self.n_micro, self.micro, s.mesh, local_rows)))
        ll = np.zeros(len(ts), np.float32)
        choice_ll = np.zeros(ts.choices.shape, np.float32)
        for index, a, b in jax.device_get(outs):
            index, a, b = index.reshape(-1), a.reshape(-1), b.reshape(-1, b.shape[-1])
            keep = index >= 0
            ll[index[keep]], choice_ll[index[keep]] = a[keep], b[keep]
        return ll, choice_ll

    def evaluate(self, params) -> dict[str, dict[str, float]]:
        """Per task, ICLMetric's metrics and the standard error."""
        return {ts.label: icl_metrics(ts, *self.scores(params, ts)) for ts in self.tasks}

    def run(self, params) -> Evaluation:
        results = self.evaluate(params)
        line = " ".join(f"{task} {primary(m):.4f}" for task, m in results.items())
        return Evaluation(tagged(results), f"downstream {line}")
