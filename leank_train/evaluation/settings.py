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
    """What ``leank run`` evaluates after stage 2 (the recipe's ``evaluate:`` section)."""

    #: run the evaluation and put its table in the model card
    enabled: bool = True
    #: prompt lengths in tokens
    lengths: list[int] = field(default_factory=lambda: [1024, 2048])
    #: probes per task and length
    samples: int = 6
    #: full model, the learned mask, and the two baselines at the same K budget
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    #: seed of the probes
    seed: int = 1234
    #: also measure the next-token KL(full || LeanK) on held-out text
    kl: bool = True
    #: the tasks of the suite (leank_train.evaluation.tasks)
    tasks: list[str] = field(default_factory=lambda: list(TASK_NAMES))
    #: a smoke test instead: one length, two probes per task, no KL (``QUICK``)
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
