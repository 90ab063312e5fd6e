"""Micro-tiles of a model's annotated matmuls chosen from sample inputs (``compile_onnx(..., sample_inputs=)``).

The sample inputs are run through the ONNX model with onnxruntime, the left operand of each
annotated matmul (the ONNX tensor its annotation names) returned as an extra graph output, and
:func:`~pit_tvm.tuning.choose.choose_micro_tile` picks its micro-tile from that activation's
pattern (its leading dims flattened into rows; several samples stacked), with the measured
latency model of the target (:func:`~pit_tvm.tuning.choose.default_latency_model`). A choice of
``"dense"`` (no micro-tile predicted faster than dense, or every micro-tile of the samples holding
a non-zero) turns the matmul back into a plain one. Matmuls whose rows index is built from a
padding mask (shared by several matmuls) and micro-tiles given by ``sparse=`` are kept.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace

import numpy as np
import tvm
from tvm import relax

from pit_tvm.errors import UserError

#: the sources whose micro-tile follows the activation's pattern (not a row mask shared by several matmuls)
CHOOSABLE = ("relu", "explicit")


def sample_feeds(samples, input_names) -> list[dict]:
    """``sample_inputs=`` as a list of ``{input name: array}``: a dict, an ``.npz`` path, or a list of
    either; every graph input given, no unknown names"""
    if isinstance(samples, (str, os.PathLike)):
        path = os.fspath(samples)
        if not os.path.isfile(path):
            raise UserError(f"sample_inputs {path}: no such file (expected an .npz of the model's inputs)")
        try:
            with np.load(path) as npz:
                samples = {k: npz[k] for k in npz.files}
        except Exception as err:  # noqa: BLE001 - not an npz
            raise UserError(f"sample_inputs {path}: not an .npz of arrays ({type(err).__name__}: {err})") from err
    batches = list(samples) if isinstance(samples, (list, tuple)) else [samples]
    if not batches:
        raise UserError("sample_inputs is empty: give {input name: array} (or a list of them)")
    feeds = []
    for i, batch in enumerate(batches):
        if isinstance(batch, (str, os.PathLike)):
            batch = sample_feeds(batch, input_names)[0]
        if not isinstance(batch, Mapping):
            raise TypeError(f"sample_inputs[{i}] must be a dict {{input name: array}} or an .npz path, "
                            f"got {type(batch).__name__}")
        unknown = sorted(set(batch) - set(input_names))
        missing = [n for n in input_names if n not in batch]
        if unknown or missing:
            raise UserError(f"sample_inputs: {'unknown input(s) ' + str(unknown) if unknown else ''}"
                            f"{'; ' if unknown and missing else ''}{'missing input(s) ' + str(missing) if missing else ''}"
                            f"; the model's inputs are {list(input_names)}")
        feeds.append({n: np.asarray(batch[n]) for n in input_names})
    return feeds


def sample_activations(proto, feeds: list[dict], tensors: list[str]) -> dict:
    """``{tensor: [M, K] array}``: each ONNX ``tensor`` computed by onnxruntime on every feed, its
    leading dims flattened into rows, the feeds' rows stacked"""
    import onnx  # noqa: PLC0415
    import onnxruntime as ort  # noqa: PLC0415

    probe = onnx.ModelProto()
    probe.CopyFrom(proto)
    present = {o.name for o in probe.graph.output}
    for name in tensors:
        if name not in present:
            probe.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
    try:
        sess = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception as err:  # noqa: BLE001
        raise UserError(f"sample_inputs: onnxruntime cannot load the model to compute the sample "
                        f"activations: {str(err).splitlines()[0]}") from err
    rows = {name: [] for name in tensors}
    for i, feed in enumerate(feeds):
        try:
            values = sess.run(tensors, feed)
        except Exception as err:  # noqa: BLE001 - a dtype / shape the model does not take
            raise UserError(f"sample_inputs[{i}]: onnxruntime cannot run the model on it: "
                            f"{str(err).splitlines()[0]}") from err
        for name, value in zip(tensors, values):
            rows[name].append(value.reshape(-1, value.shape[-1]))
    return {name: np.concatenate(parts) for name, parts in rows.items()}


def candidates_for(m: int, k: int) -> list[tuple[int, int]]:
    """The micro-tiles of the op layer tried for a sparse ``[m, k]`` operand, those that fit it:
    strips of 32 tokens x one channel (neuron sparsity), 32 x 64 blocks, whole rows"""
    out = [(32, 1)]
    if k % 64 == 0:
        out.append((32, 64))
    out.append((1, k))
    return [t for t in out if t[0] <= m and t[1] <= k]


def _describe(choice) -> str:
    parts = [f"{a}x{b}: coverage {choice.coverage[(a, b)]:.2f}, {choice.dense_time / choice.predicted[(a, b)]:.2f}x"
             if choice.predicted[(a, b)] > 0 else f"{a}x{b}: coverage {choice.coverage[(a, b)]:.2f}"
             for a, b in choice.coverage]
    return "; ".join(parts)


