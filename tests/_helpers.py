"""Small helpers shared by the test modules (imported as ``_helpers``; pytest puts tests/ on
the path)."""
import ml_dtypes
import numpy as np


def np_dtype(dtype: str):
    """The numpy dtype of a TVM dtype name (bfloat16 through ml_dtypes)."""
    return ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)


def rows_index(nonzero_rows: np.ndarray):
    """The rows-kind PIT index of a boolean row mask: ``offsets = [0, count]`` and ``ids``
    (the non-zero rows ascending, then the others ascending), as the device index kernel
    lays it out."""
    rows = np.nonzero(nonzero_rows)[0].astype(np.int32)
    ids = np.concatenate([rows, np.nonzero(~np.asarray(nonzero_rows, bool))[0]]).astype(np.int32)
    return np.array([0, len(rows)], np.int32), ids


def legalized_cuda_module(build_fn, *shapes, dtype="float16"):
    """A Relax module of one operator ``build_fn(*params)``, legalized and fused for CUDA: the
    PrimFunc a dlight rule sees in a model. Returns ``(module, its PrimFunc)``."""
    import tvm
    from tvm import relax, tirx

    from pit_tvm.target import make_target

    bb = relax.BlockBuilder()
    params = [relax.Var(f"x{i}", relax.TensorType(s, dtype)) for i, s in enumerate(shapes)]
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(build_fn(*params))
        bb.emit_func_output(out)
    with make_target("cuda"):
        mod = tvm.transform.Sequential([relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
                                        relax.transform.FuseOps(), relax.transform.FuseTIR()])(bb.get())
    prim = [f for _, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)][0]
    return mod, prim


def build_with_cuda_rules(mod):
    """``mod`` scheduled by pit_tvm's CUDA dlight rules and built."""
    from tvm.s_tir import dlight as dl

    from pit_tvm.target import build, cuda_schedule_rules, make_target

    cuda = make_target("cuda")
    with cuda:
        mod = dl.ApplyDefaultSchedule(*cuda_schedule_rules())(mod)
    return build(mod, cuda)
