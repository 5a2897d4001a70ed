"""A KV-cache decoder for OLMo 2 and OLMo 3 blocks: prefill, then one token a step.

`JaxEngine.generate(prompts, sampling)` is the one interface a caller uses (`olmo-ctl generate`, the
generative evaluation, later the rollouts of RLVR): anything that implements `Engine` (another engine
behind the same call, such as vLLM on TPU) can take its place.

The arithmetic is the model's own (`trainer/model.py`): the same projections, QK-norm over the whole
projection, RoPE in fp32 (YaRN on the layers `ModelConfig.layer_rope_scaled` names), the reordered
norms, and the reference attention's softmax in fp32 (`trainer/attention.py`), so each decode step's
logits equal the full forward's at that position (tests/test_decode.py: within 1e-5 in fp32).

Layout. Prompts of a batch are left-padded to one length, so every row writes its next key and value
at the same cache slot; a row's position is its slot less its padding. The cache holds keys and values
of every layer `[L, B, S, KV, D]` for S = the padded prompt plus `max_tokens` slots; a sliding layer's
keys outside its window are masked, not dropped (a ring buffer of W slots per sliding layer would hold
less: not needed at the lengths generation runs at today). Layers run under one `lax.scan`, each with
its window and RoPE table chosen by its index.

Decoding runs CHUNK steps per call on the device (`lax.scan`); between calls the host looks for stop
strings in the decoded text and ends when every row is done. Sampling: greedy at temperature 0, else
softmax at the temperature over the top-p nucleus, from `jax.random.key(seed)` folded with the prompt's
index in the request and the step: the same prompts, sampling and seed give the same tokens, whatever
the batch size, and two copies of a prompt draw independently.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np

from olmo_ctl.core.errors import BadInput
from olmo_ctl.core.recipe import ModelConfig

CHUNK = 16  # decode steps per device call
PROMPT_MULTIPLE = 16  # prompts are left-padded to a multiple of this


@dataclass(frozen=True)
class Sampling:
    """How to pick each next token. `temperature` 0: greedy (argmax); `top_p` < 1: sample only from
    the smallest set of tokens whose probability reaches it. A row ends at one of `stop_token_ids`
    (kept in its tokens), at a `stop` string (the text ends before it) or after `max_tokens`."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()

    def check(self) -> None:
        if self.max_tokens < 1:
            raise BadInput(f"max tokens {self.max_tokens} is not positive", "pass --max-tokens 1 or more")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise BadInput(f"temperature {self.temperature} is not a number >= 0", "0 is greedy")
        if not 0 < self.top_p <= 1:
            raise BadInput(f"top-p {self.top_p} is not in (0, 1]", "1 samples from every token")


@dataclass
class Completion:
    """One prompt's continuation: its new tokens (a stop token included), why it ended, and its text
    when the engine has a tokenizer."""

    tokens: list[int]
    finish_reason: Literal["stop", "length"]
    text: str | None = None
    logprobs: list[float] = field(default_factory=list)  # of each token as sampled (temperature applied)


class Engine(Protocol):
    """What generates: prompts as token ids in, completions out, in the prompts' order."""

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling) -> list[Completion]: ...


# ----------------------------------------------------------------------------- the cached forward


def _layer_tables(cfg: ModelConfig):
    """Per layer: its sliding window (0: full attention) and whether its RoPE is YaRN-scaled."""
    windows = [
        0 if cfg.layer_is_full(i) or not cfg.sliding_window else cfg.sliding_window
        for i in range(cfg.n_layers)
    ]
    scaled = [cfg.layer_rope_scaled(i) for i in range(cfg.n_layers)]
    return np.asarray(windows, np.int32), np.asarray(scaled, bool)