def choose_tiles_from_samples(mod: tvm.IRModule, proto, samples, target, input_names,
                              fixed_tiles=()) -> tvm.IRModule:
    """``mod`` (after annotation) with each choosable ``pit`` matmul's micro-tile chosen from the
    sample inputs, its record in ``main``'s ``pit.annotations`` saying what was chosen and why"""
    from pit_tvm.passes.annotate import ANNOTATIONS_ATTR, PIT_RULE_ATTR, ROW_MASK_ATTR, rule_for_tile  # noqa: PLC0415
    from pit_tvm.tuning.choose import choose_micro_tile, default_latency_model  # noqa: PLC0415

    feeds = sample_feeds(samples, input_names)
    mod = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs)   # (the caller's module unchanged)
    main = mod["main"]
    records = [{str(k): v for k, v in dict(r).items()} for r in (main.attrs or {}).get(ANNOTATIONS_ATTR, [])]
    funcs = {gv.name_hint: (gv, f) for gv, f in mod.functions_items()}
    values = {v.name for v in proto.graph.value_info} | {n for node in proto.graph.node for n in node.output}

    todo = []
    for rec in records:
        fname = str(rec.get("function", ""))
        if str(rec.get("status")) != "pit" or fname not in funcs:
            continue
        func = funcs[fname][1]
        source = str(rec["source"])
        if ROW_MASK_ATTR in func.attrs or not source.startswith(CHOOSABLE):
            continue
        if str(rec["tensor"]) in fixed_tiles:
            rec["reason"] = str(rec["reason"]) + "; micro-tile given by sparse=, not chosen from the samples"
            continue
        if str(rec["tensor"]) not in values:
            rec["reason"] = (str(rec["reason"]) + f"; default micro-tile kept: {rec['tensor']!r} is not a tensor "
                             "of the ONNX graph that onnxruntime can return for the samples")
            continue
        todo.append(rec)
    if not todo:
        return _with_records(mod, records)

    acts = sample_activations(proto, feeds, sorted({str(r["tensor"]) for r in todo}))
    kind = (target if isinstance(target, tvm.target.Target) else tvm.target.Target(target)).kind.name
    tiles, dense = {}, set()
    for rec in todo:
        fname, act = str(rec["function"]), acts[str(rec["tensor"])]
        m, k = act.shape
        cands = candidates_for(m, k)
        k_operand = funcs[fname][1].params[0].ty.shape.values[-1]
        if int(getattr(k_operand, "value", -1)) != k:   # (a transpose between them: another layout)
            rec["reason"] = (str(rec["reason"]) + f"; default micro-tile kept: the matmul reads {rec['tensor']!r} "
                             "in another layout than the ONNX tensor's")
            continue
        if not cands:
            rec["reason"] = str(rec["reason"]) + f"; default micro-tile kept: the samples' {m} rows are fewer than any micro-tile"
            continue
        model = default_latency_model(k, kind)
        choice = choose_micro_tile(act, cands, model)
        how = (f"chosen from sample inputs ({m} rows, density {choice.density:.2f}; predicted speedup over dense "
               f"by micro-tile: {_describe(choice)}; latency model {os.path.basename(model.source)})")
        if not choice.is_dense and choice.coverage[choice.choice] >= 1.0:
            # every micro-tile holds a non-zero: PIT would compute all of it, plus its index
            how += "; every micro-tile of the samples holds a non-zero, nothing to skip"
            choice = replace(choice, choice="dense")
        if choice.is_dense:
            rec.update(status="dense", reason=f"{rec['reason']}; dense {how}")
            for key in ("micro_tile", "rule", "function"):
                rec.pop(key, None)
            dense.add(fname)
        else:
            tile = [int(choice.choice[0]), int(choice.choice[1])]
            rec.update(micro_tile=tile, rule=rule_for_tile(tile, k),
                       reason=f"{rec['reason']}; micro-tile {tile[0]}x{tile[1]} {how}")
            tiles[fname] = tile
        rec["chosen_from"] = "sample_inputs"

    for fname, tile in tiles.items():
        gv, func = funcs[fname]
        k = int(func.params[0].ty.shape.values[-1])
        mod[gv] = func.with_attr("pit.micro_tile", tile).with_attr(PIT_RULE_ATTR, rule_for_tile(tile, k))
    if dense:
        mod = _inline_dense(mod, {funcs[f][0] for f in dense})
    return _with_records(mod, records)


def _with_records(mod, records):
    from pit_tvm.passes.annotate import ANNOTATIONS_ATTR  # noqa: PLC0415

    gv = mod.get_global_var("main")
    mod[gv] = mod[gv].with_attr(ANNOTATIONS_ATTR, records)
    return mod


def _inline_dense(mod: tvm.IRModule, wrappers: set) -> tvm.IRModule:
    """``mod`` with the calls to the PIT wrappers ``wrappers`` replaced by their plain matmul (the
    wrappers removed): a matmul the samples say to keep dense"""
    names = {gv.name_hint for gv in wrappers}
    matmul = tvm.ir.Op.get("relax.matmul")

    @relax.expr_functor.mutator
    class _Inline(relax.PyExprMutator):
        def visit_call_(self, op):
            op = self.visit_expr_post_order(op)
            if isinstance(op.op, relax.GlobalVar) and op.op.name_hint in names:
                return relax.Call(matmul, list(op.args[:2]), mod[op.op].body.blocks[0].bindings[0].value.attrs)
            return op

    gv_main = mod.get_global_var("main")
    main = _Inline(mod).visit_expr(mod[gv_main])
    for gv in list(mod.functions):
        if gv.name_hint in names:
            del mod[gv]
    mod[gv_main] = main
    return mod
