"""Train a small transformer (flax.nnx) on packed documents: segment ids keep each document's
attention to itself, with sequence-parallel attention over a ring (or Ulysses).

    python examples/05_packed_documents.py                      # 8 CPU devices: sp=4 x tp=2
    python examples/05_packed_documents.py --layout zigzag      # the balanced ring layout
    python examples/05_packed_documents.py --attention ulysses --window 15

Every row of a batch is several documents of different lengths packed back to back, as LLM
pre-training does to avoid padding. Each document is an arithmetic sequence of tokens
(t_i = a + i d mod vocab, a and d its own), so the next token follows from the document's own
earlier tokens, and tokens of the document before are noise. The model sees per row:

    tokens       [a0 a0+d0 a0+2d0 ... | a1 a1+d1 ... | a2 ...]
    segment_ids  [0  0     0      ... | 1  1     ... | 2  ...]   -> ParallelAttention(segment_ids=)
    positions    [0  1     2      ... | 0  1     ... | 0  ...]   (restart per document)

`pk_jax.nn.flax.ParallelAttention` passes the segment ids to `pk.ring_attention` (or
`pk.ulysses_attention`): a query sees only keys of its own document (and, causal, not later
ones); the ring carries each block's segment ids with its K/V, so documents may cross the
shards. The loss counts only targets inside the same document. After training, the example
checks that the packed forward equals separate forward calls on each document alone (and that
without segment ids it would not).

The mesh is ("sp", "tp"): the sequence split over "sp", heads and MLP over "tp". Without GPUs
it runs on 8 CPU host devices and the ops' jax.lax references; on Hopper GPUs the linear layers
run their kernels, and the attention, sharded over "sp" with a mask, its masked kernels (the
ring's fused forward, or Ulysses' composed kernels; over a 1-device axis pk.attention's).
"""

import os

# Before JAX starts: 8 host devices when running on CPU (ignored by GPU backends).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pk_jax as pk
from pk_jax.nn import flax as pkn

# ------------------------------------------------------------------------------------ data


def pack(rng: np.random.Generator, batch: int, seq: int, vocab: int, unit: int):
    """A batch of packed documents: (tokens, segment_ids, positions), each int32 [B, S].

    Document lengths are multiples of `unit` (so that each document alone also splits over the
    sequence axis), 1 to 4 units each; rows are filled exactly, ids count 0, 1, ... per row.
    """
    tokens = np.zeros((batch, seq), np.int32)
    ids = np.zeros((batch, seq), np.int32)
    pos = np.zeros((batch, seq), np.int32)
    for r in range(batch):
        start, doc = 0, 0
        while start < seq:
            n = min(unit * int(rng.integers(1, 5)), seq - start)
            a, d = rng.integers(0, vocab), rng.integers(1, 4)
            tokens[r, start:start + n] = (a + d * np.arange(n)) % vocab
            ids[r, start:start + n] = doc
            pos[r, start:start + n] = np.arange(n)
            start, doc = start + n, doc + 1
    return tokens, ids, pos


def targets_and_weights(tokens: np.ndarray, ids: np.ndarray):
    """Next-token targets [B, S] and 0/1 weights: 1 where the next token is in the same
    document (the last token of a document predicts nothing)."""
    nxt = np.roll(tokens, -1, axis=1)
    same = np.roll(ids, -1, axis=1) == ids
    same[:, -1] = False
    return nxt, same.astype(np.float32)


# ----------------------------------------------------------------------------------- model


