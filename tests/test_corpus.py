"""Corpora as they ship: `prepare` on jsonl, parquet and text (files and folders of shards), the end-of-text id
between documents, bounded shards read back by the trainer as one stream, resuming an interrupted run, the
one-line refusals of bad corpora, and `sample` printing text with the tokens' tokenizer."""

import gzip
import json
import re
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from eqx_diloco.lm import prepare
from eqx_diloco.lm.config import ConfigError, DataConfig
from eqx_diloco.lm.data import TokenBatches, corpus_bytes, load_tokens, read_token_meta
from eqx_diloco.lm.token_shards import ShardedTokens, tokenizer_for_tokens

VOCAB = 300
SOURCE = corpus_bytes(20_000).decode("utf-8", errors="replace")
DOCUMENTS = [SOURCE[i : i + 700 + (i % 5) * 90] for i in range(0, 18_000, 1_000)] + ["naïve café 東京 ✓"]


def train_tokenizer(path, special_tokens=("<|endoftext|>",)):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=list(special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([SOURCE], trainer=trainer)
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory):
    return train_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")


@pytest.fixture(scope="module")
def tok(tokenizer_path):
    return Tokenizer.from_file(str(tokenizer_path))


def expected_stream(tok, documents) -> list[int]:
    eos = tok.token_to_id("<|endoftext|>")
    return [i for d in documents for i in tok.encode(d, add_special_tokens=False).ids + [eos]]


def stream(out) -> np.ndarray:
    meta = json.loads((out / "tokens.json").read_text())
    dtype = {"uint16": "<u2", "uint32": "<u4"}[meta["dtype"]]
    return np.concatenate([np.fromfile(out / s["file"], dtype) for s in meta["shards"]])


def write_jsonl(path, rows, compress=False):
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    path.write_bytes(gzip.compress(data) if compress else data)
    return path


def write_parquet(path, columns, row_group_size=5):
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
    return path


