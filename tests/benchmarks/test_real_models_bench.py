"""benchmarks/real_models.py's batch and its ``--expected-density`` (no torch needed)."""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # the repo's benchmarks/
import real_models as R  # noqa: E402


def test_padded_batch_is_right_padded_in_its_length_range():
    batch = R.padded_batch(32, 128, 16, seed=0)
    mask, ids = batch["attention_mask"], batch["input_ids"]
    lengths = mask.sum(1)
    assert mask.shape == ids.shape == (32, 128) and lengths.min() >= 16 and lengths.max() <= 128
    assert (mask == (np.arange(128)[None, :] < lengths[:, None])).all()     # right-padded
    assert (ids[mask == 0] == 0).all() and (ids[mask == 1] > 0).all()


def test_expected_density_sample_is_another_batch_of_the_same_distribution():
    """``sample``: compile_onnx's sample inputs are the batch of the next seed, not the timed
    one (their real-token fraction is what the PIT build plans for); the default gives none"""
    cfg = R.parse_args(["--device", "cuda", "--expected-density", "sample"])
    other = R.padded_batch(cfg.batch, cfg.seq, cfg.min_len, cfg.seed + 1)["attention_mask"].mean()
    sampled = round(float(R.sample_batch(cfg)["attention_mask"].mean()), 3)
    assert sampled == round(float(other), 3)
    timed = R.padded_batch(cfg.batch, cfg.seq, cfg.min_len, cfg.seed)["attention_mask"].mean()
    assert sampled != round(float(timed), 3)
    assert R.sample_batch(R.parse_args(["--device", "cuda"])) is None


def test_moe_token_check_in_float16_asks_for_pytorch_own_fraction():
    """An MoE model's fp16 rows need the fraction of tokens PyTorch's fp16 eager run keeps within
    the tolerance (at most 99 %); fp32 rows need 99 %"""
    def row(method, frac, dtype="float16"):
        return {"method": method, "dtype": dtype, "tokens_within_tol": frac, "correct": None}

    rows = [row("tvm_pit", 0.84), row("tvm_pit_off", 0.5), row("torch_eager", 0.8), row("torch_compile", 0.79)]
    R.moe_token_check(rows)
    assert [r["correct"] for r in rows] == [True, False, True, False]
    assert {r["tokens_needed"] for r in rows} == {0.8}
    fp32 = [row("tvm_pit", 0.98, "float32"), row("onnxruntime", 0.995, "float32")]
    R.moe_token_check(fp32)
    assert [r["correct"] for r in fp32] == [False, True]
