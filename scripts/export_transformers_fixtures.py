"""Export tiny random-weight Hugging Face ``transformers`` models to ONNX as test fixtures.

Each architecture is built from a small seeded config (hidden 32, 2 layers, 2-4 heads, vocabulary
100) and exported the way a user would export the real model, with ``torch.onnx.export``:

- the TorchScript exporter (``dynamo=False``, opset 17 unless ``--opset``) to
  ``tests/data/transformers/<arch>.onnx``;
- the dynamo exporter (``dynamo=True``, its default opset, 18+) to ``<arch>_dynamo.onnx``, where it
  exports the model (an architecture it fails on is reported and skipped).

Inputs ``input_ids`` and ``attention_mask`` (``[batch, sequence]`` int64, dynamic axes named
``batch`` / ``sequence``); output ``last_hidden_state`` (T5: the encoder's).  The weights are
random: the fixtures test the import and the numerics against onnxruntime, not a trained model.

Needs torch, transformers, onnx, onnxscript (not needed by the tests or CI, which read the
committed files)::

    python scripts/export_transformers_fixtures.py [--arch bert gpt2 ...] [--out DIR]
    python scripts/export_transformers_fixtures.py --arch gpt2 --opset 14 --no-dynamo --suffix _opset14
    python scripts/export_transformers_fixtures.py --full-size --arch minilm --out /tmp/big   # real dims
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import warnings

import torch

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "data" / "transformers"
VOCAB = 100
MAX_POSITIONS = 32
#: the example batch traced by the exporters: 2 sequences of 8 tokens, the second padded
EXAMPLE_BATCH, EXAMPLE_SEQUENCE = 2, 8


def _configs(full_size: bool) -> dict:
    """``{arch: (model class, config)}``: tiny configs, or with ``full_size`` the published
    models' dimensions (random weights all the same; for a one-off check, not for the repo)."""
    import transformers as tf  # noqa: PLC0415

    small = dict(vocab_size=VOCAB, max_position_embeddings=MAX_POSITIONS)
    bert = dict(small, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    # all-MiniLM-L6-v2 / sentence-transformers encoders: a BertModel, 12 heads of 32, FFN 4x
    minilm = (dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536)
              if full_size else dict(small, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=128))
    return {
        "bert": (tf.BertModel, tf.BertConfig(**bert)),
        # RoBERTa's positions start after the padding index (1): two more position rows
        "roberta": (tf.RobertaModel, tf.RobertaConfig(**dict(bert, max_position_embeddings=MAX_POSITIONS + 2),
                                                      pad_token_id=1)),
        "distilbert": (tf.DistilBertModel, tf.DistilBertConfig(vocab_size=VOCAB, max_position_embeddings=MAX_POSITIONS,
                                                               dim=32, n_layers=2, n_heads=4, hidden_dim=64)),
        "albert": (tf.AlbertModel, tf.AlbertConfig(**bert, embedding_size=16)),
        "electra": (tf.ElectraModel, tf.ElectraConfig(**bert, embedding_size=16)),
        "minilm": (tf.BertModel, tf.BertConfig(**minilm)),
        # one head of 64 over 128 positions: the shapes the fused-attention kernel takes
        "bert_head64": (tf.BertModel, tf.BertConfig(**dict(small, max_position_embeddings=128), hidden_size=64,
                                                    num_hidden_layers=1, num_attention_heads=1, intermediate_size=64)),
        "opt": (tf.OPTModel, tf.OPTConfig(vocab_size=VOCAB, max_position_embeddings=MAX_POSITIONS, hidden_size=32,
                                          num_hidden_layers=2, num_attention_heads=4, ffn_dim=64,
                                          word_embed_proj_dim=32, pad_token_id=1)),
        "gpt2": (tf.GPT2Model, tf.GPT2Config(vocab_size=VOCAB, n_positions=MAX_POSITIONS, n_embd=32, n_layer=2,
                                             n_head=4, n_inner=64, bos_token_id=0, eos_token_id=0)),
        "t5_encoder": (tf.T5EncoderModel, tf.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                      num_heads=4, relative_attention_num_buckets=8,
                                                      relative_attention_max_distance=16)),
    }


