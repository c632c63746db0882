"""What one replica's flat outer-gradient vector becomes on the wire: a quantization format,
optionally after a chunked top-k.

Dense (`topk=None`): `quantize.encode(x, fmt)`, see `quantize`.

Sparse (`topk=d`, SparseLoCo's compressor, arXiv 2508.15706): the vector is zero-padded to
whole chunks of `chunk` values; in each chunk the k = round(d x chunk) entries of largest
magnitude are kept (ties by lower index, `jax.lax.top_k`). Their values, in the order of their
positions, are quantized in `fmt` (blocks of `quantize.BLOCK_SIZE` kept values share a scale),
and their positions are sent as an Elias-Fano code (`elias_fano_encode`): sorted positions in
[0, C) cost l + 1 + (C >> l) / k bits each with l = floor(log2(C / k)) low bits, about
log2(1 / d) + 2 bits at density d, against 8 or 16 for a byte or two per position. The code
of k positions in a chunk of C has a size fixed by (C, k), so every payload of a vector of n
values has the same shapes and payloads travel through `all_gather` and `all_to_all` like
dense ones. A vector shorter than a chunk is one chunk of its own length, and at least one
entry of every chunk is kept, so a short vector (or a two-phase range of one, each range
being sparsified on its own) is sent denser than asked; `nbytes` counts what is sent.
Decoding scatters the values back into zeros. What top-k leaves out is not lost only with
error feedback, which carries it to the next sync; `DiLoCo` refuses top-k without it.

Bits per parameter for int2 values (2 bits and a 32-bit scale per 256 kept values) in chunks
of 65536: d x (l + 1 + 1 / (d 2^l) + 2 + 32/256): 0.19 at 2% (l = 5), 0.28 at 3%, 0.42 at 5%
(l = 4). The default chunk, 65536, keeps the selection close to a top-k of the whole vector
(smaller chunks force every region of the vector to send the same share).
"""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float32, Int, Int32, UInt8

from . import quantize


class SparsePayload(eqx.Module):
    """A top-k payload: `values` (a `quantize.Payload` of the chunks x k kept values, chunk by
    chunk, each chunk's in the order of their positions) and `indices` (per chunk, the
    Elias-Fano code of those positions as uint8 bytes, see `elias_fano_encode`)."""

    values: quantize.Payload
    indices: UInt8[Array, "... chunks nbytes"]


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
        positions = jnp.sort(indices, axis=1)  # the code wants them ascending; the values follow
        kept = jnp.take_along_axis(chunks, positions, axis=1)
        return SparsePayload(values=quantize.encode(kept.reshape(-1), self.fmt),
                             indices=elias_fano_encode(positions, C))

    def decode(self, payload: quantize.Payload | SparsePayload, n: int) -> Float32[Array, " n"]:
        """The float32 vector (n values) a payload stands for."""
        if not self.sparse:
            return quantize.decode(payload, self.fmt, (n,))
        chunks_n, C, k = self._chunks(n), self.chunk_for(n), self.k_for(n)
        values = quantize.decode(payload.values, self.fmt, (chunks_n * k,)).reshape(chunks_n, k)
        rows = jnp.arange(chunks_n)[:, None]
        positions = elias_fano_decode(payload.indices, C, k)
        dense = jnp.zeros((chunks_n, C), jnp.float32).at[rows, positions].set(values)
        return dense.reshape(-1)[:n]

    def nbytes(self, n: int) -> int:
        """Exact bytes of the payload of n values (indices, codes, padding and scales)."""
        if not self.sparse:
            return quantize.payload_nbytes((n,), self.fmt)
        chunks, k = self._chunks(n), self.k_for(n)
        return chunks * elias_fano_nbytes(self.chunk_for(n), k) + quantize.payload_nbytes((chunks * k,), self.fmt)


def _low_bits(universe: int, k: int) -> int:
    """Elias-Fano's low bits per position: floor(log2(universe / k)), at least 0."""
    return max(0, (universe // k).bit_length() - 1)


def _layout(universe: int, k: int) -> tuple[int, int, int]:
    """(low bits per position, bytes of the low part, bits of the high part) of k positions in [0, universe)."""
    low = _low_bits(universe, k)
    return low, -(-k * low // 8), k + ((universe - 1) >> low) + 1


def elias_fano_nbytes(universe: int, k: int) -> int:
    """Bytes of the Elias-Fano code of k positions in [0, universe)."""
    _, low_bytes, high_bits = _layout(universe, k)
    return low_bytes + -(-high_bits // 8)


def elias_fano_encode(positions: Int[Array, "m k"], universe: int) -> UInt8[Array, "m nbytes"]:
    """Each row's k ascending, distinct positions in [0, universe) as one Elias-Fano code.

    A position p splits into its l low bits (packed, l per position) and its high part
    h = p >> l, sent in unary: the i-th position sets bit h_i + i of a bit vector of
    k + ((universe - 1) >> l) + 1 bits. Bits are packed least significant first.
    """
    m, k = positions.shape
    low, _, high_bits = _layout(universe, k)
    low_part = (positions[..., None] >> jnp.arange(low)[None, None, :]) & 1  # (m, k, l), least significant bit first
    low_bytes = jnp.packbits(low_part.astype(jnp.uint8).reshape(m, k * low), axis=1, bitorder="little")
    slots = (positions >> low) + jnp.arange(k)[None, :]
    high = jnp.zeros((m, high_bits), jnp.uint8).at[jnp.arange(m)[:, None], slots].set(1)
    return jnp.concatenate([low_bytes, jnp.packbits(high, axis=1, bitorder="little")], axis=1)


def elias_fano_decode(code: UInt8[Array, "m nbytes"], universe: int, k: int) -> Int32[Array, "m k"]:
    """The k ascending positions per row that `elias_fano_encode(positions, universe)` coded."""
    m = code.shape[0]
    low, low_bytes, high_bits = _layout(universe, k)
    low_part = jnp.unpackbits(code[:, :low_bytes], axis=1, count=k * low, bitorder="little").reshape(m, k, low)
    low_values = jnp.sum(low_part.astype(jnp.int32) << jnp.arange(low, dtype=jnp.int32)[None, None, :], axis=-1, dtype=jnp.int32)
    high = jnp.unpackbits(code[:, low_bytes:], axis=1, count=high_bits, bitorder="little")
    # The i-th set bit (i = its rank) sits at h_i + i; unset bits go out of range and are dropped.
    rank = jnp.where(high == 1, jnp.cumsum(high, axis=1, dtype=jnp.int32) - 1, k)
    bit = jnp.broadcast_to(jnp.arange(high_bits, dtype=jnp.int32), (m, high_bits))
    slots = jnp.zeros((m, k), jnp.int32).at[jnp.arange(m)[:, None], rank].set(bit, mode="drop")
    return ((slots - jnp.arange(k, dtype=jnp.int32)[None, :]) << low) | low_values


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
