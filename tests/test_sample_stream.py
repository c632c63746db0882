"""`sample` streams its text a chunk at a time with bounded memory (NE05: `--max-new-tokens 100000000`
printed nothing for 90 s and allocated a buffer for every token), and the chunks are the same tokens
one long generation makes."""

import jax
import numpy as np
import pytest

from eqx_diloco.lm.export import save_model
from eqx_diloco.lm.sample import generate, generate_chunks, main as sample_main
from models import Transformer, TransformerConfig

TINY = TransformerConfig(vocab_size=256, num_layers=1, dim=16, num_heads=2)


@pytest.fixture(scope="module")
def model():
    return Transformer(TINY, key=jax.random.key(0))


@pytest.mark.parametrize(("prompt", "temperature", "top_k"), [(b"de", 0.8, 0), (b"a longer prompt", 0.0, 5)])
def test_chunks_are_the_tokens_of_one_long_generation(model, prompt, temperature, top_k):
    prompt = np.frombuffer(prompt, np.uint8).astype(np.int32)
    whole = list(generate_chunks(model, prompt, 30, temperature=temperature, top_k=top_k, seed=3, context=6,
                                 chunk=30))
    pieces = list(generate_chunks(model, prompt, 30, temperature=temperature, top_k=top_k, seed=3, context=6,
                                  chunk=7))
    assert [len(p) for p in whole] == [30] and [len(p) for p in pieces] == [7, 7, 7, 7, 2]
    np.testing.assert_array_equal(np.concatenate(pieces), whole[0])
    np.testing.assert_array_equal(generate(model, prompt, 30, temperature=temperature, top_k=top_k, seed=3,
                                           context=6), whole[0])


def test_the_first_chunk_of_a_huge_request_comes_at_once(model):
    first = next(generate_chunks(model, np.array([1, 2], np.int32), 100_000_000, seed=0, context=8, chunk=16))
    np.testing.assert_array_equal(first, generate(model, np.array([1, 2], np.int32), 16, seed=0, context=8))


def test_the_command_prints_what_one_generation_makes(model, tmp_path, capsys):
    save_model(tmp_path / "m.eqx", model, {"seq_len": 8})
    assert sample_main([str(tmp_path / "m.eqx"), "--prompt", "ab", "--max-new-tokens", "600", "--seed", "1"]) == 0
    tokens = generate(model, np.frombuffer(b"ab", np.uint8).astype(np.int32), 600, seed=1, context=8)
    assert capsys.readouterr().out == "ab" + bytes(int(t) for t in tokens).decode("utf-8", errors="replace") + "\n"
