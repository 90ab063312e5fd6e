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
