"""The collective half of an outer-gradient mean: sum every replica's (quantized) vector.

`exchange_sum` runs *inside* a `jax.shard_map` body, over one mesh axis (the replica axis,
"diloco" by default). Other mesh axes may exist; the values must be replicated over them
(every collective here names only `axis_name`). Each device passes the flat float32 vectors
of the K replicas it holds (K = 1 unless replicas share devices) and a 0/1 weight each;
every device gets back the same float32 sum of the weighted, wire-rounded vectors, and each
replica's own quantization error for error feedback. The caller
divides by the count of weighted replicas (a `psum` of the weights) to get the mean.

Methods (`resolve_method` picks one):

- `"psum"`: a float32 `psum` (format "none" without top-k only; lossless). On the wire a ring
  all-reduce: each replica sends `2 (R - 1) / R` of the float32 buffer.
- `"gather"` (one shot): each replica encodes its whole vector into one payload, the
  payloads are `all_gather`ed, and every replica decodes all R of them and sums in float32
  in replica order. Each replica sends its payload to R - 1 peers: `(R - 1) x payload`
  bytes, and holds all R received payloads (R x payload bytes; for "none" and "bf16" XLA
  also materializes the (R, n) float32 decode). Only one quantization (by the sender).
- `"two_phase"` (quantized reduce-scatter + all-gather): the vector is zero-padded to
  `R * c` values, `c` a multiple of the quantizer's block size (`chunk_size`), and cut into
  R chunks, each encoded on its own (its own scales). An `all_to_all` hands chunk k of
  every replica to replica k, which decodes and sums those R chunks in float32 (in replica
  order 0, 1, ..., R - 1), re-encodes the reduced chunk in the same format, and an
  `all_gather` of the packed reduced chunks gives everyone every chunk, decoded once. Each
  replica sends `(R - 1)` chunk payloads in each phase: `2 (R - 1) / R` of one (padded)
  payload, like a ring all-reduce of the compressed buffer. Memory per device is O(n): the
  received chunks are decoded one at a time into a running sum (no (R, n) float32 matrix).
  Two roundings (sender's and owner's). Format "none" works too (float32 chunks, no
  rounding: equals a psum up to float32 summation order).

Because chunk boundaries are multiples of `quantize.BLOCK_SIZE`, encoding the chunks one
by one makes exactly the blocks (and scales) of encoding the whole zero-padded vector: the
phase-1 rounding of a replica's vector is the same as the one-shot method's.

A format may also be a `_codec.Codec` with top-k: then every payload is sparse (kept values
and their positions). Gather adds the R sparse payloads; two-phase sparsifies each of a
replica's R chunks on its own, and the owner re-sparsifies the reduced chunk (the owner's
error e2 below is then everything that second top-k dropped).

**Choice of method (`method="auto"`).** Format "none" without top-k -> "psum". A dense lossy format:
"gather" for R <= 2 and "two_phase" for R > 2. At R = 2 both move the same bytes (one payload, up to
block padding), but two-phase needs two collectives and rounds twice, so the one-shot
exchange is never worse. From R = 3 two-phase sends fewer bytes ((R - 1) vs
2 (R - 1) / R payloads) and avoids the (R, n) decode; `benchmarks/wire.py` measures the
time per sync (benchmarks/results/wire.md). A sparse (top-k) codec: "gather" up to
`SPARSE_GATHER_MAX_REPLICAS` replicas, "two_phase" above. The owner's second top-k drops part of the
reduced sum and trains far worse (at R = 4, 2% top-k + int2, 500 steps: +23.9% against +8.2% above
float32 DiLoCo, benchmarks/results/compression), while a sparse payload is small enough that R - 1 of
them stay cheap (3% + int2 at R = 8: 0.034x the bytes of a float32 all-reduce); gather's bytes grow
with R, so two-phase takes over beyond that.

**Skipped replicas (weight 0).** A replica whose weight is 0 zeroes what it sends (the
scales of a blocked payload, the values of "none"/"bf16"), so its payload decodes to
exact zeros and adds nothing, whatever its values (NaN included); nobody needs to know the
other replicas' weights. It still takes part in the collectives and, with two-phase, still
reduces and re-encodes the chunk it owns.

**Error feedback: what `own_error` carries.** Let x_r be replica r's vector (its outer
gradient plus last round's residual), e1_r = x_r - decode(encode(x_r)) its sender-side
rounding error, and, for two-phase, S_k the float32 sum replica k reduced for chunk k and
e2_k = S_k - decode(encode(S_k)) the owner's re-encoding error. The returned total is
`T = sum_r w_r x_r - sum_r w_r e1_r - e2` (e2: all chunks' e2_k side by side).

- "gather": `own_error = e1_r` (as before).
- "two_phase": `own_error = e1_r`, plus `e2_r` (unscaled) on the chunk replica r owns.
- "psum": zeros.

e2 is an error of the *sum*, and the sum of all residuals is what the next round's sum
re-injects, so the owner carries it once (not R or count times; count x e2 would be right
only if the owner re-quantized the *mean*). With every replica weighted and
E_t = sum_r own_error_r at round t, the transmitted means telescope:
`sum_{t<=T} T_t / R = sum_{t<=T} mean_r(delta_r,t) - E_T / R`, so the time-summed
transmitted mean is off by one round's error, never growing with T
(`tests/test_exchange.py` checks this with a numpy simulation of the same rounding). If a
replica is skipped, its own error follows its own (non-finite) residual, which the caller
handles; the e2 it owns is still finite and added to it.
"""

