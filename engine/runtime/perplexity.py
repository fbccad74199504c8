"""Perplexity and KL divergence over a text, computed as llama.cpp's `llama-perplexity` computes them, so that the
numbers of the two tools can be set side by side (tools/perplexity/perplexity.cpp of llama.cpp, read for this).

The text is tokenized once (with BOS where the model adds one; a special token's spelling in it is plain text, as
llama-perplexity reads it) and cut into `n_chunk` chunks of `n_ctx` tokens
(the tail that does not fill a chunk is left out). Each chunk runs from an empty cache with its first token
replaced by BOS (where the model has one); the logits of its rows `first = n_ctx // 2` .. `n_ctx - 2` predict
tokens `first + 1` .. `n_ctx - 1`, so every scored token has at least half a context before it. Per scored token,
nll = log(sum(exp(logits - max))) + max - logits[token] (exp in f32, the sum in f64, as llama.cpp);
PPL = exp(mean nll), and its uncertainty exp(mean) * sqrt(var(nll) / (count - 1)).

The base-logits file (`--kl-divergence-base`) is llama.cpp's own layout, so a base written by llama-perplexity
(say over the F16 GGUF of the same model) is read here and one written here is read by it:

    "_logits_"   u32 n_ctx   i32 n_vocab   i32 n_chunk   i32 tokens[n_chunk * n_ctx]
    per chunk, per scored row (n_ctx - 1 - n_ctx // 2 rows): nv = 2 * ((n_vocab + 1) // 2) + 4 u16 values:
        two f32 (scale, min_log_prob) in the first four, then one u16 per vocabulary entry:
        log p[i] ~ scale * u16[i] + min_log_prob   (log-probabilities below max - 16 stored as 0)

KL divergence of a row: sum over tokens whose base log-probability is above -16 of p_base * (log p_base - log q)
(llama.cpp's cut-off: the rest cannot be told apart from 0 in 16 bits). The statistics (mean with its uncertainty,
percentiles, Δp of the scored token, "same top p") follow llama.cpp's kl_divergence().
"""
from __future__ import annotations

import errno
import math
import os
import stat
import struct
from typing import Iterator, Sequence

import numpy as np

from .. import faults
from ..errors import BitNetError
from .sampling import token_logprob

MAGIC = b"_logits_"
HEADER = struct.Struct("<8sIii")
LOG_P_FLOOR = -16.0   # log-probabilities below the top one minus this are stored as 0, and not summed in KLD


def n_chunks(n_tokens: int, n_ctx: int, wanted: int | None = None) -> int:
    """How many chunks of n_ctx tokens to score: every whole one, or `wanted` of them (None or < 0: all).
    Raises BitNetError when not even one fits (llama-perplexity asks for two; one is enough here)."""
    if n_ctx < 4:
        raise BitNetError(f"-c/--ctx-size {n_ctx}: perplexity needs a context of at least 4 tokens")
    have = n_tokens // n_ctx
    if have < 1:
        raise BitNetError(f"the text tokenizes to {n_tokens} tokens, fewer than one chunk of {n_ctx}",
                          hint="give a longer text or a smaller -c")
    if wanted is not None and wanted == 0:
        raise BitNetError("--chunks 0: nothing to score (a positive count, or -1 for every chunk)")
    return have if wanted is None or wanted < 0 else min(wanted, have)


def strided_windows(n_tokens: int, n_ctx: int, stride: int, wanted: int | None = None) -> int:
    """How many windows llama-perplexity's `--ppl-stride` pass scores: windows of n_ctx tokens starting every
    `stride` tokens while a whole one fits, each run from an empty cache as the text has it (no BOS put in front:
    llama.cpp's strided pass writes its BOS into the token list only after running it) and scored over its last
    `stride` rows (strided_first). `wanted` as n_chunks."""
    if n_ctx < 4:
        raise BitNetError(f"-c/--ctx-size {n_ctx}: perplexity needs a context of at least 4 tokens")
    if not 0 < stride < n_ctx:
        raise BitNetError(f"--ppl-stride {stride}: must be between 1 and the context size - 1 ({n_ctx - 1})")
    if n_tokens <= n_ctx:
        raise BitNetError(f"the text tokenizes to {n_tokens} tokens: a strided pass needs more than one window of "
                          f"{n_ctx}", hint="give a longer text or a smaller -c")
    if wanted is not None and wanted == 0:
        raise BitNetError("--chunks 0: nothing to score (a positive count, or -1 for every chunk)")
    have = (n_tokens - n_ctx + stride - 1) // stride
    return have if wanted is None or wanted < 0 else min(wanted, have)


