"""Text to token ids for a model: UTF-8 bytes for byte-level runs, the run's `tokenizers` tokenizer for
runs on token files (and for Hugging Face folders, their `tokenizer.json`).

Nothing here imports JAX: the trainer reads task files and their tokens before JAX starts.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from .._errors import ConfigError


@dataclasses.dataclass(frozen=True)
class TextEncoder:
    """Turns text into token ids for one model.

    **Arguments:**

    - `tokenizer`: a `tokenizers.Tokenizer`, or None for byte-level ids (each UTF-8 byte is its own id).
    - `source`: where the encoding came from, for messages (a tokenizer file, or "bytes").
    """

    tokenizer: Any = None
    source: str = "bytes"

    def encode(self, text: str) -> list[int]:
        """The ids of `text`, without special tokens (no BOS/EOS: lm-evaluation-harness's default)."""
        if self.tokenizer is None:
            return list(text.encode("utf-8"))
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    @property
    def byte_level(self) -> bool:
        return self.tokenizer is None


BYTES = TextEncoder()


def load_tokenizer_file(path: Path | str, *, flag: str) -> TextEncoder:
    """A `TextEncoder` for a `tokenizers` JSON file (`tokenizer.json`). `flag` names the argument in errors."""
    path = Path(path)
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError(f"{flag}: the `tokenizers` package is missing: pip install -e '.[prepare]'") from None
    if not path.is_file():
        raise ConfigError(f"{flag}: no tokenizer file at {path}")
    try:
        return TextEncoder(Tokenizer.from_file(str(path)), str(path))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception for a malformed file
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"{flag}: {path} is not a tokenizers JSON file ({first})") from None


def tokenizer_for_tokens(token_path: Path | str) -> TextEncoder:
    """The tokenizer a token file or folder was written with, as a `TextEncoder` (the lookup is
    `token_shards.tokenizer_file_for_tokens`). Raises `ConfigError` saying why there is none."""
    from .token_shards import tokenizer_file_for_tokens  # imports nothing of JAX

    file = tokenizer_file_for_tokens(token_path)
    if file is None:
        raise ConfigError(f"{token_path} names no tokenizer file that exists (its metadata is written by prepare)")
    return load_tokenizer_file(file, flag=str(token_path))


def encoder_for_data(source: str, path: Path | None, *, needed_by: str) -> TextEncoder:
    """How a run trained on `--data.source source` (`--data.path path`) reads text: its token file's tokenizer
    for `tokens`, UTF-8 bytes for the byte-level sources (corpus, text, synthetic). `needed_by` (a flag)
    starts the message when there is no tokenizer to be had."""
    if source != "tokens":
        return BYTES
    if path is None:
        raise ConfigError(f"{needed_by} needs the tokenizer of the token file, and no --data.path is given")
    try:
        return tokenizer_for_tokens(path)
    except ConfigError as e:
        raise ConfigError(f"{needed_by} needs the tokenizer of {path}: {e}") from None