from typing import Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float32

from ._codec import Codec, as_codec, zero_if_skipped

Method = Literal["psum", "gather", "two_phase"]
METHODS: tuple[str, ...] = ("psum", "gather", "two_phase")
SPARSE_GATHER_MAX_REPLICAS = 8  # `auto` gathers sparse payloads up to this R (module docstring)


def resolve_method(method: str, num_replicas: int, fmt: "str | Codec") -> Method:
    """The concrete exchange method for a requested one.

    **Arguments:**

    - `method`: "auto", "psum", "gather" or "two_phase".
    - `num_replicas`: R, the number of replicas.
    - `fmt`: the wire format (one of `quantize.FORMATS`, or a `Codec`, e.g. with top-k).

    **Returns:** "auto" resolves to "psum" for a lossless format ("none" without top-k), to
    "gather" for a sparse codec up to `SPARSE_GATHER_MAX_REPLICAS` replicas, else "gather" when
    R <= 2 and "two_phase" when R > 2 (see the module docstring for why).
    Explicit methods are returned unchanged; "psum" with a lossy format is a ValueError (a
    psum of quantized codes would overflow or round wrongly).
    """
    codec = as_codec(fmt)
    if method == "auto":
        if codec.lossless:
            return "psum"
        gather_up_to = SPARSE_GATHER_MAX_REPLICAS if codec.sparse else 2
        return "gather" if num_replicas <= gather_up_to else "two_phase"
    if method not in METHODS:
        raise ValueError(f"unknown exchange method {method!r}; expected auto or one of {', '.join(METHODS)}")
    if method == "psum" and not codec.lossless:
        raise ValueError(f"method 'psum' needs format 'none' without top-k (got {codec}); use 'gather' or 'two_phase'")
    return method  # type: ignore[return-value]


