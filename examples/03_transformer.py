"""Train a small decoder-only transformer (flax.nnx) on the Python standard library's own source,
byte by byte, with pk_jax's tensor-parallel layers and sequence-parallel attention.

    python examples/03_transformer.py                          # 8 CPU devices: sp=2 x tp=4
    python examples/03_transformer.py --attention ulysses      # Ulysses instead of the ring
    python examples/03_transformer.py --steps 300 --checkpoint /tmp/pk_lm.npz
    python examples/03_transformer.py --resume /tmp/pk_lm.npz  # continue from a checkpoint
    python examples/03_transformer.py --experts 8              # MoE blocks instead of MLPs

The mesh has two axes, ("sp", "tp"). Activations are [S/sp, B, D] per device: the sequence is
split over "sp" and replicated over "tp". Each block is

    x = x + RowParallel(attention_sp(ColumnParallel_q(x), ColumnParallel_k(x), ColumnParallel_v(x)))
    x = x + ParallelMLP(x)

(with --experts E, the MLP is an expert-parallel mixture of experts, `pk_jax.nn.flax.MoE`:
E experts split over "sp", a top-2 router, `pk.moe_dispatch`, grouped-GEMM experts,
`pk.moe_combine`, and 0.01 x its load-balancing loss added to the training loss), where the
column layers split the heads (and the MLP's hidden units) over "tp" (`pk.matmul`),
the row layers sum the partial products over "tp" (`pk.gemm_all_reduce`), and the attention of
the local heads runs over the sequence split along "sp": `pk.ring_attention` (K/V blocks passed
around a ring) or `pk.ulysses_attention` (all-to-all to whole sequences of fewer heads). The
byte embedding is tied to the output layer and replicated.

Without GPUs it runs on 8 CPU host devices and the ops' jax.lax references; on Hopper GPUs
with the extension built, the CUDA kernels. It prints a progress bar with the loss and tokens
per second, saves a checkpoint (numpy .npz of the parameters, the optimiser state and the
step), restores it into a fresh model and checks that it computes the same loss.
"""

import os

# Before JAX starts: 8 host devices when running on CPU (ignored by GPU backends).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import argparse
import json
import pathlib
import sys
import time

import pk_jax.launch

pk_jax.launch.initialize()  # joins a multi-process job under pk_jax.launch; else nothing

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pk_jax as pk
from pk_jax.nn import flax as pkn

VOCAB = 256  # bytes


# ---------------------------------------------------------------------------------- data


def stdlib_bytes(limit: int) -> np.ndarray:
    """The first `limit` bytes of the standard library's .py files (sorted, so every run and
    every process reads the same text)."""
    root = pathlib.Path(os.__file__).parent
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    return np.frombuffer(b"".join(chunks)[:limit], np.uint8)


def batches(text: np.ndarray, seq: int, batch: int, seed: int):
    """Endless (inputs, targets) of shape [seq, batch] (sequence first), random windows."""
    rng = np.random.default_rng(seed)
    while True:
        start = rng.integers(0, len(text) - seq - 1, batch)
        windows = np.stack([text[s:s + seq + 1] for s in start], axis=1).astype(np.int32)
        yield windows[:-1], windows[1:]


# --------------------------------------------------------------------------------- model