def refused(capsys, *args) -> str:
    """The one `error:` line of a `prepare` that exits 2."""
    assert prepare.main([str(a) for a in args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


# -- formats ----------------------------------------------------------------------------------------------


def test_jsonl_gz_and_parquet_folders_give_each_document_then_end_of_text(tmp_path, tokenizer_path, tok):
    docs = DOCUMENTS
    # jsonl: one file, a gzipped file, and a FineWeb-style folder of parquet shards (a README beside them).
    write_jsonl(tmp_path / "c.jsonl", [{"id": i, "text": d} for i, d in enumerate(docs)])
    write_jsonl(tmp_path / "c.jsonl.gz", [{"text": d} for d in docs], compress=True)
    fineweb = tmp_path / "fineweb" / "data" / "CC-MAIN-2024"
    fineweb.mkdir(parents=True)
    write_parquet(fineweb / "000_00000.parquet", {"text": docs[:7], "url": ["u"] * 7})
    write_parquet(fineweb / "000_00001.parquet", {"text": docs[7:], "url": ["u"] * (len(docs) - 7)})
    (tmp_path / "fineweb" / "README.md").write_text("# a dataset card, not a document\n")
    (tmp_path / "fineweb" / ".cache").mkdir()
    (tmp_path / "fineweb" / ".cache" / "x.parquet").write_text("hidden: never read")
    expected = expected_stream(tok, docs)
    for source in (tmp_path / "c.jsonl", tmp_path / "c.jsonl.gz", tmp_path / "fineweb"):
        out = tmp_path / f"out-{source.name}"
        meta = prepare.prepare(source, out, tokenizer_path, shard_bytes=1000)
        assert stream(out).tolist() == expected, source
        assert meta["num_documents"] == len(docs) and meta["num_tokens"] == len(expected)
        assert meta["eos_id"] == tok.token_to_id("<|endoftext|>") and meta["eos_rule"].startswith("the tokenizer's own")
        assert len(meta["shards"]) == -(-len(expected) // 500)
        assert all(s["num_tokens"] == 500 for s in meta["shards"][:-1])  # 1000 bytes = 500 uint16 ids each
        assert all((out / s["file"]).stat().st_size <= 1000 for s in meta["shards"])


def test_text_field_picks_the_column(tmp_path, tokenizer_path, tok):
    write_jsonl(tmp_path / "c.jsonl", [{"text": "not this", "content": d} for d in DOCUMENTS[:3]])
    prepare.prepare(tmp_path / "c.jsonl", tmp_path / "out", tokenizer_path, text_field="content")
    assert stream(tmp_path / "out").tolist() == expected_stream(tok, DOCUMENTS[:3])


def test_end_of_text_rules(tmp_path, tok):
    # A Hugging Face folder's tokenizer_config.json names the eos token; without one, a known name; without any,
    # the id one past the vocabulary, counted in vocab_size.
    folder = tmp_path / "hf"
    folder.mkdir()
    path = train_tokenizer(folder / "tokenizer.json", special_tokens=("<pad>", "</s>", "<|endoftext|>"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    text = tmp_path / "t.txt"
    text.write_text("def f():\n    return 1\n")
    meta = prepare.prepare(text, tmp_path / "a", path)
    assert (meta["eos_id"], meta["eos_token"], meta["eos_rule"]) == (1, "</s>", "eos_token of tokenizer_config.json")
    (folder / "tokenizer_config.json").unlink()
    assert prepare.prepare(text, tmp_path / "b", path)["eos_token"] == "<|endoftext|>"
    plain = train_tokenizer(tmp_path / "plain.json", special_tokens=())
    meta = prepare.prepare(text, tmp_path / "c", plain)
    assert meta["eos_id"] == VOCAB and meta["vocab_size"] == VOCAB + 1 and meta["eos_token"] is None
    assert stream(tmp_path / "c").tolist()[-1] == VOCAB and "one past" in meta["eos_rule"]
    meta = prepare.prepare(text, tmp_path / "d", plain, eos="none")
    assert meta["eos_id"] is None and meta["vocab_size"] == VOCAB and VOCAB not in stream(tmp_path / "d")


def test_threads_flag_sets_the_tokenizers_thread_count(tmp_path, tokenizer_path, monkeypatch):
    monkeypatch.delenv("RAYON_NUM_THREADS", raising=False)
    text = tmp_path / "t.txt"
    text.write_text("x = 1\n")
    prepare.prepare(text, tmp_path / "one", tokenizer_path, threads=1)
    assert os.environ["RAYON_NUM_THREADS"] == "1" and os.environ["TOKENIZERS_PARALLELISM"] == "false"
    prepare.prepare(text, tmp_path / "two", tokenizer_path, threads=2)
    assert os.environ["RAYON_NUM_THREADS"] == "2" and os.environ["TOKENIZERS_PARALLELISM"] == "true"


# -- the trainer reads the shard folder -------------------------------------------------------------------


def test_training_reads_the_shards_as_one_stream_across_boundaries(tmp_path, tokenizer_path, tok):
    write_jsonl(tmp_path / "c.jsonl", [{"text": d} for d in DOCUMENTS])
    out = tmp_path / "out"
    meta = prepare.prepare(tmp_path / "c.jsonl", out, tokenizer_path, shard_bytes=202)  # 101 tokens a shard
    assert len(meta["shards"]) > 20
    whole = stream(out)
    tokens = load_tokens(DataConfig(source="tokens", path=out), VOCAB, 0)
    assert isinstance(tokens, ShardedTokens) and len(tokens) == len(whole) and tokens.dtype == np.uint16
    assert np.asarray(tokens).tolist() == whole.tolist()
    assert tokens[5] == whole[5] and tokens[-1] == whole[-1] and tokens[100:103].shape == (3,)
    assert np.asarray(tokens[99:205]).tolist() == whole[99:205].tolist()  # a slice over two boundaries
    batches = TokenBatches(tokens, num_replicas=2, batch_size=8, seq_len=64, eval_fraction=0.1, seed=3)
    reference = TokenBatches(whole, num_replicas=2, batch_size=8, seq_len=64, eval_fraction=0.1, seed=3)
    # Windows of 65 tokens over shards of 101: about two in three cross a boundary.
    windows = np.arange(90, 300)[:, None] + np.arange(65)
    assert np.array_equal(tokens[windows], whole[windows])
    for step in range(6):  # the same windows as from the concatenated array
        got, want = batches.batch(step), reference.batch(step)
        assert got.dtype == np.int32 and np.array_equal(got, want)
    assert np.array_equal(batches.eval_batch(5), reference.eval_batch(5))
    assert read_token_meta(out)["vocab_size"] == VOCAB


def test_sharded_tokens_index_like_the_concatenated_array():
    shards = [np.arange(5, dtype=np.uint16), np.arange(5, 12, dtype=np.uint16), np.arange(12, 15, dtype=np.uint16)]
    tokens, whole = ShardedTokens(shards), np.arange(15, dtype=np.uint16)
    for i in range(16):
        for j in range(i, 16):  # every slice, boundaries included, and a slice of a slice
            part = tokens[i:j]
            assert len(part) == j - i and np.asarray(part).tolist() == whole[i:j].tolist()
            if j > i:
                assert part.max() == whole[i:j].max() and part[-1] == whole[j - 1]
                assert part[np.array([[0, j - i - 1]])].tolist() == [[i, j - 1]]
    assert tokens[3:10][2:5][np.array([0, 2])].tolist() == [5, 7]
    for bad in (15, -16):
        with pytest.raises(IndexError):
            tokens[bad]
    with pytest.raises(IndexError):
        tokens[np.array([0, 15])]


def test_a_damaged_or_unfinished_folder_is_refused_in_one_line(tmp_path, tokenizer_path):
    write_jsonl(tmp_path / "c.jsonl", [{"text": d} for d in DOCUMENTS])
    out = tmp_path / "out"
    meta = prepare.prepare(tmp_path / "c.jsonl", out, tokenizer_path, shard_bytes=2000)
    config = DataConfig(source="tokens", path=out)
    with pytest.raises(ConfigError, match=r"--model.vocab-size is 200 but .*tokens.json gives vocab_size 300"):
        load_tokens(config, 200, 0)
    shard = out / meta["shards"][1]["file"]
    data = shard.read_bytes()
    shard.write_bytes(data[:-2])
    with pytest.raises(ConfigError, match=f"shard {shard} is {len(data) - 2:,} bytes, but .* gives it"):
        load_tokens(config, VOCAB, 0)
    shard.write_bytes(data[:-2] + np.array([VOCAB + 5], "<u2").tobytes())  # an id beyond the vocabulary
    with pytest.raises(ConfigError, match=f"shard {shard} holds token id {VOCAB + 5}"):
        load_tokens(config, 4096, 0)
    (out / "tokens.json").unlink()
    with pytest.raises(ConfigError, match="is a folder without tokens.json"):
        load_tokens(config, VOCAB, 0)
    (out / "prepare-progress.json").write_text("{}")
    with pytest.raises(ConfigError, match="is an unfinished prepare"):
        load_tokens(config, VOCAB, 0)


# -- resuming ---------------------------------------------------------------------------------------------


class Interrupt(Exception):
    pass


def interrupted_after(shards, out):
    """A progress callback that interrupts the run once `shards` shards are in place."""

    def progress(*_):
        if len(list(out.glob("shard-*.bin"))) >= shards:
            raise Interrupt

    return progress


@pytest.mark.parametrize("fmt", ["text", "jsonl", "jsonl.gz", "parquet"])
def test_an_interrupted_run_continues_to_the_same_tokens(tmp_path, tokenizer_path, fmt):
    source = tmp_path / "src"
    source.mkdir()
    for k in range(3):
        part = DOCUMENTS[k * 6 : (k + 1) * 6]
        if fmt == "text":
            for i, d in enumerate(part):
                (source / f"{k}-{i}.txt").write_text(d)
        elif fmt.startswith("jsonl"):
            write_jsonl(source / f"{k}.{fmt}", [{"text": d} for d in part], compress=fmt.endswith(".gz"))
        else:
            write_parquet(source / f"{k}.parquet", {"text": part}, row_group_size=2)
    options = dict(shard_bytes=1000, chunk_bytes=900)
    reference = prepare.prepare(source, tmp_path / "whole", tokenizer_path, **options)
    out = tmp_path / "out"
    with pytest.raises(Interrupt):
        prepare.prepare(source, out, tokenizer_path, progress=interrupted_after(3, out), **options)
    assert not (out / "tokens.json").exists() and (out / "prepare-progress.json").exists()
    kept = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*.bin")}
    assert len(kept) >= 3
    # Resumed with another batch size: the stream from the recorded position is the same however it is batched.
    meta = prepare.prepare(source, out, tokenizer_path, shard_bytes=1000, chunk_bytes=50)
    assert meta["resumed_shards"] == len(kept)
    assert all((out / name).stat().st_mtime_ns == t for name, t in kept.items())  # kept, not written again
    assert stream(out).tolist() == stream(tmp_path / "whole").tolist()
    assert meta["num_documents"] == reference["num_documents"] and meta["shards"] == reference["shards"]
    assert not (out / "prepare-progress.json").exists() and not list(out.glob("*.partial"))


def test_a_damaged_kept_shard_is_written_again(tmp_path, tokenizer_path, capsys):
    write_jsonl(tmp_path / "c.jsonl", [{"text": d} for d in DOCUMENTS])
    whole = prepare.prepare(tmp_path / "c.jsonl", tmp_path / "whole", tokenizer_path, shard_bytes=1000)
    out = tmp_path / "out"
    with pytest.raises(Interrupt):
        prepare.prepare(tmp_path / "c.jsonl", out, tokenizer_path, shard_bytes=1000, progress=interrupted_after(4, out))
    second = out / "shard-00001.bin"
    data = bytearray(second.read_bytes())
    data[10] ^= 0xFF  # same size, one flipped byte: only the CRC-32C sees it
    second.write_bytes(bytes(data))
    (out / "shard-00003.bin.partial").write_bytes(b"\x00" * 7)  # a shard a kill left half-written
    argv = [str(tmp_path / "c.jsonl"), str(out), "--tokenizer", str(tokenizer_path), "--shard-mb", "0.001"]
    assert prepare.main(argv) == 0
    assert "kept 1 shards of an interrupted run" in capsys.readouterr().out
    assert stream(out).tolist() == stream(tmp_path / "whole").tolist()
    assert json.loads((out / "tokens.json").read_text())["shards"] == whole["shards"]
    # Once complete, the same command has nothing to do; other options are refused rather than mixed in.
    assert prepare.main(argv) == 0 and "is complete already" in capsys.readouterr().out
    err = refused(capsys, *argv[:-1], "0.002")
    assert f"OUT {out} holds a finished token folder of other inputs or options" in err


def test_a_run_stopped_before_its_first_shard_starts_again(tmp_path, tokenizer_path):
    write_jsonl(tmp_path / "c.jsonl", [{"text": d} for d in DOCUMENTS])
    prepare.prepare(tmp_path / "c.jsonl", tmp_path / "whole", tokenizer_path)
    out = tmp_path / "out"
    with pytest.raises(Interrupt):  # at the first batch, inside the first (and only) shard
        prepare.prepare(tmp_path / "c.jsonl", out, tokenizer_path, chunk_bytes=2000, progress=interrupted_after(0, out))
    assert sorted(p.name for p in out.iterdir()) == ["prepare-progress.json", "tokenizer.json"]
    meta = prepare.prepare(tmp_path / "c.jsonl", out, tokenizer_path)
    assert meta["resumed_shards"] == 0 and stream(out).tolist() == stream(tmp_path / "whole").tolist()


def test_an_unfinished_run_of_other_options_is_not_continued(tmp_path, tokenizer_path, capsys):
    write_jsonl(tmp_path / "c.jsonl", [{"text": d} for d in DOCUMENTS])
    out = tmp_path / "out"
    with pytest.raises(Interrupt):
        prepare.prepare(tmp_path / "c.jsonl", out, tokenizer_path, shard_bytes=1000, progress=interrupted_after(2, out))
    err = refused(capsys, tmp_path / "c.jsonl", out, "--tokenizer", tokenizer_path, "--text-field", "body")
    assert f"OUT {out} holds an unfinished prepare of other inputs or options (shard_tokens, text_field differ)" in err
    (out / "prepare-progress.json").write_text("{garbage")
    assert "prepare-progress.json is damaged" in refused(capsys, tmp_path / "c.jsonl", out, "--tokenizer",
                                                          tokenizer_path)


@pytest.mark.slow
def test_a_killed_prepare_resumes_through_the_command(tmp_path, tokenizer_path):
    """SIGKILL mid-run (no handler runs), then the same command: the tokens equal an uninterrupted run's."""
    text = tmp_path / "big.txt"
    text.write_text(SOURCE * 60)  # ~1.2 MB
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    command = [sys.executable, "-m", "eqx_diloco.prepare", str(text), "OUT", "--tokenizer", str(tokenizer_path),
               "--shard-mb", "0.02", "--chunk-mb", "0.05", "--threads", "1"]
    subprocess.run([*command[:4], str(tmp_path / "whole"), *command[5:]], env=env, check=True, capture_output=True)
    out = tmp_path / "out"
    command[4] = str(out)
    child = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while len(list(out.glob("shard-*.bin"))) < 3 and time.monotonic() < deadline and child.poll() is None:
        time.sleep(0.005)
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert not (out / "tokens.json").exists(), "the run ended before the kill: make the text longer"
    with pytest.raises(ConfigError, match="unfinished prepare"):
        load_tokens(DataConfig(source="tokens", path=out), VOCAB, 0)
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "of an interrupted run" in done.stdout
    assert stream(out).tolist() == stream(tmp_path / "whole").tolist()


# -- bad corpora: one line naming the file and the row ------------------------------------------------------


def test_bad_corpora_are_one_line_naming_the_file_and_row(tmp_path, tokenizer_path, capsys):
    tok = ["--tokenizer", tokenizer_path]

    def jsonl(name, lines):
        path = tmp_path / name
        path.write_bytes(b"".join(lines))
        return path

    good = b'{"text": "fine"}\n'
    cases = [
        (jsonl("missing.jsonl", [good, b'{"body": "x", "id": 3}\n']),
         "missing.jsonl line 2 has no field 'text' (its fields: body, id; choose one with --text-field)"),
        (jsonl("bytes.jsonl", [good, good, b'{"text": "caf\xe9"}\n']), "bytes.jsonl line 3 is not UTF-8: b'\\xe9\"}\\n'"),
        (jsonl("notjson.jsonl", [good, b"{text: 1}\n"]), "notjson.jsonl line 2 is not JSON: Expecting property name"),
        (jsonl("surrogate.jsonl", [good, good, good, b'{"text": "a\\ud800b"}\n']),
         "surrogate.jsonl line 4 is not UTF-8: its text holds '\\ud800' (a lone surrogate)"),
        (jsonl("list.jsonl", [b"[1, 2]\n"]), "list.jsonl line 1 is a JSON list, not an object with a 'text' field"),
        (jsonl("mixed.jsonl", [good, b'{"text": 12}\n']), "mixed.jsonl line 2: field 'text' is a JSON int, not a string"),
        (jsonl("empty.jsonl", [b"\n"]), "empty.jsonl holds no documents (an empty jsonl shard)"),
    ]
    text = tmp_path / "latin1.txt"
    text.write_bytes(b"line one\nline two\nd\xe9j\xe0 vu\n")
    cases.append((text, "latin1.txt line 3 (byte 19) is not UTF-8: b'\\xe9j\\xe0 '"))
    write_parquet(tmp_path / "nocol.parquet", {"body": ["x"]})
    cases.append((tmp_path / "nocol.parquet", "nocol.parquet has no column 'text' (its columns: body;"))
    write_parquet(tmp_path / "ints.parquet", {"text": [1, 2]})
    cases.append((tmp_path / "ints.parquet", "ints.parquet: column 'text' is int64, not a string column"))
    invalid = pa.array([b"ok", b"fine", b"caf\xe9"], pa.binary()).view(pa.string())  # a writer that never checked
    pq.write_table(pa.table({"text": invalid}), tmp_path / "bytes.parquet")
    cases.append((tmp_path / "bytes.parquet", "bytes.parquet row 3 is not UTF-8: b'\\xe9'"))
    write_parquet(tmp_path / "nulls.parquet", {"text": ["a", "b", None, "d"]}, row_group_size=2)
    cases.append((tmp_path / "nulls.parquet", "nulls.parquet row 3: 'text' is null"))
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "empty.parquet")
    cases.append((tmp_path / "empty.parquet", "empty.parquet holds no documents (an empty parquet shard)"))
    (tmp_path / "junk.parquet").write_bytes(b"PAR1 not really")
    cases.append((tmp_path / "junk.parquet", "junk.parquet is not a readable parquet file"))
    # Mixed schemas across the shards of one folder: the second file's column is not text.
    folder = tmp_path / "shards"
    folder.mkdir()
    write_parquet(folder / "a.parquet", {"text": DOCUMENTS})  # more than one shard: refused before it is written
    write_parquet(folder / "b.parquet", {"text": [3, 4]})
    cases.append((folder, "b.parquet: column 'text' is int64, not a string column"))
    both = tmp_path / "both"
    both.mkdir()
    write_parquet(both / "a.parquet", {"text": ["one"]})
    write_jsonl(both / "b.jsonl", [{"text": "two"}])
    cases.append((both, f"TEXT_PATH {both} mixes formats: {both / 'b.jsonl'} is jsonl, {both / 'a.parquet'} is parquet"))
    for source, message in cases:
        out = tmp_path / f"out-{source.name}"
        err = refused(capsys, source, out, *tok, "--shard-mb", "0.001")
        assert message in err, (message, err)
        assert not out.exists()  # a run that completed no shard leaves nothing behind


def test_np01_a_text_path_named_like_a_scan_cache_is_never_overwritten(tmp_path, tokenizer_path, capsys):
    """`prepare DATA/t.bin.scan.json DATA/t.bin` replaced the text by the scan cache and exited 0 (NP01)."""
    text = tmp_path / "t.bin.scan.json"
    text.write_text(SOURCE)
    out = tmp_path / "t.bin"
    code = prepare.main([str(text), str(out), "--tokenizer", str(tokenizer_path)])
    capsys.readouterr()
    assert text.read_text() == SOURCE
    assert code == 0 and (out / "tokens.json").is_file()  # a token folder: nothing is written beside it
    assert len(load_tokens(DataConfig(source="tokens", path=out), VOCAB, 0)) > 0
    # With an earlier token file at OUT, the refusal is one line and the text is still whole.
    out.rename(tmp_path / "elsewhere")
    out.write_bytes(b"\x01\x00" * 10)
    assert f"OUT is a file: {out}" in refused(capsys, text, out, "--tokenizer", tokenizer_path)
    assert text.read_text() == SOURCE and out.read_bytes() == b"\x01\x00" * 10


def test_np14_out_is_never_left_without_its_metadata(tmp_path, tokenizer_path, capsys):
    """With `OUT.json` a folder, OUT was written and then left without metadata (NP14)."""
    text = tmp_path / "t.txt"
    text.write_text(SOURCE)
    out = tmp_path / "np14.bin"
    (tmp_path / "np14.bin.json").mkdir()
    code = prepare.main([str(text), str(out), "--tokenizer", str(tokenizer_path)])
    capsys.readouterr()
    assert code == 0 and (out / "tokens.json").is_file()  # complete, with its metadata (inside OUT)
    # Where prepare writes its metadata is a folder: one line, and nothing else written.
    other = tmp_path / "other"
    (other / "tokens.json").mkdir(parents=True)
    assert f"OUT/tokens.json is a folder: {other / 'tokens.json'}" in refused(capsys, text, other, "--tokenizer",
                                                                             tokenizer_path)
    assert [p.name for p in other.iterdir()] == ["tokens.json"]


# -- the tokenizer beside the tokens, and sample ----------------------------------------------------------


def test_tokenizer_for_tokens(tmp_path, tokenizer_path, tok):
    text = tmp_path / "t.txt"
    text.write_text("def f():\n    return 1\n")
    prepare.prepare(text, tmp_path / "out", tokenizer_path)
    found = tokenizer_for_tokens(tmp_path / "out")
    assert found is not None and found.to_str() == tok.to_str()
    # A single token file whose metadata names the tokenizer file (as earlier prepares wrote), and a bare one.
    legacy = tmp_path / "legacy.bin"
    np.array([1, 2], "<u2").tofile(legacy)
    (tmp_path / "legacy.bin.json").write_text(json.dumps({"dtype": "uint16", "tokenizer": str(tokenizer_path)}))
    assert tokenizer_for_tokens(legacy).to_str() == tok.to_str()
    (tmp_path / "legacy.bin.json").unlink()
    assert tokenizer_for_tokens(legacy) is None
    (tmp_path / "out" / "tokenizer.json").write_text("{broken")
    with pytest.raises(ConfigError, match="the tokenizer of .*out, .*tokenizer.json, cannot be read"):
        tokenizer_for_tokens(tmp_path / "out")


def test_sample_finds_the_tokenizer_of_its_runs_tokens(tmp_path, tokenizer_path, tok):
    from eqx_diloco._json import to_jsonable
    from eqx_diloco.lm.config import Config
    from eqx_diloco.lm.sample import find_tokenizer

    text = tmp_path / "t.txt"
    text.write_text("x = 1\n")
    tokens = tmp_path / "tokens"
    prepare.prepare(text, tokens, tokenizer_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(to_jsonable(Config(data=DataConfig(source="tokens", path=tokens)))))
    info = {"run_dir": str(run), "data_source": "tokens"}
    assert find_tokenizer(info, None).to_str() == tok.to_str()
    assert find_tokenizer({**info, "data_source": "corpus"}, None) is None  # byte-level: no tokenizer
    assert find_tokenizer({"data_source": "tokens", "run_dir": str(tmp_path / "gone")}, None) is None
    for flag in (tokenizer_path, tokens):
        assert find_tokenizer({}, flag).to_str() == tok.to_str()
    for flag, message in ((tmp_path / "nothing", "is neither a tokenizer.json nor tokens that name one"),
                          (text, "is not a tokenizers JSON file")):
        with pytest.raises(ConfigError, match=f"--tokenizer {flag} {message}"):
            find_tokenizer({}, flag)


@pytest.mark.slow
def test_sample_prints_text_with_the_runs_tokenizer(tmp_path, tokenizer_path, tok, capsys):
    import jax

    from eqx_diloco._json import to_jsonable
    from eqx_diloco.lm import sample
    from eqx_diloco.lm.config import Config
    from eqx_diloco.lm.export import save_model
    from models import Transformer, TransformerConfig

    text = tmp_path / "t.txt"
    text.write_text(SOURCE[:3000])
    tokens = tmp_path / "tokens"
    prepare.prepare(text, tokens, tokenizer_path)
    model_config = TransformerConfig(num_layers=1, dim=16, num_heads=2, mlp_ratio=2, vocab_size=VOCAB)
    run = tmp_path / "run"
    run.mkdir()
    config = Config(model=model_config, data=DataConfig(source="tokens", path=tokens))
    (run / "config.json").write_text(json.dumps(to_jsonable(config)))
    model = Transformer(model_config, key=jax.random.key(0))
    save_model(tmp_path / "m.eqx", model, {"seq_len": 16, "run_dir": str(run), "data_source": "tokens"})
    prompt = "def main():\n"
    prompt_ids = tok.encode(prompt, add_special_tokens=False).ids
    generated = sample.generate(model, prompt_ids, 12, temperature=0.0, context=16)
    args = [str(tmp_path / "m.eqx"), "--prompt", prompt, "--max-new-tokens", "12", "--temperature", "0"]
    assert sample.main(args) == 0
    expected = prompt + tok.decode([int(t) for t in generated], skip_special_tokens=False) + "\n"
    assert capsys.readouterr().out == expected
    # --tokenizer names it directly (a tokenizer.json, or the token folder); without any, ids as before.
    for flag in (tokenizer_path, tokens):
        assert sample.main([*args, "--tokenizer", str(flag)]) == 0
        assert capsys.readouterr().out == expected
    save_model(tmp_path / "bare.eqx", model, {"seq_len": 16})
    assert sample.main([str(tmp_path / "bare.eqx"), "--prompt", " ".join(map(str, prompt_ids)), "--max-new-tokens",
                        "12", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.split()[len(prompt_ids):] == [str(int(t)) for t in generated]
    small = TransformerConfig(num_layers=1, dim=16, num_heads=2, mlp_ratio=2, vocab_size=VOCAB - 10)
    save_model(tmp_path / "small.eqx", Transformer(small, key=jax.random.key(0)), {"seq_len": 16})
    assert sample.main([str(tmp_path / "small.eqx"), "--tokenizer", str(tokenizer_path)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: the tokenizer has {VOCAB} tokens, more than the model's vocabulary of {VOCAB - 10}: it is " \
                  "not the model's tokenizer\n"


def test_docs_name_every_prepare_flag_and_no_other():
    """docs/data.md's flag table is prepare's parser, flag for flag, with the same defaults where they are
    numbers; and it documents sample's --tokenizer."""
    from pathlib import Path

    doc = (Path(__file__).parents[1] / "docs" / "data.md").read_text()
    table = doc[doc.index("### Flags") : doc.index("### Interrupted runs")]
    documented = dict(re.findall(r"^\| `(--[a-z-]+)` \| ([^|]+) \|", table, re.M))
    captured = {a.option_strings[0]: a.default for a in prepare.build_parser()._actions
                if a.option_strings and a.option_strings[0] != "-h"}
    assert set(documented) == set(captured)
    for flag, default in captured.items():
        if isinstance(default, (int, float)) and not isinstance(default, bool):
            assert documented[flag].strip() == f"{default:g}", flag
        elif isinstance(default, str):
            assert documented[flag].strip() == f"`{default}`", flag
    assert "`--tokenizer`, a `tokenizer.json` or a token folder" in doc


def test_the_run_summary_hints_a_text_prompt_when_the_tokens_name_a_tokenizer(tmp_path, tokenizer_path):
    from eqx_diloco.lm._banner import _sample_prompt
    from eqx_diloco.lm.config import Config
    from models import TransformerConfig

    text = tmp_path / "t.txt"
    text.write_text(SOURCE[:2000])
    prepare.prepare(text, tmp_path / "tokens", tokenizer_path)
    config = Config(model=TransformerConfig(vocab_size=VOCAB), data=DataConfig(source="tokens", path=tmp_path / "tokens"))
    assert _sample_prompt(config) == ""  # sample's default prompt is text, read with the tokenizer
    (tmp_path / "tokens" / "tokenizer.json").unlink()
    first = int(stream(tmp_path / "tokens")[0])
    assert _sample_prompt(config) == f" --prompt {first}    # token ids in, token ids out"


def test_the_trainer_refuses_an_unfinished_token_folder_in_one_line(tmp_path, tokenizer_path, capsys):
    from eqx_diloco.lm.train import main as train_main

    write_jsonl(tmp_path / "c.jsonl", [{"text": d} for d in DOCUMENTS])
    out = tmp_path / "out"
    with pytest.raises(Interrupt):
        prepare.prepare(tmp_path / "c.jsonl", out, tokenizer_path, shard_bytes=1000, progress=interrupted_after(2, out))
    capsys.readouterr()
    assert train_main(["--data.source", "tokens", "--data.path", str(out), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: --data.path {out} is an unfinished prepare (no tokens.json yet): run the same "
                   f"`python -m eqx_diloco.prepare` command again to finish it\n")
