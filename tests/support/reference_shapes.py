"""The tiny reference model and forward shapes that tests without special needs share."""

from hicache.reference.engine.config import ForwardConfig, ModelConfig

MODEL = ModelConfig()
FWD = ForwardConfig(chunk_size=16, page_size=8, max_pages=32)