class Block(nnx.Module):
    """Pre-norm attention (segment-masked, causal) and MLP, tensor-parallel over "tp", attention
    sequence-parallel over "sp"."""

    def __init__(self, dim: int, heads: int, *, attention: str, layout: str, window,
                 rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(dim, rngs=rngs)
        self.norm2 = nnx.LayerNorm(dim, rngs=rngs)
        self.attn = pkn.ParallelAttention(dim, heads, axis_name="tp", seq_axis="sp",
                                          attention=attention, causal=True, layout=layout,
                                          local_window_size=window, rngs=rngs)
        self.mlp = pkn.ParallelMLP(dim, 4 * dim, axis_name="tp", rngs=rngs)

    def __call__(self, x: jax.Array, segment_ids) -> jax.Array:  # x: [B, S/sp, D]
        x = x + self.attn(self.norm1(x), segment_ids=segment_ids).astype(x.dtype)
        return x + self.mlp(self.norm2(x)).astype(x.dtype)


class Model(nnx.Module):
    def __init__(self, *, vocab: int, dim: int, heads: int, layers: int, max_len: int,
                 attention: str, layout: str, window, rngs: nnx.Rngs):
        self.embed = nnx.Param(jax.random.normal(rngs.params(), (vocab, dim)) * 0.1)
        self.pos = nnx.Param(jax.random.normal(rngs.params(), (max_len, dim)) * 0.1)
        self.blocks = nnx.List([Block(dim, heads, attention=attention, layout=layout,
                                      window=window, rngs=rngs) for _ in range(layers)])
        self.norm = nnx.LayerNorm(dim, rngs=rngs)

    def __call__(self, tokens, positions, segment_ids=None) -> jax.Array:
        """[B, S/sp] tokens, positions within their document, segment ids (None: one document
        per row) -> float32 logits [B, S/sp, vocab]."""
        x = self.embed[...][tokens] + self.pos[...][positions]
        for block in self.blocks:
            x = block(x, segment_ids)
        return (self.norm(x) @ self.embed[...].T).astype(jnp.float32)  # tied embedding


# -------------------------------------------------------------------------------- training


def arguments() -> argparse.ArgumentParser:
    """The command line; every option has help text and a default (shown by --help)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--steps", type=int, default=60, help="training steps")
    parser.add_argument("--attention", choices=("ring", "ulysses"), default="ring",
                        help="sequence-parallel attention over the sp axis")
    parser.add_argument("--layout", choices=("contiguous", "zigzag"), default="contiguous",
                        help="the ring's sequence layout (ring only)")
    parser.add_argument("--window", type=int, default=None,
                        help="also a causal sliding window: each token sees itself and this "
                             "many tokens before it (None: the whole document)")
    parser.add_argument("--sp", type=int, default=None,
                        help="size of the sequence-parallel axis; the rest of the devices form "
                             "tp (None: 4, 2 or 1, the largest dividing the device count)")
    parser.add_argument("--seq", type=int, default=64,
                        help="tokens per packed row (a multiple of 2 x sp)")
    parser.add_argument("--batch", type=int, default=8, help="packed rows per step")
    parser.add_argument("--vocab", type=int, default=32, help="vocabulary size")
    parser.add_argument("--dim", type=int, default=64, help="model width (a multiple of 8 x tp)")
    parser.add_argument("--heads", type=int, default=8,
                        help="attention heads (a multiple of tp, and of tp x sp for Ulysses)")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam's learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data and the model")
    return parser


def main(argv=None) -> dict:
    parser = arguments()
    args = parser.parse_args(argv)
    n = jax.device_count()
    sp = args.sp or next(s for s in (4, 2, 1) if n % s == 0)
    if sp <= 0 or n % sp:
        parser.error(f"--sp {sp} must divide the device count ({n})")
    tp = n // sp
    unit = 2 * sp  # document lengths: multiples of 2 sp, so each one alone splits (zigzag too)
    if args.seq % unit:
        parser.error(f"--seq {args.seq} must be a multiple of 2 x sp = {unit}")
    if args.dim % (8 * tp) or args.heads % tp or args.dim % args.heads:
        parser.error(f"--dim {args.dim} and --heads {args.heads} must split over tp={tp}: "
                     f"--dim a multiple of {8 * tp}, --heads a multiple of {tp} dividing it")
    if args.attention == "ulysses" and (args.heads // tp) % sp:
        parser.error(f"--heads {args.heads}: Ulysses splits each device's {args.heads // tp} "
                     f"heads over sp={sp}: use a multiple of {tp * sp}, or --attention ring")
    mesh = jax.make_mesh((sp, tp), ("sp", "tp"))
    pk.init(mesh)
    window = None if args.window is None else (args.window, 0)
    print(f"pk_jax {pk.__version__}: {n} x {jax.devices()[0].platform}, mesh sp={sp} x tp={tp}; "
          f"{args.attention} attention{f' ({args.layout})' if args.attention == 'ring' else ''}"
          f" with segment ids{f' and a window of {args.window}' if window else ''}")

    model = Model(vocab=args.vocab, dim=args.dim, heads=args.heads, layers=args.layers,
                  max_len=args.seq, attention=args.attention, layout=args.layout,
                  window=window, rngs=nnx.Rngs(args.seed))
    pkn.shard(model, mesh)
    graphdef, params = nnx.split(model)
    specs = pkn.partition_specs(params)
    row = P(None, "sp")  # [B, S]: the sequence split over "sp", replicated over "tp"
    # The sequence order on the mesh: zigzag-permuted for the zigzag ring, else as it is.
    zigzag = args.attention == "ring" and args.layout == "zigzag"
    order = lambda s: pk.zigzag_indices(s, sp) if zigzag else np.arange(s)

    def logits_fn(params, tokens, positions, ids):
        """Global [B, S] arrays in mesh order -> logits [B, S, vocab] (ids None: no mask)."""
        def local(params, tokens, positions, ids):
            return nnx.merge(graphdef, params)(tokens, positions, ids)

        in_specs = (specs, row, row, None if ids is None else row)
        return jax.shard_map(local, mesh=mesh, in_specs=in_specs,
                             out_specs=P(None, "sp", None))(params, tokens, positions, ids)

    def loss_fn(params, tokens, positions, ids, targets, weights):
        def local(params, tokens, positions, ids, targets, weights):
            logits = nnx.merge(graphdef, params)(tokens, positions, ids)
            nll = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
            total = jax.lax.psum(jnp.sum(nll * weights), "sp")
            return total / jax.lax.psum(jnp.sum(weights), "sp")

        return jax.shard_map(local, mesh=mesh, in_specs=(specs,) + (row,) * 5,
                             out_specs=P())(params, tokens, positions, ids, targets, weights)

    tx = optax.adam(args.lr)
    opt_state = tx.init(params)

    @jax.jit
    def train_step(params, opt_state, *batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rng = np.random.default_rng(args.seed)
    place = NamedSharding(mesh, row)

    def batch():
        tokens, ids, pos = pack(rng, args.batch, args.seq, args.vocab, unit)
        targets, weights = targets_and_weights(tokens, ids)
        idx = order(args.seq)
        return tuple(jax.device_put(x[:, idx], place)
                     for x in (tokens, pos, ids, targets, weights))

    losses, t0 = [], time.perf_counter()
    for i in range(args.steps):
        params, opt_state, loss = train_step(params, opt_state, *batch())
        losses.append(float(loss))
        if i == 0 or (i + 1) % max(1, args.steps // 6) == 0:
            print(f"step {i + 1:4d}/{args.steps}  loss {losses[-1]:.3f}", flush=True)
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {args.steps} steps "
          f"({time.perf_counter() - t0:.1f} s)")

    # The packed forward against each document of row 0 run alone (no segment ids), and the
    # packed forward without segment ids (documents attending to their neighbours).
    tokens, ids, pos = pack(rng, 1, args.seq, args.vocab, unit)
    idx = order(args.seq)
    put = lambda x: jax.device_put(jnp.asarray(x), place)
    logits = jax.jit(logits_fn)
    packed = np.asarray(logits(params, *(put(x[:, idx]) for x in (tokens, pos, ids))))
    unmasked = np.asarray(logits(params, put(tokens[:, idx]), put(pos[:, idx]), None))
    back = np.argsort(idx)
    packed, unmasked = packed[:, back], unmasked[:, back]
    alone_err = mixed_err = 0.0
    for doc in np.unique(ids[0]):
        cols = np.flatnonzero(ids[0] == doc)
        one = order(len(cols))
        alone = np.asarray(logits(params, put(tokens[:, cols][:, one]),
                                  put(pos[:, cols][:, one]), None))[:, np.argsort(one)]
        alone_err = max(alone_err, float(np.abs(packed[:, cols] - alone).max()))
        mixed_err = max(mixed_err, float(np.abs(unmasked[:, cols] - alone).max()))
    scale = float(np.abs(packed).max())
    print(f"packed forward vs {len(np.unique(ids[0]))} per-document forward calls: max |diff| "
          f"{alone_err:.2e} (logits up to {scale:.1f}); without segment ids: {mixed_err:.2e}")
    assert alone_err <= 0.02 * scale + 1e-2, (alone_err, scale)
    return {"losses": losses, "doc_err": alone_err, "unmasked_err": mixed_err, "scale": scale}


if __name__ == "__main__":
    main()