def _rope_rows(positions, cfg: ModelConfig, scaling):
    """cos, sin [B, T, head_dim] (fp32) at each row's own positions, as `model.rope_tables`."""
    import jax.numpy as jnp

    from olmo_ctl.trainer.model import rope_inv_freq

    inv_freq, attn_factor = rope_inv_freq(cfg.head_dim, cfg.rope_theta, scaling)
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    if attn_factor == 1.0:
        return jnp.cos(emb), jnp.sin(emb)
    return jnp.cos(emb) * attn_factor, jnp.sin(emb) * attn_factor


def _apply_rope(x, cos, sin):
    """x [B, T, H, D] rotated at per-row cos/sin [B, T, D], as `model.apply_rope`."""
    import jax.numpy as jnp

    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos[:, :, None, :] + rotated * sin[:, :, None, :]).astype(x.dtype)


def init_cache(cfg: ModelConfig, batch: int, slots: int) -> dict:
    """Zero keys and values [L, B, slots, KV, D] in the compute dtype."""
    import jax.numpy as jnp

    from olmo_ctl.trainer.model import dtype_of

    shape = (cfg.n_layers, batch, slots, cfg.n_kv_heads, cfg.head_dim)
    dt = dtype_of(cfg.compute_dtype)
    return {"k": jnp.zeros(shape, dt), "v": jnp.zeros(shape, dt)}


