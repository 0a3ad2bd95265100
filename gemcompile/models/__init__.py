"""GEM-ref reference model and its synthetic data (plain PyTorch; no dependency on the compiler)."""
from .data import DataConfig, GemBatch, SyntheticData
from .gem import GemRef, GemRefConfig, gem_ref_config, masked_bce_loss

__all__ = [
    "DataConfig",
    "GemBatch",
    "SyntheticData",
    "GemRef",
    "GemRefConfig",
    "gem_ref_config",
    "masked_bce_loss",
]
