"""leank_train: learn LeanK masks by distillation with PyTorch Lightning."""
