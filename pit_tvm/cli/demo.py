"""``pit-tvm demo``: a ReLU MLP whose hidden activations are ~90% zero: PIT vs dense vs numpy.

The hidden layer has OPT's structure: most neurons are silent for most tokens (their biases
are strongly negative), so whole columns of the hidden activation are zero for strips of
tokens: 32x1 micro-tiles along the second matmul's reduction axis (SRead of the non-zero
columns of H and the matching rows of W2). The same matmuls are timed in numpy (its BLAS) beside
the dense TVM build and PIT, so the first numbers a user sees compare with what they would use
otherwise.
"""
from __future__ import annotations

import numpy as np

from pit_tvm.cli.main import fraction, positive_int
from pit_tvm.errors import UserError


def register(subparsers):
    p = subparsers.add_parser("demo", help="ReLU MLP with ~90%% zero activations: PIT vs dense vs numpy")
    p.add_argument("--target", default="llvm", help="llvm (default) or cuda")
    p.add_argument("--tokens", type=positive_int, default=512)
    p.add_argument("--d-model", type=positive_int, default=512)
    p.add_argument("--hidden", type=positive_int, default=2048)
    p.add_argument("--active", type=fraction, default=0.1, help="fraction of neurons that fire, in (0, 1]")
    p.add_argument("--micro-tile", default="32x1", help="ROWSxCOLS micro-tile of the hidden activation")
    p.add_argument("--repeat", type=positive_int, default=10)
    p.set_defaults(func=run)


def make_mlp(tokens, d_model, hidden, active, seed=0):
    """Weights whose ReLU output is ~(1-active) zero, neuron-structured like OPT's FFN."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, d_model)).astype(np.float32)
    w1 = (rng.standard_normal((d_model, hidden)) / np.sqrt(d_model)).astype(np.float32)
    b1 = np.where(rng.random(hidden) < active, 0.5, -8.0).astype(np.float32)   # silent neurons
    w2 = (rng.standard_normal((hidden, d_model)) / np.sqrt(hidden)).astype(np.float32)
    return x, w1, b1, w2


def run(args) -> int:
    import tvm

    import pit_tvm
    from pit_tvm.ops.matmul import DenseMatmul
    from pit_tvm.target import device_for
    from pit_tvm.timing import median_ms

    from pit_tvm.cli.compile import parse_micro_tile

    mr, mk = parse_micro_tile(args.micro_tile)
    try:
        dev = device_for(args.target)
    except ValueError as err:      # not a target name
        raise UserError(f"--target {args.target!r}: {err}") from err
    if not dev.exist:
        raise UserError(f"--target {args.target}: no {dev} device on this machine")
    x, w1, b1, w2 = make_mlp(args.tokens, args.d_model, args.hidden, args.active)
    print(f"ReLU MLP {args.tokens} tokens x {args.d_model} -> {args.hidden} -> {args.d_model}, "
          f"target {args.target}, micro-tile {mr}x{mk}; compiling...")
    try:
        layer1 = DenseMatmul(args.d_model, args.hidden, "float32", args.target)
        dense2 = DenseMatmul(args.hidden, args.d_model, "float32", args.target)
        pit2 = pit_tvm.sparse_matmul(args.hidden, args.d_model, "float32", micro_tile=(mr, mk), target=args.target)
    except ValueError as err:      # e.g. a micro-tile the sizes do not take
        raise UserError(err) from err

    x_t, w1_t, w2_t = (tvm.runtime.tensor(v, dev) for v in (x, w1, w2))
    h = np.maximum(layer1(x, w1) + b1, 0).astype(np.float32)
    h_t = tvm.runtime.tensor(h, dev)
    y_ref = np.maximum(x @ w1 + b1, 0) @ w2
    y_pit = pit2(h_t, w2_t).numpy()
    y_dense = dense2(h_t, w2_t).numpy()
    err = float(np.max(np.abs(y_pit - y_ref)) / (np.max(np.abs(y_ref)) + 1e-12))
    ok = np.allclose(y_pit, y_ref, rtol=1e-3, atol=1e-3) and np.allclose(y_dense, y_ref, rtol=1e-3, atol=1e-3)
    offsets, ids = pit2.index(h_t)
    tiles = ids.numpy().size
    occupancy = offsets.numpy()[-1] / max(tiles, 1)
    print(f"hidden activations zero: {np.mean(h == 0):.1%}; non-zero {mr}x{mk} micro-tiles: {occupancy:.1%}")
    print(f"correct vs numpy: {'yes' if ok else 'NO'} (max relative error {err:.2e})")

    t1 = median_ms(lambda: layer1(x_t, w1_t), dev, args.repeat)
    t_dense = median_ms(lambda: dense2(h_t, w2_t), dev, args.repeat)
    t_pit = median_ms(lambda: pit2(h_t, w2_t), dev, args.repeat)
    # the same two matmuls in numpy (its BLAS, all cores), for an honest baseline
    host = tvm.cpu()
    n1 = median_ms(lambda: x @ w1, host, args.repeat)
    n2 = median_ms(lambda: h @ w2, host, args.repeat)
    numpy_label = "numpy (ms)" if str(dev) == str(host) else "numpy CPU (ms)"
    print(f"{'':28s}{numpy_label:>15s}{'dense (ms)':>12s}{'PIT (ms)':>12s}{'vs dense':>10s}{'vs numpy':>10s}")
    for label, t_np, t_d, t_p in (("second matmul (sparse A)", n2, t_dense, t_pit),
                                  ("whole MLP (first dense)", n1 + n2, t1 + t_dense, t1 + t_pit)):
        print(f"{label:28s}{t_np:15.3f}{t_d:12.3f}{t_p:12.3f}{t_d / t_p:9.2f}x{t_np / t_p:9.2f}x")
    print("PIT time includes building the index on the device every call; 'vs' columns: PIT's speedup "
          "(below 1: slower). Bias and ReLU are not timed on either side.")
    return 0 if ok else 1