def chunk_size(num_values: int, fmt: "str | Codec", num_replicas: int) -> int:
    """Values per chunk in the two-phase exchange: the vector is zero-padded to R chunks.

    A chunk is a multiple of the codec's alignment (`quantize.BLOCK_SIZE` for blocked
    formats), so no quantization block is cut; "none", "bf16" and sparse codecs (each chunk
    is sparsified on its own, at the same density) need none: `ceil(num_values / R)`.
    """
    align = as_codec(fmt).align
    per_replica = -(-num_values // num_replicas)
    return align * -(-per_replica // align)


def payload_nbytes_for(num_values: int, fmt: "str | Codec", num_replicas: int, method: str) -> int:
    """Bytes of one replica's whole encoded vector under `method` (scales, indices and padding included).

    "psum": 4 bytes per value. "gather": the codec's payload of n values. "two_phase": R
    chunk payloads of `chunk_size` values each (the zero padding to R equal chunks is
    counted). This is what `sent_bytes` counts; `wire_nbytes` is what the collectives move.
    """
    codec = as_codec(fmt)
    method = resolve_method(method, num_replicas, codec)
    if method == "psum":
        return 4 * num_values
    if method == "gather":
        return codec.nbytes(num_values)
    return num_replicas * codec.nbytes(chunk_size(num_values, codec, num_replicas))


def wire_nbytes(num_values: int, fmt: "str | Codec", num_replicas: int, method: str) -> int:
    """Bytes one replica sends for one `exchange_sum` of `num_values` values.

    With R = `num_replicas`, n = `num_values`, p = the codec's payload bytes of n values and
    p_c = those of `chunk_size(n, fmt, R)` values:

    - "psum" (ring all-reduce of the float32 buffer): `ceil(2 (R - 1) * 4n / R)`;
    - "gather" (all_gather of one payload): `(R - 1) * p`;
    - "two_phase": all_to_all of R chunk payloads keeps one and sends R - 1, then the
      all_gather of the reduced chunk sends it to R - 1 peers: `2 (R - 1) * p_c`
      (= 2 (R - 1) / R of the padded payload).

    R = 1 sends nothing. "auto" is resolved with `resolve_method` first.
    """
    codec = as_codec(fmt)
    method = resolve_method(method, num_replicas, codec)
    R = num_replicas
    if method == "psum":
        return -(-2 * (R - 1) * 4 * num_values // R)
    if method == "gather":
        return (R - 1) * codec.nbytes(num_values)
    return 2 * (R - 1) * codec.nbytes(chunk_size(num_values, codec, R))


def _row(payload, i: int):
    return jax.tree.map(lambda leaf: leaf[i], payload)


def _sum_rows(payloads, codec: Codec, size: int, R: int) -> Float32[Array, " size"]:
    """Decode R stacked payloads (leading axis) and add them in replica order, in float32.

    A running sum of one decoded row at a time: XLA fuses each decode into its add, so no
    (R, size) float32 matrix is held, and the order of the additions is fixed.
    """
    total = codec.decode(_row(payloads, 0), size)
    for r in range(1, R):
        total = total + codec.decode(_row(payloads, r), size)
    return total


def _encode_rows(rows: Float32[Array, "*lead n"], codec: Codec):
    """Each row (over any leading axes) encoded on its own, and each row's rounding error."""
    n = rows.shape[-1]
    encode, decode = codec.encode, lambda p: codec.decode(p, n)
    for _ in range(rows.ndim - 1):
        encode, decode = jax.vmap(encode), jax.vmap(decode)
    payload = encode(rows)
    return payload, rows - decode(payload)


def _gather_replicas(payload, axis_name: str):
    """All replicas' payloads, rows in replica order: every device's K local rows, device by device."""
    gathered = jax.lax.all_gather(payload, axis_name, to="invarying")  # leaves (devices, K, ...)
    return jax.tree.map(lambda leaf: leaf.reshape(-1, *leaf.shape[2:]), gathered)


def sent_values(flat: Float32[Array, " n"], fmt: "str | Codec", num_replicas: int, method: str) -> Float32[Array, " n"]:
    """What one replica's vector decodes to after its own encoding under `method` (the first
    rounding, before any reduction): one encode of the vector for "gather", an encode per
    chunk for "two_phase" (which, for a sparse codec, is a top-k per chunk), the vector itself
    for "psum"."""
    codec = as_codec(fmt)
    method = resolve_method(method, num_replicas, codec)
    n = flat.shape[0]
    if method == "psum":
        return flat
    if method == "gather":
        return codec.decode(codec.encode(flat), n)
    c = chunk_size(n, codec, num_replicas)
    rows = jnp.pad(flat, (0, num_replicas * c - n)).reshape(num_replicas, c)
    _, error = _encode_rows(rows, codec)
    return (rows - error).reshape(-1)[:n]


def exchange_sum(
    flat: Float32[Array, "*K n"],
    weight: Float32[Array, "*K"],
    fmt: "str | Codec",
    *,
    axis_name: str = "diloco",
    method: str,
) -> tuple[Float32[Array, " n"], Float32[Array, "*K n"]]:
    """Sum over replicas of `weight_r * decode(encode(flat_r))`; call inside `jax.shard_map`.

    **Arguments:**

    - `flat`: this device's replicas' vectors: (n,) for one replica per device, or (K, n)
      for K replicas on each device along `axis_name` (replica i K + k is row k on device
      i). Float32, the same n everywhere. Varies over `axis_name`; replicated over any
      other mesh axis.
    - `weight`: () or (K,), 0 or 1 per replica (any value > 0 counts as 1): 0 leaves that
      replica out of the sum (its values may then be non-finite).
    - `fmt`: wire format, one of `quantize.FORMATS` or a `Codec` (top-k).
    - `axis_name`: the mesh axis along which devices hold different replicas.
    - `method`: "psum", "gather", "two_phase" or "auto" (see `resolve_method`; R is the axis
      size times K).

    **Returns:** `(total, own_error)`. `total` (n,) float32 is the same on every device
    (invariant over `axis_name`: it may leave the shard_map with `P()`), for "two_phase" it
    is the decoded re-encoded sum (re-sparsified, with top-k). `own_error`, shaped like
    `flat`, is what each replica's error-feedback residual should become (module docstring:
    its phase-1 rounding error, plus, for two-phase, the owner's re-encoding error of the
    chunk it owns; zeros for a lossless exchange). Unused outputs cost nothing under `jit`.
    A device's K replicas count as K replicas everywhere: in the sum, in the order of the
    additions and in the chunk each owns, so the result does not depend on how replicas are
    placed on devices.
    """
    codec = as_codec(fmt)
    if flat.ndim not in (1, 2) or jnp.ndim(weight) != flat.ndim - 1:
        raise ValueError(f"exchange_sum takes a flat vector (n,) or rows (K, n) with weights () or (K,), got shapes "
                         f"{flat.shape} and {jnp.shape(weight)}")
    one = flat.ndim == 1
    rows = (flat[None] if one else flat).astype(jnp.float32)
    keep = (jnp.reshape(weight, (-1,)) > 0)
    R = jax.lax.axis_size(axis_name) * rows.shape[0]
    method = resolve_method(method, R, codec)
    total, own_error = _exchange_rows(rows, keep, codec, axis_name=axis_name, method=method, R=R)
    return total, own_error[0] if one else own_error


def _exchange_rows(rows, keep, codec: Codec, *, axis_name: str, method: str, R: int):
    K, n = rows.shape
    if method == "psum":
        local = jnp.sum(jnp.where(keep[:, None], rows, jnp.zeros_like(rows)), axis=0)
        return jax.lax.psum(local, axis_name), jnp.zeros_like(rows)

    zero_skipped = jax.vmap(zero_if_skipped)
    if method == "gather":
        payload, own_error = _encode_rows(rows, codec)
        gathered = _gather_replicas(zero_skipped(payload, keep), axis_name)
        return _sum_rows(gathered, codec, n, R), own_error

    # two_phase: each row is cut into R chunks of c values, each encoded on its own (a chunk
    # is whole quantization blocks / top-k chunks, so dense formats round exactly as one
    # encode of the row would).
    c = chunk_size(n, codec, R)
    padded = jnp.pad(rows, ((0, 0), (0, R * c - n)))
    payload, e1 = _encode_rows(padded.reshape(K, R, c), codec)  # leaves (K, R, ...); e1 (K, R, c)
    payload = jax.vmap(zero_if_skipped)(payload, keep)
    devices = R // K
    # Leaves as (sender k, owner's device, owner k, ...).
    chunks = jax.tree.map(lambda leaf: leaf.reshape(K, devices, K, *leaf.shape[2:]), payload)
    # Phase 1 (reduce-scatter): after the all_to_all, axis 1 is the sending device; reorder to
    # (owner k, sender replica), senders in replica order.
    received = jax.tree.map(lambda leaf: jax.lax.all_to_all(leaf, axis_name, 1, 1), chunks)
    # (sender k, sender device, owner k) -> (owner k, sender device, sender k): replica d K + k.
    received = jax.tree.map(
        lambda leaf: jnp.moveaxis(leaf, 2, 0).swapaxes(1, 2).reshape(K, R, *leaf.shape[3:]), received
    )
    owned = jax.vmap(lambda payloads: _sum_rows(payloads, codec, c, R))(received)  # (K, c)
    if codec.lossless:
        reduced, e2 = owned, jnp.zeros_like(owned)
    else:
        reduced, e2 = _encode_rows(owned, codec)  # re-encoded (re-sparsified, with top-k)
    # Phase 2 (all-gather): everyone gets every owner's encoded reduced chunk.
    gathered = _gather_replicas(reduced, axis_name)
    if codec.lossless:
        total = gathered.reshape(R * c)[:n]
    else:
        total = jax.vmap(lambda p: codec.decode(p, c))(gathered).reshape(R * c)[:n]
    first = jax.lax.axis_index(axis_name) * K  # replica index of this device's row 0
    e1 = e1.reshape(K, R * c)

    def add_owned(e1_row, e2_row, k):
        at = (first + k) * c
        return jax.lax.dynamic_update_slice(e1_row, jax.lax.dynamic_slice(e1_row, (at,), (c,)) + e2_row, (at,))

    own_error = jax.vmap(add_owned)(e1, e2, jnp.arange(K))
    return total, own_error[:, :n]
