"""Tiny Hugging Face MoE checkpoints made locally: for tests, parity checks and the demo server."""

from moeserve.checkpoints.demo import demo_model_path
from moeserve.checkpoints.make_model import SUPPORTED_ARCHS, MakeModelSpec, make_model
from moeserve.checkpoints.tokenizer import train_tokenizer

__all__ = ["SUPPORTED_ARCHS", "MakeModelSpec", "demo_model_path", "make_model", "train_tokenizer"]
