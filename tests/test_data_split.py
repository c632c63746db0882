"""`--data.split`: contiguous per-replica shares (the default, unchanged) vs iid sampling of the whole train split."""

import dataclasses

import numpy as np
import pytest

from eqx_diloco.lm.config import Config, ConfigError, DataConfig, validate
from eqx_diloco.lm.data import TokenBatches


def _tokens(n=4000):
    # Token i has value i % 4000 so a window's first token tells where it starts.
    return (np.arange(n) % 4000).astype(np.uint16)


def _batches(split, *, seed=0, replicas=2, batch_size=64, seq_len=8, tokens=None):
    return TokenBatches(_tokens() if tokens is None else tokens, num_replicas=replicas, batch_size=batch_size,
                        seq_len=seq_len, eval_fraction=0.1, seed=seed, split=split)


def _starts(b, steps=20):
    """Window start positions in the train split, shape (steps, R, batch)."""
    return np.stack([b.batch(s)[:, :, 0] for s in range(steps)]).astype(np.int64)


def test_contiguous_is_the_default_and_unchanged():
    tokens = _tokens()
    default = TokenBatches(tokens, num_replicas=2, batch_size=16, seq_len=8, eval_fraction=0.1, seed=3)
    assert default.split == "contiguous"
    explicit = _batches("contiguous", seed=3, batch_size=16)
    # The formula the trainer used before the flag existed: replica r samples inside its own share.
    train = tokens[: int(len(tokens) * 0.9)]
    share, window = len(train) // 2, 9
    for step in range(5):
        expected = np.empty((2, 16, window), np.int32)
        for r in range(2):
            rng = np.random.default_rng([3, r, step])
            starts = r * share + rng.integers(0, share - window + 1, 16)
            expected[r] = train[starts[:, None] + np.arange(window)]
        np.testing.assert_array_equal(default.batch(step), expected)
        np.testing.assert_array_equal(explicit.batch(step), expected)


def test_contiguous_replicas_stay_in_their_share():
    b = _batches("contiguous")
    starts = _starts(b)
    share = len(b.train) // 2
    assert starts[:, 0].max() < share - 8 and starts[:, 1].min() >= share


def test_iid_replicas_sample_the_whole_train_split():
    b = _batches("iid")
    starts = _starts(b, steps=40)
    n_train, window = len(b.train), 9
    assert starts.min() >= 0 and starts.max() <= n_train - window
    half = n_train // 2
    for r in range(2):
        # Each replica draws from both halves of the train split, roughly evenly.
        low = (starts[:, r] < half).mean()
        assert 0.35 < low < 0.65, (r, low)
    # Replicas have their own streams, not the same windows.
    assert not np.array_equal(starts[:, 0], starts[:, 1])
    # Windows never reach into the held-out tokens.
    assert b.batch(0).max() < n_train


def test_iid_is_deterministic_per_seed():
    a, b, c = _batches("iid", seed=7), _batches("iid", seed=7), _batches("iid", seed=8)
    for step in (0, 1, 17):
        np.testing.assert_array_equal(a.batch(step), b.batch(step))
    assert not np.array_equal(a.batch(0), c.batch(0))
    assert not np.array_equal(a.batch(0), a.batch(1))


def test_iid_and_contiguous_share_the_eval_batch():
    np.testing.assert_array_equal(_batches("iid").eval_batch(8), _batches("contiguous").eval_batch(8))


def test_iid_allows_windows_longer_than_a_share():
    # 3600 train tokens over 16 replicas: 225 per share, too few for a 300-token window,
    # but iid samples from the whole split.
    with pytest.raises(ConfigError, match="seq-len"):
        _batches("contiguous", replicas=16, seq_len=299, batch_size=2)
    assert _batches("iid", replicas=16, seq_len=299, batch_size=2).batch(0).shape == (16, 2, 300)


def test_bad_split_is_a_config_error():
    with pytest.raises(ConfigError, match="--data.split"):
        _batches("shuffled")
    with pytest.raises(ConfigError, match="--data.split"):
        validate(dataclasses.replace(Config(), data=DataConfig(split="shuffled")))


def test_split_is_recorded_in_the_config_dump():
    config = dataclasses.replace(Config(), data=DataConfig(split="iid"))
    validate(config)
    assert dataclasses.asdict(config)["data"]["split"] == "iid"


def test_the_embedded_corpus_walk_reads_the_sorted_sources_without_packages_and_tests(tmp_path, monkeypatch):
    """`corpus_bytes` reads the standard library's `.py` files in sorted path order, leaving out
    site-packages and test folders: the same bytes as sorting every path of the tree, without listing
    the folders it leaves out. Files and folders interleave by name, as sorted paths do."""
    import sysconfig

    from eqx_diloco.lm import data

    files = ["a.py", "ab/z.py", "ab.py", "b/c/d.py", "b/c.py", "b/site-packages/x.py", "test/t.py", "tests/u.py",
             "c/test/v.py", "c/w.py", "c/w.txt", "d.py/e.py", "z.py"]
    for i, name in enumerate(files):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(f"# {i} {name}\n")
    (tmp_path / "link").symlink_to(tmp_path / "b", target_is_directory=True)  # not followed, as rglob does not
    expected = b"".join(p.read_bytes() for p in sorted(tmp_path.rglob("*.py"))
                        if p.is_file() and not {"site-packages", "test", "tests"} & set(p.relative_to(tmp_path).parts))
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    assert data.corpus_bytes(10**6) == expected
    assert b"site-packages" not in expected and b"t.py" not in expected and b"# 0 a.py\n# 2 ab.py" not in expected
    assert data.corpus_bytes(20) == expected[:20]