class Block(nnx.Module):
    """Pre-norm attention and MLP, tensor-parallel over "tp", attention sequence-parallel
    over "sp"."""

    def __init__(self, dim: int, heads: int, hidden: int, *, attention: str, experts: int,
                 rngs: nnx.Rngs):
        self.heads, self.attention, self.experts = heads, attention, experts
        self.norm1 = nnx.LayerNorm(dim, rngs=rngs)
        self.norm2 = nnx.LayerNorm(dim, rngs=rngs)
        self.q, self.k, self.v = (pkn.ColumnParallelLinear(dim, dim, rngs=rngs)
                                  for _ in range(3))
        self.out = pkn.RowParallelLinear(dim, dim, rngs=rngs)
        self.mlp = (pkn.MoE(dim, hidden, experts, top_k=2, axis_name="sp", rngs=rngs)
                    if experts else pkn.ParallelMLP(dim, hidden, rngs=rngs))

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:  # x: [S/sp, B, D]
        h = self.norm1(x)
        tp = jax.lax.axis_size("tp")
        s, b, dim = h.shape

        def heads(t):  # [S/sp, B, D/tp] -> [B, S/sp, H/tp, D/H]
            return t.reshape(s, b, self.heads // tp, dim // self.heads).transpose(1, 0, 2, 3)

        q, k, v = heads(self.q(h)), heads(self.k(h)), heads(self.v(h))
        attend = pk.ring_attention if self.attention == "ring" else pk.ulysses_attention
        o = attend(q, k, v, "sp", causal=True)
        o = o.transpose(1, 0, 2, 3).reshape(s, b, dim // tp)
        x = x + self.out(o).astype(x.dtype)
        if self.experts:  # (y, load-balancing loss)
            y, aux = self.mlp(self.norm2(x))
            return x + y.astype(x.dtype), aux
        return x + self.mlp(self.norm2(x)).astype(x.dtype), jnp.zeros((), jnp.float32)


class Transformer(nnx.Module):
    def __init__(self, *, dim: int, heads: int, hidden: int, layers: int, seq: int,
                 attention: str, experts: int = 0, rngs: nnx.Rngs):
        self.embed = nnx.Param(jax.random.normal(rngs.params(), (VOCAB, dim)) * 0.02)
        self.pos = nnx.Param(jax.random.normal(rngs.params(), (seq, dim)) * 0.02)
        self.blocks = nnx.List([Block(dim, heads, hidden, attention=attention,
                                      experts=experts, rngs=rngs) for _ in range(layers)])
        self.norm = nnx.LayerNorm(dim, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        """tokens [S/sp, B] -> (logits [S/sp, B, VOCAB], the blocks' load-balancing loss)."""
        s = tokens.shape[0]
        first = jax.lax.axis_index("sp") * s  # this shard's first position
        pos = jax.lax.dynamic_slice_in_dim(self.pos[...], first, s)
        x = self.embed[...][tokens] + pos[:, None, :]
        aux = jnp.zeros((), jnp.float32)
        for block in self.blocks:
            x, a = block(x)
            aux = aux + a
        return self.norm(x) @ self.embed[...].T, aux  # tied embedding


# ---------------------------------------------------------------------------- checkpoints


def _flat(tree) -> dict[str, np.ndarray]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}


# The options that shape the model: a checkpoint records them, and --resume compares them.
MODEL_OPTIONS = ("dim", "heads", "layers", "seq", "experts")


def save_checkpoint(path: str, params, opt_state, step: int, config: dict | None = None) -> None:
    """Parameters, optimiser state, step and the model options as one .npz (numpy only, no
    extra packages)."""
    arrays = {f"params{k}": v for k, v in _flat(params).items()}
    arrays.update({f"opt{k}": v for k, v in _flat(opt_state).items()})
    tmp = f"{path}.tmp.npz"
    np.savez(tmp, step=np.int64(step), config=np.array(json.dumps(config or {})), **arrays)
    os.replace(tmp, path)


def _options(config: dict) -> str:
    return " ".join(f"--{k} {config[k]}" for k in MODEL_OPTIONS if k in config)


def restore_checkpoint(path: str, params, opt_state, config: dict | None = None):
    """(params, opt_state, step) from `path`, shaped and sharded like the given ones.

    Raises:
        ValueError: the checkpoint was saved with other model options than `config`, or holds
            arrays of other shapes; the message names the checkpoint and the options to pass.
    """
    with np.load(path) as data:
        saved = json.loads(str(data["config"])) if "config" in data else {}
        if config:
            differ = [k for k in MODEL_OPTIONS if k in saved and saved[k] != config.get(k)]
            if differ:
                raise ValueError(
                    f"checkpoint {path} was saved with {_options({k: saved[k] for k in differ})}"
                    f", and this run has {_options({k: config[k] for k in differ})}. Resume it "
                    f"with the options it was saved with: {_options(saved)}.")

        def mismatch(what: str) -> ValueError:
            hint = (f"pass the options it was saved with: {_options(saved)}" if saved else
                    "pass the model options (--dim, --heads, --layers, --seq, --experts) it "
                    "was saved with")
            return ValueError(f"checkpoint {path} does not fit this model: {what}. It was "
                              f"saved with other model options; {hint}.")

        def fill(prefix, like):
            paths, treedef = jax.tree_util.tree_flatten_with_path(like)
            leaves = []
            for key_path, leaf in paths:
                key = f"{prefix}{jax.tree_util.keystr(key_path)}"
                if key not in data:
                    raise mismatch(f"it has no {key}")
                value = data[key]
                if np.shape(value) != np.shape(leaf):
                    raise mismatch(f"{key} has shape {np.shape(value)} there and "
                                   f"{np.shape(leaf)} here")
                if isinstance(leaf, jax.Array) and isinstance(leaf.sharding, NamedSharding):
                    value = jax.device_put(value.astype(leaf.dtype), leaf.sharding)
                elif isinstance(leaf, jax.Array):  # e.g. the optimiser's step count
                    value = jnp.asarray(value, leaf.dtype)
                leaves.append(value)
            return jax.tree_util.tree_unflatten(treedef, leaves)

        return fill("params", params), fill("opt", opt_state), int(data["step"])


def check_sizes(args, sp: int, tp: int) -> str:
    """Why the model options do not split over the ("sp", "tp") mesh ("" when they do): each
    message names the option and values that work."""
    if args.dim <= 0 or args.dim % (8 * tp):
        return (f"--dim {args.dim}: the projections split the width over tp={tp}, and each "
                f"device's part must be a multiple of 8: use a multiple of {8 * tp}")
    if args.heads <= 0 or args.dim % args.heads or args.heads % tp:
        fits = [h for h in range(tp, args.dim + 1, tp) if args.dim % h == 0][:4]
        return (f"--heads {args.heads}: the heads split --dim {args.dim} and are split over "
                f"tp={tp}, so --heads must divide {args.dim} and be a multiple of {tp}: e.g. "
                f"{', '.join(map(str, fits))}")
    if args.attention == "ulysses" and (args.heads // tp) % sp:
        return (f"--heads {args.heads}: Ulysses attention splits each device's {args.heads // tp} "
                f"heads again over sp={sp}: use a multiple of {tp * sp}, or --attention ring")
    if args.seq <= 0 or args.seq % sp:
        return f"--seq {args.seq}: the sequence is split over sp={sp}: use a multiple of {sp}"
    if args.experts and args.experts % sp:
        return (f"--experts {args.experts}: the experts are split over sp={sp}: use a multiple "
                f"of {sp}")
    return ""


# --------------------------------------------------------------------------------- training


def progress(step: int, total: int, loss: float, tokens_per_s: float, width: int = 24) -> str:
    done = int(width * step / total)
    rate = f"{tokens_per_s:,.0f} tokens/s" if tokens_per_s else "compiling"
    return f"[{'#' * done}{'.' * (width - done)}] {step:4d}/{total}  loss {loss:.3f}  {rate}"


def arguments() -> argparse.ArgumentParser:
    """The command line; every option has help text and a default (shown by --help)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="training steps")
    parser.add_argument("--attention", choices=("ring", "ulysses"), default="ring",
                        help="sequence-parallel attention over the sp axis")
    parser.add_argument("--sp", type=int, default=None,
                        help="size of the sequence-parallel axis; the rest of the devices form "
                             "tp (None: 2 if it divides the device count, else 1)")
    parser.add_argument("--dim", type=int, default=128,
                        help="model width (a multiple of 8 x tp)")
    parser.add_argument("--heads", type=int, default=8,
                        help="attention heads (a multiple of tp that divides --dim)")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks")
    parser.add_argument("--seq", type=int, default=128,
                        help="sequence length in bytes (a multiple of sp)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam's learning rate")
    parser.add_argument("--experts", type=int, default=0,
                        help="MoE blocks with this many experts (split over sp); 0: MLPs")
    parser.add_argument("--text-bytes", type=int, default=2_000_000,
                        help="bytes of standard-library source to train on")
    parser.add_argument("--checkpoint", default=None,
                        help="where to save at the end (.npz; None: no checkpoint)")
    parser.add_argument("--resume", default=None,
                        help="a checkpoint to continue from (None: start from scratch)")
    parser.add_argument("--losses", action="store_true",
                        help="print every step's loss (tests/gpu/compare_losses.py reads them)")
    return parser


def main(argv=None) -> dict:
    parser = arguments()
    args = parser.parse_args(argv)

    n = jax.device_count()
    sp = args.sp or (2 if n % 2 == 0 else 1)
    if sp <= 0 or n % sp:
        parser.error(f"--sp {sp} must divide the device count ({n})")
    problem = check_sizes(args, sp, n // sp)
    if problem:
        parser.error(problem)
    config = {k: getattr(args, k) for k in MODEL_OPTIONS}
    mesh = jax.make_mesh((sp, n // sp), ("sp", "tp"))
    pk.init(mesh)
    attention_stem = "ring_attn" if args.attention == "ring" else "ulysses_attn"
    print(f"pk_jax {pk.__version__}: {n} x {jax.devices()[0].platform}, mesh sp={sp} x "
          f"tp={n // sp}; {args.attention} attention ({pk.backend_name(attention_stem, 'sp')}), "
          f"TP layers ({pk.backend_name('gemm_ar', 'tp')})")
    if args.losses:  # the ops with kernels that this model runs
        kernels = ("gemm_ar", "ag_gemm", "gemm_rs") + (("grouped_matmul",) if args.experts else ())
        print("backends: " + " ".join(
            f"{s}={pk.backend_name(s, None if s == 'grouped_matmul' else 'tp')}"
            for s in kernels), flush=True)

    model = Transformer(dim=args.dim, heads=args.heads, hidden=4 * args.dim, layers=args.layers,
                        seq=args.seq, attention=args.attention, experts=args.experts,
                        rngs=nnx.Rngs(0))
    pkn.shard(model, mesh)
    graphdef, params = nnx.split(model)
    specs = pkn.partition_specs(params)
    tok_spec = P("sp", None)  # [S, B]: the sequence split over "sp"

    def loss_fn(params, inputs, targets):
        def local(params, inputs, targets):
            logits, aux = nnx.merge(graphdef, params)(inputs)
            nll = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32),
                                                                  targets)
            return jax.lax.pmean(nll.mean(), "sp") + 0.01 * aux

        return jax.shard_map(local, mesh=mesh, in_specs=(specs, tok_spec, tok_spec),
                             out_specs=P())(params, inputs, targets)

    tx = optax.adam(args.lr)
    opt_state = tx.init(params)
    start_step = 0
    if args.resume:
        try:
            params, opt_state, start_step = restore_checkpoint(args.resume, params, opt_state,
                                                               config)
        except (ValueError, OSError) as e:
            parser.error(f"--resume: {e}")
        print(f"resumed from {args.resume} at step {start_step}")

    @jax.jit
    def train_step(params, opt_state, inputs, targets):
        loss, grads = jax.value_and_grad(loss_fn)(params, inputs, targets)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    evaluate = jax.jit(loss_fn)
    place = NamedSharding(mesh, tok_spec)
    text = stdlib_bytes(args.text_bytes)
    data = batches(text, args.seq, args.batch, seed=start_step)
    print(f"text: {len(text):,} bytes of {pathlib.Path(os.__file__).parent}/*.py")

    losses, tokens, seconds = [], 0, 0.0
    tty = sys.stdout.isatty()
    for i in range(start_step, start_step + args.steps):
        inputs, targets = (jax.device_put(a, place) for a in next(data))
        t0 = time.perf_counter()
        params, opt_state, loss = train_step(params, opt_state, inputs, targets)
        loss = float(loss)  # waits for the step
        if i > start_step + 1:  # the first two steps compile (the second for the new layouts)
            seconds += time.perf_counter() - t0
            tokens += args.seq * args.batch
        losses.append(loss)
        if args.losses:
            print(f"step {i + 1}  loss {loss:.6f}", flush=True)
        line = progress(i + 1 - start_step, args.steps, loss, tokens / seconds if seconds else 0)
        if tty:
            print("\r" + line, end="", flush=True)
        elif (i + 1 - start_step) % max(1, args.steps // 20) == 0 or i == start_step:
            print(line, flush=True)
    if tty:
        print()
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {args.steps} steps; "
          f"{tokens / seconds if seconds else 0:,.0f} tokens/s after compiling")

    result = {"losses": losses, "step": start_step + args.steps}
    if args.checkpoint:
        save_checkpoint(args.checkpoint, params, opt_state, start_step + args.steps, config)
        fresh = nnx.split(Transformer(dim=args.dim, heads=args.heads, hidden=4 * args.dim,
                                      layers=args.layers, seq=args.seq,
                                      attention=args.attention, experts=args.experts,
                                      rngs=nnx.Rngs(1)))[1]
        fresh = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), fresh,
                             specs)
        restored, _, step = restore_checkpoint(args.checkpoint, fresh, tx.init(fresh), config)
        inputs, targets = (jax.device_put(a, place) for a in next(data))
        before, after = float(evaluate(params, inputs, targets)), float(
            evaluate(restored, inputs, targets))
        assert before == after, (before, after)
        print(f"checkpoint {args.checkpoint}: step {step}, restored into a fresh model, "
              f"same loss {after:.4f}")
        result["eval_loss"] = after
    return result


if __name__ == "__main__":
    main()
