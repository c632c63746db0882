"""Token files for `--data.source tokens`: the vocabulary taken from their metadata, the metadata cross-checked
against the file (size, token count, id range), and the one bounded-memory scan of a file's ids, cached beside it."""

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import tyro

from eqx_diloco.lm import data
from eqx_diloco.lm._banner import setup_lines
from eqx_diloco.lm.config import Config, ConfigError, DataConfig
from eqx_diloco.lm.data import load_tokens, open_tokens, token_meta_path, token_scan_path
from eqx_diloco.lm.train import main as train_main
from models import TransformerConfig

TINY = ["--model.num-layers", "2", "--model.dim", "32", "--model.num-heads", "2", "--train.seq-len", "16",
        "--train.batch-size", "4", "--checkpoint.every", "0", "--train.steps", "2"]


def write_tokens(path, ids, dtype="<u2", meta=None):
    np.asarray(ids, dtype).tofile(path)
    if meta is not None:
        token_meta_path(path).write_text(json.dumps(meta))
    return path


def cli_config(path, *flags) -> Config:
    return tyro.cli(Config, args=["--data.source", "tokens", "--data.path", str(path), *flags])


# -- the vocabulary ---------------------------------------------------------------------------------------


def test_vocab_size_comes_from_the_token_metadata_unless_the_flag_is_given(tmp_path):
    path = write_tokens(tmp_path / "t.bin", np.arange(2000) % 300, meta={"dtype": "uint16", "vocab_size": 300})
    config = cli_config(path)
    assert config.model.vocab_size == 300 and type(config.model) is TransformerConfig
    assert f"  vocab        300, the vocab_size of {token_meta_path(path)}" in setup_lines(config)
    assert len(open_tokens(path, config.model.vocab_size)) == 2000
    # An explicit, larger flag is kept, and the set-up output says what the file would have given.
    bigger = cli_config(path, "--model.vocab-size", "32000")
    assert bigger.model.vocab_size == 32000
    assert f"  vocab        32000, from --model.vocab-size ({token_meta_path(path)} gives 300)" in setup_lines(bigger)
    # The byte-level sources, and a token file without metadata, keep the byte vocabulary.
    assert tyro.cli(Config, args=[]).model.vocab_size == 256
    assert Config().model.vocab_size == 256
    bare = write_tokens(tmp_path / "bare.bin", [1, 2, 3])
    assert cli_config(bare).model.vocab_size == 256
    assert not any("vocab   " in line for line in setup_lines(cli_config(bare)))
    # Library configs name their model in full: nothing is taken from the file.
    library = Config(model=TransformerConfig(vocab_size=1000), data=DataConfig(source="tokens", path=path))
    assert library.model.vocab_size == 1000