def forward_cached(params, tokens, start, pad, cache, cfg: ModelConfig):
    """tokens [B, T] at cache slots start..start+T-1 (every row), rows left-padded by `pad` [B] slots
    -> (logits float32 [B, T, padded_vocab_size], the cache with their keys and values written)."""
    import jax
    import jax.numpy as jnp

    from olmo_ctl.trainer.attention import _NEG
    from olmo_ctl.trainer.model import dtype_of, rms_norm

    dt = dtype_of(cfg.compute_dtype)
    B, T = tokens.shape
    S = cache["k"].shape[2]
    H, KV, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    slots = start + jnp.arange(T)  # [T] the query slots
    positions = jnp.maximum(slots[None, :] - pad[:, None], 0)  # [B, T]
    plain = _rope_rows(positions, cfg, None)
    scaled = _rope_rows(positions, cfg, cfg.rope_scaling) if cfg.rope_scaling is not None else plain
    key_slot = jnp.arange(S)
    visible = (key_slot[None, :] <= slots[:, None])[None] & (key_slot[None, None, :] >= pad[:, None, None])
    windows, rope_scaled = (jnp.asarray(a) for a in _layer_tables(cfg))

    def mm(x, w):
        return jnp.einsum("btd,df->btf", x, w.astype(dt))

    def layer(x, inputs):
        p, k_cache, v_cache, window, is_scaled = inputs
        a = p["attn"]
        q = rms_norm(mm(x, a["wq"]), a["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(mm(x, a["wk"]), a["k_norm"], cfg.rms_norm_eps)
        v = mm(x, a["wv"]).reshape(B, T, KV, D)
        cos = jnp.where(is_scaled, scaled[0], plain[0])
        sin = jnp.where(is_scaled, scaled[1], plain[1])
        q = _apply_rope(q.reshape(B, T, H, D), cos, sin)
        k = _apply_rope(k.reshape(B, T, KV, D), cos, sin)
        k_cache = jax.lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype), (0, start, 0, 0))
        v_cache = jax.lax.dynamic_update_slice(v_cache, v.astype(v_cache.dtype), (0, start, 0, 0))
        kk = jnp.repeat(k_cache, H // KV, axis=2) if H != KV else k_cache
        vv = jnp.repeat(v_cache, H // KV, axis=2) if H != KV else v_cache
        s = jnp.einsum("bqhd,bkhd->bhqk", q, kk, preferred_element_type=jnp.float32) / math.sqrt(D)
        in_window = (window == 0) | (key_slot[None, :] > slots[:, None] - window)  # [T, S]
        mask = visible & in_window[None]
        s = jnp.where(mask[:, None], s, _NEG)
        probs = jax.nn.softmax(s, axis=-1)
        o = jnp.einsum("bhqk,bkhd->bqhd", probs.astype(vv.dtype), vv, preferred_element_type=jnp.float32)
        o = o.astype(q.dtype).reshape(B, T, H * D)
        h = x + rms_norm(mm(o, a["wo"]), p["attn_norm"], cfg.rms_norm_eps)
        m = p["mlp"]
        ff = mm(jax.nn.silu(mm(h, m["w1"])) * mm(h, m["w3"]), m["w2"])
        return h + rms_norm(ff, p["mlp_norm"], cfg.rms_norm_eps), (k_cache, v_cache)

    x = jnp.take(params["embed"], tokens, axis=0).astype(dt)
    x, (ks, vs) = jax.lax.scan(layer, x, (params["blocks"], cache["k"], cache["v"], windows, rope_scaled))
    x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    logits = jnp.einsum("btd,dv->btv", x, params["lm_head"].astype(dt), preferred_element_type=jnp.float32)
    n, V = cfg.softmax_vocab_size, logits.shape[-1]
    if 0 < n < V:
        logits = jnp.where(jnp.arange(V) < n, logits, jnp.finfo(jnp.float32).min)
    return logits, {"k": ks, "v": vs}


def row_keys(key, rows, step):
    """Each row's key for `step`: `key` folded with the row's prompt (its index in the request) and the
    step, so a prompt's draws depend on neither its batch nor its place in it, and two copies of one
    prompt draw independently."""
    import jax

    return jax.vmap(lambda r: jax.random.fold_in(jax.random.fold_in(key, r), step))(rows)


def pick(logits, keys, temperature, top_p, nucleus: bool):
    """Next tokens [B] and their log-probabilities from logits [B, V]: argmax at temperature 0, else a
    draw (with each row's key of `keys` [B]) from the softmax at `temperature` over the top-`top_p`
    nucleus (only where `nucleus`, a static choice: the sort costs a step's time on a large vocabulary)."""
    import jax
    import jax.numpy as jnp

    greedy = jnp.argmax(logits, axis=-1)
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)
    if nucleus:
        order = jnp.argsort(-scaled, axis=-1)
        sorted_logits = jnp.take_along_axis(scaled, order, -1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the tokens ranked above each
        keep_sorted = before < top_p  # the first token always stays
        keep = jnp.zeros_like(keep_sorted).at[jnp.arange(scaled.shape[0])[:, None], order].set(keep_sorted)
        scaled = jnp.where(keep, scaled, -jnp.inf)
    drawn = jax.vmap(lambda k, row: jax.random.categorical(k, row))(keys, scaled)
    tok = jnp.where(temperature > 0, drawn, greedy)
    return tok, jnp.take_along_axis(jax.nn.log_softmax(scaled, -1), tok[:, None], -1)[:, 0]


@functools.lru_cache(maxsize=16)
def _programs(cfg: ModelConfig):
    """The jitted prefill and decode chunk of `cfg`, shared by every engine of that model (one
    compile per shape: prompts are padded to multiples of PROMPT_MULTIPLE, batches to a power of 2)."""
    import jax
    import jax.numpy as jnp

    def prefill(params, tokens, pad, cache, key, rows, stops, temperature, top_p, *, nucleus):
        logits, cache = forward_cached(params, tokens, 0, pad, cache, cfg)
        last = logits[:, -1]
        tok, lp = pick(last, row_keys(key, rows, 0), temperature, top_p, nucleus)
        tok = tok.astype(jnp.int32)
        return tok, lp, jnp.isin(tok, stops), cache, last

    def chunk(
        params,
        cache,
        last,
        start,
        pad,
        done,
        stops,
        key,
        rows,
        step0,
        temperature,
        top_p,
        *,
        nucleus,
        want_logits,
    ):
        def one(carry, i):
            cache, last, done = carry
            logits, cache = forward_cached(params, last[:, None], start + i, pad, cache, cfg)
            logits = logits[:, 0]
            tok, lp = pick(logits, row_keys(key, rows, step0 + i), temperature, top_p, nucleus)
            tok = jnp.where(done, 0, tok).astype(jnp.int32)
            return (cache, tok, done | jnp.isin(tok, stops)), (
                tok,
                lp,
                logits if want_logits else jnp.zeros((0,)),
            )

        (cache, last, done), (toks, lps, logits) = jax.lax.scan(one, (cache, last, done), jnp.arange(CHUNK))
        return cache, last, done, toks.T, lps.T, logits

    return (
        jax.jit(prefill, static_argnames=("nucleus",)),
        jax.jit(chunk, static_argnames=("nucleus", "want_logits")),
    )


# ----------------------------------------------------------------------------- the engine


class JaxEngine:
    """Generates with the model's parameters `params` (numpy or JAX arrays) of `cfg`, on this
    process's devices (`mesh`: rows split over its ("data", "fsdp") devices, the parameters laid out
    as the trainer lays them out). `decode(ids)` turns tokens into text for stop strings and
    `Completion.text` (None: no text, no stop strings)."""

    def __init__(
        self,
        params,
        cfg: ModelConfig,
        *,
        decode: Callable[[list[int]], str] | None = None,
        mesh=None,
        batch_size: int = 8,
    ):
        import jax

        self.cfg = dataclasses.replace(cfg, remat="none")
        self.decode_text = decode
        self.mesh = mesh
        self.batch_size = max(1, batch_size)
        if mesh is not None:
            from olmo_ctl.trainer import sharding

            self.params = jax.device_put(params, sharding.param_shardings(params, mesh))
        else:
            self.params = jax.device_put(params)
        self.step_logits: list[np.ndarray] = []  # with `keep_logits`: each step's logits (tests)

    # The host loop ---------------------------------------------------------------------------

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: Sampling, keep_logits: bool = False
    ) -> list[Completion]:
        sampling.check()
        if sampling.stop and self.decode_text is None:
            raise BadInput("stop strings need a tokenizer to read the text", "pass the model's tokenizer")
        out: list[Completion] = []
        for i in range(0, len(prompts), self.batch_size):
            out += self._generate_batch(
                [list(p) for p in prompts[i : i + self.batch_size]], sampling, keep_logits, first_index=i
            )
        return out

    def _generate_batch(
        self, prompts: list[list[int]], sampling: Sampling, keep_logits: bool, first_index: int = 0
    ) -> list[Completion]:
        import jax
        import jax.numpy as jnp

        if any(not p for p in prompts):
            raise BadInput("a prompt has no tokens", "give every prompt at least one token")
        V = self.cfg.vocab_size
        bad = [t for p in prompts for t in p if not 0 <= t < V]
        if bad:
            raise BadInput(f"prompt token {bad[0]} is outside the vocabulary (0..{V - 1})")
        rows = len(prompts)
        T = -(-max(len(p) for p in prompts) // PROMPT_MULTIPLE) * PROMPT_MULTIPLE
        B = 1 << (rows - 1).bit_length()  # a power of 2: few shapes, few compiles
        if self.mesh is not None:  # rows split evenly over the mesh's batch devices
            n = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
            B = -(-B // n) * n
        steps = -(-(sampling.max_tokens - 1) // CHUNK) * CHUNK
        tokens = np.zeros((B, T), np.int32)
        pad = np.zeros((B,), np.int32)
        for r, p in enumerate(prompts):
            tokens[r, T - len(p) :] = p
            pad[r] = T - len(p)
        for r in range(rows, B):  # filler rows: a copy of the first prompt, never returned
            tokens[r], pad[r] = tokens[0], pad[0]
        cache = init_cache(self.cfg, B, T + steps)
        tok_in, pad_in = jnp.asarray(tokens), jnp.asarray(pad)
        if self.mesh is not None:
            from olmo_ctl.trainer import sharding

            rows_sharding = sharding.row_sharding(self.mesh)
            tok_in, pad_in = jax.device_put(tok_in, rows_sharding), jax.device_put(pad_in, rows_sharding)
            cache = jax.device_put(
                cache, jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec(None, sharding.AXES))
            )
        key = jax.random.key(sampling.seed)
        row_ids = np.arange(first_index, first_index + B, dtype=np.int32)  # each row's prompt in the request
        row_ids[rows:] = first_index  # filler rows, never returned
        rows_in = jnp.asarray(row_ids)
        if self.mesh is not None:
            rows_in = jax.device_put(rows_in, rows_sharding)
        stop_ids = tuple(sampling.stop_token_ids) or (self.cfg.eos_token_id,)
        stops = jnp.asarray(stop_ids, jnp.int32)
        prefill, chunk = _programs(self.cfg)
        temperature, top_p = jnp.float32(sampling.temperature), jnp.float32(sampling.top_p)
        nucleus = sampling.temperature > 0 and sampling.top_p < 1
        first, first_lp, done, cache, last_logits = prefill(
            self.params, tok_in, pad_in, cache, key, rows_in, stops, temperature, top_p, nucleus=nucleus
        )
        gen = [np.asarray(first)[:, None]]
        lps = [np.asarray(first_lp)[:, None]]
        finished = np.asarray(done).copy()
        if keep_logits:
            self.step_logits = [np.asarray(last_logits)]
        cut: dict[int, int] = {}  # row -> tokens kept (a stop string ended it)
        last, made = first, 1
        while made < sampling.max_tokens and not finished[:rows].all():
            cache, last, done, toks, lp, logits = chunk(
                self.params,
                cache,
                last,
                jnp.int32(T + made - 1),
                pad_in,
                done,
                stops,
                key,
                rows_in,
                jnp.int32(made),
                temperature,
                top_p,
                nucleus=nucleus,
                want_logits=keep_logits,
            )
            gen.append(np.asarray(toks))
            lps.append(np.asarray(lp))
            if keep_logits:
                self.step_logits += list(np.asarray(logits))
            made += CHUNK
            finished = np.asarray(done).copy()
            if sampling.stop:
                for r in range(rows):
                    if r not in cut:
                        n = self._stop_string_at(self._row_tokens(gen, r, sampling, stop_ids), sampling.stop)
                        if n is not None:
                            cut[r] = n
                            finished[r] = True
        all_toks = np.concatenate(gen, axis=1)
        all_lps = np.concatenate(lps, axis=1)
        out = []
        for r in range(rows):
            toks = self._row_tokens([all_toks], r, sampling, stop_ids)
            reason: Literal["stop", "length"] = "stop" if toks and toks[-1] in stop_ids else "length"
            text = None
            if r in cut:
                toks, reason = toks[: cut[r]], "stop"
            if self.decode_text is not None:
                text = self.decode_text([t for t in toks if t not in stop_ids])
                if r in cut:
                    text = _before_stop(text, sampling.stop)
            out.append(Completion(toks, reason, text, [float(x) for x in all_lps[r, : len(toks)]]))
        return out

    @staticmethod
    def _row_tokens(
        gen: list[np.ndarray], r: int, sampling: Sampling, stop_ids: tuple[int, ...]
    ) -> list[int]:
        """Row r's tokens up to its first stop token (kept) or `max_tokens`."""
        toks = [int(t) for part in gen for t in part[r]][: sampling.max_tokens]
        for i, t in enumerate(toks):
            if t in stop_ids:
                return toks[: i + 1]
        return toks

    def _stop_string_at(self, toks: list[int], stop: tuple[str, ...]) -> int | None:
        """The fewest of `toks` whose text holds a stop string, or None."""
        assert self.decode_text is not None
        if not any(s in self.decode_text(toks) for s in stop):
            return None
        for n in range(1, len(toks) + 1):
            if any(s in self.decode_text(toks[:n]) for s in stop):
                return n
        return len(toks)


def _before_stop(text: str, stop: tuple[str, ...]) -> str:
    at = [text.find(s) for s in stop if s in text]
    return text[: min(at)] if at else text
