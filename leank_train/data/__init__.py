"""Training data: haystacks (``haystack``), needle tasks (``tasks``), the LightningDataModule (``datamodule``)."""

from .datamodule import NeedleDataModule, collate_needles, load_tokenizer, model_max_positions
from .haystack import NOISE, essay_text, haystack_text
from .tasks import DEFAULT_TEMPLATES, NeedleSampler, NeedleTemplate, length_grid

__all__ = [
    "DEFAULT_TEMPLATES",
    "NOISE",
    "NeedleDataModule",
    "NeedleSampler",
    "NeedleTemplate",
    "collate_needles",
    "essay_text",
    "haystack_text",
    "length_grid",
    "load_tokenizer",
    "model_max_positions",
]