def test_a_flag_below_the_metadata_vocab_is_a_one_line_error(tmp_path, capsys):
    path = write_tokens(tmp_path / "t.bin", np.arange(2000) % 300, meta={"dtype": "uint16", "vocab_size": 300})
    code = train_main([*TINY, "--run-dir", str(tmp_path / "run"), "--data.source", "tokens", "--data.path", str(path),
                       "--model.vocab-size", "256"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: --model.vocab-size is 256 but ") and str(token_meta_path(path)) in err


# -- metadata cross-checks ----------------------------------------------------------------------------------


def check_error(path, vocab_size, *patterns):
    with pytest.raises(ConfigError) as info:
        open_tokens(path, vocab_size)
    message = str(info.value)
    assert "\n" not in message and str(path) in message, message
    for pattern in patterns:
        assert re.search(pattern, message), (pattern, message)


def test_size_must_match_num_tokens(tmp_path):
    ids = np.arange(50_000) % 256
    # uint32 ids under metadata that says uint16 (K03): twice the bytes num_tokens gives.
    wrong_dtype = write_tokens(tmp_path / "k03.bin", ids, "<u4",
                               {"dtype": "uint16", "vocab_size": 256, "num_tokens": 50_000})
    check_error(wrong_dtype, 256, r"is 200,000 bytes, but .*k03.bin.json gives num_tokens 50,000 of uint16 "
                                  r"\(100,000 bytes\)", "truncated or its dtype is wrong")
    # A copy cut short (K13).
    cut = write_tokens(tmp_path / "k13.bin", ids[:30_000], meta={"dtype": "uint16", "vocab_size": 256,
                                                                 "num_tokens": 50_000})
    check_error(cut, 256, r"is 60,000 bytes, but .*k13.bin.json gives num_tokens 50,000")
    # A num_tokens that is not a count.
    token_meta_path(cut).write_text(json.dumps({"dtype": "uint16", "num_tokens": "many"}))
    with pytest.raises(ConfigError, match="has an invalid num_tokens: 'many'"):
        open_tokens(cut, 256)
    # The right count is accepted.
    token_meta_path(cut).write_text(json.dumps({"dtype": "uint16", "vocab_size": 256, "num_tokens": 30_000}))
    assert len(open_tokens(cut, 256)) == 30_000


def test_ids_must_be_below_the_metadata_vocab_and_the_model_vocab(tmp_path):
    # Ids up to 999 under metadata that says vocab_size 256 (K05): not a diverged loss, a wrong file.
    high = write_tokens(tmp_path / "k05.bin", np.arange(5000) % 1000, meta={"dtype": "uint16", "vocab_size": 256})
    check_error(high, 256, r"holds token id 999, but .*k05.bin.json gives vocab_size 256")
    # uint16 ids read as uint32 (K02): pairs of ids make ids far beyond the vocabulary.
    pairs = write_tokens(tmp_path / "k02.bin", np.arange(5000) % 200 + 1, meta={"dtype": "uint32", "vocab_size": 256})
    check_error(pairs, 256, r"holds token id \d{6,}, but .*k02.bin.json gives vocab_size 256", r"dtype \(uint32\)")
    # Without metadata, against the model's vocabulary.
    bare = write_tokens(tmp_path / "bare.bin", np.arange(5000) % 1000)
    check_error(bare, 256, r"--model.vocab-size must exceed every token id in --data.path \(found id 999 in ")
    assert int(open_tokens(bare, 1000).max()) == 999


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_the_chunked_scan_finds_the_largest_id_anywhere(tmp_path, monkeypatch, dtype):
    # 3 ids per chunk (uint16), 1 (uint32): the largest id in the first, a middle and the last, partial, chunk.
    monkeypatch.setattr(data, "SCAN_CHUNK_BYTES", 6)
    for where in (0, 7, 10):
        ids = np.zeros(11, np.int64)
        ids[where] = 70_000 if dtype == "uint32" else 60_000
        path = write_tokens(tmp_path / f"{dtype}_{where}.bin", ids, np.dtype(dtype).newbyteorder("<"),
                            {"dtype": dtype})
        assert data.max_token_id(path, dtype) == ids[where]


# -- the scan, once ---------------------------------------------------------------------------------------------


def counting_scan(monkeypatch) -> list:
    calls = []
    scan = data.scan_max_id

    def counted(*args):
        calls.append(args[0])
        return scan(*args)

    monkeypatch.setattr(data, "scan_max_id", counted)
    return calls


def test_a_bare_file_is_scanned_once_and_the_verdict_cached(tmp_path, monkeypatch):
    calls = counting_scan(monkeypatch)
    path = write_tokens(tmp_path / "bare.bin", np.arange(3000) % 250)
    config = DataConfig(source="tokens", path=path)
    assert len(load_tokens(config, 256, 0)) == 3000
    assert len(calls) == 1
    cache = json.loads(token_scan_path(path).read_text())
    stat = path.stat()
    assert cache["max_id"] == 249 and cache["size"] == stat.st_size and cache["mtime_ns"] == stat.st_mtime_ns
    assert cache["dtype"] == "uint16"
    load_tokens(config, 256, 0)  # a second start: the cached verdict
    with pytest.raises(ConfigError, match="found id 249"):
        load_tokens(config, 200, 0)  # the cached maximum is checked against each run's vocabulary
    assert len(calls) == 1
    # A rewritten file (other size and mtime) is scanned again, and its new ids are checked.
    write_tokens(path, np.arange(4000) % 300)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    with pytest.raises(ConfigError, match="found id 299"):
        load_tokens(config, 256, 0)
    assert len(calls) == 2
    # So is one read as another dtype (its metadata changed).
    token_meta_path(path).write_text(json.dumps({"dtype": "uint32"}))
    with pytest.raises(ConfigError, match="found id"):
        load_tokens(config, 256, 0)
    assert len(calls) == 3


def test_an_unwritable_cache_is_not_an_error(tmp_path, monkeypatch):
    calls = counting_scan(monkeypatch)
    path = write_tokens(tmp_path / "bare.bin", np.arange(3000) % 250)
    token_scan_path(path).mkdir()  # the cache cannot be written there (as a read-only folder would refuse it)
    for _ in range(2):
        assert len(open_tokens(path, 256)) == 3000
    assert len(calls) == 2  # scanned each time, nothing cached
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bare.bin", "bare.bin.scan.json"]  # no partial files


def test_a_damaged_cache_is_rescanned(tmp_path, monkeypatch):
    calls = counting_scan(monkeypatch)
    path = write_tokens(tmp_path / "bare.bin", np.arange(3000) % 250)
    open_tokens(path, 256)
    token_scan_path(path).write_text("{torn")
    open_tokens(path, 256)
    assert len(calls) == 2 and json.loads(token_scan_path(path).read_text())["max_id"] == 249


def _rss_peak_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM in /proc/self/status")


def test_the_scan_holds_one_chunk_in_memory(tmp_path, monkeypatch):
    """A 64 MiB file is checked with a 1 MiB chunk: the peak resident memory grows by far less than the file
    (through a memory map, every page read stays resident: the whole file)."""
    monkeypatch.setattr(data, "SCAN_CHUNK_BYTES", 1 << 20)
    path = tmp_path / "big.bin"
    with path.open("wb") as f:
        for i in range(32):
            np.full(1 << 20, i, "<u2").tofile(f)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak (VmHWM) to the current resident size
        before = _rss_peak_kib()
        tokens = open_tokens(path, 256)
        grown = _rss_peak_kib() - before
        assert len(tokens) == 32 << 20
        assert grown < 16 * 1024, f"peak resident memory grew by {grown} KiB for a 65,536 KiB file"
    finally:
        path.unlink()
