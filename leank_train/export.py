"""Export the learned mask as a mask repo folder (what ``hub/<model>/`` holds and the Hub receives).

The folder is written next to its target under a temporary name and swapped into place
(:func:`leank_infer.mask.write_mask_folder`), so a reader never sees half a mask repo; an older
mask repo at the target is replaced only once the new one is complete, model card and pattern
plot (``leank_infer.hub.card``) included, and nothing but an empty folder or a mask repo is replaced.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L

from leank_infer.hub.card import write_card_files
from leank_infer.mask import ChannelMask, check_mask_target, write_mask_folder
from leank_infer.model.loading import EMBEDDED_LOADER, EMBEDDED_MODEL_ID


def write_mask_repo(mask: ChannelMask, folder: str | os.PathLike, eval_results: dict | None = None) -> Path:
    """Write ``mask``, its model card and pattern plot to ``folder`` as a whole; returns the folder.

    ``folder`` may be new, empty or an older mask repo; anything else (a folder with other files,
    a file, a link, ``/``) is refused with a MaskError before anything is written.
    """

    def fill(tmp: Path) -> None:
        mask.write_files(tmp)
        write_card_files(tmp, eval_results, repo=str(folder))

    return write_mask_folder(folder, fill)


class ExportMask(L.Callback):
    """At the end of fit, binarise the module's alpha and write the mask repo folder ``dirpath``.

    ``recent_size``/``accumu_size`` are the *decode-time* sizes stored in the mask (training uses
    the module's own ``recent_size``); ``recipe`` is the recipe file whose text goes in config.json.
    """

    def __init__(
        self,
        dirpath: str | None = None,
        recent_size: int = 64,
        accumu_size: int = 16,
        recipe: str | None = None,
    ) -> None:
        """
        Args:
            dirpath: output mask folder; None disables the export.
            recent_size: decode-time recent window kept with all channels.
            accumu_size: decode-time tokens gathered before they are compressed into the middle.
            recipe: path of the recipe YAML (its text is stored in config.json) or the YAML text itself.
        """
        super().__init__()
        self.dirpath = dirpath
        self.recent_size = recent_size
        self.accumu_size = accumu_size
        self.recipe = recipe
        self.exported: Path | None = None

    def recipe_text(self) -> str | None:
        if self.recipe is None:
            return None
        path = Path(self.recipe)
        try:
            if "\n" not in self.recipe and path.is_file():
                return path.read_text()
        except OSError:
            pass
        return self.recipe

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Refuse an export folder that may not be replaced before training, not after it."""
        if self.dirpath is not None and trainer.is_global_zero:
            check_mask_target(self.dirpath)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.dirpath is None or not trainer.is_global_zero:
            return
        hp = pl_module.hparams
        base, loader = hp.base_model, dict(hp.loader or {})
        if base == "embedded":
            base, loader = EMBEDDED_MODEL_ID, {**EMBEDDED_LOADER, **loader}
        extra: dict[str, Any] = {
            "training": {
                "stage": int(hp.stage),
                "steps": int(trainer.global_step),
                "train_recent_size": int(hp.recent_size),
                "final_distill_loss_last10": getattr(pl_module, "final_distill_loss", None),
            }
        }
        mask = pl_module.mask(
            recent_size=self.recent_size,
            accumu_size=self.accumu_size,
            base_model=base,
            loader=loader,
            recipe=self.recipe_text(),
            extra=extra,
        )
        self.exported = write_mask_repo(mask, self.dirpath)