def strided_first(n_ctx: int, stride: int) -> int:
    """The first scored row of a strided window: its last `stride` rows are scored (n_ctx - stride - 1 ..
    n_ctx - 2, each predicting the token after it)."""
    return n_ctx - stride - 1


def passes(n_tokens: int, n_ctx: int, wanted: int | None = None, stride: int = 0,
           bos: int | None = None) -> list[tuple[int, int | None, int]]:
    """The runs of a perplexity pass over n_tokens, each (its first token's index, the BOS put in front or None,
    its first scored row) for chunk_logits: whole chunks of n_ctx with `bos` in front scored over their second
    half (n_chunks), or with `stride` > 0 llama-perplexity's strided windows (strided_windows)."""
    if stride:
        first = strided_first(n_ctx, stride)
        return [(i * stride, None, first) for i in range(strided_windows(n_tokens, n_ctx, stride, wanted))]
    return [(c * n_ctx, bos, n_ctx // 2) for c in range(n_chunks(n_tokens, n_ctx, wanted))]


def scored_rows(n_ctx: int) -> int:
    """Rows of a chunk that are scored: first = n_ctx // 2 up to n_ctx - 2."""
    return n_ctx - 1 - n_ctx // 2


def chunk_logits(model, chunk: Sequence[int], bos: int | None,
                 first: int | None = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Run one chunk from an empty cache (its first token replaced by `bos` when not None); yield (logits [m, V],
    targets [m]) pieces, in order, for rows `first` (default n_ctx // 2) .. n_ctx - 2 (the engine's prefill rows
    per piece). The last token is never run: nothing reads its logits."""
    ids = [int(t) for t in chunk]
    if bos is not None:
        ids[0] = int(bos)
    n = len(ids)
    first = n // 2 if first is None else first
    model.reset()
    model.prefill(ids[:first])
    step = max(1, int(model.chunk))
    for a in range(first, n - 1, step):
        b = min(a + step, n - 1)
        logits = model.prefill(ids[a:b], all_logits=True)
        yield logits, np.asarray(chunk[a + 1: b + 1], np.int64)


def _log_norm(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row: the largest logit (f32) and log(sum(exp(logits - largest))) (exp in f32, the sum in f64)."""
    top = logits.max(axis=1)
    lse = np.log(np.exp(logits - top[:, None]).sum(axis=1, dtype=np.float64))
    return top, lse


def _mean_err(total: float, total2: float, count: int, min_count: int = 2) -> tuple[float, float]:
    """Mean and the uncertainty of the mean, sqrt(var / (count - 1)) (0 when it cannot be told)."""
    if count < 1:
        return 0.0, 0.0
    mean = total / count
    var = total2 / count - mean * mean
    return mean, math.sqrt(var / (count - 1)) if var > 0 and count >= min_count else 0.0


class NllStats:
    """The running negative log-likelihood of the scored tokens."""

    def __init__(self):
        self.nll = self.nll2 = 0.0
        self.count = 0

    def add(self, logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
        """Score one piece; returns its rows' nll."""
        top, lse = _log_norm(logits)
        nll = top.astype(np.float64) + lse - logits[np.arange(len(targets)), targets].astype(np.float64)
        self.nll += float(nll.sum())
        self.nll2 += float((nll * nll).sum())
        self.count += len(nll)
        return nll

    def mark(self) -> tuple:
        """The running sums now: back() returns to them (a chunk cut short by Ctrl-C is not counted)."""
        return self.nll, self.nll2, self.count

    def back(self, mark: tuple):
        self.nll, self.nll2, self.count = mark

    def ppl(self) -> float:
        return math.exp(self.nll / self.count) if self.count else float("nan")

    def mean_nll(self) -> tuple[float, float]:
        """(the mean negative log-likelihood, its uncertainty)."""
        return _mean_err(self.nll, self.nll2, self.count)

    def estimate(self) -> tuple[float, float]:
        """(PPL, its uncertainty), as llama-perplexity's "Final estimate"."""
        mean, err = self.mean_nll()
        ppl = math.exp(mean)
        return ppl, err * ppl


def compress_rows(logits: np.ndarray) -> np.ndarray:
    """The rows as the base file stores them: [m, nv] u16, each row (scale, min_log_prob) as two f32 in its first
    four values, then one u16 per vocabulary entry (llama.cpp's log_softmax with its uint16 output)."""
    m, vocab = logits.shape
    nv = 2 * ((vocab + 1) // 2) + 4
    out = np.zeros((m, nv), np.uint16)
    top = logits.max(axis=1)
    low = np.maximum(logits.min(axis=1), top - np.float32(-LOG_P_FLOOR))
    _, lse = _log_norm(logits)
    min_log_prob = (low - top - lse.astype(np.float32)).astype(np.float32)
    scale = ((top - low) / np.float32(65535.0)).astype(np.float32)
    head = out[:, :4].view(np.float32)
    head[:, 0], head[:, 1] = scale, min_log_prob
    for r in range(m):
        if scale[r] == 0:
            continue
        q = np.rint(np.float32(1.0) / scale[r] * (logits[r] - low[r]))
        out[r, 4: 4 + vocab] = np.where(logits[r] > low[r], q, 0).astype(np.uint16)
    return out


def expand_rows(rows: np.ndarray, vocab: int) -> np.ndarray:
    """Base log-probabilities [m, vocab] f32 back from compress_rows' form."""
    head = np.ascontiguousarray(rows[:, :4]).view(np.float32)
    return head[:, :1] * rows[:, 4: 4 + vocab].astype(np.float32) + head[:, 1:2]


class LogitsWriter:
    """Writes a base-logits file: to PATH.partial, renamed over PATH by commit() once every chunk is in, so an
    interrupted run never leaves a half file (nor replaces a whole one). One fixed name: what a killed run left
    there is written over by the next run, never piled up beside it. It is opened without following a link, and a
    PATH.partial that is not a plain file of this user's alone (a link or a FIFO another user made first in a
    shared folder, a hard link to some other file) is refused, never written through. A fatal fault (the fault
    guard's exit) removes it."""

    def __init__(self, path: str, n_ctx: int, vocab: int, tokens: Sequence[int]):
        self.path = path
        self.tmp = path + ".partial"
        n_chunk = len(tokens) // n_ctx
        self.f, self._slot = None, -1
        try:
            fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENXIO):   # a link there, or a FIFO with no reader
                raise BitNetError(f"cannot write {path}: {self.tmp} is there and is not a plain file of yours; "
                                  "remove it or choose another file") from None
            raise BitNetError(f"cannot write {path}: {e.strerror or e}") from None
        try:
            st = os.fstat(fd)
        except OSError as e:
            os.close(fd)
            raise BitNetError(f"cannot write {path}: {e.strerror or e}") from None
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_nlink != 1:
            os.close(fd)   # not ours to truncate, nor to remove
            raise BitNetError(f"cannot write {path}: {self.tmp} is there and is not a plain file of yours; "
                              "remove it or choose another file")
        try:
            os.set_blocking(fd, True)
            os.ftruncate(fd, 0)   # what a killed run left
            self.f = os.fdopen(fd, "wb")
        except OSError as e:
            os.close(fd)
            self._unlink()
            raise BitNetError(f"cannot write {path}: {e.strerror or e}") from None
        self._slot = faults.unlink_on_fault(self.tmp)
        self._write(HEADER.pack(MAGIC, n_ctx, vocab, n_chunk) + np.asarray(tokens[: n_chunk * n_ctx], "<i4").tobytes())

    def _unlink(self):
        faults.forget_cleanup(self._slot)
        self._slot = -1
        try:
            os.unlink(self.tmp)
        except OSError:
            pass

    def _write(self, data: bytes):
        """A write the disk refuses (full): the partial file removed, one line naming the file (it was an OSError
        that reached the command as 'a bug in bitnet-cpu')."""
        try:
            self.f.write(data)
        except OSError as e:
            self.abort()
            raise BitNetError(f"cannot write {self.path}: {e.strerror or e}") from None

    def add(self, logits: np.ndarray):
        self._write(compress_rows(logits).astype("<u2").tobytes())

    def commit(self):
        try:
            self.f.close()   # its last flush may be what the disk refuses
            os.replace(self.tmp, self.path)
        except OSError as e:
            self.abort()
            raise BitNetError(f"cannot write {self.path}: {e.strerror or e}") from None
        faults.forget_cleanup(self._slot)   # the name is the finished file's now: a fault leaves it
        self._slot = -1

    def abort(self):
        try:   # closing flushes: a full disk fails it, and the partial file must go all the same
            self.f.close()
        except OSError:
            pass
        self._unlink()


class LogitsReader:
    """Reads a base-logits file (this tool's or llama-perplexity's). Every size is checked against the header before
    any row is read: a truncated, foreign or corrupt file is one BitNetError."""

    def __init__(self, path: str):
        self.path = path
        try:
            self.f = open(path, "rb")
            size = os.fstat(self.f.fileno()).st_size
        except OSError as e:
            raise BitNetError(f"cannot read {path}: {e.strerror or e}") from None
        head = self.f.read(HEADER.size)
        if len(head) < HEADER.size or head[:8] != MAGIC:
            self.f.close()
            raise BitNetError(f"{path} is not a file of base logits (llama-perplexity --kl-divergence-base)")
        _, self.n_ctx, self.vocab, self.n_chunk = HEADER.unpack(head)
        if not (4 <= self.n_ctx <= 1 << 24 and 1 <= self.vocab <= 1 << 24 and 1 <= self.n_chunk <= 1 << 24):
            self.f.close()
            raise BitNetError(f"{path}: impossible header (n_ctx {self.n_ctx}, vocab {self.vocab}, "
                              f"chunks {self.n_chunk})")
        self.nv = 2 * ((self.vocab + 1) // 2) + 4
        want = HEADER.size + 4 * self.n_ctx * self.n_chunk + 2 * self.nv * scored_rows(self.n_ctx) * self.n_chunk
        if size != want:
            self.f.close()
            raise BitNetError(f"{path}: {size} bytes where its header ({self.n_chunk} chunks of {self.n_ctx}, "
                              f"vocabulary {self.vocab}) means {want}: truncated or not whole")
        self.tokens = np.frombuffer(self.f.read(4 * self.n_ctx * self.n_chunk), "<i4").astype(np.int64)

    def rows(self, m: int) -> np.ndarray:
        """The next m rows [m, nv] u16."""
        data = self.f.read(2 * self.nv * m)
        if len(data) != 2 * self.nv * m:
            raise BitNetError(f"{self.path}: ended early (changed while it was read?)")
        return np.frombuffer(data, "<u2").reshape(m, self.nv)

    def close(self):
        self.f.close()


def _percentile(sorted_values: np.ndarray, fraction: float) -> float:
    """llama.cpp's percentile: linear between the two nearest of the sorted values."""
    if fraction <= 0:
        return float(sorted_values[0])
    if fraction >= 1:
        return float(sorted_values[-1])
    p = fraction * (len(sorted_values) - 1)
    i = int(p)
    p -= i
    return float((1 - p) * sorted_values[i] + p * sorted_values[min(i + 1, len(sorted_values) - 1)])


class KldStats:
    """KL divergence and the other comparisons of this model's rows with the base file's, row by row."""

    BLOCK = 32

    def __init__(self):
        self.sums = dict.fromkeys(("nll", "nll2", "nll_base", "nll_base2", "nll_nll_base", "kld", "kld2",
                                   "p_diff", "p_diff2", "p_diff4"), 0.0)
        self.same_top = 0
        self.count = 0
        self.floored = 0   # scored tokens the base file holds at its floor (below its top log-probability - 16)
        self.klds: list[np.ndarray] = []
        self.p_diffs: list[np.ndarray] = []

    def mark(self) -> tuple:
        """The running figures now: back() returns to them (a chunk cut short by Ctrl-C is not counted)."""
        return dict(self.sums), self.same_top, self.count, self.floored, len(self.klds), len(self.p_diffs)

    def back(self, mark: tuple):
        sums, self.same_top, self.count, self.floored, n_klds, n_diffs = mark
        self.sums = dict(sums)
        del self.klds[n_klds:], self.p_diffs[n_diffs:]

    def add(self, logits: np.ndarray, targets: np.ndarray, base_rows: np.ndarray):
        """Compare one piece of rows with the base file's rows for the same positions."""
        for a in range(0, len(targets), self.BLOCK):   # bounded temporaries: a few f64 copies of BLOCK rows
            self._add(logits[a: a + self.BLOCK], targets[a: a + self.BLOCK], base_rows[a: a + self.BLOCK])

    def _add(self, logits: np.ndarray, targets: np.ndarray, base_rows: np.ndarray):
        m, vocab = logits.shape
        top, lse = _log_norm(logits)
        log_q = logits.astype(np.float64) - (top.astype(np.float64) + lse)[:, None]
        log_p = expand_rows(base_rows, vocab)
        r = np.arange(m)
        nll = -log_q[r, targets]
        nll_base = -log_p[r, targets].astype(np.float64)
        self.floored += int((base_rows[r, 4 + targets] == 0).sum())
        kept = log_p > np.float32(LOG_P_FLOOR)
        p = np.where(kept, np.exp(np.where(kept, log_p, 0).astype(np.float64)), 0.0)
        kld = (p * np.where(kept, log_p - log_q, 0.0)).sum(axis=1)
        p_diff = np.exp(-nll) - np.exp(-nll_base)
        s = self.sums
        s["nll"] += float(nll.sum())
        s["nll2"] += float((nll * nll).sum())
        s["nll_base"] += float(nll_base.sum())
        s["nll_base2"] += float((nll_base * nll_base).sum())
        s["nll_nll_base"] += float((nll * nll_base).sum())
        s["kld"] += float(kld.sum())
        s["kld2"] += float((kld * kld).sum())
        s["p_diff"] += float(p_diff.sum())
        s["p_diff2"] += float((p_diff ** 2).sum())
        s["p_diff4"] += float((p_diff ** 4).sum())
        self.same_top += int((logits.argmax(axis=1) == log_p.argmax(axis=1)).sum())
        self.count += m
        self.klds.append(kld)
        self.p_diffs.append(p_diff)

    def _mean_err(self, a: str, b: str) -> tuple[float, float]:
        return _mean_err(self.sums[a], self.sums[b], self.count, min_count=11)

    def _cov(self) -> float:
        n, s = self.count, self.sums
        if n < 10:
            return 0.0
        return (s["nll_nll_base"] / n - (s["nll"] / n) * (s["nll_base"] / n)) / (n - 1)

    def row(self) -> dict:
        """The running figures llama-perplexity prints per chunk."""
        lp, lp_err = self._mean_err("nll", "nll2")
        lb, lb_err = self._mean_err("nll_base", "nll_base2")
        kld, kld_err = self._mean_err("kld", "kld2")
        mse, mse_err = self._mean_err("p_diff2", "p_diff4")
        rms = math.sqrt(mse)
        top = self.same_top / self.count
        return {"ppl": math.exp(lp), "ppl_err": math.exp(lp) * lp_err,
                "ln_ppl_ratio": lp - lb, "ln_ppl_ratio_err": math.sqrt(max(0.0, lp_err ** 2 + lb_err ** 2 - 2 * self._cov())),
                "kld": kld, "kld_err": kld_err,
                "p_diff_rms": rms, "p_diff_rms_err": 0.5 / rms * mse_err if rms > 0 else 0.0,
                "same_top": top, "same_top_err": math.sqrt(top * (1 - top) / (self.count - 1)) if self.count > 1 else 0.0}

    def summary(self) -> dict:
        """Everything llama-perplexity's final statistics hold (percentiles over every scored token)."""
        lp, lp_err = self._mean_err("nll", "nll2")
        lb, lb_err = self._mean_err("nll_base", "nll_base2")
        ppl, ppl_base = math.exp(lp), math.exp(lb)
        cov = self._cov()
        ratio_err = math.sqrt(max(0.0, lp_err ** 2 + lb_err ** 2 - 2 * cov))
        ppl_err, base_err = ppl * lp_err, ppl_base * lb_err
        kld, kld_err = self._mean_err("kld", "kld2")
        dp, dp_err = self._mean_err("p_diff", "p_diff2")
        klds = np.sort(np.concatenate(self.klds))
        dps = np.sort(np.concatenate(self.p_diffs))
        row = self.row()
        return {
            "count": self.count, "base_floored": self.floored,
            "ppl": ppl, "ppl_err": ppl_err, "ppl_base": ppl_base, "ppl_base_err": base_err,
            "ln_ppl_cor": cov / (lp_err * lb_err) if lp_err > 0 and lb_err > 0 else 0.0,
            "ln_ppl_ratio": lp - lb, "ln_ppl_ratio_err": ratio_err,
            "ppl_ratio": math.exp(lp - lb), "ppl_ratio_err": math.exp(lp - lb) * ratio_err,
            "ppl_diff": ppl - ppl_base,
            "ppl_diff_err": math.sqrt(max(0.0, ppl_err ** 2 + base_err ** 2 - 2 * ppl * ppl_base * cov)),
            "kld": kld, "kld_err": kld_err,
            "kld_percentiles": {"max": float(klds[-1]), "99.9": _percentile(klds, 0.999),
                                "99.0": _percentile(klds, 0.99), "95.0": _percentile(klds, 0.95),
                                "90.0": _percentile(klds, 0.90), "median": float(np.median(klds)),
                                "10.0": _percentile(klds, 0.10), "5.0": _percentile(klds, 0.05),
                                "1.0": _percentile(klds, 0.01), "0.1": _percentile(klds, 0.001),
                                "min": float(klds[0])},
            "p_diff": dp, "p_diff_err": dp_err,
            "p_diff_percentiles": {"max": float(dps[-1]), "99.9": _percentile(dps, 0.999),
                                   "99.0": _percentile(dps, 0.99), "95.0": _percentile(dps, 0.95),
                                   "90.0": _percentile(dps, 0.90), "75.0": _percentile(dps, 0.75),
                                   "median": float(np.median(dps)), "25.0": _percentile(dps, 0.25),
                                   "10.0": _percentile(dps, 0.10), "5.0": _percentile(dps, 0.05),
                                   "1.0": _percentile(dps, 0.01), "0.1": _percentile(dps, 0.001),
                                   "min": float(dps[0])},
            "p_diff_rms": row["p_diff_rms"], "p_diff_rms_err": row["p_diff_rms_err"],
            "same_top": row["same_top"], "same_top_err": row["same_top_err"],
        }


# ---- HellaSwag (llama-perplexity --hellaswag) -----------------------------------------------------------------
# llama.cpp's task file (its hellaswag_val_full.txt, from the HellaSwag validation set as lm-evaluation-harness
# prepares it): 6 lines per task: "activity_label: ctx", the gold ending's index (0-3), the 4 endings. Each ending
# is scored as the mean log-probability of the tokens of tokenize(BOS + ctx + " " + ending) after the part the four
# sequences share; the task counts as right when the gold ending has the highest mean (acc_norm), and the running
# accuracy comes with its 95% Wilson interval, as llama-perplexity prints them.

HELLASWAG_Z = 1.95996398454


class HellaswagTask:
    def __init__(self, index: int, context: str, gold: int, endings: list[str]):
        self.index, self.context, self.gold, self.endings = index, context, gold, endings


def parse_hellaswag(text: str) -> list[HellaswagTask]:
    """The tasks of a llama.cpp HellaSwag file; BitNetError naming the first line that is not one."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if not lines or len(lines) % 6:
        raise BitNetError(f"a HellaSwag file has 6 lines per task; this one has {len(lines)} lines",
                          hint="llama.cpp's hellaswag_val_full.txt layout: context, gold index 0-3, 4 endings")
    tasks = []
    for t in range(len(lines) // 6):
        block = [ln.rstrip("\r") for ln in lines[6 * t: 6 * t + 6]]
        if block[1].strip() not in ("0", "1", "2", "3"):
            raise BitNetError(f"HellaSwag line {6 * t + 2}: {block[1][:40]!r} is not a gold ending index 0-3")
        tasks.append(HellaswagTask(t, block[0], int(block[1]), block[2:6]))
    return tasks


class Mt19937:
    """std::mt19937 seeded as llama-perplexity seeds it (1): its raw 32-bit outputs, from numpy's MT19937 (the same
    generator and the same seeding routine), so that the tasks it draws are llama-perplexity's."""

    def __init__(self, seed: int = 1):
        self.gen = np.random.MT19937()
        self.gen._legacy_seeding(seed)
        self.buf: list[int] = []

    def __call__(self) -> int:
        if not self.buf:
            self.buf = [int(x) for x in self.gen.random_raw(1024)][::-1]
        return self.buf.pop()


def uniform_below(rng: Mt19937, n: int) -> int:
    """std::uniform_int_distribution<size_t>(0, n - 1)(rng) as GCC's libstdc++ (11 and later) computes it from a
    32-bit generator: Lemire's multiply-and-shift with rejection. Other standard libraries draw otherwise."""
    product = rng() * n
    low = product & 0xFFFFFFFF
    if low < n:
        threshold = ((1 << 32) - n) % n
        while low < threshold:
            product = rng() * n
            low = product & 0xFFFFFFFF
    return product >> 32


def draw_hellaswag(tasks: list, n: int) -> list:
    """llama-perplexity's draw of n HellaSwag tasks (all of them, when n is their count: in its random order): a
    uniform index into the tasks left, each time, from std::mt19937(1)."""
    left, rng = list(tasks), Mt19937(1)
    return [left.pop(uniform_below(rng, len(left))) for _ in range(min(n, len(tasks)))]


def wilson(right: int, n: int) -> tuple[float, float]:
    """The 95% Wilson score interval of right / n (llama-perplexity's)."""
    z2 = HELLASWAG_Z * HELLASWAG_Z / n
    freq = right / n
    half = z2 * math.sqrt(n * (4.0 * freq * (1 - freq) + z2)) / (HELLASWAG_Z + HELLASWAG_Z)
    return (freq + z2 * 0.5 - half) / (1.0 + z2), (freq + z2 * 0.5 + half) / (1.0 + z2)


def _logprob(logits: np.ndarray, token: int) -> float:
    """log-softmax of one row at `token`: the arithmetic a sampled or scored token records (sampling.token_logprob)."""
    return token_logprob(logits, token, 0).logprob


def continuation_scores(model, seqs: list[list[int]]) -> list[float]:
    """The mean log-probability of each sequence's tokens after the prefix they all share (llama-perplexity's
    acc_norm scores of HellaSwag and multiple choice): the shared prefix runs once, each ending after it from that
    cache position."""
    common = 0
    while all(common < len(s) for s in seqs) and len({s[common] for s in seqs}) == 1:
        common += 1
    common = max(1, min(common, min(len(s) for s in seqs) - 1))   # at least one token of each ending is scored
    model.reset()
    last = model.prefill(seqs[0][:common]).copy()   # the logits that predict each ending's first token
    scores = []
    for s in seqs:
        model.truncate(common)
        total = _logprob(last, s[common])
        if len(s) - 1 > common:
            rows = model.prefill(s[common: len(s) - 1], all_logits=True)
            total += sum(_logprob(rows[i], s[common + 1 + i]) for i in range(len(rows)))
        scores.append(total / (len(s) - common))
    return scores


# ---- Winogrande (llama-perplexity --winogrande) ---------------------------------------------------------------
# llama.cpp's CSV (e.g. ikawrakow/winogrande-eval-for-llama.cpp): index,sentence,choice1,choice2,answer (1 or 2),
# the sentence with "_" where a choice goes (quoted when it holds commas). Each choice's score is the mean
# log-probability of the tokens after "first part + choice" (the last one, the full stop, left out when more than
# one follows), or after the part the two sentences share when either choice leaves at most 3 tokens after it.

WINOGRANDE_MIN_TRAILING = 3


class WinograndeTask:
    def __init__(self, index: int, first: str, second: str, choices: tuple[str, str], answer: int):
        self.index, self.first, self.second, self.choices, self.answer = index, first, second, choices, answer


def parse_winogrande(text: str) -> tuple[list[WinograndeTask], list[str]]:
    """(tasks, the lines skipped, each "line N: why"): llama-perplexity's CSV reading -- the first four commas outside
    quotes split a line, a quoted sentence loses its quotes, and a line without them, without "_" or without an
    answer of 1 or 2 (a header) is skipped. As there, the file's last line is never a task: llama-perplexity drops
    the file's final newline and stops at the end of the file before using the line read last; doing the same keeps
    the task count, and so its random draw, the same."""
    tasks, skipped = [], []
    lines = (text[:-1] if text.endswith("\n") else text).split("\n")[:-1]
    for number, line in enumerate(lines, 1):
        line = line.rstrip("\r")
        if not line:
            continue
        commas, quoted = [], False
        for i, ch in enumerate(line):
            if quoted:
                quoted = ch != '"'
            elif ch == '"':
                quoted = True
            elif ch == ",":
                commas.append(i)
                if len(commas) == 4:
                    break
        if len(commas) != 4:
            skipped.append(f"line {number}: fewer than 5 fields")
            continue
        c0, c1, c2, c3 = commas
        sentence = line[c0 + 2: c1 - 1] if line[c0 + 1: c0 + 2] == '"' else line[c0 + 1: c1]
        answer = line[c3 + 1:].strip()
        if "_" not in sentence or answer not in ("1", "2"):
            skipped.append(f"line {number}: " + ("no _ in its sentence" if "_" not in sentence else
                                                f"answer {answer[:20]!r} is not 1 or 2"))
            continue
        where = sentence.index("_")
        tasks.append(WinograndeTask(len(tasks), sentence[:where], sentence[where + 1:],
                                    (line[c1 + 1: c2], line[c2 + 1: c3]), int(answer)))
    return tasks, skipped


def float_draw(count: int, n: int) -> list[int]:
    """llama-perplexity's draw of n of `count` task indices for Winogrande and multiple choice (0 or all of them:
    every index, in order): a float index scale * mt19937() * left (float32 arithmetic, as there), the pick
    replaced by the last one left. (Where the float rounds up to `left`, which llama.cpp would read past its
    array for, once in ~2^25 draws, the last one is taken.)"""
    if n <= 0 or n >= count:
        return list(range(count))
    rng, aux, out = Mt19937(1), list(range(count)), []
    scale = np.float32(1.0) / (np.float32(1.0) + np.float32(4294967295.0))
    for _ in range(n):
        j = min(int(scale * np.float32(rng()) * np.float32(len(aux))), len(aux) - 1)
        out.append(aux[j])
        aux[j] = aux[-1]
        aux.pop()
    return out


def draw_winogrande(tasks: list, n: int) -> list:
    """llama-perplexity's draw of n of the tasks (float_draw)."""
    return [tasks[i] for i in float_draw(len(tasks), n)]


def winogrande_scores(model, seqs: list[list[int]], bases: list[int]) -> list[float]:
    """The two choices' scores (seqs: each whole sentence's tokens with BOS; bases: the token count of BOS + first
    part + that choice), by llama-perplexity's rule; nan when a choice leaves nothing to score (it loses)."""
    common = 0
    while common < min(len(seqs[0]), len(seqs[1])) and seqs[0][common] == seqs[1][common]:
        common += 1
    skip_choice = all(len(s) - common > WINOGRANDE_MIN_TRAILING for s in seqs)
    scores = []
    for s, base in zip(seqs, bases):
        start = base if skip_choice else common
        last = 1 if len(s) - start > 1 else 0
        count = len(s) - start - last
        if count <= 0 or start < 1:
            scores.append(float("nan"))
            continue
        model.reset()
        logits = model.prefill(s[: len(s) - 1 - last], all_logits=True)
        scores.append(sum(_logprob(logits[j], s[j + 1]) for j in range(start - 1, len(s) - 1 - last)) / count)
    return scores


# ---- multiple choice (llama-perplexity --multiple-choice) ---------------------------------------------------------
# llama.cpp's binary task file (ikawrakow/validation-datasets-for-llama.cpp: ARC, MMLU, TruthfulQA, HellaSwag), all
# little-endian: uint32 task count n, uint32 byte offset of each task, then the tasks; a task is a string (uint32
# length, UTF-8 bytes) -- the question --, then two answer sets (mc1: one right answer, mc2: several, unused): uint32
# count (at most 100), that many strings, that many int32 labels (1: right). Each answer is scored as HellaSwag's
# endings are: tokenize(BOS + question + " " + answer), the mean log-probability after the shared prefix.

MC_MAX_ANSWERS = 100   # llama-perplexity's bound on one set's answers


class ChoiceTask:
    def __init__(self, index: int, question: str, answers: list[str], labels: list[int]):
        self.index, self.question, self.answers, self.labels = index, question, answers, labels


class _Cursor:
    def __init__(self, data: bytes, pos: int, what: str):
        self.data, self.pos, self.what = data, pos, what

    def u32(self, field: str) -> int:
        return int.from_bytes(self.take(4, field), "little")

    def take(self, size: int, field: str) -> bytes:
        if self.pos > len(self.data):   # an offset past the end (a damaged table), not a short read
            raise BitNetError(f"{self.what}: {field} would start at byte {self.pos}, past the end of the file "
                              f"({len(self.data)} bytes)")
        if self.pos + size > len(self.data):
            raise BitNetError(f"{self.what}: cut short at byte {self.pos} (reading {field}: {size} bytes, "
                              f"{len(self.data) - self.pos} left)")
        out = self.data[self.pos: self.pos + size]
        self.pos += size
        return out

    def text(self, field: str) -> str:
        raw = self.take(self.u32(field + "'s length"), field)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise BitNetError(f"{self.what}: {field} is not UTF-8 (byte {self.pos - len(raw) + e.start})") from None

    def answers(self, field: str) -> tuple[list[str], list[int]]:
        n = self.u32(f"{field}'s answer count")
        if n > MC_MAX_ANSWERS:
            raise BitNetError(f"{self.what}: {field} has {n} answers (at most {MC_MAX_ANSWERS}): not a multiple-choice "
                              "file, or a damaged one")
        answers = [self.text(f"{field} answer {i + 1}") for i in range(n)]
        labels = [int(x) for x in np.frombuffer(self.take(4 * n, f"{field}'s labels"), "<i4")]
        return answers, labels


def _choice_task(data: bytes, pos: int, index: int) -> tuple[ChoiceTask, int]:
    cur = _Cursor(data, pos, f"multiple-choice task {index + 1} (at byte {pos})")
    question = cur.text("its question")
    answers, labels = cur.answers("mc1")
    cur.answers("mc2")   # read past: llama-perplexity scores mc1 only
    if not question or not answers or any(not a for a in answers):
        raise BitNetError(f"{cur.what}: an empty question or answer (llama-perplexity refuses such a task too)")
    return ChoiceTask(index, question, answers, labels), cur.pos


def parse_multiple_choice(data: bytes, n: int) -> tuple[list[ChoiceTask], int]:
    """(the tasks to score, the file's task count): n of them drawn as llama-perplexity draws them (float_draw, each
    read at its offset), or every one (n = 0 or at least the count) read in turn after the offsets, as it does."""
    head = _Cursor(data, 0, "multiple-choice file")
    count = head.u32("the task count")
    if count == 0:
        raise BitNetError("multiple-choice file: no tasks in it (its task count is 0)")
    offsets = np.frombuffer(head.take(4 * count, f"the offsets of {count} tasks"), "<u4")
    if n <= 0 or n >= count:
        tasks, pos = [], head.pos
        for i in range(count):
            task, pos = _choice_task(data, pos, i)
            tasks.append(task)
        return tasks, count
    return [_choice_task(data, int(offsets[i]), i)[0] for i in float_draw(count, n)], count
