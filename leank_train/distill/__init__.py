"""Distillation: the LightningModule (loss, optimisation) and the teacher/student attention passes."""