class LastHiddenState(torch.nn.Module):
    """``(input_ids, attention_mask) -> last_hidden_state``, as an export of the bare model gives"""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        kwargs = {"use_cache": False} if "use_cache" in self.model.config.to_dict() else {}
        return self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state


def build(arch: str, full_size: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    cls, config = _configs(full_size)[arch]
    return LastHiddenState(cls(config)).eval()   # (the exporter restores the wrapper's mode recursively)


def example_inputs():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (EXAMPLE_BATCH, EXAMPLE_SEQUENCE), generator=g)
    mask = torch.ones(EXAMPLE_BATCH, EXAMPLE_SEQUENCE, dtype=torch.int64)
    mask[1, 5:] = 0
    return ids, mask


NAMES = dict(input_names=["input_ids", "attention_mask"], output_names=["last_hidden_state"])


def export_torchscript(module, path, opset: int):
    axes = {"batch": 0, "sequence": 1}
    dynamic = {n: {v: k for k, v in axes.items()} for n in ["input_ids", "attention_mask", "last_hidden_state"]}
    torch.onnx.export(module, example_inputs(), str(path), dynamo=False, opset_version=opset,
                      dynamic_axes=dynamic, do_constant_folding=True, **NAMES)


def export_dynamo(module, path):
    batch = torch.export.Dim("batch", min=1, max=1024)
    sequence = torch.export.Dim("sequence", min=2, max=MAX_POSITIONS)
    dims = {0: batch, 1: sequence}
    program = torch.onnx.export(module, example_inputs(), dynamo=True, external_data=False,
                                dynamic_shapes={"input_ids": dims, "attention_mask": dims}, **NAMES)
    program.save(str(path), external_data=False)
    strip_metadata(path)


def strip_metadata(path):
    """drop the dynamo exporter's per-node metadata (source stack traces, FX names: most of the
    file) and doc strings; the graph is unchanged"""
    import onnx  # noqa: PLC0415

    model = onnx.load(str(path))
    for value in [*model.graph.node, *model.graph.input, *model.graph.output, *model.graph.value_info,
                  *model.graph.initializer]:
        del value.metadata_props[:]
        value.doc_string = ""
    del model.metadata_props[:]
    onnx.save(model, str(path))


def check(module, path):
    """the export agrees with PyTorch on the example batch's real tokens (onnxruntime)"""
    import numpy as np  # noqa: PLC0415
    import onnxruntime as ort  # noqa: PLC0415

    ids, mask = example_inputs()
    with torch.no_grad():
        want = module(ids, mask).numpy()
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = sess.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})[0]
    real = mask.numpy().astype(bool)
    err = float(np.abs(got[real] - want[real]).max())
    if err > 1e-4:
        raise RuntimeError(f"{path.name}: onnxruntime differs from PyTorch by {err}")


def main(argv=None) -> int:
    archs = list(_configs(False))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", nargs="+", default=archs, choices=archs)
    p.add_argument("--out", type=pathlib.Path, default=OUT)
    p.add_argument("--opset", type=int, default=17, help="the TorchScript exporter's opset (14-17)")
    p.add_argument("--no-dynamo", action="store_true", help="only the TorchScript exporter")
    p.add_argument("--suffix", default="", help="appended to the TorchScript exports' names (e.g. _opset14)")
    p.add_argument("--full-size", action="store_true", help="the published models' dimensions (large files)")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    failed = []
    for arch in args.arch:
        module = build(arch, args.full_size)
        exporters = [(args.suffix, lambda m, f: export_torchscript(m, f, args.opset))]
        if not args.no_dynamo:
            exporters.append(("_dynamo", export_dynamo))
        for suffix, export in exporters:
            path = args.out / f"{arch}{suffix}.onnx"
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    export(module, path)
                check(module, path)
            except Exception as err:  # noqa: BLE001 - report the exporter's failure, go on
                failed.append(path.name)
                print(f"{path.name}: FAILED {type(err).__name__}: {str(err).splitlines()[0][:200]}", file=sys.stderr)
                path.unlink(missing_ok=True)
                continue
            print(f"{path.name}: {path.stat().st_size / 1024:.0f} kB")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
