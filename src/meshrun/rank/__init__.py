"""What runs in every rank process: process groups and mesh, the model's parallel form, the
train loop and its meters. Gets a resolved plain dict from the driver; never imports Hydra."""
