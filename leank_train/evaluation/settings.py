"""What ``leank run`` evaluates after stage 2 (the recipe's ``evaluate:`` section), and ``--quick``."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .methods import METHODS
from .tasks import TASKS

#: the RULER-style tasks (:mod:`.tasks`), all of them by default
TASK_NAMES = tuple(TASKS)
#: ``--quick``: one length, two probes per task, no KL (a smoke test: its intervals are wide)
QUICK = {"lengths": [1024], "samples": 2, "kl": False}


@dataclass
class EvalSettings:
    """What ``leank run`` evaluates after stage 2 (the recipe's ``evaluate:`` section).

    Args:
        enabled: run the evaluation and put its table in the model card.
        lengths: prompt lengths in tokens (the suite: prompt plus generation, as in RULER).
        samples: probes per task and length.
        methods: full model, the learned mask, and the two baselines (random, ThinK) at the same K budget.
        seed: seed of the probes.
        kl: also measure the next-token KL(full || LeanK) on held-out text.
        tasks: the tasks of the suite (leank_train.evaluation.tasks).
        quick: a smoke test instead: one length, two probes per task, no KL (what ``leank eval --quick`` runs).
    """

    enabled: bool = True
    lengths: list[int] = field(default_factory=lambda: [1024, 2048])
    samples: int = 6
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    seed: int = 1234
    kl: bool = True
    tasks: list[str] = field(default_factory=lambda: list(TASK_NAMES))
    quick: bool = False

    def resolved(self) -> EvalSettings:
        """These settings with ``quick`` applied (its lengths, probes and KL replace the others)."""
        return replace(self, **QUICK) if self.quick else self

    def command(self, mask: str) -> str:
        """The ``leank eval`` command that reproduces these figures."""
        if self.quick:
            cmd = f"leank eval {mask} --quick --methods {' '.join(self.methods)} --seed {self.seed}"
        else:
            cmd = (f"leank eval {mask} --lengths {' '.join(map(str, self.lengths))} --samples {self.samples}"
                   f" --methods {' '.join(self.methods)} --seed {self.seed}")
        if list(self.tasks) != list(TASK_NAMES):
            cmd += f" --tasks {' '.join(self.tasks)}"
        return cmd if self.kl or self.quick else cmd + " --no-kl"
