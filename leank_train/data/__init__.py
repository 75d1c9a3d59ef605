"""Training data: haystacks, needle tasks, and the LightningDataModule that samples them."""

from .datamodule import (
    DEFAULT_TEMPLATES,
    NOISE,
    NeedleDataModule,
    NeedleTemplate,
    collate_needles,
    essay_text,
    haystack_text,
    length_grid,
    load_tokenizer,
)

__all__ = [
    "DEFAULT_TEMPLATES",
    "NOISE",
    "NeedleDataModule",
    "NeedleTemplate",
    "collate_needles",
    "essay_text",
    "haystack_text",
    "length_grid",
    "load_tokenizer",
]
