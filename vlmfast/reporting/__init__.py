"""What a run tells its user: ``report`` (the speed/memory report and its comparison with the previous run) and
``tracking`` (TensorBoard, wandb, MLflow: checked before any work, closed together)."""
