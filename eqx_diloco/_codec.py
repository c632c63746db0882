"""What one replica's flat outer-gradient vector becomes on the wire: a quantization format,
optionally after a chunked top-k.

Dense (`topk=None`): `quantize.encode(x, fmt)`, see `quantize`.

Sparse (`topk=d`, SparseLoCo's compressor, arXiv 2508.15706): the vector is zero-padded to
whole chunks of `chunk` values; in each chunk the k = round(d x chunk) entries of largest
magnitude are kept (ties by lower index, `jax.lax.top_k`), their values are quantized in
`fmt` (blocks of `quantize.BLOCK_SIZE` kept values share a scale) and their positions in the
chunk are sent as one unsigned byte each (chunk <= 256) or two (chunk <= 65536). A vector
shorter than a chunk is one chunk of its own length, and at least one entry of every chunk is
kept, so a short vector (or a two-phase range of one, each range being sparsified on its own)
is sent denser than asked; `nbytes` counts what is sent. Decoding
scatters the values back into zeros. Every payload of a vector of n values has the same
shapes, so payloads travel through `all_gather` and `all_to_all` like dense ones. What
top-k leaves out is not lost only with error feedback, which carries it to the next sync;
`DiLoCo` refuses top-k without it.

Bytes per chunk: k x index bytes, plus the quantized values: for density d and int2 values,
d x (16 + 2 + 32/256) bits per parameter with 2-byte positions (0.54 at 3%, 0.36 at 2%) and
d x (8 + 2 + 32/256) with 1-byte positions (chunk <= 256: 0.32 at 3%).

The default chunk, 65536, is the largest the 2-byte positions allow, so the selection is close
to a top-k of the whole vector: on the embedded corpus (R = 2, H = 20, 500 steps, 3 seeds) top-k
3% in 256-value chunks ended 27% above float32 DiLoCo and 2% in 65536-value chunks 7% above, at
0.32 and 0.42 bits per parameter (`benchmarks/compression.py`).
"""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float32, Shaped

from . import quantize


class SparsePayload(eqx.Module):
    """A top-k payload: `values` (a `quantize.Payload` of the chunks x k kept values, chunk by
    chunk) and `indices` ((chunks, k) uint8 or uint16 positions within each chunk)."""

    values: quantize.Payload
    indices: Shaped[Array, "... chunks k"]


@dataclasses.dataclass(frozen=True)
class Codec:
    """A wire format for flat float32 vectors.

    **Arguments:**

    - `fmt`: the quantization format of the values (`quantize.FORMATS`).
    - `topk`: the density in (0, 1] of a chunked top-k, or None for dense vectors.
    - `chunk`: values per top-k chunk (a power of two, 8 to 65536; default 65536).
    """

    fmt: str = "none"
    topk: float | None = None
    chunk: int = 65536

    @property
    def sparse(self) -> bool:
        return self.topk is not None

    @property
    def lossless(self) -> bool:
        """Whether decode(encode(x)) == x (float32, dense): the exchange may be a plain psum."""
        return self.fmt == "none" and not self.sparse

    @property
    def align(self) -> int:
        """Values a dense two-phase chunk must be a multiple of, so that cutting a vector into
        chunks cuts no quantization block (then each chunk rounds as one encode of the whole
        vector would). A sparse codec selects within each chunk on its own: no alignment."""
        if self.sparse:
            return 1
        return quantize.BLOCK_SIZE if self.fmt in quantize._BLOCKED else 1

    def chunk_for(self, n: int) -> int:
        """The top-k chunk of a vector of n values: `chunk`, or n for a shorter vector (so a small
        vector is not padded to a whole chunk)."""
        return max(1, min(self.chunk, n))

    def k_for(self, n: int) -> int:
        """Entries kept per top-k chunk of a vector of n values."""
        return max(1, round(self.topk * self.chunk_for(n)))

    def _chunks(self, n: int) -> int:
        return -(-n // self.chunk_for(n))

    def encode(self, x: Float32[Array, " n"]) -> quantize.Payload | SparsePayload:
        """The payload of one flat vector."""
        if not self.sparse:
            return quantize.encode(x, self.fmt)
        n = x.shape[0]
        C = self.chunk_for(n)
        chunks = jnp.pad(x.astype(jnp.float32), (0, self._chunks(n) * C - n)).reshape(-1, C)
        # NaN counts as the largest magnitude, so a non-finite vector stays non-finite on the wire.
        magnitude = jnp.where(jnp.isnan(chunks), jnp.inf, jnp.abs(chunks))
        _, indices = jax.lax.top_k(magnitude, self.k_for(n))
        kept = jnp.take_along_axis(chunks, indices, axis=1)
        index_dtype = jnp.uint8 if C <= 256 else jnp.uint16
        return SparsePayload(values=quantize.encode(kept.reshape(-1), self.fmt), indices=indices.astype(index_dtype))

    def decode(self, payload: quantize.Payload | SparsePayload, n: int) -> Float32[Array, " n"]:
        """The float32 vector (n values) a payload stands for."""
        if not self.sparse:
            return quantize.decode(payload, self.fmt, (n,))
        chunks_n, C, k = self._chunks(n), self.chunk_for(n), self.k_for(n)
        values = quantize.decode(payload.values, self.fmt, (chunks_n * k,)).reshape(chunks_n, k)
        rows = jnp.arange(chunks_n)[:, None]
        dense = jnp.zeros((chunks_n, C), jnp.float32).at[rows, payload.indices.astype(jnp.int32)].set(values)
        return dense.reshape(-1)[:n]

    def nbytes(self, n: int) -> int:
        """Exact bytes of the payload of n values (indices, codes, padding and scales)."""
        if not self.sparse:
            return quantize.payload_nbytes((n,), self.fmt)
        kept = self._chunks(n) * self.k_for(n)
        return kept * (1 if self.chunk_for(n) <= 256 else 2) + quantize.payload_nbytes((kept,), self.fmt)


def zero_if_skipped(payload: quantize.Payload | SparsePayload, keep: Array) -> quantize.Payload | SparsePayload:
    """A payload that decodes to exact zeros when `keep` is False (NaN scales included)."""
    if isinstance(payload, SparsePayload):
        return SparsePayload(values=zero_if_skipped(payload.values, keep), indices=payload.indices)
    if payload.scales is None:
        return quantize.Payload(data=jnp.where(keep, payload.data, jnp.zeros_like(payload.data)), scales=None)
    # Codes of blocked formats are always finite, so a zero scale decodes them to zeros.
    return quantize.Payload(data=payload.data, scales=jnp.where(keep, payload.scales, jnp.zeros_like(payload.scales)))


def as_codec(fmt: "str | Codec") -> Codec:
    """A `Codec` for a format name (dense) or the codec itself."""
    if isinstance(fmt, Codec):
        quantize._check(fmt.fmt)
        return fmt
    quantize._check(fmt)
    return Codec(fmt)
