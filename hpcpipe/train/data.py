"""Training data: deterministic global batches of token sequences, sharded over data-parallel ranks.

Every dataset answers `global_batch(step) -> (inputs, targets)`, the same on every rank, and
`shard(step, dp_rank, dp_size)`, the contiguous slice of rows that rank trains on; the shards of all
ranks concatenate to the global batch. Row r of step s depends only on (seed, s, r), so a rank
generates or reads just its own rows. Arrays are int64 NumPy arrays of shape (rows, seq_len);
targets are the inputs shifted by one token.

Kinds:
- `synthetic`: a seeded Markov chain over the vocabulary whose entropy rate is computed exactly, so
  the best achievable loss is known;
- `text`: any UTF-8 file, byte-level tokens (vocab 256), windows at seeded random offsets;
- `hdf5`: a 1-D integer token dataset in an HDF5 file, windows at seeded random offsets.

HDF5 token files are bad input (ConfigError, exit code 2, naming the file and the dataset) when
they are missing, truncated, not HDF5, lack the dataset, hold something other than a 1-D integer
array, are too short for one window, or hold a token outside 0..model.vocab-1. Datasets up to
SCAN_TOKENS tokens are read once in full when the dataset is built (the same on every rank, so
the job stops before any step); larger ones are checked window by window as they are read. A
flipped byte in the token data is only detectable with a checksum: `write_token_file` stores the
dataset with HDF5's Fletcher32 filter, which makes such a read fail with a clear error.
"""

from __future__ import annotations

import codecs
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hpcpipe.config import ConfigError, option
from hpcpipe.model.config import ModelConfig

__all__ = [
    "DataConfig",
    "Dataset",
    "HDF5Data",
    "MarkovChain",
    "SyntheticData",
    "TextData",
    "build_dataset",
    "write_token_file",
]

CHAIN_STREAM = 2  # random stream tags: default_rng([seed, TAG, ...]); init uses tag 1
BATCH_STREAM = 3
MAX_MARKOV_STATES = 1 << 16
DENSE_SOLVE_STATES = 2048  # up to this many states the stationary law is a dense linear solve
SCAN_TOKENS = 1 << 26
"""HDF5 token datasets up to this many tokens are read in full and checked (ids in range,
checksums where stored) when the dataset is built; larger ones window by window."""
_SCAN_BLOCK = 1 << 22
_H5_ERRORS = (OSError, KeyError, ValueError, TypeError, RuntimeError)


@dataclass(frozen=True)
class DataConfig:
    """[data]: where token sequences come from and how many make one optimizer step."""

    kind: str = option(
        "synthetic",
        "synthetic: seeded Markov chain with known entropy rate; text: UTF-8 file, byte tokens; "
        "hdf5: 1-D token dataset",
        choices=("synthetic", "text", "hdf5"),
    )
    path: str = option("", "file to read (text and hdf5)")
    dataset: str = option("tokens", "name of the 1-D integer token dataset in the HDF5 file")
    global_batch: int = option(
        32, "sequences per optimizer step, over all data-parallel ranks", minimum=1
    )
    seed: int | None = option(None, "seed of the data streams; unset = run.seed", minimum=0)
    markov_order: int = option(
        1, "tokens of context that determine the next one", minimum=1, maximum=8
    )
    markov_branching: int = option(
        4, "possible successors of each context (sparser = lower entropy)", minimum=1
    )
    markov_concentration: float = option(
        1.0, "Dirichlet concentration of successor weights (small = peaked)", minimum=0.05
    )

    def __post_init__(self) -> None:
        if self.kind in ("text", "hdf5") and not self.path:
            raise ValueError(f"path: is required when kind = {self.kind!r}")


# --------------------------------------------------------------------------- Markov chain


