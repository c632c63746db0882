"""Real tokenized data: `python -m eqx_diloco.prepare` with a BPE tokenizer trained here (nothing is
downloaded), memory-mapped uint16/uint32 token files and folders with metadata, and training on them.
Corpus formats, shards, resuming and bad corpora: tests/test_corpus.py."""

import json
import os
import signal

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from eqx_diloco.lm import data, prepare
from eqx_diloco.lm.config import ConfigError, DataConfig
from eqx_diloco.lm._corpus_readers import Position, read_pieces
from eqx_diloco.lm.data import TokenBatches, corpus_bytes, load_tokens, token_scan_path
from eqx_diloco.lm.train import main as train_main
from util import read_metrics

VOCAB = 400
TEXT = corpus_bytes(12_000).decode("utf-8", errors="replace") + "\nnon-ASCII: naïve café 東京 ✓\n"


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory):
    """A byte-level BPE tokenizer trained on a few KB of the stdlib's source, saved as tokenizer.json."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([TEXT], trainer=trainer)
    assert tok.get_vocab_size() == VOCAB
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


def stream(out) -> np.ndarray:
    """The token stream of token folder `out`: its shards, concatenated in the order tokens.json lists them."""
    meta = json.loads((out / "tokens.json").read_text())
    dtype = {"uint16": "<u2", "uint32": "<u4"}[meta["dtype"]]
    return np.concatenate([np.fromfile(out / s["file"], dtype) for s in meta["shards"]])


def test_prepare_writes_uint16_ids_and_metadata(tmp_path, tokenizer_path, capsys):
    text = TEXT[:6000]  # under 8 KB: one piece, encoded as a whole
    assert len(text.encode()) < prepare.PIECE_BYTES
    text_file = tmp_path / "corpus.txt"
    text_file.write_text(text, encoding="utf-8")
    out = tmp_path / "data" / "tokens"
    assert prepare.main([str(text_file), str(out), "--tokenizer", str(tokenizer_path), "--chunk-mb", "100"]) == 0
    captured = capsys.readouterr()
    assert "tokenized" in captured.err and "100%" in captured.err and "1 documents" in captured.err  # progress
    assert f"--data.path {out}" in captured.out
    meta = json.loads((out / "tokens.json").read_text())
    tok = Tokenizer.from_file(str(tokenizer_path))
    eos = tok.token_to_id("<|endoftext|>")
    expected = tok.encode(text, add_special_tokens=False).ids + [eos]  # the tokenizer's own end-of-text
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == VOCAB and meta["num_tokens"] == len(expected)
    assert meta["eos_id"] == eos and meta["eos_token"] == "<|endoftext|>" and meta["num_documents"] == 1
    assert (out / "shard-00000.bin").stat().st_size == 2 * len(expected)
    assert stream(out).tolist() == expected  # one piece: exactly the tokenizer's encoding
    assert (out / "tokenizer.json").read_bytes() == tokenizer_path.read_bytes() and meta["tokenizer"] == "tokenizer.json"
    assert not list(out.glob("*.partial")) and not (out / "prepare-progress.json").exists()


def test_small_chunks_lose_nothing(tmp_path, tokenizer_path, text_file):
    out = tmp_path / "tokens"
    meta = prepare.prepare(text_file, out, tokenizer_path, chunk_bytes=300, eos="none")
    ids = stream(out)
    assert len(ids) == meta["num_tokens"] > 1000 and meta["eos_id"] is None
    assert Tokenizer.from_file(str(tokenizer_path)).decode(ids.tolist()) == TEXT  # byte-exact round trip


def test_text_pieces_cut_at_lines_and_never_inside_a_character(tmp_path):
    path = tmp_path / "t.txt"
    text = "ab cd\n" * 7 + "é" * 40 + "東京" * 30 + "\nend"
    path.write_text(text, encoding="utf-8")
    size = len(text.encode())
    for piece_bytes in (1, 3, 7, 16):
        pieces = list(read_pieces([(path, "text")], [size], Position(), text_field="text", piece_bytes=piece_bytes))
        assert "".join(p.text for p in pieces) == text
        assert pieces[-1].after.offset == size and [p.document_end for p in pieces].count(True) == 1
        assert pieces[-1].document_end and pieces[-1].after.line == text.count("\n") + 1
        if piece_bytes >= 3:  # a piece that holds a word is cut after a line or a word
            words = [p.text for p in pieces if set(p.text) <= set("ab cd\n")]
            assert len(words) >= 2 and all(t.endswith(("\n", " ")) for t in words)
        # Read again from any piece's end: the same pieces follow (what resuming relies on).
        middle = pieces[len(pieces) // 2].after
        again = list(read_pieces([(path, "text")], [size], middle, text_field="text", piece_bytes=piece_bytes))
        assert [p.text for p in again] == [p.text for p in pieces[len(pieces) // 2 + 1:]]


def test_folder_and_eos(tmp_path, tokenizer_path):
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text("def a():\n    return 1\n")
    (folder / "b.txt").write_text("def b():\n    return 2\n")
    out = tmp_path / "tokens"
    meta = prepare.prepare(folder, out, tokenizer_path, eos="<|endoftext|>")
    tok = Tokenizer.from_file(str(tokenizer_path))
    eos = tok.token_to_id("<|endoftext|>")
    ids = stream(out).tolist()
    assert ids.count(eos) == 2 and ids[-1] == eos and meta["num_tokens"] == len(ids)
    first = ids[: ids.index(eos)]
    assert tok.decode(first) == "def a():\n    return 1\n"


def test_large_vocabulary_writes_uint32(tmp_path, tokenizer_path):
    tok = Tokenizer.from_file(str(tokenizer_path))
    tok.add_tokens([f"<x{i}>" for i in range(66_000)])
    big = tmp_path / "big_tokenizer.json"
    tok.save(str(big))
    text = tmp_path / "t.txt"
    text.write_text("def f(): <x65999> <x0>\n")
    out = tmp_path / "tokens"
    meta = prepare.prepare(text, out, big)
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == VOCAB + 66_000
    ids = stream(out)
    assert tok.token_to_id("<x65999>") in ids.tolist() and int(ids.max()) > 65_535
    tokens = load_tokens(DataConfig(source="tokens", path=out), meta["vocab_size"], 0)
    assert tokens.dtype == np.uint32 and tokens.tolist() == ids.tolist()
    with pytest.raises(ConfigError, match=f"--model.vocab-size is 256 but {out}/tokens.json gives vocab_size 66400"):
        load_tokens(DataConfig(source="tokens", path=out), 256, 0)


def test_token_file_is_memory_mapped_and_batches_read_from_it(tmp_path):
    out = tmp_path / "ids.bin"
    ids = (np.arange(50_000) * 7919 % 70_000).astype("<u4")
    ids.tofile(out)
    (tmp_path / "ids.bin.json").write_text(json.dumps({"dtype": "uint32", "vocab_size": 70_000}))
    tokens = load_tokens(DataConfig(source="tokens", path=out), 70_000, 0)
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint32 and len(tokens) == 50_000
    batches = TokenBatches(tokens, num_replicas=2, batch_size=3, seq_len=8, eval_fraction=0.1, seed=0)
    assert isinstance(batches.train, np.memmap)
    b = batches.batch(5)
    assert b.dtype == np.int32 and b.shape == (2, 3, 9)
    # Every window is a contiguous run of the file.
    for window in b.reshape(-1, 9):
        start = int(np.flatnonzero(ids == window[0])[0])
        assert window.tolist() == ids[start : start + 9].astype(np.int64).tolist()
    e = batches.eval_batch(4)
    assert e.dtype == np.int32 and int(e.max()) < 70_000


def test_a_byte_size_not_a_multiple_of_the_dtype_is_an_error(tmp_path):
    out = tmp_path / "ids.bin"
    out.write_bytes(b"\x01\x00\x00\x00" * 100 + b"\x01\x00")  # 402 bytes of uint32
    (tmp_path / "ids.bin.json").write_text(json.dumps({"dtype": "uint32", "vocab_size": 10}))
    with pytest.raises(ConfigError, match="402 bytes, not a whole number of uint32 token ids"):
        load_tokens(DataConfig(source="tokens", path=out), 256, 0)
    (tmp_path / "ids.bin.json").unlink()  # without metadata: uint16, odd size
    out.write_bytes(b"\x01\x00" * 100 + b"\x01")
    with pytest.raises(ConfigError, match="201 bytes, not a whole number of uint16 token ids"):
        load_tokens(DataConfig(source="tokens", path=out), 256, 0)


def test_bad_metadata_is_an_error(tmp_path):
    out = tmp_path / "ids.bin"
    out.write_bytes(b"\x01\x00" * 100)
    (tmp_path / "ids.bin.json").write_text(json.dumps({"dtype": "int8"}))
    with pytest.raises(ConfigError, match='must give "dtype": "uint16" or "uint32"'):
        load_tokens(DataConfig(source="tokens", path=out), 256, 0)
    (tmp_path / "ids.bin.json").write_text("{not json")
    with pytest.raises(ConfigError, match="is not readable JSON"):
        load_tokens(DataConfig(source="tokens", path=out), 256, 0)


@pytest.mark.slow
def test_train_three_steps_on_prepared_tokens(tmp_path, tokenizer_path, text_file, capsys):
    out = tmp_path / "tokens"
    assert prepare.main([str(text_file), str(out), "--tokenizer", str(tokenizer_path), "--shard-mb", "0.001"]) == 0
    assert len(list(out.glob("shard-*.bin"))) > 5  # training windows cross shard boundaries
    run = tmp_path / "run"
    args = ["--model.num-layers", "2", "--model.dim", "32", "--model.num-heads", "2", "--train.seq-len", "16",
            "--train.batch-size", "4", "--checkpoint.every", "0", "--train.steps", "3", "--train.log-every", "1",
            "--train.eval-sequences", "4", "--diloco.sync-period", "3", "--data.source", "tokens", "--data.path", str(out),
            "--run-dir", str(run)]
    capsys.readouterr()
    assert train_main([*args, "--model.vocab-size", "256"]) == 2  # the tokenizer has 400 ids
    err = capsys.readouterr().err
    assert err.startswith(f"error: --model.vocab-size is 256 but {out}/tokens.json") and "--model.vocab-size 400" in err
    assert err.count("\n") == 1
    assert train_main(args) == 0  # no --model.vocab-size: the tokenizer's, from tokens.bin.json
    assert f"vocab        {VOCAB}, the vocab_size of {out}/tokens.json" in capsys.readouterr().out
    assert json.loads((run / "config.json").read_text())["model"]["vocab_size"] == VOCAB
    records = read_metrics(run)
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    assert len(evals) == 2 and all(np.isfinite(evals)) and evals[-1] < np.log(VOCAB) + 1
    assert [r["sent_bytes"] for r in records if "loss" in r][-1] > 0  # the replicas synced at step 3


@pytest.mark.parametrize("case,message", [
    ("no_text", "TEXT_PATH does not exist"),
    ("no_tokenizer", "--tokenizer does not exist"),
    ("bad_tokenizer", "is not a tokenizers JSON file"),
    ("bad_eos", "--eos '<nope>' is not a token"),
    ("empty", "holds no text to tokenize"),
])
def test_prepare_errors_are_one_line(tmp_path, tokenizer_path, text_file, capsys, case, message):
    text, tok, extra = text_file, tokenizer_path, []
    if case == "no_text":
        text = tmp_path / "missing.txt"
    elif case == "no_tokenizer":
        tok = tmp_path / "missing.json"
    elif case == "bad_tokenizer":
        tok = tmp_path / "bad.json"
        tok.write_text('{"not": "a tokenizer"}')
    elif case == "bad_eos":
        extra = ["--eos", "<nope>"]
    elif case == "empty":
        text = tmp_path / "empty.txt"
        text.write_text("")
    out = tmp_path / "tokens"
    assert prepare.main([str(text), str(out), "--tokenizer", str(tok), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and message in err[-1], err
    assert not out.exists()


def test_prepare_records_the_largest_id_so_training_does_not_scan(tmp_path, tokenizer_path, text_file, monkeypatch):
    out = tmp_path / "tokens"
    prepare.prepare(text_file, out, tokenizer_path, eos="<|endoftext|>", shard_bytes=2000)
    ids = stream(out)
    shards = sorted(out.glob("shard-*.bin"))
    assert len(shards) > 2
    for shard in shards:
        assert json.loads(token_scan_path(shard).read_text())["max_id"] == int(np.fromfile(shard, "<u2").max())
    monkeypatch.setattr(data, "scan_max_id", lambda *args: pytest.fail("scanned a file prepare had described"))
    assert len(load_tokens(DataConfig(source="tokens", path=out), VOCAB, 0)) == len(ids)


def run_prepare(capsys, text, out, tokenizer_path, *extra) -> str:
    """The one-line error of a refused `prepare` (exit code 2)."""
    assert prepare.main([str(text), str(out), "--tokenizer", str(tokenizer_path), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_out_may_not_be_or_lie_inside_the_input(tmp_path, tokenizer_path, text_file, capsys):
    before = text_file.read_bytes()
    # The same file, also spelled another way and through a link: OUT names a folder, and is a file.
    assert f"OUT is a file: {text_file}" in run_prepare(capsys, text_file, text_file, tokenizer_path)
    out = tmp_path / "sub" / ".." / text_file.name  # no folder sub: the path does not exist as spelled
    assert f"OUT {out} is TEXT_PATH {text_file}" in run_prepare(capsys, text_file, out, tokenizer_path)
    link = tmp_path / "link.bin"
    link.symlink_to(text_file)
    assert "OUT is a file" in run_prepare(capsys, text_file, link, tokenizer_path)
    assert text_file.read_bytes() == before
    # Inside a TEXT_PATH folder: the next run would read the ids as text.
    folder = tmp_path / "texts"
    (folder / "deeper").mkdir(parents=True)
    (folder / "a.txt").write_text("def a():\n")
    for out in (folder, folder / "tokens", folder / "deeper" / "tokens"):
        err = run_prepare(capsys, folder, out, tokenizer_path)
        assert f"OUT {out} is{'' if out == folder else ' inside'} TEXT_PATH {folder}" in err
    # TEXT_PATH inside OUT: a file of the folder being written.
    err = run_prepare(capsys, folder / "a.txt", folder, tokenizer_path)
    assert f"TEXT_PATH {folder / 'a.txt'} is inside OUT {folder}" in err
    assert sorted(p.name for p in folder.rglob("*")) == ["a.txt", "deeper"]


def test_non_regular_inputs_are_refused_not_read(tmp_path, tokenizer_path, capsys):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)

    def hung(signum, frame):
        raise AssertionError("prepare blocked on its input")

    # Reading a FIFO without a writer, or /dev/zero, never ends: fail the test instead of hanging it.
    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(30)
    try:
        for text in (fifo, "/dev/zero"):
            err = run_prepare(capsys, text, tmp_path / "tokens.bin", tokenizer_path)
            assert f"TEXT_PATH must be a regular file or a folder (not a device, FIFO or socket): {text}" in err
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert not (tmp_path / "tokens.bin").exists()


def test_unwritable_and_folder_outputs_and_bad_sizes(tmp_path, tokenizer_path, text_file, capsys):
    folder = tmp_path / "outdir"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    assert f"OUT {folder} is a folder holding other files" in run_prepare(capsys, text_file, folder, tokenizer_path)
    assert [p.name for p in folder.iterdir()] == ["notes.txt"]
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    err = run_prepare(capsys, text_file, blocker / "tokens", tokenizer_path)  # its folder cannot be made
    assert f"cannot write OUT: {blocker}" in err
    for value in ("nan", "0", "-1", "inf", "1e9"):
        assert f"--chunk-mb must be > 0 and <= 1024 (got {float(value)})" in run_prepare(
            capsys, text_file, tmp_path / "t", tokenizer_path, "--chunk-mb", value)
    for value in ("nan", "0", "-1", "inf"):
        assert f"--shard-mb must be >= 0.001 and <= 1048576 (got {float(value)})" in run_prepare(
            capsys, text_file, tmp_path / "t", tokenizer_path, "--shard-mb", value)
    for value in ("0", "-2", "5000"):
        assert f"--threads must be >= 1 and <= 1024 (got {value})" in run_prepare(
            capsys, text_file, tmp_path / "t", tokenizer_path, "--threads", value)
    assert not (tmp_path / "t").exists()
    # An empty folder is a fine OUT.
    empty = tmp_path / "empty"
    empty.mkdir()
    assert prepare.main([str(text_file), str(empty), "--tokenizer", str(tokenizer_path)]) == 0
    assert (empty / "tokens.json").is_file()
