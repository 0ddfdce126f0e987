"""Data: the Markov chain's exact entropy rate, determinism, sharding, and file errors."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

from hpcpipe.config import ConfigError, parse_section
from hpcpipe.model import ModelConfig
from hpcpipe.train.data import (
    DataConfig,
    MarkovChain,
    SyntheticData,
    build_dataset,
    stationary_distribution,
)

MODEL = ModelConfig(kind="mlp", layers=1, d_model=8, d_ff=8, vocab=12, seq_len=16)


@pytest.mark.parametrize(("vocab", "order", "branching"), [(12, 1, 3), (5, 2, 2), (4, 3, 3)])
def test_stationary_law_and_entropy_rate(vocab: int, order: int, branching: int) -> None:
    chain = MarkovChain.random(vocab, order, branching, 1.0, seed=7)
    p = chain.transition_matrix()
    np.testing.assert_allclose(p.sum(axis=1), 1.0, rtol=1e-12)
    assert (np.count_nonzero(p, axis=1) == min(branching, vocab)).all()
    # pi is stationary over states: next state of (s, token) is (s * vocab + token) mod n
    n = chain.n_states
    flow = np.zeros(n)
    for s in range(n):
        for tok in range(vocab):
            flow[(s * vocab + tok) % n] += chain.pi[s] * p[s, tok]
    np.testing.assert_allclose(flow, chain.pi, atol=1e-14)
    assert (chain.pi > 0).all()  # irreducible: every state recurs
    dense = stationary_distribution(vocab, order, chain.succ, chain.probs, "dense")
    power = stationary_distribution(vocab, order, chain.succ, chain.probs, "power")
    np.testing.assert_allclose(power, dense, atol=1e-12)
    h = -(chain.pi[:, None] * np.where(p > 0, p * np.log(np.where(p > 0, p, 1)), 0)).sum()
    assert chain.entropy_rate == pytest.approx(h, rel=1e-12)
    assert 0 < chain.entropy_rate <= np.log(branching) + 1e-12


def test_entropy_rate_matches_brute_force_estimate() -> None:
    """Mean -log P(next | context) over long samples converges to H (ergodic theorem)."""
    chain = MarkovChain.random(6, 2, 3, 0.7, seed=3)
    u = np.random.default_rng(11).random((64, 4000))
    seq = chain.sample(u)
    p = chain.transition_matrix()
    state = seq[:, 0] * 6 + seq[:, 1]
    logs = []
    for t in range(2, seq.shape[1]):
        logs.append(np.log(p[state, seq[:, t]]))
        state = chain.next_state(state, seq[:, t])
    nll = -np.concatenate(logs)
    stderr = nll.std() / np.sqrt(nll.size) * 3  # samples are correlated: be generous
    assert abs(nll.mean() - chain.entropy_rate) < 4 * stderr
    # first-token law is the stationary marginal: plug-in unigram entropy ~ H_1
    counts = np.bincount(seq.ravel(), minlength=6) / seq.size
    h1 = -(counts * np.log(counts)).sum()
    assert h1 == pytest.approx(chain.block_entropy(1), abs=0.01)


def test_optimal_loss_accounts_for_short_contexts() -> None:
    one = MarkovChain.random(8, 1, 3, 1.0, seed=1)
    assert one.optimal_loss(10) == pytest.approx(one.entropy_rate, rel=1e-12)
    two = MarkovChain.random(8, 2, 3, 1.0, seed=1)
    h1, h2 = two.block_entropy(1), two.block_entropy(2)
    expected = ((h2 - h1) + 9 * two.entropy_rate) / 10
    assert two.optimal_loss(10) == pytest.approx(expected, rel=1e-12)
    assert two.optimal_loss(10) > two.entropy_rate


def test_synthetic_batches_are_deterministic_and_shard() -> None:
    ds = build_dataset(DataConfig(global_batch=12), MODEL, seed=5)
    assert isinstance(ds, SyntheticData)
    x, y = ds.global_batch(3)
    assert x.shape == y.shape == (12, MODEL.seq_len) and x.dtype == np.int64
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one
    again = build_dataset(DataConfig(global_batch=12), MODEL, seed=5).global_batch(3)
    np.testing.assert_array_equal(again[0], x)
    assert not np.array_equal(ds.global_batch(4)[0], x)
    assert not np.array_equal(
        build_dataset(DataConfig(global_batch=12), MODEL, 6).global_batch(3)[0], x
    )
    assert ds.optimal_loss == pytest.approx(ds.entropy_rate)
    for dp in (1, 2, 3, 4, 6, 12):
        ranges = [ds.shard_range(r, dp) for r in range(dp)]
        covered = [i for r in ranges for i in r]
        assert covered == list(range(12))  # disjoint, contiguous, complete
        shards = [ds.shard(3, r, dp) for r in range(dp)]
        np.testing.assert_array_equal(np.concatenate([s[0] for s in shards]), x)
        np.testing.assert_array_equal(np.concatenate([s[1] for s in shards]), y)
    with pytest.raises(ValueError, match=r"data.global_batch: = 12 must be divisible by dp = 5"):
        ds.shard(0, 0, 5)


def test_data_seed_overrides_run_seed() -> None:
    a = build_dataset(DataConfig(seed=9), MODEL, seed=1).global_batch(0)[0]
    b = build_dataset(DataConfig(seed=9), MODEL, seed=2).global_batch(0)[0]
    np.testing.assert_array_equal(a, b)


def test_synthetic_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"data.markov_order = 3 gives model.vocab\*\*order"):
        build_dataset(DataConfig(markov_order=3), ModelConfig(vocab=256), 0)
    with pytest.raises(ConfigError, match=r"exceeds model\.seq_len"):
        build_dataset(DataConfig(markov_order=3), ModelConfig(vocab=4, seq_len=2), 0)


def text_model() -> ModelConfig:
    return ModelConfig(kind="mlp", layers=1, d_model=8, d_ff=8, vocab=256, seq_len=8)


def test_text_data_windows_come_from_the_file(tmp_path: Path) -> None:
    body = ("héllo wörld, " * 20).encode("utf-8")
    path = tmp_path / "corpus.txt"
    path.write_bytes(body)
    ds = build_dataset(DataConfig(kind="text", path=str(path), global_batch=6), text_model(), 0)
    x, y = ds.global_batch(2)
    assert x.shape == (6, 8)
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    data = np.frombuffer(body, dtype=np.uint8)
    for row_x, row_y in zip(x, y, strict=True):
        window = np.concatenate((row_x, row_y[-1:]))
        starts = [i for i in range(len(data) - 8) if (data[i : i + 9] == window).all()]
        assert starts, "every window is a slice of the file"
    np.testing.assert_array_equal(np.concatenate([ds.shard(2, r, 3)[0] for r in range(3)]), x)


def test_text_data_errors_name_file_and_key(tmp_path: Path) -> None:
    missing = tmp_path / "nope.txt"
    with pytest.raises(ConfigError, match=r"deck.toml: data.path = '.*nope.txt': no such file"):
        build_dataset(DataConfig(kind="text", path=str(missing)), text_model(), 0, "deck.toml")
    short = tmp_path / "short.txt"
    short.write_text("abc")
    with pytest.raises(ConfigError, match=r"data.path = '.*short.txt' has 3 bytes"):
        build_dataset(DataConfig(kind="text", path=str(short)), text_model(), 0)
    binary = tmp_path / "blob.bin"
    binary.write_bytes(b"ok" + bytes([0xFF, 0xFE]) * 20)
    with pytest.raises(ConfigError, match=r"blob.bin' is not UTF-8 text \(byte 2\)"):
        build_dataset(DataConfig(kind="text", path=str(binary)), text_model(), 0)
    with pytest.raises(ConfigError, match=r"model.vocab = 64 is too small"):
        build_dataset(DataConfig(kind="text", path=str(short)), ModelConfig(vocab=64), 0)
    with pytest.raises(ConfigError, match=r"deck: data.path is required when kind = 'text'"):
        parse_section(DataConfig, {"kind": "text"}, "deck", "data")


def write_tokens(path: Path, name: str, tokens: np.ndarray) -> None:
    with h5py.File(path, "w") as fh:
        fh.create_dataset(name, data=tokens)


def test_hdf5_data(tmp_path: Path) -> None:
    tokens = np.arange(500, dtype=np.int32) % 12
    path = tmp_path / "tokens.h5"
    write_tokens(path, "corpus/ids", tokens)
    cfg = DataConfig(kind="hdf5", path=str(path), dataset="corpus/ids", global_batch=4)
    ds = build_dataset(cfg, MODEL, 0)
    x, y = ds.global_batch(0)
    assert x.shape == (4, MODEL.seq_len)
    np.testing.assert_array_equal(y, (x + 1) % 12)  # a window of the arithmetic sequence
    np.testing.assert_array_equal(np.concatenate([ds.shard(0, r, 2)[1] for r in range(2)]), y)


def test_hdf5_errors_name_file_and_key(tmp_path: Path) -> None:
    path = tmp_path / "tokens.h5"
    write_tokens(path, "ids", np.arange(100) % 12)
    with pytest.raises(
        ConfigError,
        match=r"data.dataset = 'tokens': no such dataset in .*tokens.h5'; "
        r"datasets there: ids",
    ):
        build_dataset(DataConfig(kind="hdf5", path=str(path)), MODEL, 0)
    floats = tmp_path / "floats.h5"
    write_tokens(floats, "tokens", np.zeros(100))
    with pytest.raises(ConfigError, match="float64 with shape \\(100,\\); expected a 1-D integer"):
        build_dataset(DataConfig(kind="hdf5", path=str(floats)), MODEL, 0)
    short = tmp_path / "short.h5"
    write_tokens(short, "tokens", np.zeros(5, dtype=np.int64))
    with pytest.raises(ConfigError, match=r"has 5 tokens; needs at least model\.seq_len \+ 2"):
        build_dataset(DataConfig(kind="hdf5", path=str(short)), MODEL, 0)
    big = tmp_path / "big.h5"
    write_tokens(big, "tokens", np.full(100, 40, dtype=np.int64))
    with pytest.raises(ConfigError, match=r"model\.vocab = 12 does not cover token 40"):
        build_dataset(DataConfig(kind="hdf5", path=str(big), global_batch=2), MODEL, 0)
    text = tmp_path / "notes.txt"
    text.write_text("not hdf5 " * 20)
    with pytest.raises(ConfigError, match=r"notes\.txt' is not an HDF5 file"):
        build_dataset(DataConfig(kind="hdf5", path=str(text)), MODEL, 0)
    with pytest.raises(ConfigError, match="no such file"):
        build_dataset(DataConfig(kind="hdf5", path=str(tmp_path / "x.h5")), MODEL, 0)


def test_large_chain_uses_power_iteration() -> None:
    chain = MarkovChain.random(64, 2, 3, 1.0, seed=0)  # 4096 states: beyond the dense solve
    n = chain.n_states
    nxt = (np.arange(n)[:, None] * 64 + chain.succ) % n
    flow = np.bincount(nxt.ravel(), (chain.pi[:, None] * chain.probs).ravel(), n)
    np.testing.assert_allclose(flow, chain.pi, atol=1e-13)
    assert (chain.pi > 0).all()