def _de_bruijn(alphabet: int, order: int) -> list[int]:
    """A cyclic sequence containing every `order`-gram exactly once (Lyndon-word construction)."""
    a = [0] * (alphabet * order)
    seq: list[int] = []

    def db(t: int, p: int) -> None:
        if t > order:
            if order % p == 0:
                seq.extend(a[1 : p + 1])
        else:
            a[t] = a[t - p]
            db(t + 1, p)
            for j in range(a[t - p] + 1, alphabet):
                a[t] = j
                db(t + 1, t)

    db(1, 1)
    return seq


def _entropy(p: np.ndarray) -> float:
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


@dataclass(frozen=True)
class MarkovChain:
    """Order-k chain over `vocab` tokens; state = last k tokens, index = base-`vocab` number.

    `succ[s]` are the possible next tokens of state s and `probs[s]` their probabilities. Every
    state has the successor that follows it in a de Bruijn cycle, so the chain is irreducible and
    its stationary law `pi` is unique.
    """

    vocab: int
    order: int
    succ: np.ndarray = field(repr=False)
    probs: np.ndarray = field(repr=False)
    pi: np.ndarray = field(repr=False)

    @property
    def n_states(self) -> int:
        return self.vocab**self.order

    @classmethod
    def random(
        cls, vocab: int, order: int, branching: int, concentration: float, seed: int
    ) -> MarkovChain:
        """A random sparse chain: `branching` successors per state, Dirichlet weights."""
        n = vocab**order
        if n > MAX_MARKOV_STATES:
            raise ValueError(
                f"vocab**order = {vocab}**{order} = {n} states exceeds {MAX_MARKOV_STATES}"
            )
        b = min(branching, vocab)
        rng = np.random.default_rng([seed, CHAIN_STREAM])
        cycle = np.asarray(_de_bruijn(vocab, order), dtype=np.int64)
        # State at cycle position p is cycle[p : p + order] (cyclically); its cycle successor is
        # the token after it.
        ext = np.concatenate((cycle, cycle[:order]))
        states = np.zeros(n, dtype=np.int64)
        for j in range(order):
            states = states * vocab + ext[j : j + n]
        forced = np.empty(n, dtype=np.int64)
        forced[states] = ext[order : order + n]
        succ = np.empty((n, b), dtype=np.int64)
        for s in range(n):
            others = rng.permutation(vocab - 1)[: b - 1]
            others = others + (others >= forced[s])  # skip the forced token
            succ[s] = np.concatenate(([forced[s]], others))
        probs = rng.dirichlet(np.full(b, concentration), size=n)
        probs = np.maximum(probs, 1e-6)
        probs /= probs.sum(axis=1, keepdims=True)
        # Relabel tokens at random so the forced cycle is not visible as "next token id".
        perm = rng.permutation(vocab)
        inv = np.argsort(perm)
        digits = np.arange(n)
        canon = np.zeros(n, dtype=np.int64)
        for j in range(order):
            d = (digits // vocab ** (order - 1 - j)) % vocab
            canon = canon * vocab + inv[d]
        succ, probs = perm[succ[canon]], probs[canon]
        return cls(vocab, order, succ, probs, stationary_distribution(vocab, order, succ, probs))

    def next_state(self, state: np.ndarray, token: np.ndarray) -> np.ndarray:
        return (state * self.vocab + token) % self.n_states

    def transition_matrix(self) -> np.ndarray:
        """Dense next-token probabilities, shape (n_states, vocab)."""
        p = np.zeros((self.n_states, self.vocab))
        np.put_along_axis(p, self.succ, self.probs, axis=1)
        return p

    @property
    def entropy_rate(self) -> float:
        """H = -sum_s pi_s sum_j P_sj log P_sj, nats per token: the best achievable mean loss."""
        return float(-(self.pi[:, None] * self.probs * np.log(self.probs)).sum())

    def block_entropy(self, length: int) -> float:
        """Entropy of `length` consecutive tokens of the stationary chain, nats."""
        if length <= self.order:
            marg = self.pi.reshape((self.vocab,) * self.order)
            marg = marg.sum(axis=tuple(range(length, self.order))) if length < self.order else marg
            return _entropy(marg.ravel())
        return self.block_entropy(self.order) + (length - self.order) * self.entropy_rate

    def optimal_loss(self, seq_len: int) -> float:
        """Best mean loss over sequences of `seq_len` targets (positions < k see a partial context).

        Target t is token t+1 given tokens 0..t: conditional entropy H_{t+2} - H_{t+1}.
        Equals the entropy rate for an order-1 chain.
        """
        total = sum(self.block_entropy(t + 2) - self.block_entropy(t + 1) for t in range(seq_len))
        return total / seq_len

    def sample(self, uniforms: np.ndarray) -> np.ndarray:
        """Sequences from the stationary chain, one row per row of `uniforms`.

        `uniforms` has shape (rows, 1 + length - order): one to draw the first k tokens from `pi`,
        one per later token; the result has `length` tokens per row.
        """
        rows, n_u = uniforms.shape
        length = n_u - 1 + self.order
        cum_pi = np.cumsum(self.pi)
        state = np.minimum(
            np.searchsorted(cum_pi, uniforms[:, 0] * cum_pi[-1], side="right"), self.n_states - 1
        )
        out = np.empty((rows, length), dtype=np.int64)
        for j in range(self.order):
            out[:, j] = (state // self.vocab ** (self.order - 1 - j)) % self.vocab
        cum = np.cumsum(self.probs, axis=1)
        cum[:, -1] = np.inf
        for t in range(self.order, length):
            pick = (uniforms[:, t - self.order + 1, None] >= cum[state]).sum(axis=1)
            tok = self.succ[state, pick]
            out[:, t] = tok
            state = self.next_state(state, tok)
        return out


def stationary_distribution(
    vocab: int, order: int, succ: np.ndarray, probs: np.ndarray, method: str = "auto"
) -> np.ndarray:
    """Stationary law pi of an irreducible chain: pi P = pi, sum pi = 1.

    "dense": a linear solve (exact to rounding); "power": iteration of the lazy chain (P + I) / 2,
    which has the same pi and is aperiodic, so it converges; "auto" picks dense for small chains.
    """
    n = vocab**order
    if method == "auto":
        method = "dense" if n <= DENSE_SOLVE_STATES else "power"
    nxt = (np.arange(n)[:, None] * vocab + succ) % n
    if method == "dense":
        p = np.zeros((n, n))
        np.add.at(p, (np.repeat(np.arange(n), succ.shape[1]), nxt.ravel()), probs.ravel())
        a = p.T - np.eye(n)
        a[-1] = 1.0
        rhs = np.zeros(n)
        rhs[-1] = 1.0
        pi = np.linalg.solve(a, rhs)
    elif method == "power":
        pi = np.full(n, 1.0 / n)
        for _ in range(200_000):
            new = 0.5 * pi + 0.5 * np.bincount(nxt.ravel(), (pi[:, None] * probs).ravel(), n)
            if np.abs(new - pi).sum() < 1e-14:
                pi = new
                break
            pi = new
        else:
            raise RuntimeError(f"stationary distribution of {n} states did not converge")
    else:
        raise ValueError(f"method = {method!r} must be 'auto', 'dense' or 'power'")
    pi = np.maximum(pi, 0.0)
    return pi / pi.sum()


# --------------------------------------------------------------------------- datasets


class Dataset(ABC):
    """Global batches of `global_batch_size` rows of `seq_len` tokens; row r of step s is fixed."""

    def __init__(self, vocab: int, seq_len: int, global_batch_size: int, seed: int):
        self.vocab, self.seq_len = vocab, seq_len
        self.global_batch_size, self.seed = global_batch_size, seed

    @property
    def optimal_loss(self) -> float | None:
        """Best achievable mean loss when known (synthetic data), else None."""
        return None

    @abstractmethod
    def _sequences(self, step: int, lo: int, hi: int) -> np.ndarray:
        """Rows lo..hi-1 of step `step`, each seq_len + 1 tokens."""

    def _row_rngs(self, step: int, lo: int, hi: int) -> list[np.random.Generator]:
        return [np.random.default_rng([self.seed, BATCH_STREAM, step, r]) for r in range(lo, hi)]

    def rows(self, step: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets) of global-batch rows lo..hi-1 at `step`."""
        if step < 0:
            raise ValueError(f"step = {step} must be >= 0")
        if not 0 <= lo <= hi <= self.global_batch_size:
            raise ValueError(
                f"rows {lo}..{hi} outside the global batch of {self.global_batch_size}"
            )
        seq = self._sequences(step, lo, hi)
        return seq[:, :-1], seq[:, 1:]

    def global_batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """The whole batch of `step`: what the single-process reference trains on."""
        return self.rows(step, 0, self.global_batch_size)

    def shard_range(self, dp_rank: int, dp_size: int) -> range:
        """Rows of the global batch that data-parallel rank `dp_rank` of `dp_size` owns."""
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank = {dp_rank} must be in 0..{dp_size - 1}")
        if self.global_batch_size % dp_size:
            raise ValueError(
                f"data.global_batch: = {self.global_batch_size} must be divisible by dp = {dp_size}"
            )
        per = self.global_batch_size // dp_size
        return range(dp_rank * per, (dp_rank + 1) * per)

    def shard(self, step: int, dp_rank: int, dp_size: int) -> tuple[np.ndarray, np.ndarray]:
        """This rank's disjoint contiguous slice of the global batch of `step`."""
        r = self.shard_range(dp_rank, dp_size)
        return self.rows(step, r.start, r.stop)


class SyntheticData(Dataset):
    """Sequences of a seeded Markov chain, each started from the stationary law."""

    def __init__(self, chain: MarkovChain, seq_len: int, global_batch_size: int, seed: int):
        super().__init__(chain.vocab, seq_len, global_batch_size, seed)
        self.chain = chain

    @property
    def entropy_rate(self) -> float:
        return self.chain.entropy_rate

    @property
    def optimal_loss(self) -> float:
        return self.chain.optimal_loss(self.seq_len)

    def _sequences(self, step: int, lo: int, hi: int) -> np.ndarray:
        n_u = 1 + self.seq_len + 1 - self.chain.order
        u = np.empty((hi - lo, n_u))
        for k, g in enumerate(self._row_rngs(step, lo, hi)):
            u[k] = g.random(n_u)
        return self.chain.sample(u)


class _WindowData(Dataset):
    """Windows of seq_len + 1 tokens at seeded random offsets of a 1-D token array."""

    n_tokens: int

    def _offsets(self, step: int, lo: int, hi: int) -> list[int]:
        span = self.n_tokens - self.seq_len
        return [int(g.integers(0, span)) for g in self._row_rngs(step, lo, hi)]


class TextData(_WindowData):
    """Byte-level tokens of a UTF-8 file (memory-mapped, so large corpora cost no RAM)."""

    def __init__(self, path: str, seq_len: int, global_batch_size: int, seed: int, source: str):
        super().__init__(256, seq_len, global_batch_size, seed)
        self.path = path
        p = Path(path)
        if not p.is_file():
            raise ConfigError(source, "data.path", f"= {path!r}: no such file")
        self.n_tokens = p.stat().st_size
        if self.n_tokens < seq_len + 2:
            raise ConfigError(
                source,
                "data.path",
                f"= {path!r} has {self.n_tokens} bytes; needs at least model.seq_len + 2 = "
                f"{seq_len + 2}",
            )
        with p.open("rb") as fh:
            head = fh.read(1 << 20)
        try:
            codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
        except UnicodeDecodeError as exc:
            raise ConfigError(
                source,
                "data.path",
                f"= {path!r} is not UTF-8 text (byte {exc.start}); "
                "use kind = 'hdf5' for pre-tokenised data",
            ) from None
        self._bytes = np.memmap(p, dtype=np.uint8, mode="r")

    def _sequences(self, step: int, lo: int, hi: int) -> np.ndarray:
        out = np.empty((hi - lo, self.seq_len + 1), dtype=np.int64)
        for k, off in enumerate(self._offsets(step, lo, hi)):
            out[k] = self._bytes[off : off + self.seq_len + 1]
        return out


class HDF5Data(_WindowData):
    """A 1-D integer token dataset in an HDF5 file; values must lie in 0..vocab-1.

    Every problem with the file is a ConfigError naming it and the dataset (exit code 2).
    """

    def __init__(
        self,
        path: str,
        name: str,
        vocab: int,
        seq_len: int,
        global_batch_size: int,
        seed: int,
        source: str,
    ):
        import h5py

        super().__init__(vocab, seq_len, global_batch_size, seed)
        self.path, self.name, self.source = path, name, source
        if not Path(path).is_file():
            raise ConfigError(source, "data.path", f"= {path!r}: no such file")
        try:
            fh = h5py.File(path, "r")
        except OSError as exc:
            what = (
                "is truncated (a partial copy: copy it again)"
                if "truncated" in str(exc)
                else "is not an HDF5 file, or is damaged"
            )
            raise ConfigError(source, "data.path", f"= {path!r} {what} ({exc})") from None
        with fh:
            try:
                self.n_tokens = self._check_dataset(fh)
                if self.n_tokens <= SCAN_TOKENS:
                    self._scan(fh[name])
            except ConfigError:
                raise
            except _H5_ERRORS as exc:
                raise ConfigError(
                    source,
                    "data.path",
                    f"= {path!r} is damaged ({type(exc).__name__}: {exc}); copy it again or "
                    "re-create it",
                ) from None

    def _check_dataset(self, fh: Any) -> int:
        """The dataset's presence, kind, shape and length; returns its number of tokens."""
        import h5py

        path, name, source = self.path, self.name, self.source
        if name not in fh or not isinstance(fh[name], h5py.Dataset):
            found: list[str] = []
            fh.visititems(lambda k, v: found.append(k) if isinstance(v, h5py.Dataset) else None)
            raise ConfigError(
                source,
                "data.dataset",
                f"= {name!r}: no such dataset in {path!r}; datasets there: "
                + (", ".join(found) or "none"),
            )
        ds = fh[name]
        if ds.ndim != 1 or ds.dtype.kind not in "iu":
            raise ConfigError(
                source,
                "data.dataset",
                f"= {name!r} in {path!r} is {ds.dtype} with shape {ds.shape}; "
                "expected a 1-D integer array of token ids",
            )
        n = int(ds.shape[0])
        if n < self.seq_len + 2:
            raise ConfigError(
                source,
                "data.dataset",
                f"= {name!r} in {path!r} has {n} tokens; needs at least "
                f"model.seq_len + 2 = {self.seq_len + 2}",
            )
        return n

    def _scan(self, ds: Any) -> None:
        """Read every token once, in bounded blocks: unreadable data and ids outside the
        vocabulary stop the run here, on every rank alike, before any step."""
        for lo in range(0, self.n_tokens, _SCAN_BLOCK):
            hi = min(self.n_tokens, lo + _SCAN_BLOCK)
            self._check_tokens(self._read(ds, lo, hi), lo, "")

    def _read(self, ds: Any, lo: int, hi: int) -> np.ndarray:
        try:
            return np.asarray(ds[lo:hi])
        except _H5_ERRORS as exc:
            raise ConfigError(
                self.source,
                "data.dataset",
                f"= {self.name!r} in {self.path!r}: tokens {lo}..{hi - 1} cannot be read "
                f"({type(exc).__name__}: {exc}); the file is damaged (a flipped byte or a "
                "partial copy): copy it again or re-create it",
            ) from None

    def _check_tokens(self, tokens: np.ndarray, offset: int, when: str) -> None:
        if not tokens.size:
            return
        bad = np.flatnonzero((tokens < 0) | (tokens >= self.vocab))
        if bad.size:
            i = int(bad[0])
            raise ConfigError(
                self.source,
                "model.vocab",
                f"= {self.vocab} does not cover token {int(tokens[i])} of dataset "
                f"{self.name!r} in {self.path!r} (position {offset + i}{when}): token ids must "
                f"be 0..model.vocab-1",
            )

    def _sequences(self, step: int, lo: int, hi: int) -> np.ndarray:
        import h5py

        out = np.empty((hi - lo, self.seq_len + 1), dtype=np.int64)
        try:
            fh = h5py.File(self.path, "r")
        except OSError as exc:
            raise ConfigError(
                self.source, "data.path", f"= {self.path!r} cannot be opened any more ({exc})"
            ) from None
        with fh:
            try:
                ds = fh[self.name]
            except _H5_ERRORS as exc:
                raise ConfigError(
                    self.source,
                    "data.dataset",
                    f"= {self.name!r} in {self.path!r} cannot be opened any more ({exc})",
                ) from None
            for k, off in enumerate(self._offsets(step, lo, hi)):
                window = self._read(ds, off, off + self.seq_len + 1)
                self._check_tokens(window, off, f", step {step}")
                out[k] = window
        return out


def write_token_file(
    path: str | Path, tokens: Any, dataset: str = "tokens", *, chunk: int = 1 << 16
) -> Path:
    """Write a `kind = "hdf5"` token file: a 1-D integer dataset, chunked with HDF5's
    Fletcher32 checksum so that a damaged copy fails on read instead of feeding wrong tokens.
    Written to a temporary name and renamed, so a partial file never appears under `path`."""
    import h5py

    ids = np.asarray(tokens)
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise ValueError(f"tokens must be a 1-D integer array, got {ids.dtype}{ids.shape}")
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with h5py.File(tmp, "w", libver="v108") as fh:
            fh.create_dataset(
                dataset, data=ids, chunks=(max(1, min(chunk, ids.size)),), fletcher32=True
            )
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def build_dataset(
    data: DataConfig, model: ModelConfig, seed: int, source: str = "[data]"
) -> Dataset:
    """The dataset of the deck; `seed` is run.seed (data.seed overrides it when set).

    `source` names the deck in error messages.
    """
    seed = data.seed if data.seed is not None else seed
    if data.kind == "synthetic":
        if data.markov_order > model.seq_len:
            raise ConfigError(
                source,
                "data.markov_order",
                f"= {data.markov_order} exceeds model.seq_len = {model.seq_len}",
            )
        n = model.vocab**data.markov_order
        if n > MAX_MARKOV_STATES:
            raise ConfigError(
                source,
                "data.markov_order",
                f"= {data.markov_order} gives model.vocab**order = {n} chain states; "
                f"at most {MAX_MARKOV_STATES} are supported",
            )
        chain = MarkovChain.random(
            model.vocab,
            data.markov_order,
            data.markov_branching,
            data.markov_concentration,
            seed,
        )
        return SyntheticData(chain, model.seq_len, data.global_batch, seed)
    if data.kind == "text":
        if model.vocab < 256:
            raise ConfigError(
                source,
                "model.vocab",
                f"= {model.vocab} is too small for byte-level text (needs 256)",
            )
        return TextData(data.path, model.seq_len, data.global_batch, seed, source)
    if data.kind == "hdf5":
        return HDF5Data(
            data.path, data.dataset, model.vocab, model.seq_len, data.global_batch, seed, source
        )
    raise ConfigError(source, "data.kind", f"= {data.kind!r} is not a known data kind")
